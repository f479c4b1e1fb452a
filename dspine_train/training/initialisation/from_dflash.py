"""Start a run from a published DFlash draft: `model.init_from` = a DFlash-format checkpoint.

What carries over, and what starts fresh:

* the backbone (`fc`, `hidden_norm`, `layers.*`, `norm`) is the checkpoint's, tensor for tensor;
* DSpine's own parts start at their initialisation, as in a fresh run with the same seed: the
  injection writes and the predecessor gate at zero, the readouts and token codes from the token
  table's PCA init, the message and receiver gate at their seeded random values;
* the draft's recipe (`method`, `block_attention`, `injection`, `transition_cache`, the
  objective) is the run's, not the checkpoint's: `recipe=qwen3_8b` trains a DSpine draft.

The draft's structure must be the checkpoint's. `num_layers`, `target_layer_ids`,
`block_size`, `mask_token_id` and `attention_bias` are taken from the checkpoint where the
recipe leaves them unset, and a recipe that sets one to another value is refused by name (a
published `Qwen3-8B-DFlash-b16` under `recipe=qwen3_8b` just works; a 3-layer recipe on a
5-layer checkpoint is an error, never a silent reshape). The architecture the draft takes from
the target (`hidden_size`, heads, `head_dim`, MLP width, RoPE, norm epsilon, vocabulary,
embedding scale, target depth) must equal the checkpoint's, or the checkpoint was made for
another target and is refused by name.

Attention: DFlash attends over the whole block (bidirectional); DSpine's default is causal.
With `block_attention: bidirectional` a warm-started draft proposes exactly what the DFlash
draft proposes at step 0 (zero writes leave every hidden state unchanged, so the
transition-cache walk picks each slot's argmax). With the default causal attention the
backbone runs under another mask than the one it was trained with, so its step-0 proposals
differ from the DFlash draft's (slot t no longer sees the mask slots after it) until training
adapts it. `tests/test_initialisation_from_dflash.py` checks both statements.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...formats import FormatError, dflash, readable_format
from ...modeling import DSpineConfig, DSpineDraftModel
from ..errors import TrainingError

# Structure fields: the checkpoint's unless the recipe sets them (then they must agree).
STRUCTURE_FIELDS = ("num_layers", "target_layer_ids", "block_size", "mask_token_id",
                    "attention_bias", "sliding_window")
# Fields the draft takes from the target; the checkpoint must have been made for the same one.
TARGET_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                 "rope_parameters", "embed_scale", "target_num_layers")


def dflash_checkpoint(init_from: str | None) -> DSpineConfig | None:
    """The config (as a `method: dflash` `DSpineConfig`) of the DFlash checkpoint `init_from`,
    or None when there is no `init_from`, it is a DSpine export, or it is no local directory
    (a Hub id: `DSpineDraftModel.from_pretrained` reads DSpine exports from the Hub; a DFlash
    checkpoint is read from a local directory). `TrainingError` when the directory has no
    readable `config.json` or is a DFlash config this project cannot run."""
    if not init_from or not Path(init_from).is_dir():
        return None
    try:
        fields = dflash.read_config(init_from)
        if readable_format(fields, init_from) != "dflash":  # ours or SpecForge's: load_draft
            return None
        return dflash.config_from_dict(fields, init_from)
    except FormatError as err:
        raise TrainingError(f"model.init_from: {err}") from err


def structure_overrides(overrides: dict[str, Any], checkpoint: DSpineConfig, source: str,
                        fields: tuple[str, ...] = STRUCTURE_FIELDS,
                        kind: str = "DFlash checkpoint") -> dict[str, Any]:
    """The recipe's draft `overrides` completed with the checkpoint's structure `fields`;
    `TrainingError` naming every `model.<field>` the recipe sets to another value (`kind`:
    what the message calls the checkpoint; `from_export` passes a DSpine export's fields)."""
    merged = dict(overrides)
    conflicts = []
    noun = kind.split()[-1]
    for name in fields:
        theirs = getattr(checkpoint, name)
        if name not in merged:
            merged[name] = list(theirs) if isinstance(theirs, list) else theirs
        elif merged[name] != theirs:
            conflicts.append(f"model.{name}={merged[name]!r} (the {noun} has {theirs!r})")
    if conflicts:
        raise TrainingError(
            f"model.init_from: the {kind} {source} has another structure than the recipe: "
            f"{', '.join(conflicts)}; leave these fields unset to take the {noun}'s"
        )
    return merged


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def check_target_fields(config: DSpineConfig, checkpoint: DSpineConfig, source: str) -> None:
    """`TrainingError` naming every `TARGET_FIELDS` entry where the draft for this target
    (`config`) and the checkpoint differ: the checkpoint was made for another target."""
    differ = [f"{name}={getattr(checkpoint, name)!r} (this target: {getattr(config, name)!r})"
              for name in TARGET_FIELDS if not _same(getattr(config, name),
                                                     getattr(checkpoint, name))]
    if differ:
        raise TrainingError(
            f"model.init_from: the draft {source} was made for another target: "
            + ", ".join(differ)
        )


def load_backbone(draft: DSpineDraftModel, source: str) -> None:
    """Copy the backbone of the DFlash checkpoint at `source` into `draft` (cast to its dtype);
    DSpine's own parts keep their values. `TrainingError` naming missing, unexpected or
    mismatched tensors."""
    try:
        tensors = dflash.read_backbone(source, draft.state_dict())
    except FormatError as err:
        raise TrainingError(f"model.init_from: {err}") from err
    with torch.no_grad():
        draft.load_state_dict(tensors, strict=False)


def describe(config: DSpineConfig, source: str) -> str:
    """One line for the run's log: what the warm start loaded, and the attention caveat."""
    line = (f"model.init_from: the backbone of the DFlash draft {source} ({config.num_layers} "
            f"layers, block {config.block_size}); method {config.method}, injection and token "
            "codes start at their init")
    if config.block_attention != "bidirectional":
        line += (f"; block_attention={config.block_attention}, the DFlash draft attended "
                 "bidirectionally, so step 0 proposes differently (model.block_attention="
                 "bidirectional keeps its proposals)")
    return line
