"""SpecForge's Domino checkpoint format (`sgl-project/SpecForge`, `DominoDraftModel`).

What was read from SpecForge's `specforge/modeling/draft/domino.py`, `dflash.py` and
`configs/qwen3-8b-domino.json` (SGLang runs these under `--speculative-algorithm DFLASH`; not
run here):

**config.json.** A Qwen3 config (`model_type: qwen3`; width, heads, `head_dim`, MLP width, RoPE,
norm epsilon, `num_hidden_layers` = draft layers, full-attention `layer_types`),
`architectures: ["DominoDraftModel"]`, top-level `block_size`, `num_target_layers` and `emb_dim`,
and `dflash_config` with

    SpecForge               ours
    mask_token_id           mask_token_id
    target_layer_ids        target_layer_ids        layer i's output (`hidden_states[i + 1]`)
    projector_type          -                       must be "domino" (SpecForge sets it when absent)
    emb_dim                 domino_emb_dim          width of `embed_proj`
    gru_hidden_dim          domino_gru_hidden_dim   G
    pure_draft_prefix_len   domino_prefix_len       default 0
    shift_label             domino_shift_label      default false

**Tensors.** The DFlash backbone under our names (`fc`, `hidden_norm`, `layers.N.*`, `norm`), and
`prefix_gru.weight_ih_l0` (3G, H), `prefix_gru.weight_hh_l0` (3G, G), `embed_proj.0.weight`
(E, H + G), `embed_proj.2.weight` (V, E): the names of our draft's own modules. No target
embedding or head. Anything else (keys, tensors, sliding-window layers, another projector) is
refused by name on read. SpecForge's older checkpoints that nest the heads under `logit_head.`
are read too (its own loader maps them the same way).

`--format specforge` writes a `method: domino` draft so (`formats.write_format`); a DSpine
draft keeps SpecForge's DSpine format (`specforge.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..modeling.configuration_dspine import DSpineConfig
from . import dflash
from .dflash import FormatError, backbone_config_dict, is_backbone_key

ARCHITECTURE = "DominoDraftModel"
PROJECTOR_TYPE = "domino"
HEAD_PREFIXES = ("prefix_gru.", "embed_proj.")
# Checkpoint-only prefixes SpecForge maps onto its modules (`normalize_draft_head_checkpoint_keys`).
NESTED_PREFIX = "logit_head."
# dflash_config keys -> our fields (with SpecForge's default when the key is absent).
DOMINO_KEYS = {"emb_dim": ("domino_emb_dim", None), "gru_hidden_dim": ("domino_gru_hidden_dim", None),
               "pure_draft_prefix_len": ("domino_prefix_len", 0),
               "shift_label": ("domino_shift_label", False)}
DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "projector_type", "block_size",
               "num_target_layers")


def is_domino_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a SpecForge Domino checkpoint's."""
    if fields.get("model_type") == DSpineConfig.model_type:
        return False
    block = fields.get("dflash_config") or {}
    return ARCHITECTURE in (fields.get("architectures") or []) or (
        isinstance(block, dict) and block.get("projector_type") == PROJECTOR_TYPE)


# ---------------------------------------------------------------------------- writing
def check_exportable(config: DSpineConfig, source: str) -> None:
    """`FormatError` unless SpecForge's `DominoDraftModel` can hold a draft with `config`."""
    problems = []
    if config.method != "domino":
        problems.append(f"method={config.method!r}")
    if config.embed_scale != 1.0:
        problems.append(f"embed_scale={config.embed_scale!r}")
    if problems:
        raise FormatError(f"{source}: SpecForge's DominoDraftModel cannot represent "
                          f"{', '.join(problems)} (it is a method: domino draft for a target that "
                          "does not scale its input embeddings); export it with --format dspine")


def config_dict(config: DSpineConfig, dtype: torch.dtype) -> dict[str, Any]:
    """SpecForge's Domino `config.json` for a draft with `config` and weights of `dtype`."""
    out = backbone_config_dict(config, dtype, ARCHITECTURE)
    out["block_size"] = config.block_size
    out["num_target_layers"] = config.target_num_layers
    out["emb_dim"] = config.domino_emb_dim
    out["layer_types"] = ["full_attention"] * config.num_layers
    out["dflash_config"] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "projector_type": PROJECTOR_TYPE,
        "pure_draft_prefix_len": config.domino_prefix_len,
        "emb_dim": config.domino_emb_dim,
        "gru_hidden_dim": config.domino_gru_hidden_dim,
        "shift_label": bool(config.domino_shift_label),
    }
    return out


def state_dict(draft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone and Domino head tensors of a draft state dict (SpecForge's names: ours)."""
    return {k: v.detach().contiguous() for k, v in draft_state.items()
            if is_backbone_key(k) or k.startswith(HEAD_PREFIXES)}


# ---------------------------------------------------------------------------- reading
def config_from_dict(fields: dict[str, Any], source: str) -> DSpineConfig:
    """A `method: domino` `DSpineConfig` for a SpecForge Domino `config.json`; `FormatError`
    names every key this project does not read."""
    archs = fields.get("architectures") or [ARCHITECTURE]
    if archs != [ARCHITECTURE]:
        raise FormatError(f"{source}: architectures {archs}: only {ARCHITECTURE} is read here")
    block = dict(fields.get("dflash_config") or {})
    if block.get("projector_type", PROJECTOR_TYPE) != PROJECTOR_TYPE:
        raise FormatError(f"{source}: dflash_config.projector_type="
                          f"{block['projector_type']!r}: a DominoDraftModel needs 'domino'")
    unknown = sorted(k for k in block if k not in DFLASH_KEYS and k not in DOMINO_KEYS)
    if unknown:
        raise FormatError(f"{source}: dflash_config keys this project does not read: "
                          f"{', '.join(unknown)}")
    top_emb = fields.get("emb_dim")
    if top_emb is not None and block.get("emb_dim") not in (None, top_emb):
        raise FormatError(f"{source}: emb_dim={top_emb} and dflash_config.emb_dim="
                          f"{block['emb_dim']} differ")
    domino = {}
    for key, (name, default) in DOMINO_KEYS.items():
        value = block.get(key, top_emb if key == "emb_dim" else None)
        if value is None:
            value = default
        if value is None:
            raise FormatError(f"{source}: config.json has no dflash_config.{key}")
        domino[name] = value
    if not isinstance(domino["domino_shift_label"], bool):
        raise FormatError(f"{source}: dflash_config.shift_label="
                          f"{domino['domino_shift_label']!r} is not a boolean")
    # The backbone is read (and its unsupported keys refused) as DFlash's.
    plain = {k: v for k, v in fields.items() if k != "emb_dim"}
    plain["architectures"] = [dflash.ARCHITECTURE]
    plain["dflash_config"] = {k: v for k, v in block.items() if k in DFLASH_KEYS
                              and k != "projector_type"}
    base = dflash.config_from_dict(plain, source)
    if base.sliding_window is not None:  # SpecForge's Domino window is not checked here
        raise FormatError(f"{source}: config.json sets sliding_attention layers (sliding_window="
                          f"{base.sliding_window}), which this project's Domino does not read")
    own = {name: getattr(base, name) for name in DSpineConfig.own_fields()}
    own.update(method="domino", **domino)
    try:
        return DSpineConfig(**own)
    except ValueError as err:
        raise FormatError(f"{source}: {err}") from err


def read_tensors(directory: str, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors checked against a domino draft's state dict `expected`: every
    backbone and head tensor present with its shape, nothing else (`logit_head.` nesting
    undone)."""
    tensors = {}
    for key, value in dflash.read_tensors(directory).items():
        if key.startswith(NESTED_PREFIX) and key[len(NESTED_PREFIX):].startswith(HEAD_PREFIXES):
            key = key[len(NESTED_PREFIX):]
        tensors[key] = value
    wanted = {k for k in expected if is_backbone_key(k) or k.startswith(HEAD_PREFIXES)}
    unexpected = sorted(k for k in tensors if k not in wanted)
    missing = sorted(k for k in wanted if k not in tensors)
    mismatched = sorted(f"{k} {tuple(tensors[k].shape)} (expected {tuple(expected[k].shape)})"
                        for k in tensors if k in wanted and tensors[k].shape != expected[k].shape)
    dflash.check_weights(directory, missing, unexpected, mismatched)
    return tensors
