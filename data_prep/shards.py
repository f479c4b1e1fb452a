"""Atomic outputs: JSONL shards (the regeneration output and its resume state) and files.

A shard is written to a hidden ``.part-NNNNN.jsonl.XXXX.tmp``, flushed to disk and renamed to
``part-NNNNN.jsonl`` (:func:`dspine_train.checkpoint_io.write_text_atomic`); a rename is
atomic, so a shard either exists complete or not at all, whatever kills the process.  The
ids in the complete shards are the finished rows: a rerun skips them (no duplicates) and
redoes everything else (no losses).  Left-over ``.tmp`` files are from a killed write and are
deleted on start.
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.schema import DataError
from dspine_train.checkpoint_io import write_text_atomic

SHARD_PREFIX = "part-"
SHARD_SUFFIX = ".jsonl"
LOCK_FILE = ".lock"


def shard_paths(output_dir: str | Path) -> list[Path]:
    """The complete shards of ``output_dir``, in write order."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    return sorted(directory.glob(f"{SHARD_PREFIX}[0-9]*{SHARD_SUFFIX}"))


def remove_partial_shards(output_dir: str | Path) -> int:
    """Delete ``.tmp`` shards a killed run left behind; return how many."""
    directory = Path(output_dir)
    # the names of write_text_atomic, and of the versions before it (part-NNNNN.jsonl.tmp)
    partial = (list(directory.glob(f".{SHARD_PREFIX}*{SHARD_SUFFIX}.*.tmp"))
               + list(directory.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}.tmp")))
    for path in partial:
        path.unlink()
    return len(partial)


def read_done_ids(output_dir: str | Path) -> set[str]:
    """Ids of the rows already in complete shards.

    A shard that does not parse was not written by :class:`ShardWriter` (which never leaves
    one half-written), so it is an error naming the file and line rather than a silent skip.
    """
    done: set[str] = set()
    for path in shard_paths(output_dir):
        with open(path, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                try:
                    row_id = json.loads(line)["id"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(f"{path}:{line_number}: not a regenerated row; the output "
                                    f"directory holds a foreign or edited shard") from None
                if row_id in done:
                    raise DataError(f"{path}:{line_number}: id {row_id!r} is in two shards")
                done.add(row_id)
    return done


@contextmanager
def exclusive_lock(output_dir: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``output_dir`` so two runs never write the same shards.

    ``flock`` locks die with their process, so a run killed with -9 leaves no stale lock.
    """
    handle = open(Path(output_dir) / LOCK_FILE, "w")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"another run is writing to {output_dir}") from None
        yield
    finally:
        handle.close()


@dataclass(frozen=True)
class _WriterState:
    next_index: int
    rows_written: int
    buffer: list[str]


class ShardWriter:
    """Buffers finished rows and writes them as numbered shards.

    A shard is written when ``shard_size`` rows are buffered or ``flush_interval_s`` passed
    since the last write, so a ``kill -9`` loses at most that much work (which the next run
    redoes).  Call :meth:`flush` before exiting on Ctrl-C; it is safe to call again after a
    flush that a KeyboardInterrupt cut short (see :meth:`flush`).
    """

    def __init__(self, output_dir: str | Path, shard_size: int,
                 flush_interval_s: float = float("inf")) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.flush_interval_s = flush_interval_s
        existing = shard_paths(self.output_dir)
        first = int(existing[-1].name[len(SHARD_PREFIX):-len(SHARD_SUFFIX)]) + 1 if existing else 0
        self._state = _WriterState(first, 0, [])
        self._last_flush = time.monotonic()

    @property
    def rows_written(self) -> int:
        """Rows this writer has put into complete shards."""
        return self._state.rows_written

    def add(self, row: Mapping[str, Any]) -> None:
        """Buffer one finished row; write a shard if the buffer is full or old."""
        self._state.buffer.append(json.dumps(row, ensure_ascii=False))
        if (len(self._state.buffer) >= self.shard_size
                or time.monotonic() - self._last_flush >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next shard (nothing if the buffer is empty).

        The new state is committed with one attribute store after the rename.  If a
        KeyboardInterrupt lands between the rename and that store, the shard for this index
        already exists and the next call only commits: no row is written twice.
        """
        self._last_flush = time.monotonic()
        state = self._state
        if not state.buffer:
            return
        path = self.output_dir / f"{SHARD_PREFIX}{state.next_index:05d}{SHARD_SUFFIX}"
        if not path.exists():
            write_text_atomic(path, "\n".join(state.buffer) + "\n")
        self._state = _WriterState(state.next_index + 1, state.rows_written + len(state.buffer), [])
