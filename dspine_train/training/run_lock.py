"""One training run per output directory (`dspine_train.output_lock`, taken by the trainer).

Two `train.py` runs with the same `output_dir` would interleave their metrics and prune each
other's checkpoints. The trainer locks `output_dir` (and a `checkpoint.dir` outside it) right
after the process group exists and before anything is written: before the checkpoint manager
looks at (and later prunes) checkpoints, before the token table is built, before
`metrics.jsonl` is opened. Only the main process takes the locks (one per output directory, for
the whole world); its verdict is broadcast, so every process raises the same `TrainingError`
naming the holder and none waits in a collective the main process never reaches.

Under `train.py` (and `dspine_train.training.cache_features`, the same recipes) Hydra writes into
`output_dir` (its `hydra/` record of the run's config and the log, `hydra.run.dir`) before
`main` runs: `HydraOutputLock`, a Hydra callback the recipes install, takes the same lock in
`on_run_start`, before Hydra creates or writes anything there. It runs in the launcher's rank 0
only (`RANK`); a refused rank 0 exits, and the launcher stops the other ranks.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..output_lock import OutputLockedError, acquire, release
from .config import TrainConfig
from .errors import TrainingError


def run_output_dirs(config: TrainConfig) -> dict[str, Path]:
    """The output directories of a run, by config key: `output_dir`, and `checkpoint.dir`
    when it lies outside it."""
    output = Path(config.output_dir)
    dirs = {"output_dir": output}
    if config.checkpoint.dir:
        checkpoints = Path(config.checkpoint.dir)
        if not checkpoints.resolve().is_relative_to(output.resolve()):
            dirs["checkpoint.dir"] = checkpoints
    return dirs


def lock_run_outputs(config: TrainConfig, accelerator: Accelerator) -> list[Path]:
    """Lock the run's output directories (main process); returns those this process locked.

    `TrainingError` on every process when another run holds one of them."""
    taken: list[Path] = []
    problem = None
    if accelerator.is_main_process:
        try:
            for key, path in run_output_dirs(config).items():
                acquire(path, key)
                taken.append(path)
        except OutputLockedError as err:
            release_run_outputs(taken)
            taken, problem = [], str(err)
    if accelerator.num_processes > 1:
        box = [problem]
        broadcast_object_list(box)
        problem = box[0]
    if problem is not None:
        raise TrainingError(problem)
    return taken


def release_run_outputs(paths: list[Path]) -> None:
    """Release what `lock_run_outputs` took (the kernel releases it anyway when the process
    ends)."""
    for path in paths:
        release(path)


class HydraOutputLock(Callback):
    """Hydra callback: lock the recipe's `output_dir` before Hydra writes into it (see above);
    a refusal is one `error:` line and exit status 1."""

    def __init__(self) -> None:
        self.locked: Path | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        output_dir = config.get("output_dir")
        if not output_dir or os.environ.get("RANK", "0") != "0":
            return
        try:
            acquire(output_dir, "output_dir")
        except OutputLockedError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(1)
        self.locked = Path(output_dir)
        # `main` ends a failed run with sys.exit, which skips `on_run_end`: release at exit too
        atexit.register(self._release)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._release()

    def _release(self) -> None:
        if self.locked is not None:
            release(self.locked)
            self.locked = None
