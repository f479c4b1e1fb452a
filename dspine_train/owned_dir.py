"""Output directories a tool owns: marker file, overlap refusal, atomic replacement, cleanup.

A tool that replaces its output directory wholesale (``data_prep.tokenize``, the feature cache)
must never delete what it did not write.  The rules:

* the tool writes a marker file into every directory it creates (:func:`write_marker`);
* before writing, :func:`check_replaceable` refuses a destination that is a file, or a
  non-empty directory without the marker, or one that overlaps an input (equal to it, inside
  it, or containing it) -- with a one-line :class:`OwnedDirError` naming the config key;
* the new output is built in a hidden sibling ``.NAME.tmp-PID-XXXX`` (:func:`build_dir`) and
  swapped in by :func:`replace_dir`; builds and swapped-out copies left by a killed run are
  removed by :func:`clean_dead_builds` (a swapped-out copy whose replacement never arrived is
  put back instead).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path


class OwnedDirError(ValueError):
    """A destination the tool refuses to write into; the message names the key and the path."""


def has_marker(path: Path, marker: str) -> bool:
    """Whether ``path`` is a directory holding ``marker``."""
    return (path / marker).is_file()


def write_marker(path: Path, marker: str, tool: str) -> None:
    """Mark ``path`` as written by ``tool``."""
    (path / marker).write_text(f"written by {tool}; it may replace this directory\n")


def overlaps(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same path or one lies inside the other."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def check_replaceable(destination: Path, key: str, marker: str, tool: str,
                      inputs: Mapping[str, Iterable[str | Path]],
                      is_legacy: Callable[[Path], bool] | None = None) -> None:
    """Refuse ``destination`` (config key ``key``) unless ``tool`` may replace it.

    ``inputs`` maps a config key to the paths it names; ``is_legacy`` recognises an output
    of ``tool`` written before markers existed (accepted like a marked one).
    """
    for input_key, paths in inputs.items():
        for path in paths:
            if path and overlaps(destination, Path(path)):
                raise OwnedDirError(
                    f"{key}: {destination} overlaps {input_key} {path} (equal, inside or "
                    f"containing); {tool} replaces its output, so choose another directory")
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise OwnedDirError(f"{key}: {destination} exists and is not a plain directory (a "
                            f"file or a symlink); {tool} refuses to replace it (remove it or "
                            f"choose another path)")
    if not destination.is_dir() or has_marker(destination, marker):
        return
    entries = {entry.name for entry in destination.iterdir()}
    if not entries or (is_legacy is not None and is_legacy(destination)):
        return
    raise OwnedDirError(
        f"{key}: {destination} is not empty and was not written by {tool} (no {marker} "
        f"marker; it holds e.g. {sorted(entries)[0]!r}); refusing to replace it -- choose "
        f"another directory, or remove this one yourself")


def build_dir(destination: Path) -> Path:
    """A fresh hidden sibling of ``destination`` to build the new output in."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-{os.getpid()}-",
                                 dir=destination.parent))


def replace_dir(source: Path, destination: Path) -> None:
    """Move the finished directory ``source`` to ``destination``, replacing an old one.

    The old directory is renamed aside first, so ``destination`` is at every moment either
    the complete old output or the complete new one (a kill in between leaves the old one
    aside, and :func:`clean_dead_builds` puts it back).
    """
    stale = destination.parent / f".{destination.name}.old-{os.getpid()}"
    if destination.exists() or destination.is_symlink():
        destination.rename(stale)
    source.rename(destination)
    if stale.is_dir() and not stale.is_symlink():
        shutil.rmtree(stale, ignore_errors=True)
    elif stale.exists() or stale.is_symlink():
        stale.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def clean_dead_builds(destination: Path) -> list[Path]:
    """Remove the build and swapped-out siblings of ``destination`` whose process is dead.

    Returns what was removed.  A swapped-out copy (``.NAME.old-PID``) is renamed back when
    ``destination`` is missing: the run died between the two renames of :func:`replace_dir`.
    """
    parent = destination.parent
    if not parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(destination.name)}\.(tmp|old)-(\d+)(-.*)?")
    removed = []
    for entry in sorted(parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is None or int(match.group(2)) == os.getpid() or _alive(int(match.group(2))):
            continue
        if match.group(1) == "old" and not destination.exists():
            entry.rename(destination)
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink()
        removed.append(entry)
    return removed
