"""Static key/value cache of the compact target, allocated once per engine.

Layout: `keys` / `values` of shape `(batch, layers, kv_heads, capacity, head_dim)` and
`lengths (batch,)`, the number of committed positions of each sequence.

Ragged batches need no padding inside the cache: cache slot `j` of a sequence always holds that
sequence's position `j`. A forward over `T` new tokens writes them at slots
`lengths[b] .. lengths[b] + T - 1`; tokens that only pad a shorter sequence's input (inputs are
right-padded) land past its committed length, where the attention mask never looks, and are
overwritten by that sequence's next write. Rolling back rejected draft tokens is therefore just
lowering `lengths`.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Preallocated per-layer K/V buffers plus per-sequence committed lengths."""

    def __init__(
        self,
        batch_size: int,
        num_layers: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch_size, num_layers, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.capacity = capacity
        self.batch_size = batch_size

    def reset(self, batch_size: int) -> None:
        """Start `batch_size` new sequences (rows `0 .. batch_size-1`) at length 0."""
        if batch_size > self.batch_size:
            raise ValueError(
                f"batch of {batch_size} sequences exceeds the cache's "
                f"max_batch_size={self.batch_size}"
            )
        self.lengths.zero_()

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Store new `keys`/`values (B, kv_heads, T, D)` of `layer` at slots `positions (B, T)`."""
        batch, heads, _, head_dim = keys.shape
        # (B, T) -> (B, kv_heads, T, D): the same slot index for every head and channel.
        index = positions[:, None, :, None].expand(batch, heads, -1, head_dim)
        self.keys[:batch, layer].scatter_(2, index, keys)
        self.values[:batch, layer].scatter_(2, index, values)

    def layer_view(self, layer: int, batch: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `(batch, kv_heads, kv_len, D)` of the first `kv_len` slots."""
        return (
            self.keys[:batch, layer, :, :kv_len],
            self.values[:batch, layer, :, :kv_len],
        )

    def crop(self, lengths: torch.Tensor) -> None:
        """Set the committed lengths of the first `len(lengths)` sequences (drops later slots)."""
        self.lengths[: lengths.shape[0]].copy_(lengths)
