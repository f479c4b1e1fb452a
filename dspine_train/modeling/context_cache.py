"""`DraftContextCache`: per-layer keys/values of the committed context features (inference).

The cache is allocated once for `max_length` committed positions plus one block of slack: the
block being drafted writes its own K/V right after the committed context (where the next
committed features will later be written), so a draft step never allocates a K/V tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftContextCache:
    """Static K/V buffers of the draft's context, with a committed length per sequence.

    keys / values: one tensor per draft layer, (B, kv_heads, max_length + block_size, head_dim).
    lengths: (B,) long, number of committed context positions per sequence.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    max_length: int
    block_size: int

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        max_length: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> DraftContextCache:
        shape = (batch_size, num_kv_heads, max_length + block_size, head_dim)
        return cls(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)],
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
            max_length=max_length,
            block_size=block_size,
        )

    @property
    def capacity(self) -> int:
        """Positions a K/V buffer holds: committed context plus one block."""
        return self.keys[0].shape[2]

    def write(self, layer: int, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v (B, kv_heads, T, D) at positions start[b] .. start[b] + T - 1 of each sequence.

        Positions past the buffer are clamped to its last slot; they only ever hold padding
        beyond the committed length, which no query reads.
        """
        t = k.shape[2]
        pos = start[:, None] + torch.arange(t, device=start.device)  # (B, T)
        pos = pos.clamp_max(self.capacity - 1)
        index = pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, kv, T, D)
        self.keys[layer].scatter_(2, index, k.to(self.keys[layer].dtype))
        self.values[layer].scatter_(2, index, v.to(self.values[layer].dtype))

    def advance(self, counts: torch.Tensor) -> None:
        """Commit `counts` (B,) more positions per sequence."""
        new = self.lengths + counts
        # Deliberate check without a host sync on CUDA (asynchronous assert).
        torch._assert_async(
            (new <= self.max_length).all(), "DraftContextCache overflow: raise max_length"
        )
        self.lengths.copy_(new)  # in place: captured CUDA graphs keep reading this tensor

    def crop(self, lengths: torch.Tensor) -> None:
        """Forget everything past `lengths` (B,): later writes overwrite it."""
        self.lengths.copy_(torch.minimum(self.lengths, lengths.to(self.lengths)))
