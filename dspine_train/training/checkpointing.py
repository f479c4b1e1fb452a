"""Resumable checkpoints: `accelerator.save_state` plus a small JSON `TrainState`.

A checkpoint directory `step_XXXXXXXX/` holds DeepSpeed's model/optimizer/scheduler shards and
accelerate's RNG states (written by every process), `train_state.json` (step, stream
position, best score), `run_config.json` (the resolved config of the run and its fingerprint)
and, written last, `manifest.json` (the sha256 and size of every other file). It is written
under a temporary name and renamed when complete, so a directory named `step_*` with a
`train_state.json` is always a whole checkpoint: a crash or a bad step never damages the last
good one. After each save the oldest are deleted, keeping the `keep_last` newest and the best.

Resuming runs DeepSpeed's loader, which unpickles: a crafted checkpoint can execute code, so
only trusted checkpoints may be resumed. `verify_manifest` refuses a checkpoint whose files
differ from its manifest (missing, extra, truncated or changed) before anything is unpickled;
`config_differences` refuses a checkpoint of another run (a different fingerprint), naming the
keys. Only the settings in `RESUME_MAY_CHANGE` may differ on resume.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..checkpoint_io import replace_dir
from .errors import TrainingError

STATE_FILE = "train_state.json"
CONFIG_FILE = "run_config.json"
MANIFEST_FILE = "manifest.json"
PREFIX = "step_"

# Settings that may differ between a checkpoint and the run resuming it; every other key of
# the resolved config shapes the run (its fingerprint), and a difference refuses the resume.
# More steps (the warmup + cosine schedule is then recomputed for the new length), where
# the outputs go, logging and the eval / checkpoint cadence, the Hub upload of the final export,
# and plan_only's own settings.
RESUME_MAY_CHANGE = (
    "optim.max_steps", "optim.epochs",
    "output_dir", "checkpoint.dir", "checkpoint.resume_from", "checkpoint.every",
    "checkpoint.keep_last", "eval.every", "logging.*",
    "export.push_to_hub", "export.push_private", "export.push_target_id", "export.push_endpoint",
    "export.push_timeout",
    "plan_only", "gpu_memory_gib", "world_size", "logits_chunk_size",
)


@dataclass
class TrainState:
    """Where training stands; with the accelerate state it makes resume exact.

    step: optimizer steps done. position: global micro-batches consumed (see `BatchStream`).
    total_steps: the schedule length. best_tau / best_step: best simulated acceptance length
    so far and where. world_size / grad_accum_steps: the layout that wrote the checkpoint.
    """

    step: int = 0
    position: int = 0
    total_steps: int = 0
    best_tau: float | None = None
    best_step: int | None = None
    world_size: int = 1
    grad_accum_steps: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after `step` optimizer steps."""
    return f"{PREFIX}{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config dicts -> {"optim.lr": 0.01, ...} (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def _may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1]))
               for k in RESUME_MAY_CHANGE)


def run_fingerprint(config: dict[str, Any]) -> str:
    """sha256 of the settings that shape a run (every key not in `RESUME_MAY_CHANGE`)."""
    shaping = {k: v for k, v in flatten_config(config).items() if not _may_change(k)}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: saved -> current` for each run-shaping setting that differs."""
    old, new = flatten_config(saved), flatten_config(current)

    def show(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key], default=str) if key in values else "(absent)"

    return [f"{k}: {show(old, k)} -> {show(new, k)}" for k in sorted(set(old) | set(new))
            if not _may_change(k) and (k not in old or k not in new or old[k] != new[k])]


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def _files(root: Path) -> list[str]:
    """Every file (or link) under `root` but the manifest, as relative paths."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p != root / MANIFEST_FILE)


def write_manifest(checkpoint: Path) -> None:
    """Record the sha256 and size of every file of `checkpoint` in its `manifest.json`."""
    files = {name: {"sha256": _sha256(checkpoint / name), "bytes": (checkpoint / name).stat().st_size}
             for name in _files(checkpoint)}
    (checkpoint / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


def previous_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint older than `path` in its directory, or None."""
    older = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    return older[-1] if older else None


def verify_manifest(checkpoint: Path) -> None:
    """`TrainingError` naming the first file of `checkpoint` that its manifest does not vouch
    for (missing, not listed, truncated or changed), and the previous checkpoint to use."""
    def refuse(problem: str) -> TrainingError:
        prev = previous_checkpoint(checkpoint)
        hint = (f"resume from the previous checkpoint, checkpoint.resume_from={prev}" if prev
                else "no earlier checkpoint exists in that directory")
        return TrainingError(f"checkpoint {checkpoint}: {problem}; it is not resumed ({hint})")

    try:
        listed = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        raise refuse(f"no {MANIFEST_FILE} (the sha256 sums written at save time), so its "
                     "files cannot be verified") from None
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise refuse(f"unreadable {MANIFEST_FILE} ({err})") from err
    present = _files(checkpoint)
    for name in sorted(set(listed) - set(present)):
        raise refuse(f"file {name} is missing")
    for name in sorted(set(present) - set(listed)):
        raise refuse(f"file {name} is not in {MANIFEST_FILE} (added after the save)")
    for name in present:
        file = checkpoint / name
        if file.is_symlink():
            raise refuse(f"file {name} is a symbolic link")
        if file.stat().st_size != listed[name]["bytes"]:
            raise refuse(f"file {name} has {file.stat().st_size} bytes, "
                         f"{listed[name]['bytes']} were saved (truncated or changed)")
        if _sha256(file) != listed[name]["sha256"]:
            raise refuse(f"file {name} differs from its sha256 in {MANIFEST_FILE} (changed)")


def prune_checkpoints(root: Path, keep_last: int, best_step: int | None) -> list[Path]:
    """Delete complete checkpoints except the `keep_last` newest and the best; return the
    deleted ones. Half-written `.tmp_*` directories of an interrupted save go too."""
    found = complete_checkpoints(root)
    keep = set(found[-keep_last:])
    if best_step is not None:
        keep.add(root / checkpoint_name(best_step))
    removed = [path for path in found if path not in keep]
    removed += list(root.glob(f".tmp_{PREFIX}*"))
    for path in removed:
        shutil.rmtree(path)
    return removed


class CheckpointManager:
    """Saves, rotates and restores checkpoints under one directory."""

    def __init__(self, root: Path, keep_last: int, accelerator: Accelerator,
                 run_config: dict[str, Any]) -> None:
        """`run_config`: the resolved config of this run (plain nested dicts), saved with
        every checkpoint and compared with a checkpoint's on resume."""
        self.root = root
        self.keep_last = keep_last
        self.accelerator = accelerator
        self.run_config = run_config
        self.fingerprint = run_fingerprint(run_config)
        self._checked: set[Path] = set()

    def save(self, state: TrainState) -> Path:
        """Write the checkpoint of `state.step` (all processes call this)."""
        acc = self.accelerator
        final = self.root / checkpoint_name(state.step)
        tmp = self.root / f".tmp_{final.name}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
            (tmp / CONFIG_FILE).write_text(json.dumps(
                {"fingerprint": self.fingerprint, "config": self.run_config}, indent=2,
                default=str))
            write_manifest(tmp)
            # The same step saved again (e.g. a rerun) replaces the old one whole, with no
            # moment at which neither is there.
            replace_dir(tmp, final)
            prune_checkpoints(self.root, self.keep_last, state.best_step)
        acc.wait_for_everyone()
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def resolve(self, resume_from: str) -> Path | None:
        """`checkpoint.resume_from` -> a checkpoint directory ("latest" may find none)."""
        if resume_from == "latest":
            return self.latest()
        path = Path(resume_from)
        if not (path / STATE_FILE).is_file():
            prev = previous_checkpoint(path)
            raise TrainingError(
                f"checkpoint.resume_from: {path} is not a complete checkpoint (no {STATE_FILE})"
                + (f"; the previous checkpoint is {prev}" if prev else "")
            )
        return path

    def check_fresh(self) -> None:
        """A run that does not resume must not write into (and prune) another run's checkpoints."""
        found = complete_checkpoints(self.root)
        if found:
            raise TrainingError(
                f"checkpoint.dir: {self.root} already holds {len(found)} checkpoint(s) of an "
                f"earlier run (newest {found[-1].name}); a fresh run would prune them. Resume it "
                "with checkpoint.resume_from=latest, write to another output_dir or "
                "checkpoint.dir, or delete that directory yourself"
            )

    def check_resumable(self, path: Path) -> None:
        """Refuse to resume `path` unless its files match its manifest and its run is this
        one (same fingerprint), and unless every checkpoint in this run's directory is of this
        run too (pruning would mix or delete them). The main process reads the files; every
        process raises the same error."""
        problem = None
        if self.accelerator.is_main_process:
            try:
                verify_manifest(path)
                for other in [path, *(p for p in complete_checkpoints(self.root) if p != path)]:
                    self._check_same_run(other)
            except TrainingError as err:
                problem = str(err)
        if self.accelerator.num_processes > 1:
            box = [problem]
            broadcast_object_list(box)
            problem = box[0]
        if problem is not None:
            raise TrainingError(problem)
        self._checked.add(path)

    def _check_same_run(self, path: Path) -> None:
        try:
            saved = json.loads((path / CONFIG_FILE).read_text())["config"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise TrainingError(
                f"checkpoint {path}: no readable {CONFIG_FILE} ({err}), so it cannot be matched "
                "with this run's settings"
            ) from err
        differences = config_differences(saved, self.run_config)
        if differences:
            raise TrainingError(
                f"checkpoint {path} belongs to a run with other settings; resume it with the "
                f"same ones (only {', '.join(RESUME_MAY_CHANGE)} may change) or write to "
                "another output_dir. Differing: " + "; ".join(differences)
            )

    def load(self, path: Path) -> TrainState:
        """Check `path` (`check_resumable`, unless done already), then restore model,
        optimizer, scheduler and RNG states from it (all processes)."""
        if path not in self._checked:
            self.check_resumable(path)
        try:
            state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        except (OSError, TypeError, json.JSONDecodeError) as err:
            raise TrainingError(f"checkpoint {path}: unreadable {STATE_FILE}: {err}") from err
        self.accelerator.load_state(str(path))
        return state
