"""DSpark drafts in vLLM's speculators format (`speculators==0.9.0`, `speculators/models/dspark`).

What `speculators`' `DSparkSpeculatorConfig` / `DSparkDraftModel` write and read, established from
the package source (and checked against it by `tests/test_speculators_dspark.py`):

* `config.json`: the DFlash speculators config (`speculators.py`: `transformer_layer_config`,
  `aux_hidden_state_layer_ids` = our `target_layer_ids` + 1, `mask_token_id`, `block_size`,
  `draft_vocab_size`, `speculators_config` naming the verifier) with
  `speculators_model_type: "dspark"`, `architectures: ["DSparkDraftModel"]` (the class name its
  `save_pretrained` writes), `sample_from_anchor: true` (the anchor slot predicts: slot k
  predicts token a+k+1, `block_size` drafted tokens, so `speculative_tokens = block_size`), and
  the heads' keys `markov_rank`, `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov`. vLLM's speculators reader (`update_dspark`) maps this config to
  its `Qwen3DSparkModel` / `DSparkDraftModel` and reads the same keys.
* weights: the DFlash backbone under DFlash's names (ours), `markov_head.markov_w1.weight`
  (V, r), `markov_head.markov_w2.weight` (V, r) and `confidence_head.proj.{weight,bias}`
  ((1, H [+ r]), (1,)): our names. The target's embedding and head are the verifier's and are
  never saved; DSpine's `injection.*` and `token_codes` have no place in it.

Written for a `method: dspark` draft (`--format speculators` picks this module by the draft's
method) and read back (`load_draft`), every key and tensor checked. Refused on read: a DSpark
trained in DFlash's layout (`sample_from_anchor: false`), the `gated` / `rnn` Markov heads
(speculators' training variants; vLLM serves `vanilla` only), a pruned draft vocabulary and
sliding-window layers.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, Qwen3Config

from ..modeling import DSpineConfig, DSpineDraftModel
from . import dflash, speculators
from .dflash import FormatError

MODEL_TYPE = "dspark"  # `speculators_model_type`
ARCHITECTURE = "DSparkDraftModel"
# DSpark's own tensors, beside DFlash's backbone (`dflash.BACKBONE_PREFIXES`).
HEAD_PREFIXES = ("markov_head.", "confidence_head.")
HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head",
             "confidence_head_with_markov")


def is_dspark_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a speculators DSpark checkpoint's."""
    return fields.get("speculators_model_type") == MODEL_TYPE


# ---------------------------------------------------------------------------- writing
def check_exportable(config: DSpineConfig, source: str) -> None:
    """`FormatError` unless `config` is a DSpark draft that speculators' DSpark runs as ours."""
    if config.method != "dspark":
        raise FormatError(f"{source}: method: {config.method} is not a DSpark draft")
    speculators.check_runnable(config, source)


def config_dict(config: DSpineConfig, dtype: torch.dtype,
                verifier: dict[str, Any]) -> dict[str, Any]:
    """The speculators `config.json` of a DSpark draft with `config`, weights of `dtype`, for
    the verifier `verifier` (`speculators.verifier_block`)."""
    out = speculators.config_dict(config, dtype, verifier)
    out["architectures"] = [ARCHITECTURE]
    out["speculators_model_type"] = MODEL_TYPE
    block = out["speculators_config"]
    block["algorithm"] = MODEL_TYPE
    # every slot drafts, the anchor's too
    block["proposal_methods"][0]["speculative_tokens"] = config.num_predictions
    out["sample_from_anchor"] = True
    out.update({key: getattr(config, key) for key in HEAD_KEYS})
    return out


def is_dspark_key(name: str) -> bool:
    """Whether state-dict key `name` is part of a DSpark checkpoint (backbone or heads)."""
    return dflash.is_backbone_key(name) or name.startswith(HEAD_PREFIXES)


def state_dict(draft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone and head tensors of a DSpark draft's state dict, contiguous."""
    return {k: v.detach().contiguous() for k, v in draft_state.items() if is_dspark_key(k)}


# ---------------------------------------------------------------------------- reading
def target_depth(fields: dict[str, Any], layer_ids: list[int], source: str) -> int:
    """The target's depth, from the verifier's `config.json` when it can be read; else the
    least depth the context layers allow (speculators feeds no context feature from the last
    layer), said in a warning (the engine checks the draft against its real target)."""
    name = ((fields.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if name:
        try:
            verifier, _ = PretrainedConfig.get_config_dict(name)
            depth = (verifier.get("text_config") or verifier).get("num_hidden_layers")
            if isinstance(depth, int):
                return depth
        except (OSError, ValueError):
            pass
    depth = max(layer_ids) + 2
    warnings.warn(f"{source}: the verifier {name!r} is not readable here; taking the target's "
                  f"depth as {depth} (the least its context layers allow)", stacklevel=3)
    return depth


def config_from_dict(fields: dict[str, Any], source: str) -> DSpineConfig:
    """A `method: dspark` `DSpineConfig` for a speculators DSpark `config.json`; `FormatError`
    names every key whose network this project does not run."""
    if not is_dspark_config(fields):
        raise FormatError(f"{source}: speculators_model_type "
                          f"{fields.get('speculators_model_type')!r}: only {MODEL_TYPE!r} is read")
    layer = dict(fields.get("transformer_layer_config") or {})
    unsupported = []
    if fields.get("sample_from_anchor") is not True:
        unsupported.append(f"sample_from_anchor={fields.get('sample_from_anchor')!r} (a DSpark "
                           "in DFlash's layout, the anchor not predicting)")
    kinds = set(layer.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        unsupported.append(f"transformer_layer_config.layer_types={sorted(kinds)}")
    for key in ("use_sliding_window",):
        if layer.get(key):
            unsupported.append(f"transformer_layer_config.{key}={layer[key]!r}")
    vocab = layer.get("vocab_size")
    if fields.get("draft_vocab_size") not in (None, vocab):
        unsupported.append(f"draft_vocab_size={fields['draft_vocab_size']} (a pruned vocabulary; "
                           f"the target's is {vocab})")
    if fields.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        unsupported.append(f"target_hidden_size={fields['target_hidden_size']} (a target wider "
                           "than the draft)")
    if unsupported:
        raise FormatError(f"{source}: config.json sets {', '.join(unsupported)}, which this "
                          "project's DSpark network does not implement")
    try:
        qwen = Qwen3Config(**layer)
    except (TypeError, ValueError) as err:
        raise FormatError(f"{source}: transformer_layer_config is not a Qwen3 config: {err}") from err
    aux = fields.get("aux_hidden_state_layer_ids")
    if not aux or fields.get("mask_token_id") is None or fields.get("block_size") is None:
        raise FormatError(f"{source}: config.json lacks aux_hidden_state_layer_ids, "
                          "mask_token_id or block_size")
    # vLLM's capture id i + 1 is the output of layer i, our id i
    layer_ids = [int(i) - 1 for i in aux]
    verifier = (fields.get("speculators_config") or {}).get("verifier") or {}
    hidden = qwen.hidden_size
    try:
        return DSpineConfig(
            method="dspark",
            **dflash.backbone_fields(qwen),
            target_layer_ids=layer_ids,
            target_num_layers=target_depth(fields, layer_ids, source),
            block_size=fields["block_size"],
            mask_token_id=fields["mask_token_id"],
            target_name_or_path=verifier.get("name_or_path"),
            markov_rank=fields.get("markov_rank", 256),
            markov_head_type=fields.get("markov_head_type", "vanilla"),
            enable_confidence_head=fields.get("enable_confidence_head", True),
            # speculators builds the head from `confidence_head_with_markov` only when it has one
            confidence_head_with_markov=(fields.get("enable_confidence_head", True)
                                         and fields.get("confidence_head_with_markov", True)),
            # DSpine's parts are unused by a DSpark draft; sized so they fit any target.
            transfer_dim=min(DSpineConfig.transfer_dim, hidden, qwen.vocab_size - 1),
            message_size=min(DSpineConfig.message_size, hidden),
            candidate_k=min(DSpineConfig.candidate_k, qwen.vocab_size),
        )
    except ValueError as err:
        raise FormatError(f"{source}: {err}") from err


def read_weights(directory: str | Path, expected: dict[str, torch.Tensor],
                 extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors of the DSpark checkpoint at `directory`, checked against a draft's state dict
    `expected`: every backbone and head tensor present with its shape, the optional `extra`
    ones (in `expected` too) with theirs, and nothing else, or `FormatError` naming the
    missing, unexpected and mismatched."""
    tensors = dflash.read_tensors(directory)
    dflash.check_tensors(directory, tensors, expected, is_dspark_key, optional=extra)
    return tensors


def import_dspark(directory: str | Path) -> DSpineDraftModel:
    """A speculators DSpark checkpoint as a `method: dspark` `DSpineDraftModel`, every key and
    tensor checked; in the dtype of its `fc.weight`. DSpine's own parts (`injection.*`,
    `token_codes`), unused by a DSpark draft, keep their initial values."""
    directory = Path(directory)
    config = config_from_dict(dflash.read_config(directory), str(directory))
    draft = DSpineDraftModel(config)
    tensors = read_weights(directory, draft.state_dict())
    draft.load_state_dict(tensors, strict=False)
    draft.config._name_or_path = str(directory)
    return draft.to(tensors["fc.weight"].dtype).eval()
