"""Compact causal-LM target for the engine: Qwen3, Qwen2, Llama and Gemma-3 (text).

One module tree with Hugging Face parameter names (`model.layers.{i}.self_attn.q_proj.weight`,
...) so a target's safetensors load straight into it (`weights.load_target`). The forward runs
new tokens of a ragged batch against a `StaticKVCache` and returns, from the same pass, the final
normed hidden states and the draft's context features: the outputs of the requested layers,
`hidden_states[l + 1]` in HF's `output_hidden_states` numbering, concatenated to `(B, T, n*H)`.

The family differences are switches: q/k RMSNorm per head (Qwen3, Gemma-3), bias on q/k/v but
not o (Qwen2, or `attention_bias` for Qwen3/Llama), `mlp_bias` (Llama), and Gemma-3's own:
embeddings scaled by sqrt(hidden), RMSNorm weights applied as `1 + w`, norms after attention and
around the MLP, the attention scale `query_pre_attn_scalar ** -0.5`, sliding-window layers with
their own RoPE. Logit softcapping (Gemma-2) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from dspine_train.engine.errors import CheckpointError
from dspine_train.engine.kv_cache import StaticKVCache
from dspine_train.engine.rope import RopeTable, apply_rope, rope_layer_types
from dspine_train.modeling.few_rows import Projection
from dspine_train.modeling.sdpa_attention import causal_attention, masked_attention

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "gemma3_text")
# Families whose layers may be sliding-window layers (`layer_types`).
_SLIDING_MODEL_TYPES = ("gemma3_text",)
# `hidden_act` names of these families; transformers.activations is not used because importing
# it pulls in accelerate, which the engine must not load.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class TargetConfig:
    """The architecture facts the compact target needs, read from an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    embed_scale: float = 1.0  # the input embedding is multiplied by it (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # norms after attention and before/after the MLP (Gemma)
    norm_offset: bool = False  # RMSNorm weight applied as `1 + w`, in float32 (Gemma)
    attn_scale: float | None = None  # softmax scale; None is 1/sqrt(head_dim)
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" / "sliding_attention"
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> TargetConfig:
        """Translate a `Qwen3Config` / `Qwen2Config` / `LlamaConfig`; reject anything else."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"config.json model_type={model_type!r} is not supported by the engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        layer_types = getattr(config, "layer_types", None) or []
        gemma = model_type == "gemma3_text"
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise CheckpointError(
                    f"config.json {name}={getattr(config, name)}: softcapped logits are not "
                    f"supported by the engine"
                )
        if getattr(config, "use_bidirectional_attention", False):
            raise CheckpointError("config.json use_bidirectional_attention=true is not "
                                  "supported by the engine (a causal LM is needed)")
        if model_type not in _SLIDING_MODEL_TYPES and any(
            kind != "full_attention" for kind in layer_types
        ):
            raise CheckpointError(
                f"config.json layer_types={sorted(set(layer_types))}: sliding-window layers "
                f"are not supported by the engine"
            )
        # Gemma names it `hidden_activation`.
        hidden_act = getattr(config, "hidden_act", None) or getattr(
            config, "hidden_activation", None
        )
        if hidden_act not in ACTIVATIONS:
            raise CheckpointError(
                f"config.json hidden_act={hidden_act!r} is not supported by the engine "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=hidden_act,
            # Qwen2 hard-codes bias on q/k/v and none on o; the others follow `attention_bias`.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            embed_scale=config.hidden_size**0.5 if gemma else 1.0,
            sandwich_norms=gemma,
            norm_offset=gemma,
            attn_scale=config.query_pre_attn_scalar**-0.5 if gemma else None,
            layer_types=tuple(layer_types) if gemma else (),
            sliding_window=getattr(config, "sliding_window", None) if gemma else None,
        )


@dataclass
class TargetOutput:
    """What one target forward returns."""

    hidden: torch.Tensor  # (B, T, H) final hidden states after the final norm
    features: torch.Tensor | None  # (B, T, n*H) outputs of the feature layers, or None


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, in HF's order; with
    `offset` (Gemma) the weight is applied as `1 + w` in float32 before the cast."""

    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """GQA self-attention over the static cache (`modeling.sdpa_attention`: causal prefill, masked
    verify, both on fused SDPA kernels)."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = Projection(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = Projection(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = Projection(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = Projection(q_size, config.hidden_size, bias=config.o_bias)
        self.scale = config.attn_scale
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: StaticKVCache,
        layer: int,
        positions: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """`mask (B, 1, T, kv_len)` over the cache, or None for a prefill (causal, new tokens)."""
        batch, steps, _ = x.shape
        # (B, T, heads * D) -> (B, T, heads, D)
        q = self.q_proj(x).view(batch, steps, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # (B, T, heads, D) -> (B, heads, T, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        cache.write(layer, k, v, positions)
        if mask is None:
            # Prefill: every cache length is 0, so the cache holds exactly these tokens.
            out = causal_attention(q, k, v, scale=self.scale)
        else:
            keys, values = cache.layer_view(layer, batch, kv_len)
            out = masked_attention(q, keys, values, mask, scale=self.scale, label="verify")
        # (B, heads, T, D) -> (B, T, heads * D)
        out = out.transpose(1, 2).reshape(batch, steps, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))`."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        size, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Projection(size, inner, bias=bias)
        self.up_proj = Projection(size, inner, bias=bias)
        self.down_proj = Projection(inner, size, bias=bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention then MLP, each with a residual."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        size, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(size, eps, offset)
        # Pre-MLP norm in Qwen/Llama, the norm of the attention output in Gemma.
        self.post_attention_layernorm = RMSNorm(size, eps, offset)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, offset)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: StaticKVCache,
        layer: int,
        positions: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, mask, cache, layer, positions, kv_len)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)


class TargetModel(nn.Module):
    """The frozen target: `model` (backbone) + `lm_head`, inference only.

    Build it on the `meta` device and load weights with `weights.load_target`; then call
    `setup(max_batch_size, max_seq_len)` once to allocate the KV cache and RoPE table.
    """

    def __init__(self, config: TargetConfig, hf_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.hf_config = hf_config
        self.model = Backbone(config)
        self.lm_head = Projection(config.hidden_size, config.vocab_size, bias=False)
        self.feature_layer_ids: tuple[int, ...] = ()
        self.cache: StaticKVCache | None = None
        self.rope: RopeTable | None = None
        # RoPE per layer type when the config sets it so (Gemma-3), else the one `rope` table.
        self.ropes: dict[str | None, RopeTable] = {}

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights."""
        return self.lm_head.weight.dtype

    def set_feature_layers(self, layer_ids: tuple[int, ...] | list[int]) -> None:
        """Choose the layers (0-based) whose outputs `forward` returns as context features."""
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(
                f"feature layer ids {bad} are outside the target's {self.config.num_layers} layers"
            )
        self.feature_layer_ids = ids

    def setup(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the static KV cache and RoPE table (once; sizes are upper bounds)."""
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the target's max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        cfg = self.config
        self.cache = StaticKVCache(
            max_batch_size,
            cfg.num_layers,
            cfg.num_kv_heads,
            max_seq_len,
            cfg.head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        self.ropes = {
            kind: RopeTable(self.hf_config, cfg.head_dim, max_seq_len, device=self.device,
                            dtype=self.dtype, layer_type=kind)
            for kind in rope_layer_types(self.hf_config)
        }
        self.rope = next(iter(self.ropes.values()))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        kv_len: int | None = None,
        prefill: bool = False,
        tree_depths: torch.Tensor | None = None,
        tree_ancestors: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run new tokens `input_ids (B, T)` (right-padded) at each sequence's cache length.

        Sequence `b`'s token `i` gets position `cache.lengths[b] + i` and is written to that
        cache slot; `cache.lengths` is not advanced (the caller commits with `cache.crop`).
        `kv_len` bounds the slots attended to (any value above every `lengths[b] + T`); the
        default is the full capacity. `prefill=True` promises every cache length is 0 (the
        caller just reset the cache): attention is then plain causal over the new tokens, with
        no mask, which the flash / memory-efficient kernels run.

        A token tree (`tree_depths (B, T)`, `tree_ancestors (B, T, T)`, see
        `engine.token_tree.TokenTree`) changes two things: token `i` gets position
        `lengths[b] + tree_depths[b, i]` (it is still written to slot `lengths[b] + i`), and it
        sees the committed context plus the new tokens `j` with `tree_ancestors[b, i, j]` only.
        """
        if self.cache is None or self.rope is None:
            raise RuntimeError("TargetModel.setup(...) must be called before forward")
        cache, (batch, steps) = self.cache, input_ids.shape
        kv_len = cache.capacity if kv_len is None else kv_len
        offsets = torch.arange(steps, device=input_ids.device)
        lengths = cache.lengths[:batch, None]
        written = lengths + offsets[None, :]  # (B, T): the cache slot of each new token
        mask = sliding_mask = None
        slots = torch.arange(kv_len, device=input_ids.device)
        if tree_depths is None:
            positions = written
            # (B, T, S): a query sees the slots at or before its own position.
            visible = slots[None, None, :] <= positions[:, :, None]
            key_positions = slots[None, :]
        else:
            positions = lengths + tree_depths
            visible, key_positions = _tree_visibility(
                lengths, slots, tree_depths, tree_ancestors
            )
        if not prefill:
            mask = visible.unsqueeze(1)  # (B, 1, T, S)
        if "sliding_attention" in self.config.layer_types:
            # ... and a sliding layer only the last `sliding_window` of them (HF's
            # `kv_idx > q_idx - sliding_window`), in a prefill too.
            window = key_positions[:, None, :] > positions[:, :, None] - self.config.sliding_window
            sliding_mask = (visible & window).unsqueeze(1)
        ropes = {kind: table.lookup(positions) for kind, table in self.ropes.items()}
        layer_types = self.config.layer_types or ("full_attention",) * self.config.num_layers

        wanted = set(self.feature_layer_ids)
        collected: dict[int, torch.Tensor] = {}
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:
            # As HF's scaled embedding: the factor cast to the weights' dtype first.
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        for index, layer in enumerate(self.model.layers):
            kind = layer_types[index]
            rope = ropes[kind] if kind in ropes else ropes[None]
            layer_mask = sliding_mask if kind == "sliding_attention" else mask
            x = layer(x, rope, layer_mask, cache, index, written, kv_len)
            if index in wanted:
                collected[index] = x
        hidden = self.model.norm(x)
        # HF reports the normed state as the last entry of `hidden_states`; follow it.
        if self.config.num_layers - 1 in wanted:
            collected[self.config.num_layers - 1] = hidden
        features = None
        if self.feature_layer_ids:
            features = torch.cat([collected[i] for i in self.feature_layer_ids], dim=-1)
        return TargetOutput(hidden=hidden, features=features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `(..., V)` of final hidden states `(..., H)`."""
        return self.lm_head(hidden).float()


def _tree_visibility(
    lengths: torch.Tensor,
    slots: torch.Tensor,
    depths: torch.Tensor,
    ancestors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention over the cache: `(visible (B, T, S), key positions (B, S))`.

    A query sees every committed slot (`< lengths[b]`) and the slots `lengths[b] + j` of the
    new tokens `j` that are itself or its ancestors; the key at such a slot sits at position
    `lengths[b] + depths[b, j]`.
    """
    steps = depths.shape[1]
    j = slots[None, :] - lengths  # (B, S): index into the new tokens, where 0 <= j < T
    in_block = (j >= 0) & (j < steps)
    jj = j.clamp(0, steps - 1)
    tree = ancestors.gather(2, jj[:, None, :].expand(-1, steps, -1)) & in_block[:, None, :]
    visible = (j < 0)[:, None, :] | tree
    key_positions = torch.where(in_block, lengths + depths.gather(1, jj), slots[None, :])
    return visible, key_positions
