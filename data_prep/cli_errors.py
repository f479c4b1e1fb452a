"""The one-line console message of an error that stops a ``data_prep`` CLI."""

from __future__ import annotations

import errno


def os_error_line(error: OSError, writing: str) -> str:
    """``error`` (a failed read or write) as one line; ``writing`` says what was being written.

    The errno is named (``ENOSPC``, ``EACCES``, ...) because that is what a user searches for.
    """
    name = errno.errorcode.get(error.errno or 0, "")
    where = f"{error.filename}: " if error.filename else ""
    line = f"writing {writing}: {where}{error.strerror or error}" + (f" ({name})" if name else "")
    if error.errno == errno.ENOSPC:
        line += "; free space or choose another location"
    return line
