"""The trainer's export of its draft (`output_dir/final`, `best`): a Hugging Face model directory.

`model.safetensors` + `config.json` in the format `export.format` names (`dspine_train.formats`:
"dspine" is `save_pretrained` plus the DFlash keys, the token codes being a buffer of the draft;
"dflash" is z-lab's DFlashDraftModel format, backbone only), a `token_table.safetensors` copy
of the full table (dspine only), `training_info.json` (the recipe, its data and training budget)
and, when the run evaluated, `eval_results.json` (the held-out acceptance; both read by the model
card of `dspine_train.hub`). The target's embedding and lm_head
are never part of it. Under ZeRO-3 the weights are gathered first (`accelerator.get_state_dict`,
which relies on `stage3_gather_16bit_weights_on_model_save`).
`DSpineDraftModel.from_pretrained(path)` reloads it bit-identically. Converting an export to
another format afterwards is the CLI `python -m dspine_train.export`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from torch import nn

from ..checkpoint_io import build_dir, clean_dead_builds, replace_dir
from ..formats import EXPORT_MARKER, is_draft_export, write_format
from ..owned_dir import OwnedDirError, check_replaceable, write_marker
from .errors import TrainingError

DRAFT_PREFIX = "draft."
TOKEN_TABLE_FILE = "token_table.safetensors"
INFO_FILE = "training_info.json"
EVAL_RESULTS_FILE = "eval_results.json"


def check_export_dirs(output_dir: Path, names: tuple[str, ...] = ("final", "best")) -> None:
    """Refuse, before training, an export directory of the run (`output_dir/final`, `best`)
    that `export_draft` would replace at the end but that holds something other than an export
    (the marker, or an older export's files alone): `TrainingError` naming it."""
    for name in names:
        try:
            check_replaceable(output_dir / name, "output_dir", EXPORT_MARKER, "the trainer's export",
                              {}, is_legacy=is_draft_export)
        except OwnedDirError as err:
            raise TrainingError(str(err)) from None


def export_draft(
    accelerator: Accelerator,
    engine: nn.Module,
    out_dir: Path,
    token_table_path: Path,
    info: dict[str, Any],
    fmt: str = "dspine",
    eval_results: dict[str, Any] | None = None,
) -> None:
    """Write the draft wrapped by `engine` (a prepared `DraftStep`) to `out_dir`.

    `info` becomes training_info.json, `eval_results` (when given) eval_results.json.
    Every process must call this (ZeRO-3 gathers collectively); the main process writes into a
    temporary directory and swaps it in, so `out_dir` is always a whole export (the old one or
    the new one, never missing).
    """
    state = accelerator.get_state_dict(engine)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    draft = accelerator.unwrap_model(engine).draft
    draft_state = {k[len(DRAFT_PREFIX):]: v for k, v in state.items() if k.startswith(DRAFT_PREFIX)}
    clean_dead_builds(out_dir)
    tmp = build_dir(out_dir)
    try:
        write_format(draft, tmp, fmt, draft_state)
        if fmt == "dspine":  # the DFlash format has no token codes
            shutil.copyfile(token_table_path, tmp / TOKEN_TABLE_FILE)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, default=str))
        if eval_results is not None:
            (tmp / EVAL_RESULTS_FILE).write_text(json.dumps(eval_results, indent=2))
        # the same marker as `python -m dspine_train.export`: either may replace this export
        write_marker(tmp, EXPORT_MARKER, "the trainer's export")
        replace_dir(tmp, out_dir)  # no moment without a whole export at out_dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
