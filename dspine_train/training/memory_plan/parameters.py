"""Parameter counts of the draft and the target, from configs alone.

Both are counted on models built on the `meta` device (no memory, no weights read): the draft
is the real `DSpineDraftModel` of the planned fields, the target whatever
`AutoModelForCausalLM.from_config` builds. Only a target architecture transformers cannot build
(remote code) falls back to a dense-decoder formula, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from ...modeling import DSpineConfig, DSpineDraftModel
from ...modeling.method_presets import METHOD_FREE_FIELDS


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) config."""
    return getattr(config, "text_config", None) or config


def attention_dims(config: PretrainedConfig) -> tuple[int, int]:
    """(q, kv): widths of the query and of the key (= value) projections."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads * head_dim, kv_heads * head_dim


def draft_parameter_counts(
    target_config: PretrainedConfig,
    *,
    draft_num_layers: int,
    transfer_dim: int,
    message_size: int,
    num_context_layers: int | None = None,
    attention_bias: bool = False,
    method_fields: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Trainable parameters of a draft for `target_config`, by component: `fc`,
    `hidden_norm`, `layers`, `final_norm`, `injection` and, where its method has them,
    `method_heads` (every other module: DSpark's Markov and confidence heads, for example).
    `method_fields`: the draft's `method` and the fields it leaves open
    (`method_fields_of`); None plans a DSpine draft.

    The draft is built on the `meta` device (no memory), as the target is in
    `target_parameter_count`, so the count is the real `DSpineDraftModel`'s whatever its
    layers hold. Its layers have the target's width and head layout (METHOD 1); the frozen
    embedding and lm_head belong to the target and the token codes are a buffer, so neither
    is counted here. The injection modules exist (and are trained) even when the draft runs
    as plain DFlash (`injection: false`): the readouts still feed the alignment term.
    """
    cfg = text_config(target_config)
    fields = DSpineConfig.target_derived_fields(cfg, None)
    n = draft_num_layers if num_context_layers is None else num_context_layers
    # the context layers' number alone sizes `fc`; a what-if plan may ask for more than L
    fields["target_num_layers"] = max(fields["target_num_layers"], n)
    config = DSpineConfig(
        **fields,
        num_layers=draft_num_layers,
        target_layer_ids=list(range(n)),
        transfer_dim=transfer_dim,
        message_size=message_size,
        candidate_k=1,
        mask_token_id=0,
        attention_bias=attention_bias,
        **dict(method_fields or {}),
    )
    with torch.device("meta"):
        draft = DSpineDraftModel(config)
    modules = {"fc": draft.fc, "hidden_norm": draft.hidden_norm, "layers": draft.layers,
               "final_norm": draft.norm, "injection": draft.injection}
    counts = {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()}
    heads = sum(p.numel() for p in draft.parameters()) - sum(counts.values())
    if heads:
        counts["method_heads"] = heads
    return counts


def method_fields_of(config: DSpineConfig) -> dict[str, Any]:
    """The fields that size a draft's method-specific modules: its `method` and the fields
    that method leaves open (DSpark's Markov rank and heads, for example)."""
    return {"method": config.method,
            **{name: getattr(config, name) for name in METHOD_FREE_FIELDS[config.method]}}


def draft_layer_parameters(cfg: PretrainedConfig, attention_bias: bool = False) -> int:
    """Parameters of one draft decoder layer."""
    counts = draft_parameter_counts(cfg, draft_num_layers=1, transfer_dim=1, message_size=1,
                                    attention_bias=attention_bias)
    return counts["layers"]


def dense_decoder_parameters(cfg: PretrainedConfig) -> int:
    """Parameter count of a dense Llama/Qwen-style decoder, from its config alone.

    `V*H` embedding + L layers (q/k/v/o [+ biases], q/k norms when the model type is qwen3,
    SwiGLU, two RMSNorms) + final norm + `V*H` lm_head unless tied.
    """
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = attention_dims(cfg)
    per_layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * inter
    per_layer += 2 * hidden
    if getattr(cfg, "attention_bias", False):
        per_layer += q_dim + 2 * kv_dim + hidden
    if str(getattr(cfg, "model_type", "")).startswith("qwen3"):
        per_layer += 2 * (q_dim // cfg.num_attention_heads)
    head = 0 if getattr(cfg, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + cfg.num_hidden_layers * per_layer + hidden + head


def target_parameter_count(target_config: PretrainedConfig) -> int:
    """Exact parameter count of the target (tied weights counted once).

    Builds the model on the `meta` device (no memory, no weights read) with
    `AutoModelForCausalLM.from_config`, so any architecture transformers knows is counted
    exactly. For one it does not know (remote code), falls back to the dense-decoder formula
    of `dense_decoder_parameters` with a warning.
    """
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target_config)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as err:
        warnings.warn(
            f"memory plan: cannot build {type(target_config).__name__} on the meta device ({err}); "
            "counting the target's parameters with the dense-decoder formula",
            stacklevel=2,
        )
        return dense_decoder_parameters(text_config(target_config))
    return sum(p.numel() for p in model.parameters())
