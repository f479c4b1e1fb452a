"""The host side of a round: its one device-to-host read, and what the host does with it.

`AcceptanceReader.read` brings a round's acceptance back in one transfer (the only host sync of
a round); `record_round` commits the rows to the running sequences and the call's counters;
`ProposalLedger` tells the round planner how far each proposal matched the tokens the sequences
went on to commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspine_train.engine.acceptance import Acceptance, clip_at_eos
from dspine_train.engine.prompts import SequenceState
from dspine_train.engine.round_planner import RoundPlanner, common_prefix
from dspine_train.engine.stats import GenerationStats


@dataclass
class RoundRow:
    """One sequence's round as read: `tokens` the accepted drafts then the bonus (padded past
    them), `num_accepted`, `keep` the tokens to keep (cut after an EOS), `eos` whether one was
    met, and `drafted` the draft's chain tokens (empty where the draft did not run)."""

    tokens: list[int]
    num_accepted: int
    keep: int
    eos: bool
    drafted: list[int]


class AcceptanceReader:
    """Reads a round's acceptance in one transfer: into pinned buffers (one per shape) with an
    event to wait on, on CUDA; with `tolist` elsewhere."""

    def __init__(self, eos_token_ids: Sequence[int], device: torch.device) -> None:
        self._eos = torch.tensor(list(eos_token_ids) or [-1], device=device)
        self._buffers: dict[tuple[int, ...], torch.Tensor] = {}
        self._done = torch.cuda.Event() if device.type == "cuda" else None

    def read(self, acc: Acceptance, drafted: torch.Tensor | None = None) -> list[RoundRow]:
        """The round's rows; `drafted (B, g)` the draft's chain tokens, read in the same
        transfer."""
        counts, hit_eos = clip_at_eos(acc.tokens, acc.num_accepted + 1, self._eos)
        parts = [acc.tokens, acc.num_accepted[:, None], counts[:, None], hit_eos[:, None].long()]
        if drafted is not None:
            parts.append(drafted)
        width = acc.tokens.shape[1]
        return [
            RoundRow(row[:width], row[width], row[width + 1], bool(row[width + 2]),
                     row[width + 3 :])
            for row in self._transfer(torch.cat(parts, dim=1))
        ]

    def _transfer(self, packed: torch.Tensor) -> list[list[int]]:
        if self._done is None:
            return packed.tolist()
        host = self._buffers.get(tuple(packed.shape))
        if host is None:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._buffers[tuple(packed.shape)] = host
        host.copy_(packed, non_blocking=True)
        self._done.record()
        self._done.synchronize()  # deliberate: the one host sync of a round
        return host.tolist()


def record_round(
    rows: list[RoundRow],
    states: list[SequenceState],
    committed: list[int],
    stats: GenerationStats,
) -> list[int]:
    """Commit one round's `rows` to the running sequences (`committed`: their target cache
    lengths, kept on the host) and `stats`; return the rows that finished in this round."""
    finished = []
    for b, row in enumerate(rows):
        if states[b].done:
            continue
        before = len(states[b].tokens)
        states[b].extend(row.tokens[: row.keep], ends_with_eos=row.eos)
        # What the sequence kept (EOS, a stop string or the token budget may cut the round
        # short): its last kept token stands as the round's bonus (see `GenerationStats`).
        kept = len(states[b].tokens) - before
        stats.verifications += 1
        stats.committed += kept
        for i in range(kept - 1):
            stats.accepted_at[i] += 1
        stats.round_accepted[b].append(row.num_accepted)
        committed[b] += row.num_accepted + 1
        if states[b].done:
            finished.append(b)
    return finished


class ProposalLedger:
    """What each proposal of a call would have had accepted, scored once the tokens it proposed
    to continue are known, and told to the round planner.

    A proposal made before a round continues the sequence after its anchor. Whatever the round
    verified (a plain step reveals one token), the tokens the sequence goes on to commit are
    the target's own continuation, so comparing the proposal with them later gives exactly how
    many of its tokens a round verifying it would have accepted at temperature 0 (the same law
    when sampling). This is what lets the planner learn about a proposal it did not verify."""

    def __init__(self, planner: RoundPlanner, num_sequences: int) -> None:
        self.planner = planner
        self._pending: list[list[tuple[str, int, int, list[int]]]] = [
            [] for _ in range(num_sequences)
        ]

    def propose(self, row: int, start: int, kind: str, size: int, tokens: list[int]) -> None:
        """`tokens` proposed (by "ngram" with suffix size `size`, or by the "draft") to continue
        sequence `row` from its `start`-th new token."""
        if tokens:
            self._pending[row].append((kind, size, start, tokens))

    def settle(self, row: int, state: SequenceState) -> None:
        """Score the proposals of `row` that `state` now decides: every token committed, or
        one that differs from the proposal (a round verifying it would stop there); a finished
        sequence drops the ones it cannot score."""
        done, kept = state.done, []
        for kind, size, start, tokens in self._pending[row]:
            known = state.tokens[start : start + len(tokens)]
            accepted = common_prefix(tokens, known)
            if accepted == len(known) < len(tokens):  # no mismatch yet: wait for more tokens
                if not done:
                    kept.append((kind, size, start, tokens))
                continue
            if kind == "ngram":
                self.planner.record_ngram(size, accepted)
            else:
                self.planner.record_draft(accepted)
        self._pending[row] = kept
