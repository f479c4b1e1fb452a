"""Output directories a tool owns: the marker file and the refusal of foreign or overlapping paths.

A tool that replaces its output directory wholesale (``data_prep.tokenize``, the feature cache)
must never delete what it did not write.  The rules:

* the tool writes a marker file into every directory it creates (:func:`write_marker`);
* before writing, :func:`check_replaceable` refuses a destination that is a file, or a
  non-empty directory without the marker, or one that overlaps an input (equal to it, inside
  it, or containing it) -- with a one-line :class:`OwnedDirError` naming the config key;
* the new output is built and swapped in with :mod:`dspine_train.checkpoint_io`
  (``build_dir``, ``replace_dir``: no moment without a whole output) and builds left by a
  killed run are removed by its ``clean_dead_builds``.
"""

from __future__ import annotations

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
