"""Attention masks of the training forward (METHOD 1, "Attention").

Keys/values are laid out as `[context (S positions) ; block 0 ; block 1 ; ...]`, queries as
`[block 0 ; block 1 ; ...]` (A blocks of B slots per sequence). Query slot k of block b sees
context positions `j < anchors[b]` and the slots of its own block (`k' <= k` when causal,
all when bidirectional). Blocks never see each other. With a sliding window W (z-lab's
`sliding_attention` layers) a query at position p = anchor + k sees only the context
positions j with p - j < W; the block itself stays whole (W >= B is required).

On CPU a dense boolean mask feeds SDPA; on CUDA the same predicate builds a flex-attention
`BlockMask` (by a compiled builder, see `compiled_flex`) for compiled flex attention, so both
paths compute the same attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compiled_flex import BlockMask, compiled_block_mask


def default_use_flex(device: torch.device) -> bool:
    """The training forward's attention path on `device`: compiled flex on CUDA, else dense SDPA."""
    return device.type == "cuda"


def training_attention_path(use_flex: bool) -> str:
    """What the training forward's attention runs, in words (for logs and the memory plan)."""
    if use_flex:
        return ("compiled flex attention (torch.compile, block-sparse mask, no score matrix; "
                "compiles on the first step)")
    return "dense SDPA with a boolean (B, 1, Q, S+Q) mask"


def dense_training_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean mask (B, 1, A*Bk, S + A*Bk), True where a query may attend.

    anchors: (B, A) anchor positions (padding anchors may hold any valid position); `window`:
    the sliding window W, or None.
    """
    bsz, num_blocks = anchors.shape
    device = anchors.device
    q = torch.arange(num_blocks * block_size, device=device)
    q_block, q_slot = q // block_size, q % block_size  # (Q,)
    ctx = torch.arange(seq_len, device=device)
    # context part: (B, Q, S)
    q_anchor = anchors[:, q_block][:, :, None]  # (B, Q, 1)
    ctx_ok = ctx[None, None, :] < q_anchor
    if window is not None:  # p - j < W at p = anchor + slot
        ctx_ok = ctx_ok & (ctx[None, None, :] > q_anchor + q_slot[None, :, None] - window)
    # block part: (Q, Q) shared by the batch
    same_block = q_block[:, None] == q_block[None, :]
    blk_ok = same_block & (q_slot[None, :] <= q_slot[:, None]) if causal else same_block
    blk_ok = blk_ok[None].expand(bsz, -1, -1)
    return torch.cat((ctx_ok, blk_ok), dim=-1)[:, None]  # (B, 1, Q, S+Q)


def training_mask_mod(
    anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool,
    window: int | None = None,
) -> Callable:
    """The predicate of `dense_training_mask` as a flex-attention `mask_mod(b, h, q_idx, kv_idx)`.

    `seq_len` and `block_size` are closed over as Python ints, which the dynamic compile of
    `compiled_flex` keeps symbolic (a new sequence length does not recompile); `causal` is a
    constant of the model.
    """

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202, ARG001 - flex signature
        q_block = q_idx // block_size
        q_slot = q_idx % block_size
        in_ctx = kv_idx < seq_len
        anchor = anchors[b, q_block]
        ctx_ok = in_ctx & (kv_idx < anchor)
        if window is not None:
            ctx_ok = ctx_ok & (kv_idx > anchor + q_slot - window)
        kv_off = kv_idx - seq_len
        blk_ok = (~in_ctx) & (kv_off // block_size == q_block)
        if causal:
            blk_ok = blk_ok & (kv_off % block_size <= q_slot)
        return ctx_ok | blk_ok

    return mask_mod


def flex_training_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, causal: bool,
    window: int | None = None,
) -> BlockMask:
    """The same predicate as `dense_training_mask`, as a flex-attention BlockMask.

    Built by the compiled `create_block_mask` (see `compiled_flex`), which never materialises
    the dense mask.
    """
    bsz, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    mask_mod = training_mask_mod(anchors, seq_len, block_size, causal, window)
    return compiled_block_mask(mask_mod, bsz, q_len, seq_len + q_len, anchors.device)


def inference_block_mask(
    lengths: torch.Tensor, cache_len: int, block_size: int, causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """Mask (B, 1, Bk, cache_len) for one block per sequence over the context cache.

    The block's own K/V sit in the cache right after the committed context, at positions
    `lengths[b] .. lengths[b] + Bk - 1`, so a key j is visible when `j < lengths[b]` (context)
    or it is one of the block's slots (`<= k` for a causal block); with a sliding `window` W
    a context key only when `lengths[b] + k - j < W` as well.
    """
    j = torch.arange(cache_len, device=lengths.device)[None, None, :]  # (1, 1, L)
    k = torch.arange(block_size, device=lengths.device)[None, :, None]  # (1, Bk, 1)
    start = lengths[:, None, None]  # (B, 1, 1)
    ctx_ok = j < start
    if window is not None:
        ctx_ok = ctx_ok & (j > start + k - window)
    last = start + k if causal else start + block_size - 1
    blk_ok = (j >= start) & (j <= last)
    return (ctx_ok | blk_ok)[:, None]  # (B, 1, Bk, L)
