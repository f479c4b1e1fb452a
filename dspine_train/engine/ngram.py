"""N-gram candidates: continue a sequence the way its own context continued before.

Prompt-lookup decoding (as `transformers`' `prompt_lookup_num_tokens`) without a model: take
the last n tokens of a sequence (the prompt, everything generated so far, and the round's
anchor), find an earlier place where the same n tokens stand, and propose the tokens that
followed them there. n runs from `max_n` down to `min_n`; the longest suffix that matches wins.

The index is kept per sequence on the host and grows with the tokens the engine commits, so a
proposal costs a few dictionary look-ups per round whatever the length of the context (no
scan, no device work, no host read: the host already holds every committed token, since the
round's single read brings them back). The engine copies the proposals to the device with the
round's other inputs and merges them into the round's token tree (`engine.token_tree`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspine_train.engine.errors import GenerationInputError

MATCH_POLICIES = ("earliest", "latest")


@dataclass(frozen=True)
class NgramConfig:
    """How n-gram candidates are found.

    `max_n` / `min_n`: the longest and shortest suffix looked up (longest first);
    `num_tokens`: how many continuation tokens one proposal holds (its branch's depth);
    `match`: which earlier occurrence continues a suffix that occurs several times:
    "earliest" (as transformers' prompt lookup) or "latest" (the most recent one).
    """

    max_n: int = 3
    min_n: int = 1
    num_tokens: int = 7
    match: str = "earliest"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise GenerationInputError(
                f"n-gram sizes must satisfy 1 <= min_n <= max_n (CLI: --ngram-min-n / "
                f"--ngram-max-n), got min_n={self.min_n}, max_n={self.max_n}")
        if self.num_tokens < 1:
            raise GenerationInputError(
                f"ngram num_tokens (CLI: --ngram-tokens) must be >= 1, got {self.num_tokens}")
        if self.match not in MATCH_POLICIES:
            raise GenerationInputError(
                f"ngram match={self.match!r} (CLI: --ngram-match) must be one of "
                f"{', '.join(MATCH_POLICIES)}")


class NgramIndex:
    """The n-gram index of one sequence: for each n, where each n-gram was followed.

    `extend` appends tokens; `propose` returns the continuation of the current suffix and the
    size n of the suffix that matched (0 and `[]` when none does).
    """

    def __init__(self, config: NgramConfig, tokens: Sequence[int] = ()) -> None:
        self.config = config
        self.tokens: list[int] = []
        # _starts[n][gram] = position of the token that followed `gram` (its continuation start)
        self._starts: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_n, config.max_n + 1)
        }
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens`, indexing every n-gram that now has a token after it."""
        latest = self.config.match == "latest"
        history = self.tokens
        for token in tokens:
            position = len(history)  # the new token continues the n-grams ending just before it
            for n, starts in self._starts.items():
                if position >= n:
                    gram = tuple(history[position - n : position])
                    if latest:
                        starts[gram] = position
                    else:
                        starts.setdefault(gram, position)
            history.append(int(token))

    def propose(self) -> tuple[list[int], int]:
        """The continuation of the longest matching suffix (at most `num_tokens` tokens) and
        that suffix's size; `([], 0)` when no suffix of size >= `min_n` occurred before."""
        history, length = self.tokens, len(self.tokens)
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            if length < n:
                continue
            start = self._starts[n].get(tuple(history[length - n :]))
            if start is not None:
                return history[start : start + self.config.num_tokens], n
        return [], 0


def pack_proposals(
    proposals: Sequence[Sequence[int]], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposals as device tensors: tokens `(B, width)` (zero-padded) and lengths `(B,)`."""
    rows = [list(p[:width]) + [0] * (width - min(len(p), width)) for p in proposals]
    lengths = [min(len(p), width) for p in proposals]
    packed = torch.tensor([row + [n] for row, n in zip(rows, lengths, strict=True)])
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    return packed[:, :width], packed[:, width]
