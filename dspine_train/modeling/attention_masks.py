"""Attention masks of the training forward (SPEC 1, "Attention").

Keys/values are laid out as `[context (S positions) ; block 0 ; block 1 ; ...]`, queries as
`[block 0 ; block 1 ; ...]` (A blocks of B slots per sequence). Query slot k of block b sees
context positions `j < anchors[b]` and the slots of its own block (`k' <= k` when causal,
all when bidirectional). Blocks never see each other.

On CPU a dense boolean mask feeds SDPA; on CUDA the same predicate builds a flex-attention
`BlockMask`, so both paths compute the same attention.
"""

from __future__ import annotations

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = None  # type: ignore[assignment]


def dense_training_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool
) -> torch.Tensor:
    """Boolean mask (B, 1, A*Bk, S + A*Bk), True where a query may attend.

    anchors: (B, A) anchor positions (padding anchors may hold any valid position).
    """
    bsz, num_blocks = anchors.shape
    device = anchors.device
    q = torch.arange(num_blocks * block_size, device=device)
    q_block, q_slot = q // block_size, q % block_size  # (Q,)
    ctx = torch.arange(seq_len, device=device)
    # context part: (B, Q, S)
    ctx_ok = ctx[None, None, :] < anchors[:, q_block][:, :, None]
    # block part: (Q, Q) shared by the batch
    same_block = q_block[:, None] == q_block[None, :]
    blk_ok = same_block & (q_slot[None, :] <= q_slot[:, None]) if causal else same_block
    blk_ok = blk_ok[None].expand(bsz, -1, -1)
    return torch.cat((ctx_ok, blk_ok), dim=-1)[:, None]  # (B, 1, Q, S+Q)


def flex_training_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool
) -> BlockMask:
    """The same predicate as `dense_training_mask`, as a flex-attention BlockMask."""
    if create_block_mask is None:  # pragma: no cover
        raise RuntimeError("this torch build has no flex attention")
    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ARG001 - flex signature
        q_block = q_idx // block_size
        q_slot = q_idx % block_size
        in_ctx = kv_idx < seq_len
        ctx_ok = in_ctx & (kv_idx < anchors[b, q_block])
        kv_off = kv_idx - seq_len
        blk_ok = (~in_ctx) & (kv_off // block_size == q_block)
        if causal:
            blk_ok = blk_ok & (kv_off % block_size <= q_slot)
        return ctx_ok | blk_ok

    return create_block_mask(
        mask_mod, B=bsz, H=None, Q_LEN=q_len, KV_LEN=seq_len + q_len, device=anchors.device
    )


def inference_block_mask(
    lengths: torch.Tensor, cache_len: int, block_size: int, causal: bool
) -> torch.Tensor:
    """Mask (B, 1, Bk, cache_len) for one block per sequence over the context cache.

    The block's own K/V sit in the cache right after the committed context, at positions
    `lengths[b] .. lengths[b] + Bk - 1`, so a key j is visible when `j < lengths[b]` (context)
    or it is one of the block's slots (`<= k` for a causal block).
    """
    j = torch.arange(cache_len, device=lengths.device)[None, None, :]  # (1, 1, L)
    k = torch.arange(block_size, device=lengths.device)[None, :, None]  # (1, Bk, 1)
    start = lengths[:, None, None]  # (B, 1, 1)
    ctx_ok = j < start
    last = start + k if causal else start + block_size - 1
    blk_ok = (j >= start) & (j <= last)
    return (ctx_ok | blk_ok)[:, None]  # (B, 1, Bk, L)
