"""A stand-in draft that proposes a known continuation with some tokens corrupted.

For lossless checks at shapes where no trained draft exists (a random target with a real
model's config): after plain decoding has produced each sequence's greedy continuation, this
draft proposes exactly that continuation, with a fixed share of the proposals changed to
another token. Speculative decoding must then reproduce plain decoding token for token while
every acceptance pattern (none, some, all of a block) occurs.

Everything happens on the device with fixed shapes and no host read, so the propose step can
be captured in a CUDA graph like the real draft's. The anchor's position is read from the
context length the engine commits, so the draft needs no features (none are stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class OracleDraftConfig:
    """The draft-config fields the engine reads (`check_draft_fits_target`, the loop)."""

    block_size: int
    target_layer_ids: list[int]
    vocab_size: int
    hidden_size: int
    target_num_layers: int | None = None
    # The engine sizes a token tree by the draft's candidates per slot and reads this even for
    # a chain; the oracle proposes one chain, so one candidate.
    candidate_k: int = 1


@dataclass
class OracleProposal:
    """`tokens (B, block_size - 1)`; no draft distribution (greedy only)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None


@dataclass
class OracleContext:
    """The context cache the engine hands back to `propose`: committed lengths only."""

    lengths: torch.Tensor  # (B,) committed positions per sequence


class OracleDraft(nn.Module):
    """Proposes `sequences[b][n + 1 : n + block_size]` after a context of `n` positions.

    `set_sequences` takes the full greedy sequences (prompt + continuation) of each batch row;
    proposals past a sequence's end are `pad_id`. Each proposal at absolute position `j` of row
    `b` is replaced by `(token + 1) % vocab_size` when a fixed Bernoulli(`corrupt`) draw for
    `(b, j)` says so (the same draw whenever that position is proposed again).
    """

    def __init__(
        self,
        config: OracleDraftConfig,
        max_batch_size: int,
        max_length: int,
        corrupt: float = 0.2,
        seed: int = 1,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.pad_id = pad_id
        width = max_length + config.block_size
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer(
            "table", torch.full((max_batch_size, width), pad_id, dtype=torch.long), persistent=False
        )
        flips = torch.rand(max_batch_size, width, generator=gen) < corrupt
        self.register_buffer("flips", flips, persistent=False)

    def set_sequences(self, sequences: list[list[int]]) -> None:
        """The greedy sequences (prompt + output) the proposals follow, one per batch row."""
        if len(sequences) > self.table.shape[0]:
            raise ValueError(f"{len(sequences)} sequences exceed max_batch_size={self.table.shape[0]}")
        longest = max(len(s) for s in sequences)
        if longest > self.table.shape[1]:
            raise ValueError(f"a sequence of {longest} tokens exceeds the oracle's table width")
        self.table.fill_(self.pad_id)
        for b, seq in enumerate(sequences):
            self.table[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)

    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Nothing to bind: proposals do not use the target's weights."""

    def new_context_cache(self, batch_size, max_length, *, device=None, dtype=None) -> OracleContext:  # noqa: ANN001, ARG002
        """Lengths only; the engine's features are not needed to follow a known sequence."""
        return OracleContext(torch.zeros(batch_size, dtype=torch.long, device=device))

    def append_context(
        self, cache: OracleContext, features: torch.Tensor, counts: torch.Tensor  # noqa: ARG002
    ) -> None:
        """Advance the committed lengths by `counts (B,)` (features are ignored)."""
        cache.lengths[: counts.shape[0]] += counts.to(cache.lengths.device)

    def crop_context(self, cache: OracleContext, lengths: torch.Tensor) -> None:
        """Lower committed lengths to at most `lengths (B,)`."""
        n = lengths.shape[0]
        cache.lengths[:n] = torch.minimum(cache.lengths[:n], lengths.to(cache.lengths.device))

    @torch.no_grad()
    def propose(
        self,
        cache: OracleContext,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,  # noqa: ARG002 - greedy only
        generator: torch.Generator | None = None,  # noqa: ARG002
        kv_len: int | None = None,  # noqa: ARG002 - the engine's attention bound; nothing attends
    ) -> OracleProposal:
        """The next `block_size - 1` tokens after each anchor, some corrupted; `(B, Bk-1)`."""
        batch, width = anchor_ids.shape[0], self.config.block_size - 1
        # The anchor sits at position lengths[b]; its successors start one further on.
        offsets = torch.arange(1, width + 1, device=anchor_ids.device)
        index = (cache.lengths[:batch, None] + offsets[None, :]).clamp_max(self.table.shape[1] - 1)
        tokens = self.table[:batch].gather(1, index)  # (B, Bk-1)
        flip = self.flips[:batch].gather(1, index)
        tokens = torch.where(flip, (tokens + 1) % self.config.vocab_size, tokens)
        return OracleProposal(tokens=tokens)
