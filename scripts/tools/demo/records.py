"""The demo's records: a finished stage's record, the paths and settings the stages share, the
fingerprint that decides whether a stage runs again."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DemoError(RuntimeError):
    """A stage cannot run or failed; the message says which and why."""


@dataclass
class StageRecord:
    """A finished stage, as `stages/<stage>.json` holds it."""

    stage: str
    fingerprint: str  # hash of the stage's settings and its upstream runs (`fingerprint`)
    run_id: str  # what a downstream stage's fingerprint reads
    seconds: float
    finished_at: str
    summary: dict[str, Any]  # the stage's own figures (JSON, a shape per stage)
    # what the numerics depend on besides the settings (`environment`); {} in older records
    environment: dict[str, Any] = field(default_factory=dict)


@dataclass
class Demo:
    """Paths and settings shared by the stages."""

    args: argparse.Namespace
    out: Path
    target: Path

    @property
    def stages_dir(self) -> Path:
        """Where the stage records live."""
        return self.out / "stages"

    def path(self, *parts: str) -> Path:
        """A path under the demo's output directory."""
        return self.out.joinpath(*parts)

    def marker(self, stage: str) -> StageRecord | None:
        """The record of a finished stage, or None (also for a record this demo cannot read)."""
        try:
            return StageRecord(**json.loads((self.stages_dir / f"{stage}.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None


def fingerprint(settings: dict[str, Any], upstream: list[StageRecord]) -> str:
    """Hash of a stage's settings and the runs of the stages it reads."""
    payload = json.dumps({"settings": settings, "upstream": [m.run_id for m in upstream]},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def environment(threads: int | None) -> dict[str, Any]:
    """What a stage's figures depend on beyond its settings: the torch version and the threads
    its child processes run with (a CPU matmul sums in an order set by the thread count, so
    two runs with other thread counts train apart)."""
    import torch

    omp = str(threads) if threads else os.environ.get("OMP_NUM_THREADS")
    return {"torch": torch.__version__, "cpu_count": os.cpu_count(),
            "omp_num_threads": omp or "unset (one per core)"}


def files_digest(path: Path) -> str:
    """SHA-256 over the files under `path` (or of the file `path`), names and bytes, in name
    order: two runs wrote the same bytes exactly when their digests agree."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else file.name).encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def write_json(path: Path, data: Any) -> None:
    """Write JSON through a temporary file, so a record is never half-written."""
    from dspine_train.checkpoint_io import write_json_atomic

    write_json_atomic(path, data, default=str)
