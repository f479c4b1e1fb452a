"""DSpark drafts in DeepSpec's own format, the one vLLM serves natively as `Qwen3DSparkModel`.

DeepSpec (deepseek-ai/DeepSpec, `deepspec/modeling/dspark/qwen3/`) saves its draft as a Hugging
Face checkpoint of its `Qwen3DSparkModel`; published drafts (`deepseek-ai/dspark_qwen3_4b_block7`)
are in it, and vLLM loads it by its `architectures` name. Established from DeepSpec's source
(`build_draft_config`, `Qwen3DSparkModel.__init__`) and vLLM's `qwen3_dspark.py` loader:

* `config.json`: the target's Qwen3 config with `architectures: ["Qwen3DSparkModel"]`,
  `num_hidden_layers` = draft layers, `layer_types` all `full_attention`,
  `tie_word_embeddings: false`, and at the top level `num_target_layers`, `block_size`,
  `mask_token_id`, `target_layer_ids` (layer i's *output*, `hidden_states[i + 1]`: our
  numbering, written unchanged; DeepSpec's -1, the embedding output, has no counterpart here
  and is refused), `num_anchors` (DeepSpec's training setting, which its class requires: 512,
  its published recipes' value, when the draft was not trained there), `markov_rank`,
  `markov_head_type` (when rank > 0), `enable_confidence_head`, `confidence_head_with_markov`
  (when the head is on). The anchor slot predicts (slot k: token a+k+1): DeepSpec has no
  other layout, so there is no key for it.
* weights: the DFlash backbone under DFlash's names (ours), `markov_head.markov_w{1,2}.weight`
  (V, r) and `confidence_head.proj.{weight,bias}`. DeepSpec's class also holds copies of the
  target's `embed_tokens.weight` and `lm_head.weight` (frozen, byte-identical to the target's);
  vLLM takes the target's own when they are absent (its loader skips them), so they are not
  written here, and on import they are accepted with the target's shapes and dropped (the
  engine binds the target's).

`tests/test_deepspec_format.py` checks the keys and tensors against these readers and the
round trip against the speculators format (`speculators_dspark.py`), which the reference class
proves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config

from ..modeling import DSpineConfig, DSpineDraftModel
from . import dflash, speculators_dspark
from .dflash import FormatError

ARCHITECTURE = "Qwen3DSparkModel"
# DeepSpec's copies of the target's embedding and head: read (shape-checked) and dropped.
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")
# DeepSpec's `num_anchors` (a training setting its class requires) when the draft has none.
NUM_ANCHORS = 512
# Top-level keys of the format that are not the Qwen3 backbone's.
DSPARK_KEYS = ("num_target_layers", "block_size", "mask_token_id", "target_layer_ids",
               "num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head",
               "confidence_head_with_markov")


def is_deepspec_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a DeepSpec DSpark checkpoint's."""
    return ARCHITECTURE in (fields.get("architectures") or [])


# ---------------------------------------------------------------------------- writing
def check_exportable(config: DSpineConfig, source: str) -> None:
    """`FormatError` unless `config` is a DSpark draft DeepSpec's Qwen3 class runs as ours."""
    if config.method != "dspark":
        raise FormatError(
            f"{source}: method: {config.method} cannot be exported with --format deepspec, "
            "which holds DSpark drafts (method: dspark) only; use --format dspine or dflash")
    if config.embed_scale != 1.0:
        raise FormatError(f"{source}: the target scales its input embeddings (embed_scale="
                          f"{config.embed_scale}) and DeepSpec's Qwen3 DSpark has no such scale")


def config_dict(config: DSpineConfig, dtype: torch.dtype) -> dict[str, Any]:
    """DeepSpec's `config.json` for a DSpark draft with `config` and weights of `dtype`."""
    out = dflash.backbone_config_dict(config, dtype, ARCHITECTURE)
    out["layer_types"] = ["full_attention"] * config.num_layers
    out.update(num_target_layers=config.target_num_layers, block_size=config.block_size,
               mask_token_id=config.mask_token_id,
               target_layer_ids=list(config.target_layer_ids), num_anchors=NUM_ANCHORS,
               markov_rank=config.markov_rank,
               enable_confidence_head=config.enable_confidence_head)
    # DeepSpec writes these two only where they mean something
    if config.markov_rank > 0:
        out["markov_head_type"] = config.markov_head_type
    if config.enable_confidence_head:
        out["confidence_head_with_markov"] = config.confidence_head_with_markov
    return out


# ---------------------------------------------------------------------------- reading
def config_from_dict(fields: dict[str, Any], source: str) -> DSpineConfig:
    """A `method: dspark` `DSpineConfig` for DeepSpec's `config.json`; `FormatError` names every
    key whose network this project does not run, and every required key that is absent."""
    archs = fields.get("architectures") or []
    if archs != [ARCHITECTURE] or fields.get("model_type") != "qwen3":
        raise FormatError(f"{source}: architectures {archs}, model_type "
                          f"{fields.get('model_type')!r}: only DeepSpec's {ARCHITECTURE} (qwen3) "
                          "is read")
    required = ["num_target_layers", "block_size", "mask_token_id", "target_layer_ids",
                "markov_rank", "enable_confidence_head"]
    if fields.get("markov_rank"):
        required.append("markov_head_type")
    if fields.get("enable_confidence_head"):
        required.append("confidence_head_with_markov")
    missing = [key for key in required if fields.get(key) is None]
    if missing:
        raise FormatError(f"{source}: config.json lacks {', '.join(missing)} (DeepSpec's "
                          f"{ARCHITECTURE} needs them)")
    unsupported = []
    kinds = set(fields.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        unsupported.append(f"layer_types={sorted(kinds)}")
    if fields.get("use_sliding_window"):
        unsupported.append("use_sliding_window=True")
    if -1 in fields["target_layer_ids"]:
        unsupported.append("target_layer_ids with -1 (the embedding output as a context "
                           "feature)")
    if unsupported:
        raise FormatError(f"{source}: config.json sets {', '.join(unsupported)}, which this "
                          "project's DSpark network does not implement")
    try:
        qwen = Qwen3Config(**{k: v for k, v in fields.items() if k not in DSPARK_KEYS})
    except (TypeError, ValueError) as err:
        raise FormatError(f"{source}: config.json is not a Qwen3 config: {err}") from err
    hidden = qwen.hidden_size
    try:
        return DSpineConfig(
            method="dspark",
            **dflash.backbone_fields(qwen),
            target_layer_ids=fields["target_layer_ids"],
            target_num_layers=fields["num_target_layers"],
            block_size=fields["block_size"],
            mask_token_id=fields["mask_token_id"],
            markov_rank=fields["markov_rank"],
            markov_head_type=fields.get("markov_head_type", "vanilla"),
            enable_confidence_head=fields["enable_confidence_head"],
            confidence_head_with_markov=bool(fields.get("confidence_head_with_markov", False)),
            # DSpine's parts are unused by a DSpark draft; sized so they fit any target.
            transfer_dim=min(DSpineConfig.transfer_dim, hidden, qwen.vocab_size - 1),
            message_size=min(DSpineConfig.message_size, hidden),
            candidate_k=min(DSpineConfig.candidate_k, qwen.vocab_size),
        )
    except ValueError as err:
        raise FormatError(f"{source}: {err}") from err


def import_deepspec(directory: str | Path) -> DSpineDraftModel:
    """A DeepSpec DSpark checkpoint as a `method: dspark` `DSpineDraftModel`, every key and
    tensor checked; its copies of the target's embedding and head (when present) must have the
    target's shape (vocab_size, hidden_size) and are dropped. In the dtype of its `fc.weight`."""
    directory = Path(directory)
    config = config_from_dict(dflash.read_config(directory), str(directory))
    draft = DSpineDraftModel(config)
    expected = draft.state_dict()
    shape = (config.vocab_size, config.hidden_size)
    expected.update({name: torch.empty(shape, device="meta") for name in TARGET_COPIES})
    tensors = speculators_dspark.read_weights(directory, expected, extra=TARGET_COPIES)
    for name in TARGET_COPIES:
        tensors.pop(name, None)
    draft.load_state_dict(tensors, strict=False)
    draft.config._name_or_path = str(directory)
    return draft.to(tensors["fc.weight"].dtype).eval()
