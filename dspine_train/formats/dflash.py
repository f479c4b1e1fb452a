"""The DFlash family's checkpoint format (z-lab's `DFlashDraftModel`, `pip install dflash`).

What the DFlash loaders read, established from `dflash==0.1.0` (`dflash/model.py`):

* `config.json`: a Qwen3 config (`model_type: qwen3`; width, heads, `head_dim`, MLP width, RoPE,
  norm epsilon, `num_hidden_layers` = draft layers, `attention_bias`), `architectures:
  ["DFlashDraftModel"]`, and `dflash_config {target_layer_ids, mask_token_id, block_size}`.
  The loader also reads the top-level `num_target_layers` unconditionally (it is the argument of
  its default-layer helper), so it is written there as well as in `dflash_config`. `is_causal`
  absent or false with full-attention `layer_types` is attention over the whole block
  (bidirectional); `input_embedding_scale` (written when the target scales its embeddings,
  our `embed_scale`), `output_multiplier` and `final_logit_softcapping` default to plain Qwen
  behaviour (the last two are refused on import: our draft has neither). Sliding-window layers
  (`layer_types` all `sliding_attention`, `sliding_window` W) are our `sliding_window`: a
  query at position p sees the context positions j with p - j < W (z-lab's `_attention_mask`);
  they are written with `is_causal: false`, since z-lab's loader makes a sliding layer causal
  when `is_causal` is absent. Layers of both kinds in one draft are refused.
* `target_layer_ids` number the target's decoder layers from 0 and take layer i's *output*
  as `hidden_states[i + 1]`: the same convention as `DSpineConfig.target_layer_ids`, so the
  ids are written unchanged.
* weights: `fc.weight`, `hidden_norm.weight`, `layers.N.{self_attn.{q,k,v,o}_proj, self_attn.
  {q,k}_norm, mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm}.weight` and
  `norm.weight`: exactly the names of our backbone. No target embedding or head (both are the
  target's, as here). Our `injection.*` and `token_codes` have no place in it.

The network it runs is ours with `method: dflash`: context features `hidden_norm(fc(concat))`
projected by each layer's k/v (no input norm on the context), block queries/keys/values from the
layer's input norm, q/k RMSNorm then RoPE at the absolute positions (context 0..a-1, block
a..a+B-1), attention over every context position before the anchor and every slot of the block,
SwiGLU MLP, final norm, the target's `lm_head`; slot k >= 1 predicts token a+k, decoded by
argmax per slot. `tests/test_dflash_format.py` checks this against the package itself.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config

from ..checkpoint_io import SafetensorsWeights, WeightsError
from ..modeling.configuration_dspine import (
    METHOD_PRESETS,
    DSpineConfig,
    default_target_layer_ids,
)

ARCHITECTURE = "DFlashDraftModel"
# Parameter names shared by DFlash and our backbone (identical on both sides); the rest of our
# state dict is DSpine's own and is never written in this format.
BACKBONE_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.")
DSPINE_ONLY_PREFIXES = ("injection.", "token_codes")
# The fields of a draft that decide whether DFlash's network and decode are ours.
NETWORK_FIELDS = ("injection", "block_attention", "transition_cache")
# DFlash config keys that change the network in ways this project does not implement (yet).
UNSUPPORTED_KEYS = {
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}


class FormatError(ValueError):
    """A draft cannot be written in, or read from, a format; the message says why."""


def is_backbone_key(name: str) -> bool:
    """Whether state-dict key `name` is part of the DFlash backbone."""
    return name.startswith(BACKBONE_PREFIXES)


def check_exportable(config: DSpineConfig, source: str, fmt: str = "dflash") -> None:
    """`FormatError` unless `config` is a DFlash draft (`method: dflash`, or the same network and
    decode: no injection, bidirectional block, per-slot decode); `fmt` is the format asked for
    (every format but dspine holds DFlash drafts only)."""
    if config.method == "dspark":
        raise FormatError(
            f"{source}: a DSpark draft (method: dspark) cannot be exported with --format {fmt}: "
            "DFlash loaders would drop its Markov and confidence heads and read its slots one "
            "token early (its anchor slot predicts); export it with --format speculators or "
            "--format dspine")
    if config.method == "domino":
        raise FormatError(
            f"{source}: a Domino draft (method: domino) cannot be exported with --format {fmt}: "
            "DFlash loaders would drop its GRU and logit-delta MLP; export it with --format "
            "specforge (SGLang serves it under DFLASH) or --format dspine")
    preset = METHOD_PRESETS["dflash"]
    differ = [f"{name}={getattr(config, name)!r}" for name in NETWORK_FIELDS
              if getattr(config, name) != preset[name]]
    if differ:
        raise FormatError(
            f"{source}: a DSpine draft (method: {config.method}; {', '.join(differ)}) cannot be "
            f"exported with --format {fmt}: DFlash loaders would silently drop its injection "
            "weights and token codes and run a different network (bidirectional block, per-slot "
            "argmax); export it with --format dspine, or train it with method: dflash"
        )


def backbone_config_dict(config: DSpineConfig, dtype: torch.dtype,
                         architecture: str) -> dict[str, Any]:
    """The Qwen3 backbone fields of a draft's `config.json` (the DFlash family's and SpecForge's
    formats share them) under `architectures: [architecture]`, weights of `dtype`."""
    qwen = Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=config.attention_bias,
        initializer_range=config.initializer_range,
        tie_word_embeddings=False,
    )
    if config.sliding_window is not None:  # every layer a sliding one, as published drafts
        qwen.use_sliding_window, qwen.sliding_window = True, config.sliding_window
        qwen.max_window_layers = config.num_layers
        qwen.layer_types = ["sliding_attention"] * config.num_layers
    out = qwen.to_dict()
    for key in ("_name_or_path", "transformers_version", "id2label", "label2id"):
        out.pop(key, None)
    out["architectures"] = [architecture]
    out["dtype"] = str(dtype).removeprefix("torch.")
    # Older transformers read RoPE from top-level keys; the same values as rope_parameters.
    out["rope_theta"] = float(config.rope_parameters.get("rope_theta", 10000.0))
    return out


def backbone_fields(qwen: Qwen3Config) -> dict[str, Any]:
    """The `DSpineConfig` fields a Qwen3 backbone config gives (the reverse of
    `backbone_config_dict`)."""
    hidden = qwen.hidden_size
    return dict(
        vocab_size=qwen.vocab_size,
        hidden_size=hidden,
        intermediate_size=qwen.intermediate_size,
        num_attention_heads=qwen.num_attention_heads,
        num_key_value_heads=qwen.num_key_value_heads,
        head_dim=getattr(qwen, "head_dim", None) or hidden // qwen.num_attention_heads,
        hidden_act=qwen.hidden_act,
        rms_norm_eps=qwen.rms_norm_eps,
        max_position_embeddings=qwen.max_position_embeddings,
        rope_parameters=dict(qwen.rope_parameters),
        attention_bias=bool(qwen.attention_bias),
        num_layers=qwen.num_hidden_layers,
    )


def config_dict(config: DSpineConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The DFlash `config.json` of a draft with `config` and weights of `dtype`."""
    out = backbone_config_dict(config, dtype, ARCHITECTURE)
    out["is_causal"] = False  # attention over the whole block, as DFlash's default
    out["num_target_layers"] = config.target_num_layers
    out["dflash_config"] = dflash_block(config)
    return out


def dflash_block(config: DSpineConfig) -> dict[str, Any]:
    """The `dflash_config` block: context layers (output of layer i = hidden_states[i + 1], our
    numbering too), mask token, block size and target depth."""
    block = {
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
        "num_target_layers": config.target_num_layers,
    }
    if config.embed_scale != 1.0:  # a target that scales its input embeddings (Gemma)
        block["input_embedding_scale"] = config.embed_scale
    return block


def state_dict(draft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone tensors of a draft state dict, under DFlash's names (ours), contiguous."""
    unknown = [k for k in draft_state
               if not is_backbone_key(k) and not k.startswith(DSPINE_ONLY_PREFIXES)]
    if unknown:
        raise FormatError(f"state dict holds tensors of neither format: {', '.join(unknown)}")
    return {k: v.detach().contiguous() for k, v in draft_state.items() if is_backbone_key(k)}


# ---------------------------------------------------------------------------- reading
def is_dflash_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a DFlash checkpoint's (not a DSpine export's)."""
    if fields.get("model_type") == DSpineConfig.model_type:
        return False
    return ARCHITECTURE in (fields.get("architectures") or []) or "dflash_config" in fields


def config_from_dict(fields: dict[str, Any], source: str, architecture: str = ARCHITECTURE,
                     method: str = "dflash", **method_fields: Any) -> DSpineConfig:
    """A `method: dflash` `DSpineConfig` for a DFlash `config.json` (`architecture`, `method`
    and `method_fields`: another member of the family, `dflash2.config_from_dict`);
    `FormatError` names every key whose network this project does not run."""
    archs = fields.get("architectures") or [architecture]
    if archs != [architecture]:
        raise FormatError(f"{source}: architectures {archs}: only {architecture} drafts are read")
    block = dict(fields.get("dflash_config") or {})
    unsupported = []
    for key, plain in UNSUPPORTED_KEYS.items():
        got = block.get(key, fields.get(key))
        off = got is None or got == plain or (key == "final_logit_softcapping" and got <= 0)
        if not off:
            unsupported.append(f"{key}={got!r}")
    try:
        qwen = Qwen3Config(**{k: v for k, v in fields.items() if k != "dflash_config"})
    except (TypeError, ValueError) as err:
        raise FormatError(f"{source}: config.json is not a Qwen3 config: {err}") from err
    if fields.get("is_causal") or block.get("causal"):
        unsupported.append("is_causal=True (a causal DFlash block)")
    # what vLLM's DFlash layers read beside z-lab's keys (`qwen3_dflash.py`): windows and sink
    # biases this network has not, a rotary layout other than neox
    for key, plain in (("use_swa", False), ("swa_window_size", None),
                       ("attention_sink_bias", False)):
        if block.get(key, plain) not in (plain, None):
            unsupported.append(f"dflash_config.{key}={block[key]!r}")
    if fields.get("add_swa_attention_sink_bias"):
        unsupported.append("add_swa_attention_sink_bias=True")
    if fields.get("is_neox_style", True) is not True:
        unsupported.append(f"is_neox_style={fields['is_neox_style']!r}")
    window = sliding_window(qwen, fields, unsupported)
    if unsupported:
        raise FormatError(f"{source}: config.json sets {', '.join(unsupported)}, which this "
                          "project's DFlash network does not implement")

    def value(name: str) -> Any:
        return block.get(name, fields.get(name))

    depth = value("num_target_layers")
    mask = value("mask_token_id")
    if mask is None:
        raise FormatError(f"{source}: config.json has no dflash_config.mask_token_id")
    if depth is None:
        raise FormatError(f"{source}: config.json has no num_target_layers (the target's depth)")
    hidden = qwen.hidden_size
    layer_ids = value("target_layer_ids")
    if layer_ids is None and isinstance(depth, int) and isinstance(qwen.num_hidden_layers, int):
        # DFlash's own loader takes the formula's layers too (`build_target_layer_ids`), so
        # such checkpoints exist and serve; refusing them would refuse what DFlash runs. A
        # draft trained on other layers would run silently wrong, so the choice is said.
        layers = default_target_layer_ids(depth, qwen.num_hidden_layers)
        warnings.warn(f"{source}: config.json has no dflash_config.target_layer_ids; taking "
                      f"the default layers {layers} (as DFlash's loader does); if the draft "
                      "was trained on other layers, add them there", stacklevel=2)
    block_size = value("block_size")
    try:
        return DSpineConfig(
            method=method,
            **method_fields,
            **backbone_fields(qwen),
            sliding_window=window,
            embed_scale=float(value("input_embedding_scale") or 1.0),
            target_layer_ids=layer_ids,  # None: the same formula as DFlash's
            # Passed as written: `DSpineConfig` refuses a non-integer by name (8.5 is no size).
            target_num_layers=depth,
            block_size=16 if block_size is None else block_size,  # DFlash's default
            mask_token_id=mask,
            # DSpine's parts are unused by a dflash draft; sized so they fit any target.
            transfer_dim=min(DSpineConfig.transfer_dim, hidden, qwen.vocab_size - 1),
            message_size=min(DSpineConfig.message_size, hidden),
            candidate_k=min(DSpineConfig.candidate_k, qwen.vocab_size),
        )
    except ValueError as err:
        raise FormatError(f"{source}: {err}") from err


def sliding_window(qwen: Qwen3Config, fields: dict[str, Any], unsupported: list[str]) -> int | None:
    """The draft's `sliding_window` from its Qwen3 config (layer kinds as z-lab's loader reads
    them: `layer_types`, else `use_sliding_window` from `max_window_layers` on); appends to
    `unsupported` what this project does not run: layers of both kinds, a sliding layer
    without a window, or one left causal (`is_causal` absent)."""
    kinds = set(qwen.layer_types or ["full_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        unsupported.append(f"layer_types={sorted(kinds)} (full and sliding layers in one draft)")
    elif not isinstance(qwen.sliding_window, int) or qwen.sliding_window < 1:
        unsupported.append(f"layer_types={sorted(kinds)} with sliding_window="
                           f"{qwen.sliding_window!r} (use_sliding_window true and a window >= 1 "
                           "expected)")
    elif fields.get("is_causal") is None:
        unsupported.append("sliding_attention layers without is_causal (z-lab's loader makes "
                           "them causal; is_causal: false is the bidirectional block)")
    else:
        return qwen.sliding_window
    return None


def read_config(directory: str | Path) -> dict[str, Any]:
    """`config.json` of `directory` as a dict; `FormatError` when absent or unreadable."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FormatError(f"{path}: unreadable ({err})") from err


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `directory` (`model.safetensors`, or the index and its
    shards: `checkpoint_io.SafetensorsWeights`); `FormatError` naming the file when unreadable."""
    try:
        with SafetensorsWeights(directory) as weights:
            return dict(weights.tensors())
    except WeightsError as err:
        raise FormatError(str(err)) from err


def check_weights(source: str | Path, missing: list[str], unexpected: list[str],
                  mismatched: list[str]) -> None:
    """`FormatError` naming every missing, unexpected and mismatched tensor, if there is any."""
    problems = [f"{kind}: {', '.join(keys)}" for kind, keys in
                (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched))
                if keys]
    if problems:
        raise FormatError(f"{source}: the weights do not match its config.json ("
                          + "; ".join(problems) + ")")


def check_tensors(source: str | Path, tensors: dict[str, torch.Tensor],
                  expected: dict[str, torch.Tensor], is_key: Callable[[str], bool],
                  optional: tuple[str, ...] = ()) -> None:
    """`FormatError` (`check_weights`) unless `tensors` holds every key of the draft's state dict
    `expected` that the format carries (`is_key`), the `optional` ones of `expected` at most
    besides, and each with its shape in `expected`."""
    allowed = {k for k in expected if is_key(k) or k in optional}
    unexpected = sorted(k for k in tensors if k not in allowed)
    missing = sorted(k for k in expected if is_key(k) and k not in tensors)
    mismatched = sorted(f"{k} {tuple(tensors[k].shape)} (expected {tuple(expected[k].shape)})"
                        for k in tensors if k in expected and tensors[k].shape != expected[k].shape)
    check_weights(source, missing, unexpected, mismatched)


def read_backbone(directory: str | Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone tensors of the DFlash checkpoint at `directory` (every `*.safetensors`),
    checked against a draft's state dict `expected`: every backbone tensor present with its
    shape and nothing else, or `FormatError` naming the missing, unexpected and mismatched."""
    tensors = read_tensors(directory)
    check_tensors(directory, tensors, expected, is_backbone_key)
    return tensors
