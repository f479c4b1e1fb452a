"""DFlash2 drafts in vLLM's speculators format (`speculators==0.9.0`, `speculators/models/dflash2`).

What `speculators`' `DFlash2SpeculatorConfig` / `DFlash2DraftModel` write and read, established
from the package source (and checked against it by `tests/test_speculators_dflash2.py`):

* `config.json`: the DFlash speculators config (`speculators.py`: `transformer_layer_config`,
  `aux_hidden_state_layer_ids` = our `target_layer_ids` + 1, `mask_token_id`, `block_size`,
  `draft_vocab_size`, `speculators_config` naming the verifier) with
  `speculators_model_type: "dflash2"`, `architectures: ["DFlash2DraftModel"]`,
  `sample_from_anchor: false` (DFlash's layout: slot 0 is the anchor, B-1 drafted tokens),
  `sliding_window_non_causal: true` (DFlash2's default; it matters only for sliding-window
  layers, which are refused here) and DFlash2's keys `conv_kernel_size`, `conv_group_size`,
  `selector_rank`, `selector_top_k`. vLLM's speculators reader maps them into the
  `dflash_config` block its `DFlash2Qwen3ForCausalLM` reads.
* weights: the DFlash backbone under DFlash's names (ours), each layer's
  `{attention,mlp}_conv.{base_kernel,kernel_projection.weight}` ((2, kernel, H),
  (2 kernel H / group, H)) and `candidate_selector.{predecessor_codebook,successor_codebook}`
  (V, r), `candidate_selector.hidden_projection.weight` (r, H): our names. The target's
  embedding and head are the verifier's and are never saved; DSpine's `injection.*` and
  `token_codes` have no place in it.

Written for a `method: dflash2` draft (`--format speculators` picks this module by the draft's
method) and read back (`load_draft`), every key and tensor checked. Refused on read: a DFlash2
whose anchor slot predicts (`sample_from_anchor: true`), a pruned draft vocabulary (speculators'
DFlash2 refuses one too) and sliding-window layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config

from ..modeling import DSpineConfig, DSpineDraftModel
from . import dflash, dflash2, speculators, speculators_dspark
from .dflash import FormatError
from .dflash2 import ARCHITECTURE, KEYS, state_dict

__all__ = ["config_dict", "config_from_dict", "import_dflash2", "is_dflash2_config",
           "state_dict"]

MODEL_TYPE = "dflash2"  # `speculators_model_type`


def is_dflash2_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a speculators DFlash2 checkpoint's."""
    return fields.get("speculators_model_type") == MODEL_TYPE


# ---------------------------------------------------------------------------- writing
def check_exportable(config: DSpineConfig, source: str) -> None:
    """`FormatError` unless `config` is a DFlash2 draft that speculators' DFlash2 runs as ours."""
    if config.method != "dflash2":
        raise FormatError(f"{source}: method: {config.method} is not a DFlash2 draft")
    speculators.check_runnable(config, source)


def config_dict(config: DSpineConfig, dtype: torch.dtype,
                verifier: dict[str, Any]) -> dict[str, Any]:
    """The speculators `config.json` of a DFlash2 draft with `config`, weights of `dtype`, for
    the verifier `verifier` (`speculators.verifier_block`)."""
    out = speculators.config_dict(config, dtype, verifier)
    out["architectures"] = [ARCHITECTURE]
    out["speculators_model_type"] = MODEL_TYPE
    out["speculators_config"]["algorithm"] = MODEL_TYPE
    out["sliding_window_non_causal"] = True  # DFlash2SpeculatorConfig's default
    out.update({key: getattr(config, key) for key in KEYS})
    return out


# ---------------------------------------------------------------------------- reading
def config_from_dict(fields: dict[str, Any], source: str) -> DSpineConfig:
    """A `method: dflash2` `DSpineConfig` for a speculators DFlash2 `config.json`; `FormatError`
    names every key whose network this project does not run."""
    if not is_dflash2_config(fields):
        raise FormatError(f"{source}: speculators_model_type "
                          f"{fields.get('speculators_model_type')!r}: only {MODEL_TYPE!r} is read")
    layer = dict(fields.get("transformer_layer_config") or {})
    unsupported = []
    if fields.get("sample_from_anchor"):
        unsupported.append("sample_from_anchor=True (an anchor slot that predicts; DFlash2 "
                           "drafts in DFlash's layout)")
    kinds = set(layer.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        unsupported.append(f"transformer_layer_config.layer_types={sorted(kinds)}")
    if layer.get("use_sliding_window"):
        unsupported.append(f"transformer_layer_config.use_sliding_window="
                           f"{layer['use_sliding_window']!r}")
    vocab = layer.get("vocab_size")
    if fields.get("draft_vocab_size") not in (None, vocab):
        unsupported.append(f"draft_vocab_size={fields['draft_vocab_size']} (a pruned vocabulary; "
                           f"the target's is {vocab})")
    if fields.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        unsupported.append(f"target_hidden_size={fields['target_hidden_size']} (a target wider "
                           "than the draft)")
    if unsupported:
        raise FormatError(f"{source}: config.json sets {', '.join(unsupported)}, which this "
                          "project's DFlash2 network does not implement")
    try:
        qwen = Qwen3Config(**layer)
    except (TypeError, ValueError) as err:
        raise FormatError(f"{source}: transformer_layer_config is not a Qwen3 config: {err}") from err
    aux = fields.get("aux_hidden_state_layer_ids")
    if not aux or fields.get("mask_token_id") is None or fields.get("block_size") is None:
        raise FormatError(f"{source}: config.json lacks aux_hidden_state_layer_ids, "
                          "mask_token_id or block_size")
    layer_ids = [int(i) - 1 for i in aux]  # vLLM's capture id i + 1 is our layer i
    verifier = (fields.get("speculators_config") or {}).get("verifier") or {}
    hidden = qwen.hidden_size
    # speculators' defaults for keys a config leaves out
    settings = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                "selector_top_k": 16}
    settings.update({key: fields[key] for key in KEYS if fields.get(key) is not None})
    try:
        return DSpineConfig(
            method="dflash2",
            **dflash.backbone_fields(qwen),
            **settings,
            target_layer_ids=layer_ids,
            target_num_layers=speculators_dspark.target_depth(fields, layer_ids, source),
            block_size=fields["block_size"],
            mask_token_id=fields["mask_token_id"],
            target_name_or_path=verifier.get("name_or_path"),
            # DSpine's parts are unused by a DFlash2 draft; sized so they fit any target.
            transfer_dim=min(DSpineConfig.transfer_dim, hidden, qwen.vocab_size - 1),
            message_size=min(DSpineConfig.message_size, hidden),
            candidate_k=min(DSpineConfig.candidate_k, qwen.vocab_size),
        )
    except ValueError as err:
        raise FormatError(f"{source}: {err}") from err


def import_dflash2(directory: str | Path) -> DSpineDraftModel:
    """A speculators DFlash2 checkpoint as a `method: dflash2` `DSpineDraftModel`, every key and
    tensor checked (`dflash2.read_draft`)."""
    directory = Path(directory)
    return dflash2.read_draft(directory,
                              config_from_dict(dflash.read_config(directory), str(directory)))
