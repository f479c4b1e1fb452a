"""Rotary position tables for the compact target, computed once at setup.

The inverse frequencies come from transformers' RoPE initialisers (`ROPE_INIT_FUNCTIONS`) for the
scaled variants; the default variant is the plain formula of the families' own
`RotaryEmbedding.compute_default_rope_parameters` (importing those classes would pull in
`transformers.modeling_utils` and, through it, accelerate, which the engine must not load).
RoPE types whose frequencies change with the running sequence length (`dynamic`, `longrope`)
cannot be precomputed into one static table and are rejected.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dspine_train.engine.errors import CheckpointError

# Frequencies of these types depend on the current sequence length, so a table built once would
# differ from what the reference implementation computes on the fly.
_LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def rope_layer_types(config: PretrainedConfig) -> tuple[str | None, ...]:
    """The layer types with RoPE settings of their own (Gemma-3: `full_attention` and
    `sliding_attention`), or `(None,)` when one setting serves every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = [key for key, value in params.items() if isinstance(value, dict)]
    return tuple(nested) if nested else (None,)


def rope_parameters(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Return `(inv_freq (head_dim // 2,), attention_scaling)` for a target's HF config (for
    the layers of `layer_type` when the config sets RoPE per layer type)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE_TYPES:
        raise CheckpointError(
            f"config.json rope_parameters.rope_type={rope_type!r} depends on the running "
            f"sequence length; the engine's static RoPE table does not support it"
        )
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (base**exponent), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(
            f"config.json rope_parameters.rope_type={rope_type!r} is unknown to transformers"
        )
    if layer_type is None:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
            config, torch.device("cpu"), layer_type=layer_type
        )
    return inv_freq.float(), float(scaling)


class RopeTable:
    """Precomputed `cos`/`sin` rows for positions `0 .. max_positions-1`.

    Rows are gathered by position id, so every sequence of a ragged batch reads its own positions
    without any per-step trigonometry.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        layer_type: str | None = None,
    ) -> None:
        inv_freq, scaling = rope_parameters(config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D): the rotate-half layout HF uses
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather `(cos, sin)` of shape `(*positions.shape, D)` for integer positions."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x (B, heads, T, D)` by `cos`/`sin (B, T, D)` (rotate-half convention)."""
    cos = cos.unsqueeze(1)  # (B, 1, T, D) broadcast over heads
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
