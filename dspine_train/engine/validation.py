"""Checks that run before any generation: does the draft fit the target, are its files intact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspine_train.checkpoint_io import WeightsError, open_safetensors
from dspine_train.engine.errors import CheckpointError, IncompatibleDraftError
from dspine_train.engine.target_model import TargetModel


def check_draft_files(directory: str | Path) -> None:
    """Fail with `CheckpointError` unless `directory` holds a readable draft export.

    Opening each safetensors file validates its header and that the data it announces is all
    there, which catches truncated and corrupted files without reading the tensors.
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: no config.json (expected an exported DSpine draft)")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        raise CheckpointError(f"{directory}: no *.safetensors weights" + (
            f" ({', '.join(pickled)}: pickled .bin drafts are refused, safetensors only)"
            if pickled else ""))
    from dspine_train.modeling.configuration_dspine import DSpineConfig

    try:
        fields = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{directory}/config.json: unreadable ({err})") from err
    from dspine_train.formats import readable_format

    try:  # every field the export writes must be there (no silent defaults)
        # a DFlash, SpecForge, DeepSpec or speculators DSpark checkpoint is checked by its
        # importer (`load_draft`), strictly too
        if readable_format(fields, directory) == "dspine":
            DSpineConfig.check_export_dict(fields, str(directory))
    except (ValueError, TypeError) as err:
        raise CheckpointError(str(err)) from err
    for path in files:
        try:
            open_safetensors(path)
        except WeightsError as err:
            raise CheckpointError(str(err)) from err


def check_draft_fits_target(draft_config: Any, target: TargetModel, tokenizer: Any | None) -> None:
    """Raise `IncompatibleDraftError` when the draft was made for another target.

    Compares width, vocabulary, feature layers against the target's depth, and the tokenizer
    length recorded at export (`target_vocab_size`) with the tokenizer in use.
    """
    cfg = target.config
    problems = []
    if draft_config.hidden_size != cfg.hidden_size:
        problems.append(f"hidden_size: draft {draft_config.hidden_size}, target {cfg.hidden_size}")
    if draft_config.vocab_size != cfg.vocab_size:
        problems.append(f"vocab_size: draft {draft_config.vocab_size}, target {cfg.vocab_size}")
    layer_ids = list(draft_config.target_layer_ids)
    beyond = [i for i in layer_ids if not 0 <= i < cfg.num_layers]
    if beyond:
        problems.append(
            f"target_layer_ids {beyond} are beyond the target's {cfg.num_layers} layers"
        )
    recorded_depth = getattr(draft_config, "target_num_layers", None)
    if recorded_depth is not None and recorded_depth != cfg.num_layers:
        problems.append(
            f"target_num_layers: draft made for {recorded_depth} layers, "
            f"target has {cfg.num_layers}"
        )
    draft_scale = float(getattr(draft_config, "embed_scale", 1.0))
    if abs(draft_scale - cfg.embed_scale) > 1e-6 * cfg.embed_scale:
        problems.append(
            f"embed_scale: draft {draft_scale}, the target scales its embeddings by "
            f"{cfg.embed_scale}"
        )
    recorded_vocab = getattr(draft_config, "target_vocab_size", None)
    if tokenizer is not None and recorded_vocab is not None and recorded_vocab != len(tokenizer):
        problems.append(
            f"target_vocab_size: draft made for a tokenizer of {recorded_vocab} tokens, "
            f"this tokenizer has {len(tokenizer)} (another tokenizer)"
        )
    if problems:
        name = getattr(draft_config, "target_name_or_path", None) or "another target"
        raise IncompatibleDraftError(
            f"the draft does not fit this target (it was made for {name}): " + "; ".join(problems)
        )
