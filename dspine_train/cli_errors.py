"""One-line console messages of the errors that stop a CLI (data_prep, feature cache, export)."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

# safetensors reports a failed write as `SafetensorError("... (os error 28)")`, without errno
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_os_error(error: BaseException) -> OSError | None:
    """The operating-system error behind a failed write, or None when there is none.

    ``error`` itself when it is an ``OSError``; else the first one in its chain of causes
    (``datasets`` wraps a full disk in ``DatasetGenerationError``); else the OS error number
    that a ``SafetensorError`` names in its message, as an ``OSError``.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        match = _RUST_OS_ERROR.search(str(current))
        if match and type(current).__name__ == "SafetensorError":
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        current = current.__cause__ or current.__context__
    return None


def existing_output(path: str | Path) -> bool:
    """Whether ``path`` already holds an output (a non-empty directory): taken before the run,
    so a failure can say that this old output was left as it was."""
    path = Path(path)
    return path.is_dir() and any(path.iterdir())


def os_error_line(error: OSError, writing: str, kept: str | Path | None = None) -> str:
    """``error`` (a failed read or write) as one line; ``writing`` says what was being written.

    The errno is named (``ENOSPC``, ``EACCES``, ...) because that is what a user searches for.
    ``kept``: the output that existed before the run, said to be intact (every tool here builds
    its output beside the old one and swaps it in only once complete).
    """
    name = errno.errorcode.get(error.errno or 0, "")
    where = f"{error.filename}: " if error.filename else ""
    line = f"writing {writing}: {where}{error.strerror or error}" + (f" ({name})" if name else "")
    if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        line += "; free space or choose another location"
    if kept is not None:
        line += f"; the old output in {kept} is intact (nothing was replaced)"
    return line
