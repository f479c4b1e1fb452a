"""Draft checkpoint formats: what an export directory holds, written and read in one place.

* `dspine` (this project's own): `config.json` of `DSpineConfig` (`model_type: dspine`,
  `architectures: ["DSpineDraftModel"]`, every field) plus, derived from the fields for other
  tools to read, the DFlash keys (`dflash_config`, `num_target_layers`) and a `dspine_config`
  block with DSpine's own settings; `model.safetensors` holds the backbone under DFlash's
  tensor names plus `injection.*` and `token_codes`. Its `architectures` name is not DFlash's,
  so a loader that dispatches on it refuses the directory instead of running a DSpine draft as
  DFlash.
* `dflash` (`dflash.py`): what z-lab's `DFlashDraftModel` and the serving stacks that follow it
  read, for a DFlash draft (`method: dflash`); for a DFlash2 draft (`method: dflash2`) z-lab's
  `DFlash2DraftModel` (`dflash2.py`), which vLLM and SGLang read too. Written and read.
* `specforge` (`specforge.py`): SpecForge's `DSpineDraftModel` checkpoint (the same network under
  a few other names); read and written, every field and tensor checked.
* `speculators` (`speculators.py`): vLLM's own format as the `speculators` package writes it
  (`speculators_model_type: dflash`, the verifier named in `speculators_config`) for DFlash
  drafts, written, not read; and (`speculators_dspark.py`, `speculators_model_type: dspark`) for
  DSpark drafts (`method: dspark`), written and read; and (`speculators_dflash2.py`,
  `speculators_model_type: dflash2`) for DFlash2 drafts (`method: dflash2`), written and read.
* `deepspec` (`deepspec.py`): DeepSpec's own DSpark checkpoint (`architectures:
  ["Qwen3DSparkModel"]`, which vLLM serves natively; published DSpark drafts are in it);
  DSpark drafts only, written and read.

`export_dir` converts an export directory (the CLI `python -m dspine_train.export`);
`write_format` writes a draft into a directory being built (the trainer's export);
`load_draft` reads the dspine, dflash (DFlash and DFlash2), specforge, deepspec and speculators
(DSpark and DFlash2) formats into a
`DSpineDraftModel` (a DFlash checkpoint becomes a `method: dflash` draft, a DSpark one a
`method: dspark` draft, a DFlash2 one a `method: dflash2` draft). Further formats go beside
these.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..checkpoint_io import build_dir, clean_dead_builds, replace_dir, write_json_atomic
from ..modeling import DSpineConfig, DSpineDraftModel
from ..output_lock import lock_output
from ..owned_dir import OwnedDirError, check_no_overlap, check_replaceable, write_marker
from . import (
    deepspec,
    dflash,
    dflash2,
    specforge,
    specforge_domino,
    speculators,
    speculators_dflash2,
    speculators_dspark,
)
from .dflash import FormatError

FORMATS = ("dspine", "dflash", "specforge", "speculators", "deepspec")
WEIGHTS_FILE = "model.safetensors"
# Files of a DSpine export that travel with it (the dflash format keeps only the info file).
SIDE_FILES = {"dspine": ("token_table.safetensors", "training_info.json"),
              "dflash": ("training_info.json",),
              "specforge": ("training_info.json",),
              "speculators": ("training_info.json",),
              "deepspec": ("training_info.json",)}
# The marker of an export directory written here (the CLI and the trainer): only such a
# directory, an empty one, or a marker-less export of these files alone is replaced. A dot
# file, so `push_to_hub` leaves it out of the upload.
EXPORT_MARKER = ".dspine_train.export"
EXPORT_TOOL = "dspine_train.export"
# What a draft export holds (an older one carries no marker); push_to_hub adds README.md (its
# card) and reads eval_results.json.
EXPORT_FILES = {"config.json", WEIGHTS_FILE, "token_table.safetensors", "training_info.json",
                "eval_results.json", "README.md"}
# DFlash's own keys (the `dflash_config` block) are not repeated in `dspine_config`.
_DFLASH_FIELDS = ("num_layers", "target_layer_ids", "block_size", "mask_token_id")

__all__ = ["EXPORT_MARKER", "FORMATS", "FormatError", "check_exportable", "dspine_blocks",
           "export_dir", "import_dflash", "is_draft_export", "load_draft", "readable_format",
           "write_format"]


def is_draft_export(directory: Path) -> bool:
    """Whether `directory` holds a draft export and nothing else (one written before exports
    carried `EXPORT_MARKER`): only `EXPORT_FILES`, and a `config.json` of a draft, not of a
    target model (whose tokenizer and generation files are not export files either)."""
    if not {entry.name for entry in directory.iterdir()} <= EXPORT_FILES:
        return False
    try:
        fields = dflash.read_config(directory)
    except FormatError:
        return False
    return isinstance(fields, dict) and (
        fields.get("model_type") == DSpineConfig.model_type or dflash.is_dflash_config(fields)
        or specforge.is_specforge_config(fields) or speculators.is_speculators_config(fields)
        or specforge_domino.is_domino_config(fields)
        or deepspec.is_deepspec_config(fields))


def dspine_blocks(config: DSpineConfig) -> dict[str, Any]:
    """The keys the dspine format adds to `config.json`: DFlash's (`dflash_config`,
    `num_target_layers`) and `dspine_config`, every draft field DFlash has not. They are derived
    from the fields and dropped on load (`DSpineConfig.DERIVED_BLOCKS`)."""
    own = {name: getattr(config, name) for name in DSpineConfig.draft_fields()
           if name not in _DFLASH_FIELDS}
    return {"num_target_layers": config.target_num_layers,
            "dflash_config": dflash.dflash_block(config),
            "dspine_config": own}


def write_format(draft: DSpineDraftModel, directory: Path, fmt: str,
                 state_dict: dict[str, torch.Tensor] | None = None,
                 verifier: str | None = None) -> None:
    """Write `draft` (weights `state_dict`, default its own) into `directory` in format `fmt`:
    `model.safetensors` and `config.json`. `verifier` (speculators only) names the target model,
    default the draft's `target_name_or_path`. `FormatError` when the draft cannot be written so."""
    if fmt not in FORMATS:
        raise FormatError(f"--format {fmt!r}: not one of {', '.join(FORMATS)}")
    state = state_dict if state_dict is not None else draft.state_dict()
    directory = Path(directory)
    if fmt == "dspine":
        draft.save_pretrained(directory, state_dict=state, safe_serialization=True)
        path = directory / "config.json"
        fields = json.loads(path.read_text())
        fields.update(dspine_blocks(draft.config))
        write_json_atomic(path, fields, indent=2, sort_keys=True)
        return
    source = getattr(draft.config, "_name_or_path", "") or "the draft"
    check_window(draft.config, source, fmt)
    if draft.config.draft_vocab_size is not None:
        # These formats' loaders score the target's whole vocabulary: they would read no d2t
        # map and run the pruned head's rows as the wrong tokens.
        raise FormatError(
            f"{source}: a pruned-vocabulary draft (draft_vocab_size="
            f"{draft.config.draft_vocab_size}, its d2t map) cannot be exported with --format "
            f"{fmt}: that format has no draft-to-target id map; export it with --format dspine")
    tensors, fields = format_files(draft.config, state, fmt, source, verifier)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    write_json_atomic(directory / "config.json", fields, indent=2, sort_keys=True)


def format_files(config: DSpineConfig, state: dict[str, torch.Tensor], fmt: str, source: str,
                 verifier: str | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and `config.json` fields of a draft with `config` and weights `state` in
    `fmt` (any format but dspine), the draft checked first (`FormatError`). The DFlash-family
    formats share the backbone tensors; a DSpark's heads or a DFlash2's selector sit beside."""
    if fmt == "specforge" and config.method == "domino":
        specforge_domino.check_exportable(config, source)
        tensors = specforge_domino.state_dict(state)
        return tensors, specforge_domino.config_dict(config, tensors["fc.weight"].dtype)
    if fmt == "specforge":
        specforge.check_exportable(config, source)
        return specforge.state_dict(state), specforge.config_dict(config, state["fc.weight"].dtype)
    check_exportable(config, source, fmt)  # refused before anything is written
    dtype = state["fc.weight"].dtype
    if fmt == "deepspec":  # the same tensors as speculators' DSpark, the same names
        return speculators_dspark.state_dict(state), deepspec.config_dict(config, dtype)
    if fmt == "dflash" and config.method == "dflash2":  # z-lab's own DFlash2 format
        return dflash2.state_dict(state), dflash2.config_dict(config, dtype)
    if fmt == "dflash":
        return dflash.state_dict(state), dflash.config_dict(config, dtype)
    target = speculators.verifier_block(config, verifier, source)  # the verifier checked
    if config.method == "dspark":
        return (speculators_dspark.state_dict(state),
                speculators_dspark.config_dict(config, dtype, target))
    if config.method == "dflash2":
        return (speculators_dflash2.state_dict(state),
                speculators_dflash2.config_dict(config, dtype, target))
    return dflash.state_dict(state), speculators.config_dict(config, dtype, target)


def check_exportable(config: DSpineConfig, source: str, fmt: str) -> None:
    """`FormatError` unless a draft with `config` can be written in `fmt`, one of the DFlash
    family's formats ("dflash", "speculators", "deepspec"; the speculators format takes DFlash,
    DSpark and DFlash2 drafts, deepspec DSpark drafts)."""
    check_window(config, source, fmt)
    if fmt == "deepspec":
        deepspec.check_exportable(config, source)
    elif fmt == "speculators" and config.method == "dspark":
        speculators_dspark.check_exportable(config, source)
    elif fmt == "speculators" and config.method == "dflash2":
        speculators_dflash2.check_exportable(config, source)
    elif fmt == "speculators":
        speculators.check_exportable(config, source)
    elif fmt == "dflash" and config.method == "dflash2":
        dflash2.check_exportable(config, source)
    else:
        dflash.check_exportable(config, source, fmt)


def check_window(config: DSpineConfig, source: str, fmt: str) -> None:
    """`FormatError` for a sliding-window draft in a format other than dspine and dflash (z-lab's
    window, `dflash.py`): speculators' DFlash family measures the window from the anchor, the
    other formats hold none."""
    if config.sliding_window is not None and fmt not in ("dspine", "dflash"):
        raise FormatError(
            f"{source}: a sliding-window draft (sliding_window={config.sliding_window}) cannot "
            f"be exported with --format {fmt}: its loaders would run another attention window; "
            "export it with --format dflash (z-lab's window) or --format dspine")


def import_dflash(directory: str | Path) -> DSpineDraftModel:
    """A DFlash checkpoint as a `method: dflash` `DSpineDraftModel` (the same network).

    Every backbone tensor must be present with its shape, and nothing else may be; DSpine's own
    parts (`injection.*`, `token_codes`), unused by a dflash draft, keep their initial values.
    """
    directory = Path(directory)
    config = dflash.config_from_dict(dflash.read_config(directory), str(directory))
    draft = DSpineDraftModel(config)
    tensors = dflash.read_backbone(directory, draft.state_dict())
    dtype = next(iter(tensors.values())).dtype
    draft.load_state_dict(tensors, strict=False)
    draft.config._name_or_path = str(directory)
    return draft.to(dtype).eval()


def import_domino(directory: str | Path) -> DSpineDraftModel:
    """A SpecForge Domino checkpoint as a `method: domino` `DSpineDraftModel` (the same network);
    every backbone and head tensor must be present with its shape, and nothing else."""
    directory = Path(directory)
    config = specforge_domino.config_from_dict(dflash.read_config(directory), str(directory))
    draft = DSpineDraftModel(config)
    tensors = specforge_domino.read_tensors(str(directory), draft.state_dict())
    dtype = tensors["fc.weight"].dtype
    draft.load_state_dict(tensors, strict=False)
    draft.config._name_or_path = str(directory)
    return draft.to(dtype).eval()


def readable_format(fields: dict[str, Any], source: str | Path) -> str:
    """Which format a draft's `config.json` dict is in, of those read here: "specforge"
    (SpecForge's DSpine), "specforge-domino", "deepspec", "speculators" (a DSpark or DFlash2
    draft), "dflash2" (z-lab's DFlash2), "dflash" or "dspine". A speculators-format DFlash
    draft is refused (`FormatError`)."""
    if specforge_domino.is_domino_config(fields):  # it has a dflash_config too: checked first
        return "specforge-domino"
    if specforge.is_specforge_config(fields):  # it has a dflash_config too: checked first
        return "specforge"
    if deepspec.is_deepspec_config(fields):
        return "deepspec"
    if speculators_dspark.is_dspark_config(fields) or speculators_dflash2.is_dflash2_config(fields):
        return "speculators"
    if speculators.is_speculators_config(fields):  # its architectures name is DFlash's too
        kind = fields.get("speculators_model_type")
        raise FormatError(f"{source}: a speculators-format draft ({kind}); this project reads the "
                          "dspine, dflash and specforge formats and speculators' dspark and dflash2 drafts "
                          "(export the draft's source again)")
    if dflash2.is_dflash2_config(fields):  # it has a dflash_config too: checked first
        return "dflash2"
    return "dflash" if dflash.is_dflash_config(fields) else "dspine"


def load_draft(directory: str | Path) -> DSpineDraftModel:
    """The draft exported at `directory`, in any format (a DFlash checkpoint is imported as a
    `method: dflash` draft, a SpecForge one as the DSpine draft it is); strict
    (`DSpineDraftModel.from_pretrained` / `import_dflash` / `specforge.import_specforge`)."""
    fields = dflash.read_config(directory)
    fmt = readable_format(fields, directory)
    if fmt == "specforge-domino":
        return import_domino(directory)
    if fmt == "specforge":
        return specforge.import_specforge(directory)
    if fmt == "speculators" and speculators_dflash2.is_dflash2_config(fields):
        return speculators_dflash2.import_dflash2(directory)
    if fmt == "speculators":
        return speculators_dspark.import_dspark(directory)
    if fmt == "deepspec":
        return deepspec.import_deepspec(directory)
    if fmt == "dflash2":
        return dflash2.import_dflash2(directory)
    if fmt == "dflash":
        return import_dflash(directory)
    return DSpineDraftModel.from_pretrained(str(directory))


def draft_config(directory: str | Path) -> DSpineConfig:
    """The `DSpineConfig` of the draft exported at `directory`, in any format `load_draft`
    reads, from its config.json alone (no weights read): what `model.init_from` continues."""
    fields = dflash.read_config(directory)
    fmt = readable_format(fields, directory)
    source = str(directory)
    if fmt == "speculators" and speculators_dflash2.is_dflash2_config(fields):
        return speculators_dflash2.config_from_dict(fields, source)
    readers = {"speculators": speculators_dspark.config_from_dict,
               "specforge": specforge.config_from_dict,
               "specforge-domino": specforge_domino.config_from_dict,
               "deepspec": deepspec.config_from_dict, "dflash": dflash.config_from_dict,
               "dflash2": dflash2.config_from_dict}
    if fmt in readers:
        return readers[fmt](fields, source)
    return DSpineConfig.from_pretrained(source)


def export_dir(source: str | Path, out: str | Path, fmt: str,
               verifier: str | None = None) -> Path:
    """Write the draft exported at `source` (dspine, dflash, specforge or deepspec format, or a
    speculators DSpark or DFlash2 draft) to `out` in format `fmt` (`verifier`: see
    `write_format`).

    `out` is built beside itself and swapped in whole: it is never half-written, and an
    existing export there is replaced only once the new one is complete. It is locked for the
    run (`output_lock`: a second export into it is refused, naming the first) and must be empty,
    missing, or an export (`EXPORT_MARKER` or `is_draft_export`), and must not overlap
    `source`; all checked before the draft is read (`FormatError`). Returns `out`.
    """
    source, out = Path(source), Path(out)
    if fmt not in FORMATS:
        raise FormatError(f"--format {fmt!r}: not one of {', '.join(FORMATS)}")
    if not (source / "config.json").is_file():
        raise FormatError(f"{source}: no config.json (expected an exported draft directory)")
    # before any loading: an output over the source (equal, inside or containing it) is
    # refused before even the lock file is written beside it; one over a directory this tool
    # did not write (a target model, a dataset), once no other export can be writing it
    inputs = {"SRC_DIR": [source]}
    try:
        check_no_overlap(out, "OUT_DIR", EXPORT_TOOL, inputs)
        with lock_output(out, "OUT_DIR"):
            check_replaceable(out, "OUT_DIR", EXPORT_MARKER, EXPORT_TOOL, inputs,
                              is_legacy=is_draft_export)
            return _export_locked(source, out, fmt, verifier)
    except OwnedDirError as err:
        raise FormatError(str(err)) from None


def _export_locked(source: Path, out: Path, fmt: str, verifier: str | None) -> Path:
    """`export_dir` once `out` is locked and checked."""
    try:
        fields = dflash.read_config(source)
        if fmt in ("dflash", "speculators", "deepspec") and readable_format(
                fields, source) == "dspine":
            # a draft the format cannot hold is refused before any loading
            check_exportable(DSpineConfig.from_pretrained(source), str(source), fmt)
        draft = load_draft(source)
    except FormatError:
        raise
    except (OSError, ValueError) as err:  # its own message names the file, or it gets it
        raise FormatError(str(err) if str(source) in str(err) else f"{source}: {err}") from err
    clean_dead_builds(out)
    tmp = build_dir(out)
    try:
        write_format(draft, tmp, fmt, verifier=verifier)
        for name in SIDE_FILES[fmt]:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        write_marker(tmp, EXPORT_MARKER, EXPORT_TOOL)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
