"""One run per output directory: an exclusive OS lock held for the life of the run.

Two runs writing one output directory corrupt each other silently (interleaved metrics, one
export replacing the other).  Every tool that writes an output directory therefore takes
:func:`lock_output` on it before it writes anything; a second run is refused with a one-line
:class:`OutputLockedError` naming the holder (pid, host, command) and since when.

Where the lock lives: a hidden sibling ``.NAME.lock`` beside the directory, not inside it.
Inside, it would travel with the directory -- the exports, the tokenised data and the feature
cache are published by swapping a freshly built directory in (``checkpoint_io.replace_dir``), so
a lock file inside would be swapped out with the old content and deleted mid-run; it would also
be a foreign file to the owned-directory check and sit in exports that are pushed to the Hub.
Beside it, it matches none of the ``.NAME.tmp-PID`` / ``.NAME.old-PID`` build names that
``clean_dead_builds`` removes.

The lock is ``fcntl.flock`` on that file: the kernel drops it when the process dies, so a killed
run never leaves a stale lock (the file may stay; it is unlocked and reused).  The file is
removed on release; a run that finds the file replaced between its open and its lock retries on
the new one, so removing it never lets two runs hold the lock at once.  Locks are reentrant
within one process (a trainer that tokenises into its own output directory does not refuse
itself).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class OutputLockedError(RuntimeError):
    """The output directory is locked by another run; the message names the holder."""


@dataclass
class _Held:
    fd: int
    path: Path
    count: int


_HELD: dict[Path, _Held] = {}


def lock_path(output: str | os.PathLike[str]) -> Path:
    """The lock file of the output directory ``output``: ``.NAME.lock`` beside it."""
    resolved = Path(output).resolve()
    return resolved.parent / f".{resolved.name}.lock"


def _holder_line(fd: int) -> str:
    """Who holds the lock whose file is open as ``fd``, from what the holder wrote into it."""
    try:
        info = json.loads(os.pread(fd, 65536, 0).decode("utf-8"))
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(info["since"]))
        return (f"pid {info['pid']} on {info['host']} since {since} "
                f"(command: {info['command']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"


def acquire(output: str | os.PathLike[str], key: str) -> Path:
    """Take the lock of output directory ``output`` (named ``key`` in messages); returns the
    lock file.  Raises :class:`OutputLockedError` at once when another run holds it."""
    path = lock_path(output)
    held = _HELD.get(path)
    if held is not None:
        held.count += 1
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_line(fd)
            os.close(fd)
            raise OutputLockedError(
                f"{key}: {output} is in use by another run: {holder}; wait for it to finish, "
                f"stop it, or choose another directory (lock file {path})") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as we opened it: lock the new one
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
    _HELD[path] = _Held(fd, path, 1)
    return path


def release(output: str | os.PathLike[str]) -> None:
    """Release one :func:`acquire` of ``output``'s lock (the last one removes the file)."""
    path = lock_path(output)
    held = _HELD.get(path)
    if held is None:
        return
    held.count -= 1
    if held.count:
        return
    del _HELD[path]
    path.unlink(missing_ok=True)  # still locked: a run waiting on it retries on a new file
    os.close(held.fd)


@contextmanager
def lock_output(output: str | os.PathLike[str], key: str) -> Iterator[Path]:
    """Hold the lock of output directory ``output`` for the ``with`` block (see :func:`acquire`)."""
    path = acquire(output, key)
    try:
        yield path
    finally:
        release(output)
