"""Publish an exported DSpine draft on the Hugging Face Hub: validation, model card, upload.

The card itself is rendered by `dspine_train.model_card` (re-exported here).

`dspine-train push` (`hub_cli.py`) is the command line; this module holds the logic so it can be tested
with the Hub client replaced by a fake.

An export directory (written by the trainer's export step) holds:

    config.json           required; model_type "dspine" and the target's identity
    model.safetensors     required (or model.safetensors.index.json + the shards it names)
    eval_results.json     optional; measured results: "acceptance_length" (mean tokens per
                          target verification), "acceptance_length_per_position" (list; entry
                          k-1 is the share of blocks whose first k drafted tokens were accepted), and
                          any other scalar entries (temperature, num_prompts, ...), all shown
    training_info.json    optional; "recipe" (str), "dataset" (str or list of str) and "budget"
                          (the trainer's: optimizer_steps, sequences_seen, tokens_seen, epochs,
                          global_batch_sequences, processes, wall_time_s; any other entry shown)
    (token table and any other files are uploaded as they are; dotfiles and dot-folders never;
    a symbolic link or another non-regular file refuses the whole push, naming it)

Before anything is written or uploaded (the dry run too) the draft is loaded as the engine
loads it (`check_loads`); an export that does not load is refused.

The model card reports only what these files say; a missing measurement is written as
"not measured", never estimated. Local absolute paths (a target or data file on this machine)
appear in the card by their last component only. Uploaded JSON files carry none either, nor the
metadata of uploaded safetensors files (the token table records where it was built)
(`public_files`): config.json's `target_name_or_path` is uploaded as the target's Hub id
(given, or the recorded one when it is one; a local one without a given id is refused), other
local paths by their last component. The export itself is left as it is (the engine reads it).

Every HTTP request of the upload gives up after `timeout` seconds without progress (the Hub
client's own default is to wait forever), so an endpoint that never answers fails with a
`HubError` instead of hanging.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2  # huggingface_hub's HTTP backend: its timeout and transport errors
from huggingface_hub import CommitOperationAdd, HfApi, set_client_factory
from huggingface_hub.utils._http import default_client_factory

from dspine_train.checkpoint_io import SafetensorsWeights, WeightsError, write_text_atomic
from dspine_train.model_card import (  # re-exported: the card is part of this module's API
    CARD_TAGS,
    EVAL_RESULTS_FILE,
    LIBRARY_NAME,
    LOCAL_PATH,
    NOT_MEASURED,
    NOT_RECORDED,
    hub_base_model,
    public_text,
    render_model_card,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TRAINING_INFO_FILE = "training_info.json"
CARD_FILE = "README.md"
DEFAULT_TIMEOUT_S = 60.0  # seconds one HTTP request may go without progress
__all__ = ["CARD_TAGS", "LIBRARY_NAME", "NOT_MEASURED", "NOT_RECORDED", "ExportError",
           "ExportInfo", "HubError", "check_loads", "hub_base_model", "public_files",
           "public_text", "push_export", "render_model_card", "scrub_token", "upload_files",
           "validate_export"]


class ExportError(ValueError):
    """The export directory is missing a file or holds an invalid one; the message names it."""


class HubError(RuntimeError):
    """The Hub did not answer in time or could not be reached; the message names the endpoint."""


@dataclass
class ExportInfo:
    """What `validate_export` found in an export directory.

    Attributes:
        path: the export directory.
        config: parsed config.json.
        weight_files: safetensors files, relative to `path`.
        num_tensors: tensors across the weight files.
        num_values: elements across those tensors (parameters plus saved buffers).
        eval_results: parsed eval_results.json, None when absent.
        training_info: parsed training_info.json, empty when absent.
    """

    path: Path
    config: dict[str, Any]
    weight_files: list[str]
    num_tensors: int
    num_values: int
    eval_results: dict[str, Any] | None = None
    training_info: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- validation
def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; `ExportError` naming the file when missing or invalid."""
    if not path.is_file():
        raise ExportError(f"{path}: missing (an export needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _weights(export_dir: Path) -> tuple[list[str], int, int]:
    """(file names, tensors, elements) of the export's safetensors weights, headers only:
    the single file, or the shards of the index."""
    try:
        with SafetensorsWeights(export_dir, framework="numpy") as weights:
            num_tensors = num_values = 0
            for file in weights.files:
                shapes = weights.file_shapes(file)
                if not shapes:
                    raise ExportError(f"{file}: holds no tensors")
                num_tensors += len(shapes)
                num_values += sum(math.prod(shape) for shape in shapes.values())
            return [file.name for file in weights.files], num_tensors, num_values
    except WeightsError as err:
        raise ExportError(str(err)) from None


def validate_export(export_dir: str | os.PathLike[str]) -> ExportInfo:
    """Check an export directory and read what the model card needs.

    Requires only regular files (`upload_files`), config.json with `model_type` "dspine",
    readable safetensors weights (the header must parse and cover the whole file), and that the
    draft loads as a user will load it (`check_loads`). `ExportError` names the offending file.
    """
    path = Path(export_dir)
    if not path.is_dir():
        raise ExportError(f"{path}: not a directory")
    upload_files(path)  # no links: what is checked below is what would be uploaded
    config_path = path / CONFIG_FILE
    config = _read_json(config_path)
    if config.get("model_type") != "dspine":
        raise ExportError(
            f"{config_path}: model_type is {config.get('model_type')!r}, expected 'dspine'"
        )
    weight_files, num_tensors, num_values = _weights(path)

    eval_path = path / EVAL_RESULTS_FILE
    eval_results = _read_json(eval_path) if eval_path.is_file() else None
    if eval_results is not None and "acceptance_length" in eval_results:
        tau = eval_results["acceptance_length"]
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau):
            raise ExportError(
                f"{eval_path}: 'acceptance_length' must be a finite number, got {tau!r}"
            )
    info_path = path / TRAINING_INFO_FILE
    training_info = _read_json(info_path) if info_path.is_file() else {}
    check_loads(path)
    return ExportInfo(
        path, config, weight_files, num_tensors, num_values, eval_results, training_info
    )


def check_loads(export_dir: Path) -> None:
    """Load the export as the engine does (`Engine.from_pretrained`: `check_draft_files`, then
    the strict `formats.load_draft`), so a draft nobody could load is never published: a
    config.json field missing or of the wrong type, weights that do not match it.

    The whole draft is loaded once on the CPU (a few seconds for a large draft, less than its
    upload). `ExportError` with the loader's message on one line.
    """
    # Imported here: the engine and the model classes pull in torch and transformers, which
    # the rest of this module (and `push_to_hub.py --help`) does not need.
    from transformers.utils import logging as hf_logging

    from dspine_train.engine.validation import check_draft_files
    from dspine_train.formats import load_draft

    # A check, not a load the user asked for: no loading bar, and transformers' load report
    # (its list of missing weights) is not printed beside the one-line error.
    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        check_draft_files(export_dir)
        load_draft(export_dir)
    except Exception as err:  # noqa: BLE001 -- whatever stops the loader stops a user too
        message = " ".join(str(err).split()) or type(err).__name__
        if str(export_dir) not in message:
            message = f"{export_dir}: {message}"
        raise ExportError(f"the draft does not load as the engine loads it: {message} "
                          f"({type(err).__name__})") from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def upload_files(export_dir: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(relative path, bytes) of every export file `push_export` uploads, sorted.

    Dotfiles and anything under a dot-folder (.git, .cache, editor and temp files) are never
    uploaded. The model card is written as README.md just before the upload, replacing any
    README.md. Only regular files are uploaded: a symbolic link (to a file or a folder, inside
    or outside the export, dangling or not) or another non-regular file (a FIFO, a socket)
    is an `ExportError` naming every one, since a link's content is not the export's (a link
    to a system file would publish that file).
    """
    root = Path(export_dir)
    files: dict[str, int] = {}
    refused: list[str] = []
    # os.walk lists a linked folder among the folders and never descends into it
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(name for name in dirs if not name.startswith("."))
        refused += [(here / name).relative_to(root).as_posix() + "/" for name in dirs
                    if (here / name).is_symlink()]
        for name in names:
            if name.startswith("."):
                continue
            item = here / name
            relative = item.relative_to(root).as_posix()
            status = item.lstat()  # the entry itself, never what a link points at
            if stat.S_ISREG(status.st_mode):
                files[relative] = status.st_size
            else:
                refused.append(relative)
    if refused:
        raise ExportError(
            f"{root}: holds symbolic links or other non-regular files ({', '.join(sorted(refused))}"
            "); only regular files inside the export are uploaded: replace each link by a copy "
            "of its file, or remove it"
        )
    return sorted(files.items())


# --------------------------------------------------------------------------- public JSON
TARGET_KEY = "target_name_or_path"


def upload_target_id(config: dict[str, Any], config_path: Path, target_id: str | None) -> str | None:
    """The target's id as uploaded: `target_id` when given, else config.json's
    `target_name_or_path` when it is a Hub id (None when none is recorded).

    `ExportError` naming the key when the recorded value is a local path and no id is given.
    """
    if target_id is not None:
        if hub_base_model(target_id) is None:
            raise ExportError(f"target id {target_id!r}: not a Hub model id (ORG/NAME)")
        return target_id
    recorded = config.get(TARGET_KEY)
    if recorded is None or (isinstance(recorded, str) and hub_base_model(recorded) is not None):
        return recorded
    raise ExportError(
        f"{config_path}: {TARGET_KEY} {recorded!r} is a local path, which is never uploaded; "
        "give the target's Hub id with --target-id ORG/NAME"
    )


def _public_safetensors(path: Path, clean: Callable[[Any], Any]) -> bytes | None:
    """The safetensors file at `path` with `clean` applied to its header's `__metadata__`
    values (the tensors' bytes unchanged), or None when that changes nothing."""
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ExportError(f"{path}: not a valid safetensors file, so its metadata cannot "
                              f"be checked for local paths ({err})") from None
        metadata = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(metadata, dict):
            return None
        cleaned = {key: clean(value) for key, value in metadata.items()}
        if cleaned == metadata:
            return None
        header["__metadata__"] = cleaned
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # safetensors keeps the data 8-byte aligned
        return len(raw).to_bytes(8, "little") + raw + handle.read()


def public_files(export_dir: str | os.PathLike[str], target_id: str | None) -> dict[str, bytes]:
    """What to upload instead of the export's files that would carry a local path.

    In every uploaded `*.json`, and in the metadata of every uploaded `*.safetensors` (the
    token table records the path it was built at): config.json's `target_name_or_path`, and
    any value equal to its recorded local path (training_info.json's target), become
    `upload_target_id`; any other string that is a local absolute path becomes its last
    component, as in the card. Returns {relative path: cleaned bytes} for the files that
    change (the others are uploaded as they are; a safetensors file keeps its tensors byte for
    byte); the export is not modified. `ExportError` names a JSON file that cannot be read or
    a target that has no Hub id.
    """
    root = Path(export_dir)
    config_path = root / CONFIG_FILE
    config = _read_json(config_path)
    target = upload_target_id(config, config_path, target_id)
    recorded = config.get(TARGET_KEY)

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list):
            return [clean(item) for item in value]
        if isinstance(value, str) and value == recorded and target is not None:
            return target
        if isinstance(value, str) and LOCAL_PATH.fullmatch(value):
            return value.rstrip("/").rsplit("/", 1)[-1]
        return value

    out = {}
    for name, _ in upload_files(root):
        if name.endswith(".safetensors"):
            content = _public_safetensors(root / name, clean)
            if content is not None:
                out[name] = content
            continue
        if not name.endswith(".json"):
            continue
        try:
            data = json.loads((root / name).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ExportError(f"{root / name}: not valid JSON, so it cannot be checked for "
                              f"local paths ({err})") from None
        cleaned = clean(data)
        if name == CONFIG_FILE and target is not None:
            cleaned[TARGET_KEY] = target
        if cleaned != data:
            out[name] = (json.dumps(cleaned, indent=2) + "\n").encode("utf-8")
    return out



def public_json_files(export_dir: str | os.PathLike[str], target_id: str | None) -> dict[str, bytes]:
    """`public_files` (its older name: it covers safetensors metadata too)."""
    return public_files(export_dir, target_id)


# --------------------------------------------------------------------------- upload
def write_card(export_dir: str | os.PathLike[str], card: str) -> Path:
    """Write `card` as README.md of the export, atomically (no half-written card on failure)."""
    target = Path(export_dir) / CARD_FILE
    return write_text_atomic(target, card)


def scrub_token(err: BaseException, token: str | None) -> str:
    """`err` as one line for an error message, with `token` (if any) replaced by `***`."""
    message = " ".join(str(err).split()) or type(err).__name__
    return message.replace(token, "***") if token else message


def set_request_timeout(seconds: float) -> None:
    """Make every later HTTP request of huggingface_hub give up after `seconds` without progress.

    The library's client waits forever by default (`timeout=None`); this installs a client
    factory that keeps the library's own client (offline check, request ids) with a timeout
    for connecting, each read, each write and getting a pooled connection.
    """
    if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds!r}")

    def client_with_timeout() -> httpx2.Client:
        client = default_client_factory()
        client.timeout = httpx2.Timeout(seconds)
        return client

    set_client_factory(client_with_timeout)


def push_export(
    export_dir: str | os.PathLike[str],
    repo_id: str,
    card: str,
    *,
    token: str,
    private: bool = True,
    commit_message: str = "Upload DSpine draft",
    endpoint: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    api_factory: Callable[..., HfApi] | None = None,
    target_id: str | None = None,
) -> str:
    """Create the repo if needed, write the card into the export and upload its files.

    `private` applies when the repository is created (an existing one keeps its visibility).
    The export is expected to have passed `validate_export` (which also loads the draft; the
    card is rendered from its result); links are refused here again, before any request.
    The files uploaded are exactly `upload_files(export_dir)` (no dotfiles), JSON files as
    `public_files(export_dir, target_id)` cleans them (checked before any request). `endpoint`
    defaults to $HF_ENDPOINT / huggingface.co; each request gives up after `timeout` seconds
    without progress and raises `HubError`. `api_factory` builds the Hub client (default
    `HfApi(token=..., endpoint=...)`); tests pass a fake. Returns the URL of the commit.
    """
    public = public_files(export_dir, target_id)
    set_request_timeout(timeout)
    api = (api_factory or HfApi)(token=token, endpoint=endpoint)
    where = endpoint or getattr(api, "endpoint", None) or "the Hub"
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        write_card(export_dir, card)
        root = Path(export_dir)
        operations = [
            CommitOperationAdd(path_in_repo=name,
                               path_or_fileobj=public.get(name) or str(root / name))
            for name, _ in upload_files(root)
        ]
        commit = api.create_commit(
            repo_id=getattr(repo_url, "repo_id", None) or repo_id,
            operations=operations,
            repo_type="model",
            commit_message=commit_message,
        )
    except httpx2.TimeoutException as err:
        raise HubError(
            f"{where} did not answer within {timeout:g} s ({type(err).__name__}); "
            "check the endpoint and the network, or raise --timeout"
        ) from err
    except httpx2.TransportError as err:
        raise HubError(f"cannot reach {where}: {err}") from err
    return str(getattr(commit, "commit_url", None) or commit)
