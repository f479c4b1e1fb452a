"""Resumable checkpoints: `accelerator.save_state` plus a small JSON `TrainState`.

A checkpoint directory `step_XXXXXXXX/` holds DeepSpeed's model/optimizer/scheduler shards and
accelerate's RNG states (written by every process), and `train_state.json` (step, stream
position, best score). It is written under a temporary name and renamed when complete, so a
directory named `step_*` with a `train_state.json` is always a whole checkpoint: a crash or a
bad step never damages the last good one. After each save the oldest are deleted, keeping the
`keep_last` newest and the best.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from .errors import TrainingError

STATE_FILE = "train_state.json"
PREFIX = "step_"


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

    def __init__(self, root: Path, keep_last: int, accelerator: Accelerator) -> None:
        self.root = root
        self.keep_last = keep_last
        self.accelerator = accelerator

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
            if final.exists():  # the same step saved again (e.g. a rerun): replace it whole
                shutil.rmtree(final)
            tmp.rename(final)
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
            raise TrainingError(
                f"checkpoint.resume_from: {path} is not a complete checkpoint (no {STATE_FILE})"
            )
        return path

    def load(self, path: Path) -> TrainState:
        """Restore model, optimizer, scheduler and RNG states from `path` (all processes)."""
        try:
            state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        except (OSError, TypeError, json.JSONDecodeError) as err:
            raise TrainingError(f"checkpoint {path}: unreadable {STATE_FILE}: {err}") from err
        self.accelerator.load_state(str(path))
        return state
