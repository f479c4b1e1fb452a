"""Output directories a tool owns: the marker file and the refusal of foreign or overlapping paths.

A tool that replaces its output directory wholesale (``data_prep.tokenize``, the feature cache)
must never delete what it did not write.  The rules:

* the tool writes a marker file into every directory it creates (:func:`write_marker`);
* before writing, :func:`check_replaceable` refuses a destination that is a file, or a
  non-empty directory without the marker, or one that overlaps an input (equal to it, inside
  it, or containing it) -- with a one-line :class:`OwnedDirError` naming the config key;
* a tool writing a single file (a token table, a results file) checks it with
  :func:`check_output_file`: no overlap with an input, and an existing file only when the tool
  recognises it as its own; :func:`check_no_overlap` is the overlap rule alone;
* the run holds :mod:`dspine_train.output_lock` on its output directory, so a second run into
  the same directory is refused instead of silently mixing the two;
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


def check_no_overlap(destination: str | Path, key: str, tool: str,
                     inputs: Mapping[str, Iterable[str | Path | None]]) -> None:
    """Refuse an output ``destination`` (option ``key``) that overlaps an input of ``tool``.

    ``inputs`` maps an option to the paths it names (empty or None entries are skipped).  An
    output equal to an input, inside one (a file in the target's directory) or containing one
    (the parent of the source) would replace or delete that input, so it is refused by name
    before any work starts.
    """
    destination = Path(destination)
    for input_key, paths in inputs.items():
        for path in paths:
            if path and overlaps(destination, Path(path)):
                raise OwnedDirError(
                    f"{key}: {destination} overlaps {input_key} {path} (equal, inside or "
                    f"containing); {tool} would replace it, so choose another path")


def check_output_file(destination: str | Path, key: str, tool: str,
                      inputs: Mapping[str, Iterable[str | Path | None]],
                      is_own: Callable[[Path], bool] | None = None) -> None:
    """Refuse the single output file ``destination`` (option ``key``) unless ``tool`` may write it.

    It must not overlap an input (:func:`check_no_overlap`), must not be a directory or a
    symlink, and an existing file is replaced only when ``is_own`` recognises it as an output
    of ``tool`` (without ``is_own``, never).
    """
    destination = Path(destination)
    check_no_overlap(destination, key, tool, inputs)
    if destination.is_symlink() or destination.is_dir():
        raise OwnedDirError(f"{key}: {destination} is a directory or a symlink; give a file "
                            f"path")
    if destination.exists() and (is_own is None or not is_own(destination)):
        raise OwnedDirError(
            f"{key}: {destination} exists and was not written by {tool}; refusing to replace "
            f"it -- choose another path, or remove the file yourself")


def check_replaceable(destination: Path, key: str, marker: str, tool: str,
                      inputs: Mapping[str, Iterable[str | Path]],
                      is_legacy: Callable[[Path], bool] | None = None) -> None:
    """Refuse ``destination`` (config key ``key``) unless ``tool`` may replace it.

    ``inputs`` maps a config key to the paths it names; ``is_legacy`` recognises an output
    of ``tool`` written before markers existed (accepted like a marked one).
    """
    check_no_overlap(destination, key, tool, inputs)
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
