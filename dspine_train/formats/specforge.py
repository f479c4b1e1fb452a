"""SpecForge's DSpine checkpoint format (`sgl-project/SpecForge`, `DSpineDraftModel`).

SpecForge trains DSpine drafts but does not serve them (its `spec_generate` raises). This module
reads such a checkpoint into our `DSpineDraftModel` (the engine and `model.init_from` serve and
continue it) and writes ours in its format (`--format specforge`). What follows was read from
SpecForge's `specforge/modeling/draft/dspine.py` (commits 64ab5ca, 9aafadf), `dflash.py`,
`dflash_mask.py` and `configs/qwen3-8b-dspine.json`.

**config.json.** A Qwen3 config (`model_type: qwen3`; width, heads, `head_dim`, MLP width, RoPE,
norm epsilon, `num_hidden_layers` = draft layers, `attention_bias`), `architectures:
["DSpineDraftModel"]`, top-level `block_size`, `num_target_layers` and `is_causal`,
`dflash_config {mask_token_id, target_layer_ids}` and `dspine_config` with exactly these keys:

    SpecForge                  ours                      note
    transfer_rank              transfer_dim              r
    message_size               message_size
    top_k                      candidate_k               K of the candidates / transition table
    ce_weight                  ce_weight
    alignment_weight           alignment_weight
    alignment_warmup_steps     alignment_warmup_steps    (SpecForge default 146, ours 150)
    replacement_layers         replacement_layers
    candidate_mass_threshold   distill_mass_threshold
    replacement_probability    replacement_probability   the curriculum (METHOD 2.2)
    replacement_hold_ratio     replacement_hold_ratio
    replacement_end_ratio      replacement_end_ratio
    is_causal: true / false    block_attention: causal / bidirectional (SpecForge's mask: a slot
                               sees the context before its anchor and, when causal, the slots
                               of its block up to itself). Unset, SpecForge's mask helper falls
                               back to a per-layer-type default, but its DSpine trainer (not
                               in the indexed source) may build the mask otherwise: an unset
                               or non-boolean `is_causal` is refused, not guessed
    target_layer_ids           target_layer_ids          both take layer i's *output*
                                                         (`hidden_states[i + 1]`): unchanged

Anything else is refused by name: a key this module does not know (top level, `dflash_config`
or `dspine_config`), sliding-window layers, and DFlash-family options that change the network
(`attention_mode(s)` other than gqa/mha, `projector_type`, `pure_draft_prefix_len`,
`shift_label`). Our fields SpecForge has no key for (`loss_gamma`, `distill`, `refine_weight`,
`token_ce_intermediate`, the objective options `refine_normalization`,
`alignment_layer_reduction`, `readout_init`, the target's identity) travel in an extra
`dspine_train_config` block, which SpecForge's config class keeps as an attribute and never
reads. A checkpoint without that block (one SpecForge wrote) gets SpecForge's own objective
options (`SPECFORGE_OBJECTIVE`), so continuing its training here keeps its objective.

**Tensors.** The backbone (`fc`, `hidden_norm`, `layers.N.*`, `norm`) has our names. Injection:

    SpecForge                               ours
    injection.readouts.L.weight             injection.readouts.L.weight      R_l  (r, H)
    injection.writes.L.weight               injection.writes.L.weight        W_l  (H, m)
    injection.message.weight                injection.message.weight         M    (m, r)
    injection.receiver_gate.weight          injection.gate_recv.weight       G_recv
    injection.bias                          injection.gate_recv.bias         b (a separate
                                                                             parameter there)
    injection.predecessor_gate.weight       injection.gate_pred.weight       G_pred
    transfer_codes                          token_codes                      T (V, r), unit rows
    transfer_ready (bool scalar)            -                                must be true

**The math, part by part (SpecForge vs ours).** Identical: the prediction feature `sqrt(r) *
normalize(R_l h)`; the anchor's feature `sqrt(r) * T[x_a]` and slot t >= 2's predecessor
`f_{t-1}`, all read before the layer's writes; the gate `sigmoid(G_recv f_t + G_pred f_pred +
b)`; the write `W_l(g * M(f_pred))` after every layer, the last included, then the final norm
and the target's head; replacement in the first `replacement_layers` layers with `sqrt(r) *
T[true predecessor]`; the last-write refinement `norm(write_N(h_t, f_t, sqrt(r) T[c])) . W[c']`
on the last layer's pre-injection state; the transition-cache walk (its `select_cached`: row 0
for slot 1, then the row of the chosen candidate, argmax) is our greedy `walk_table` (its
candidates: `top_k` per slot, taken by its trainer, which is not in the indexed source). Token
codes are built the same way (METHOD 2.1) and stored, so they load as is. Differences: (1) the
write's scale is `||h|| / sqrt(H)` there and `sqrt(mean(h^2) + eps)` here (eps =
`rms_norm_eps`): a relative change of eps / (2 mean(h^2)) in the scale, 5e-7 at unit RMS - below
the bfloat16 rounding of the result by four orders of magnitude, so it is not refused, but it is
not bit-identical arithmetic (`tests/test_specforge_format.py` decodes with the epsilon set to
0, SpecForge's arithmetic: the same proposals); (2) SpecForge normalises the feature in fp32 and
casts it back, we normalise in the working dtype (identical in fp32); (3) at initialisation
SpecForge's readouts are the unwhitened directions, ours are whitened (init only: a checkpoint
stores its readouts); (4) SpecForge has no decode loop, so its "decode" is the one its
refinement term trains: ours; (5) our draft holds every tensor in one dtype (its `fc.weight`'s):
`transfer_codes` that FSDP kept in fp32 beside bf16 weights are rounded to bf16 here, where
SpecForge rounds `sqrt(r) * code` (a rounding-order difference). Not known from its source: how
its trainer names the checkpoint's tensors if not by `save_pretrained` (these names are the
module's own), and the embedding scale of non-Qwen targets (only `embed_scale` 1 is read or
written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config

from ..modeling import DSpineConfig, DSpineDraftModel
from .dflash import (
    FormatError,
    backbone_config_dict,
    backbone_fields,
    check_weights,
    read_tensors,
)

ARCHITECTURE = "DSpineDraftModel"
# Our state-dict names whose SpecForge name differs (every other tensor keeps its name).
RENAMES = {
    "injection.gate_recv.weight": "injection.receiver_gate.weight",
    "injection.gate_recv.bias": "injection.bias",
    "injection.gate_pred.weight": "injection.predecessor_gate.weight",
    "token_codes": "transfer_codes",
}
READY = "transfer_ready"  # SpecForge's flag that the token codes were initialised
# `dspine_config` key -> our field.
DSPINE_KEYS = {
    "transfer_rank": "transfer_dim",
    "message_size": "message_size",
    "top_k": "candidate_k",
    "ce_weight": "ce_weight",
    "alignment_weight": "alignment_weight",
    "alignment_warmup_steps": "alignment_warmup_steps",
    "replacement_layers": "replacement_layers",
    "candidate_mass_threshold": "distill_mass_threshold",
    "replacement_probability": "replacement_probability",
    "replacement_hold_ratio": "replacement_hold_ratio",
    "replacement_end_ratio": "replacement_end_ratio",
}
# The objective options as SpecForge's trainer has them (ours differ by default: DSpineConfig).
SPECFORGE_OBJECTIVE = {"refine_normalization": "supervised", "alignment_layer_reduction": "sum",
                       "readout_init": "directions"}
# Our fields SpecForge has no key for, carried in a block of their own.
EXTRA_BLOCK = "dspine_train_config"
EXTRA_FIELDS = ("loss_gamma", "distill", "refine_weight", "token_ce_intermediate",
                *SPECFORGE_OBJECTIVE,
                "target_name_or_path", "target_model_type", "target_vocab_size")
# `dflash_config` keys: those read, and DFlash-family options with the value that is our network.
DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "block_size", "num_target_layers")
DFLASH_NEUTRAL = {"projector_type": None, "pure_draft_prefix_len": 0, "shift_label": False}
ATTENTION_MODES = ("gqa", "mha")  # the same projections; mla / kda are other networks
# Top-level keys besides a Qwen3 config's own: SpecForge's, and older transformers' spellings.
TOP_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "dspine_config",
            "is_causal", "num_target_layers", "dtype", "torch_dtype", "transformers_version",
            "_name_or_path", "rope_theta", "rope_scaling", EXTRA_BLOCK)


def is_specforge_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a SpecForge DSpine checkpoint's (not our own export's,
    which has `model_type: dspine`)."""
    if fields.get("model_type") == DSpineConfig.model_type:
        return False
    return ARCHITECTURE in (fields.get("architectures") or []) or "dspine_config" in fields


# ---------------------------------------------------------------------------- writing
def check_exportable(config: DSpineConfig, source: str) -> None:
    """`FormatError` naming every field of `config` that SpecForge's DSpine cannot represent."""
    problems = []
    if config.method != "dspine":
        other = "speculators" if config.method in ("dspark", "dflash2") else "dflash"
        problems.append(f"method={config.method!r} (use --format {other})")
    for name, needed in (("injection", True), ("transition_cache", True), ("embed_scale", 1.0)):
        if getattr(config, name) != needed:
            problems.append(f"{name}={getattr(config, name)!r}")
    if problems:
        raise FormatError(
            f"{source}: SpecForge's DSpineDraftModel cannot represent {', '.join(problems)}: "
            "it always injects, decodes with the transition cache and does not scale its "
            "input embeddings; export it with --format dspine"
        )


def config_dict(config: DSpineConfig, dtype: torch.dtype) -> dict[str, Any]:
    """SpecForge's `config.json` for a draft with `config` and weights of `dtype`."""
    out = backbone_config_dict(config, dtype, ARCHITECTURE)
    out["block_size"] = config.block_size
    out["is_causal"] = config.block_attention == "causal"
    out["num_target_layers"] = config.target_num_layers
    out["dflash_config"] = {"mask_token_id": config.mask_token_id,
                            "target_layer_ids": list(config.target_layer_ids)}
    block = {key: getattr(config, ours) for key, ours in DSPINE_KEYS.items()}
    out["dspine_config"] = block
    out[EXTRA_BLOCK] = {name: getattr(config, name) for name in EXTRA_FIELDS}
    return out


def state_dict(draft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our draft state dict under SpecForge's names, with `transfer_ready` set."""
    out = {RENAMES.get(k, k): v.detach().contiguous() for k, v in draft_state.items()}
    out[READY] = torch.tensor(True)
    return out


# ---------------------------------------------------------------------------- reading
def config_from_dict(fields: dict[str, Any], source: str) -> DSpineConfig:
    """Our `DSpineConfig` for a SpecForge DSpine `config.json`; `FormatError` names every key
    that is unknown, missing or set to something this project's network is not."""
    problems: list[str] = []
    archs = fields.get("architectures")
    if archs != [ARCHITECTURE]:
        problems.append(f"architectures={archs!r} (expected [{ARCHITECTURE!r}])")
    if fields.get("model_type") != "qwen3":
        problems.append(f"model_type={fields.get('model_type')!r} (expected 'qwen3')")
    known = set(Qwen3Config().to_dict()) | set(TOP_KEYS)
    problems += [f"unknown key {key}" for key in sorted(set(fields) - known)]
    kinds = set(fields.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        problems.append(f"layer_types={sorted(kinds)} (full_attention only)")
    if fields.get("use_sliding_window"):
        problems.append("use_sliding_window=True")
    causal = fields.get("is_causal")
    if not isinstance(causal, bool):  # unset is a per-layer default there: not assumed here
        problems.append(f"is_causal={causal!r} (true or false: the block attention it was "
                        "trained with)")

    block = fields.get("dflash_config") or {}
    if not isinstance(block, dict):
        block, problems = {}, [*problems, "dflash_config is not a mapping"]
    for key in sorted(set(block) - set(DFLASH_KEYS) - set(DFLASH_NEUTRAL)
                      - {"attention_mode", "attention_modes"}):
        problems.append(f"unknown key dflash_config.{key}")
    for key, neutral in DFLASH_NEUTRAL.items():
        if key in block and block[key] != neutral:
            problems.append(f"dflash_config.{key}={block[key]!r} (only {neutral!r})")
    modes = block.get("attention_modes", [block.get("attention_mode", "gqa")])
    if not isinstance(modes, list) or any(str(m).lower() not in ATTENTION_MODES for m in modes):
        problems.append(f"dflash_config attention mode(s) {modes!r} (only gqa / mha)")
    if block.get("mask_token_id") is None:
        problems.append("dflash_config.mask_token_id missing")
    sizes = {v for v in (fields.get("block_size"), block.get("block_size")) if v is not None}
    if len(sizes) != 1:
        problems.append(f"block_size: {'missing' if not sizes else f'conflicting {sorted(sizes)}'}")
    depths = {v for v in (fields.get("num_target_layers"), block.get("num_target_layers"))
              if v is not None}
    if len(depths) != 1:
        problems.append(f"num_target_layers: {'missing' if not depths else sorted(depths)}")

    spine = fields.get("dspine_config")
    if not isinstance(spine, dict):
        spine, problems = {}, [*problems, "dspine_config missing or not a mapping"]
    expected = set(DSPINE_KEYS)
    problems += [f"unknown key dspine_config.{k}" for k in sorted(set(spine) - expected)]
    problems += [f"dspine_config.{k} missing" for k in sorted(expected - set(spine))]
    for key in ("transfer_rank", "message_size", "top_k", "alignment_warmup_steps",
                "replacement_layers"):
        if key in spine and (not isinstance(spine[key], int) or isinstance(spine[key], bool)):
            problems.append(f"dspine_config.{key}={spine[key]!r} (an integer)")
    extra = fields.get(EXTRA_BLOCK) or {}
    if not isinstance(extra, dict):
        extra, problems = {}, [*problems, f"{EXTRA_BLOCK} is not a mapping"]
    problems += [f"unknown key {EXTRA_BLOCK}.{k}" for k in sorted(set(extra) - set(EXTRA_FIELDS))]
    if problems:
        raise FormatError(f"{source}: config.json of a SpecForge DSpine draft: "
                          + "; ".join(problems))
    try:
        qwen = Qwen3Config(**{k: v for k, v in fields.items()
                              if k not in ("dflash_config", "dspine_config", EXTRA_BLOCK)})
    except (TypeError, ValueError) as err:
        raise FormatError(f"{source}: config.json is not a Qwen3 config: {err}") from err
    try:
        return DSpineConfig(
            method="dspine",
            **backbone_fields(qwen),
            embed_scale=1.0,
            initializer_range=qwen.initializer_range,
            target_layer_ids=block.get("target_layer_ids"),  # None: SpecForge's = our formula
            target_num_layers=int(depths.pop()),
            block_size=int(sizes.pop()),
            mask_token_id=int(block["mask_token_id"]),
            block_attention="causal" if causal else "bidirectional",
            injection=True,
            transition_cache=True,
            **{ours: spine[key] for key, ours in DSPINE_KEYS.items()},
            **{**SPECFORGE_OBJECTIVE, **extra},
        )
    except (TypeError, ValueError) as err:
        raise FormatError(f"{source}: {err}") from err


def tensors_to_ours(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                    source: str) -> dict[str, torch.Tensor]:
    """SpecForge's tensors under our names; `FormatError` naming (in SpecForge's names) every
    missing, unexpected or mismatched tensor, and an uninitialised transfer space."""
    theirs_of = {ours: RENAMES.get(ours, ours) for ours in expected}
    ours_of = {theirs: ours for ours, theirs in theirs_of.items()}
    missing = sorted(t for t in [*ours_of, READY] if t not in tensors)
    unexpected = sorted(k for k in tensors if k not in ours_of and k != READY)
    mismatched = sorted(
        f"{t} {tuple(tensors[t].shape)} (expected {tuple(expected[o].shape)})"
        for t, o in ours_of.items() if t in tensors and tensors[t].shape != expected[o].shape)
    check_weights(source, missing, unexpected, mismatched)
    ready = tensors[READY]
    if ready.numel() != 1 or not bool(ready.reshape(())):
        raise FormatError(f"{source}: {READY} is false: SpecForge never initialised this draft's "
                          "token codes (transfer_codes are not trained values)")
    return {ours: tensors[theirs] for theirs, ours in ours_of.items()}


def import_specforge(directory: str | Path) -> DSpineDraftModel:
    """A SpecForge DSpine checkpoint as our `DSpineDraftModel`, every field and tensor checked
    (`config_from_dict`, `tensors_to_ours`); in the dtype of its `fc.weight`."""
    from .dflash import read_config

    directory = Path(directory)
    config = config_from_dict(read_config(directory), str(directory))
    draft = DSpineDraftModel(config)
    tensors = tensors_to_ours(read_tensors(directory), draft.state_dict(), str(directory))
    dtype = tensors["fc.weight"].dtype
    draft.load_state_dict(tensors, strict=True)
    draft.config._name_or_path = str(directory)
    return draft.to(dtype).eval()
