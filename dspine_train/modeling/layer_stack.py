"""The draft's one layer loop: decoder layers with the gated adjacent injection after each.

Training (all anchors of a batch) and inference (one block per sequence over the context cache)
run the same loop, `run_layer_stack`. They differ only in how a layer's block queries reach the
committed context, which a *context provider* supplies:

* `ProjectedContext` (training): every layer projects the context keys/values from the fused
  target features of the whole sequence and attends over [context ; all blocks] under the
  training mask (dense or flex);
* `CachedContext` (inference): every layer writes the block's keys/values into the
  `DraftContextCache` right after the committed context and attends over the cache's first
  `kv_len` slots under the inference block mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .configuration_dspine import DSpineConfig
from .context_cache import DraftContextCache
from .injection import AdjacentInjection
from .layers import AttentionMask, DSpineAttention


class ContextProvider(Protocol):
    """How layer `layer`'s block queries attend to the context and to the blocks."""

    def attend(
        self, layer: int, attn: DSpineAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Block q (B, heads, Q, D) and k/v (B, kv_heads, Q, D) -> attention output (B, Q, H)
        through `attn.o_proj`."""
        ...


@dataclass
class ProjectedContext:
    """Training context: K/V projected per layer from the fused context features.

    features (B, S, H) fused context features (`DSpineDraftModel.fuse_context`); cos/sin their
    RoPE at positions 0..S-1; mask over [context ; blocks] (`attention_masks`).
    """

    features: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: AttentionMask

    def attend(
        self, layer: int, attn: DSpineAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        ctx_k, ctx_v = attn.project_kv(self.features, self.cos, self.sin)
        k = torch.cat((ctx_k, k), dim=2)  # (B, kv, S + A*Bk, D)
        v = torch.cat((ctx_v, v), dim=2)
        return attn.attend(q, k, v, self.mask)


@dataclass
class CachedContext:
    """Inference context: the committed context's K/V in a `DraftContextCache`.

    The block's K/V are written at `cache.lengths` (the cache's slack block, no allocation) and
    the queries attend to the first `kv_len` slots under `mask` (`inference_block_mask`).
    """

    cache: DraftContextCache
    kv_len: int
    mask: torch.Tensor

    def attend(
        self, layer: int, attn: DSpineAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cache = self.cache
        cache.write(layer, cache.lengths, k, v)
        keys = cache.keys[layer][:, :, : self.kv_len]  # (B, kv, kv_len, D), a view
        values = cache.values[layer][:, :, : self.kv_len]
        return attn.attend_cached(q, keys, values, self.mask)


@dataclass
class LayerStackOutput:
    """What the layer loop records; shapes with `...` = the blocks' leading dims ((B, A) or (B,)).

    hidden: (..., Bk, H) last layer output after its injection, before the final norm.
    pre_injection: (..., Bk, H) last layer output before its injection.
    recv_features: (..., Bk-1, r) last layer pre-injection features of slots 1..Bk-1.
    layer_features: per layer (..., Bk-1, r) post-injection features, only when asked.
    layer_hidden: per layer (..., Bk, H) outputs after injection, only when asked.
    """

    hidden: torch.Tensor
    pre_injection: torch.Tensor
    recv_features: torch.Tensor
    layer_features: list[torch.Tensor] = field(default_factory=list)
    layer_hidden: list[torch.Tensor] = field(default_factory=list)


def run_layer_stack(
    layers: nn.ModuleList,
    injection: AdjacentInjection,
    config: DSpineConfig,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    context: ContextProvider,
    anchor_codes: torch.Tensor,
    *,
    true_pred_codes: torch.Tensor | None = None,
    replace_mask: torch.Tensor | None = None,
    return_layer_features: bool = False,
    return_layer_hidden: bool = False,
) -> LayerStackOutput:
    """Run every draft layer, each followed by its injection when `config.injection` is on.

    hidden (B, Q, H) embedded block slots, Q = the blocks of one sequence laid end to end;
    cos/sin (B, 1, Q, D) their RoPE; anchor_codes (..., r) sqrt(r) T[anchor] of every block,
    whose leading dims (B, A) or (B,) give the blocks' shape (..., Bk, H). `replace_mask` (...,)
    with `true_pred_codes` (..., Bk-1, r) applies the replacement curriculum in the first
    `config.replacement_layers` layers. Per-layer features cost a readout per layer and
    per-layer outputs keep activations alive, so both are recorded only when asked (training);
    the decode step asks for neither.
    """
    bsz, width = hidden.shape[0], hidden.shape[-1]
    last = len(layers) - 1
    out_features: list[torch.Tensor] = []
    out_hidden: list[torch.Tensor] = []
    pre_injection = recv = blocks = None
    for i, layer in enumerate(layers):
        hidden = layer.forward_block(hidden, cos, sin,
                                     functools.partial(context.attend, i, layer.self_attn))
        blocks = hidden.view(*anchor_codes.shape[:-1], -1, width)  # (..., Bk, H)
        if i == last:
            pre_injection = blocks
        if config.injection:
            replace = replace_mask if i < config.replacement_layers else None
            blocks, f_recv = injection.inject(i, blocks, anchor_codes, true_pred_codes, replace)
            if i == last:
                recv = f_recv
        elif i == last:
            recv = injection.features(i, blocks[..., 1:, :])
        if return_layer_features:
            out_features.append(injection.features(i, blocks[..., 1:, :]))
        if return_layer_hidden:
            out_hidden.append(blocks)
        hidden = blocks.reshape(bsz, -1, width)  # (B, Q, H), a view
    return LayerStackOutput(
        hidden=blocks,
        pre_injection=pre_injection,
        recv_features=recv,
        layer_features=out_features,
        layer_hidden=out_hidden,
    )
