"""Whether a command line's output file can be written, checked before any work is done.

A command that computes for minutes and then cannot write its result has wasted the run; the
CLIs call `output_problem` first and report its message (one line naming the flag) instead;
`output_file_problem` adds the one output rule of `dspine_train.owned_dir` (no output over an
input, no existing file replaced unless the tool wrote it).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from dspine_train.owned_dir import OwnedDirError, check_output_file


def output_problem(path: str | Path, flag: str) -> str | None:
    """Why the file `path` given by `flag` could not be written, or None when it can.

    The nearest existing ancestor must be a writable directory (missing parents are created
    when the result is written); `path` itself must not be a directory. Writability is probed
    with an anonymous temporary file, so nothing is left behind and a read-only file system
    is caught even for root.
    """
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path}: is a directory; give a file path"
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {path}: {existing} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{flag} {path}: cannot write in {existing} ({err.strerror or err})"
    return None


def output_file_problem(path: str | Path, flag: str, tool: str,
                        inputs: Mapping[str, Iterable[str | Path | None]],
                        is_own: Callable[[Path], bool] | None = None) -> str | None:
    """`output_problem`, then why `tool` may not write the file `path` given its `inputs`
    (`owned_dir.check_output_file`: overlapping an input, or an existing file `is_own` does
    not recognise), or None when it may."""
    problem = output_problem(path, flag)
    if problem:
        return problem
    try:
        check_output_file(Path(path), flag, tool, inputs, is_own)
    except OwnedDirError as err:
        return str(err)
    return None
