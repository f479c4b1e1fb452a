"""Qwen3-style building blocks of the draft: RMSNorm, RoPE, attention over [context ; block], MLP.

A draft layer's keys and values are the concatenation of the *context* (the fused target
features of committed positions, projected by this layer's k/v projections) and the *block*
(the draft's own hidden states of the block slots). Queries come from the block only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .compiled_flex import BlockMask, compiled_flex_attention
from .configuration_dspine import DSpineConfig
from .few_rows import few_rows_linear
from .sdpa_attention import masked_attention

AttentionMask = torch.Tensor  # dense boolean mask (True = may attend), or a flex BlockMask
# A layer's context provider: block q (B, heads, Q, D), k/v (B, kv_heads, Q, D) -> the attention
# output (B, Q, H), through o_proj
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DSpineRMSNorm(nn.Module):
    """RMSNorm computed in float32, as in Qwen3."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class DSpineRotaryEmbedding(nn.Module):
    """cos/sin for arbitrary (per-sequence) positions.

    `inv_freq` comes from transformers' RoPE functions for scaled variants (linear, yarn, llama3,
    ...) and the standard formula for the default type. It is a non-persistent buffer: it is
    derived from the config, never stored in a checkpoint.
    """

    def __init__(self, config: DSpineConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = self.compute_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        # `draft.to(torch.bfloat16)` would round `inv_freq` to bf16: at theta 1e6 that moves the
        # angle at position ~4000 by radians. Module casts move the buffer to the new device but
        # keep it float32 (the values are the fp32 ones, re-read after the move).
        fp32 = self.inv_freq.float()
        super()._apply(fn, recurse)
        moved = self.inv_freq
        self.inv_freq = moved.float() if fp32.is_meta else fp32.to(moved.device)
        return self

    @staticmethod
    def compute_inv_freq(config: DSpineConfig) -> tuple[torch.Tensor, float]:
        params = config.rope_parameters or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = float(params.get("rope_theta", 10000.0))
            dim = config.head_dim
            exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return 1.0 / (base**exponent), 1.0
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        return inv_freq.float(), float(scaling)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) long -> cos, sin (B, 1, T, head_dim) ready to broadcast over heads."""
        freqs = positions.float()[..., None] * self.inv_freq.float()  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None], sin[:, None]


def vocab_projection(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """x (..., H) -> (..., V) logits through the head (V, H): `F.linear(x, head)`, weight-first
    for a drafted block's few rows on a CPU (`few_rows.few_rows_linear`: against Qwen2.5's
    151936 x 896 head, 7 rows in float32 took a third of F.linear's time)."""
    return few_rows_linear(x, head)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D) rotated by cos/sin (B, 1, T, D)."""
    return x * cos + rotate_half(x) * sin


class DSpineAttention(nn.Module):
    """GQA attention with q/k RMSNorm and RoPE; K/V = [context ; block]."""

    def __init__(self, config: DSpineConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DSpineRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DSpineRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, H) -> rotated keys and values, each (B, kv_heads, T, head_dim)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) -> rotated queries (B, heads, T, head_dim)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """q (B, heads, Q, D), k/v (B, kv_heads, K, D), mask -> (B, Q, heads * D) through o_proj."""
        b, _, nq, _ = q.shape
        if BlockMask is not None and isinstance(mask, BlockMask):
            out = compiled_flex_attention(q, k, v, mask, self.scaling)  # never eager (see there)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True
            )
        out = out.transpose(1, 2).reshape(b, nq, self.num_heads * self.head_dim)  # (B, Q, heads*D)
        return self.o_proj(out)

    def attend_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Inference twin of `attend` (dense mask only): the GQA groups folded into the query
        axis so SDPA's memory-efficient kernel takes the mask (`sdpa_attention`)."""
        b, _, nq, _ = q.shape
        out = masked_attention(q, k, v, mask, scale=self.scaling, label="draft")
        out = out.transpose(1, 2).reshape(b, nq, self.num_heads * self.head_dim)  # (B, Q, heads*D)
        return self.o_proj(out)


class DSpineMLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, config: DSpineConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DSpineDecoderLayer(nn.Module):
    """One draft layer: pre-norm attention over [context ; block], then a pre-norm MLP.

    The attention itself is split around the context: `block_qkv` gives the block's q/k/v, a
    context provider (`layer_stack`) attends them over the context, `finish` adds the residuals.
    """

    def __init__(self, config: DSpineConfig) -> None:
        super().__init__()
        self.self_attn = DSpineAttention(config)
        self.mlp = DSpineMLP(config)
        self.input_layernorm = DSpineRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DSpineRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def block_qkv(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of the block slots (hidden (B, Q, H))."""
        x = self.input_layernorm(hidden)
        k, v = self.self_attn.project_kv(x, cos, sin)
        return self.self_attn.project_q(x, cos, sin), k, v

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual attention output (from the layer's context provider), then the residual MLP."""
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_block(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attend: Attend) -> torch.Tensor:
        """The whole layer on the block slots hidden (B, Q, H): `attend(q, k, v)` (the context
        provider) gives the attention output. DFlash2's layer wraps its sublayers here."""
        q, k, v = self.block_qkv(hidden, cos, sin)
        return self.finish(hidden, attend(q, k, v))
