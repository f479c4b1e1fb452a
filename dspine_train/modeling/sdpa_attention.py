"""Attention calls shaped so SDPA takes a fused kernel, never the math fallback.

The draft's layers and the engine's target share them (the engine imports this module, the
model imports nothing from the engine). Three calls run at inference (the target's prefill
and verify, the draft's block over its context cache):

* prefill (every cache length 0, prompts right-padded): plain causal attention over the new
  tokens, `is_causal=True` with no mask; K/V are repeated to the query heads (they are only the
  prompt's length) so no `enable_gqa` is needed: the flash (bf16/fp16) and memory-efficient
  (fp32) kernels both accept it;
* verify and draft (queries over a masked cache): with a boolean mask, `enable_gqa=True` sends
  SDPA to the math kernel on common CUDA builds (K/V expanded to every query head, fp32 scores
  over the whole cache). Instead the `G = heads / kv_heads` query heads that share a K/V head are
  folded into the query-length axis: q `(B, Hkv*G, T, D)` -> `(B, Hkv, G*T, D)` against K/V
  `(B, Hkv, S, D)` as they are, the mask repeated G times along the query axis. Each folded row
  is exactly one query head's row, so the result is the same attention, and the
  memory-efficient kernel takes the mask.

`record_sdpa_backends()` lets a check report, per call, which backend SDPA selects
(`torch._fused_sdp_choice`, the dispatcher's own choice), and `fused_sdpa_only()` excludes the
math kernel so an unsupported call raises instead of silently falling back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (label, backend name) of each attention call while `record_sdpa_backends` is active.
_recorded: list[tuple[str, str]] | None = None


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal self-attention of new tokens only: q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D).

    Valid where the new tokens are the whole sequence (a prefill: every cache length 0).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        # (B, Hkv, T, D) -> (B, Hkv*G, T, D): query head h reads kv head h // G (HF's repeat_kv).
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    _record("prefill", q, k, v, None, causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    label: str = "masked",
) -> torch.Tensor:
    """GQA attention with a boolean mask, without `enable_gqa` (see the module docstring).

    q (B, Hkv*G, T, D), k/v (B, Hkv, S, D), mask (B, 1, T, S) True where a query may attend
    -> (B, Hkv*G, T, D).
    """
    batch, heads, steps, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    # (B, Hkv*G, T, D) -> (B, Hkv, G*T, D): folded row g*T + t is query head kv*G + g at step t.
    folded = q.reshape(batch, kv_heads, groups * steps, head_dim)
    # (B, 1, T, S) -> (B, 1, G*T, S): every group reads the same mask rows.
    folded_mask = mask.expand(batch, 1, steps, keys).repeat(1, 1, groups, 1)
    _record(label, folded, k, v, folded_mask, causal=False, scale=scale)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=folded_mask, scale=scale)
    return out.reshape(batch, heads, steps, head_dim)  # (B, Hkv, G*T, D) -> (B, H, T, D)


def _record(
    label: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
) -> None:
    if _recorded is None:
        return
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, scale=scale, enable_gqa=False)
    _recorded.append((label, SDPBackend(choice).name))


@contextmanager
def record_sdpa_backends() -> Iterator[list[tuple[str, str]]]:
    """Collect `(label, backend)` for every attention call of this module in the body (eager
    calls only: a compiled or graphed step does not run this Python)."""
    global _recorded
    previous, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = previous


@contextmanager
def fused_sdpa_only() -> Iterator[None]:
    """SDPA restricted to the flash and memory-efficient kernels: a call either of them cannot
    run raises instead of falling back to the math kernel. On CPU (flash + math only) it allows
    the CPU flash kernel, which takes masks too."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        yield
