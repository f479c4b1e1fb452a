"""Export the trained draft as a Hugging Face model directory.

`model.safetensors` + `config.json` via `save_pretrained` (the token codes are a buffer of the
draft, so they are inside), a `token_table.safetensors` copy of the full table, and
`training_info.json`. The target's embedding and lm_head are never part of it. Under ZeRO-3
the weights are gathered first (`accelerator.get_state_dict`, which relies on
`stage3_gather_16bit_weights_on_model_save`). `DSpineDraftModel.from_pretrained(path)` reloads
it bit-identically.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from torch import nn

DRAFT_PREFIX = "draft."
TOKEN_TABLE_FILE = "token_table.safetensors"
INFO_FILE = "training_info.json"


def export_draft(
    accelerator: Accelerator,
    engine: nn.Module,
    out_dir: Path,
    token_table_path: Path,
    info: dict[str, Any],
) -> None:
    """Write the draft wrapped by `engine` (a prepared `DraftStep`) to `out_dir`.

    Every process must call this (ZeRO-3 gathers collectively); the main process writes into a
    temporary directory and swaps it in, so `out_dir` is always a whole export.
    """
    state = accelerator.get_state_dict(engine)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    draft = accelerator.unwrap_model(engine).draft
    draft_state = {k[len(DRAFT_PREFIX):]: v for k, v in state.items() if k.startswith(DRAFT_PREFIX)}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published directory is not
    draft.save_pretrained(tmp, state_dict=draft_state, safe_serialization=True)
    shutil.copyfile(token_table_path, tmp / TOKEN_TABLE_FILE)
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, default=str))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    accelerator.wait_for_everyone()
