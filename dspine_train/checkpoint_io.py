"""Checkpoint I/O: atomic file writes, atomic directory replacement, safetensors weight reading.

Every tool that publishes a file or a whole directory (exports, checkpoints, feature caches,
tokenised datasets, token tables, model cards, result files) and every reader of a model
directory's safetensors weights goes through this module, so each of these jobs is done one way.

* Files: :func:`write_atomic` (and the ``write_text/bytes/json_atomic`` helpers) write a hidden
  temporary sibling ``.NAME.XXXX.tmp``, fsync it and ``os.replace`` it over ``path``; a reader
  sees the old file or the new one, never a half-written one, and a failure leaves no temp file.
* Directories: build the new content in :func:`build_dir` (a hidden sibling
  ``.NAME.tmp-PID-XXXX``) and publish it with :func:`replace_dir`.  On Linux the two
  directories are swapped with ``renameat2(RENAME_EXCHANGE)``, so there is no moment at which
  the destination is missing; the old content, now under the build name, is deleted after.
  Where the exchange is unsupported (another OS, or a filesystem answering EINVAL) the old
  directory is renamed aside to ``.NAME.old-PID`` first: between that rename and the next the
  destination is missing for an instant, and a run killed exactly there leaves the old copy
  aside, which :func:`clean_dead_builds` puts back.  :func:`publish_dir` publishes only where
  nothing exists yet (first writer wins).
* Weights: :class:`SafetensorsWeights` opens a model directory holding ``model.safetensors``
  or ``model.safetensors.index.json`` + shards, and reads named tensors lazily through
  ``safe_open``; a missing shard, a truncated file or a missing tensor raises
  :class:`WeightsError` naming the file.

Imports nothing from the training stack (the engine uses it) and not torch (``framework`` is the
caller's choice).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Directories are published readable by all, like a plain mkdir under the usual umask
# (mkdtemp makes them owner-only); files likewise (mkstemp makes them 0600).
DIR_MODE = 0o755
FILE_MODE = 0o644


# --------------------------------------------------------------------------- files
def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # EINVAL on filesystems without directory fsync; the rename itself happened
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], write: Callable[[Path], None],
                 mode: int = FILE_MODE) -> Path:
    """Create ``path`` by calling ``write(temporary_path)``, then fsync and rename it in place.

    ``path`` holds the old content or the complete new one at every moment; on any failure
    (a full disk, an exception in ``write``, an interrupt) the temporary file is removed and
    the old ``path`` is left as it was.  Parent directories are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding=encoding))


def write_json_atomic(path: str | os.PathLike[str], obj: Any, **dumps: Any) -> Path:
    """Write ``obj`` as JSON (``json.dumps(obj, **dumps)`` plus a newline) atomically."""
    dumps.setdefault("indent", 2)
    return write_text_atomic(path, json.dumps(obj, **dumps) + "\n")


# --------------------------------------------------------------------------- directories
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2: Any = None


def _load_renameat2() -> Any:
    """libc's ``renameat2`` (glibc >= 2.28), or False where there is none."""
    global _renameat2
    if _renameat2 is None:
        _renameat2 = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                function = libc.renameat2
            except (OSError, AttributeError):
                pass
            else:
                function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                     ctypes.c_char_p, ctypes.c_uint]
                function.restype = ctypes.c_int
                _renameat2 = function
    return _renameat2


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``); both must exist.

    Returns False, having changed nothing, where the exchange is unsupported (not Linux, a
    libc without ``renameat2``, or a filesystem/kernel answering EINVAL/ENOSYS/ENOTSUP).
    Any other failure raises ``OSError``.
    """
    function = _load_renameat2()
    if not function:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot exchange {a} and {b}: {os.strerror(code)}", str(a))


def build_dir(destination: str | os.PathLike[str]) -> Path:
    """A fresh hidden sibling ``.NAME.tmp-PID-XXXX`` of ``destination`` to build new output in.

    Its name ties it to this process, so :func:`clean_dead_builds` can remove it after a kill.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-{os.getpid()}-",
                                 dir=destination.parent))
    path.chmod(DIR_MODE)
    return path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_dir(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    """Publish the finished directory ``source`` as ``destination``, replacing what is there.

    ``source`` should be a sibling of ``destination`` (same filesystem; :func:`build_dir`).
    An existing destination is exchanged with ``source`` in one ``renameat2`` call, then the old
    content (now at ``source``) is deleted: ``destination`` is at every moment either the
    complete old output or the complete new one.  Without the exchange (see the module
    docstring) the old output is renamed aside first; a failure of the second rename puts it
    back, and a kill between the two is repaired by :func:`clean_dead_builds`.
    """
    source, destination = Path(source), Path(destination)
    if not (destination.exists() or destination.is_symlink()):
        os.rename(source, destination)
    elif exchange_paths(source, destination):
        _remove(source)  # the old output, under the build's name
    else:
        _replace_by_renames(source, destination)
    _fsync_dir(destination.parent)


def _replace_by_renames(source: Path, destination: Path) -> None:
    """The fallback of :func:`replace_dir`: rename aside, rename in, delete the old copy."""
    stale = destination.parent / f".{destination.name}.old-{os.getpid()}"
    _remove(stale)  # left by an earlier call of this process that failed to delete it
    os.rename(destination, stale)
    try:
        os.rename(source, destination)
    except BaseException:
        os.rename(stale, destination)
        raise
    _remove(stale)


def publish_dir(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> bool:
    """Move the finished directory ``source`` to ``destination`` unless one is already there.

    For outputs that are built once and never replaced (first writer wins, e.g. two processes
    making the same tiny fixture): returns False and deletes ``source`` when ``destination``
    appeared meanwhile.
    """
    source, destination = Path(source), Path(destination)
    try:
        os.rename(source, destination)
    except OSError:
        if not destination.exists():
            raise
        _remove(source)
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def clean_dead_builds(destination: str | os.PathLike[str]) -> list[Path]:
    """Remove the build and swapped-out siblings of ``destination`` whose process is dead.

    Returns what was removed.  A swapped-out copy (``.NAME.old-PID``, only made where the
    exchange is unsupported) is renamed back when ``destination`` is missing: the run died
    between the two renames of :func:`replace_dir`.
    """
    destination = Path(destination)
    parent = destination.parent
    if not parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(destination.name)}\.(tmp|old)-(\d+)(-.*)?")
    removed = []
    for entry in sorted(parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is None or int(match.group(2)) == os.getpid() or _alive(int(match.group(2))):
            continue
        if match.group(1) == "old" and not (destination.exists() or destination.is_symlink()):
            os.rename(entry, destination)
            continue
        _remove(entry)
        removed.append(entry)
    return removed


# --------------------------------------------------------------------------- safetensors
class WeightsError(ValueError):
    """Weights that cannot be read; the message names the file (and tensor)."""


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """A weights directory, file or shard that is not there."""


def open_safetensors(path: str | os.PathLike[str], framework: str = "pt",
                     device: str = "cpu") -> Any:
    """``safe_open`` of one file, checked: the header parses and covers the whole file.

    Raises :class:`WeightsNotFoundError` for a missing file and :class:`WeightsError` for a
    truncated or corrupted one, naming the file.  The handle memory-maps the file; tensors are
    read only when asked for.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsNotFoundError(f"{path}: missing (not a file)")
    try:
        return safe_open(str(path), framework=framework, device=device)
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{path}: not a valid safetensors file, truncated or corrupted "
                           f"({err})") from None


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{index_path}: not valid JSON ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index_path}: no 'weight_map' entries")
    for key, name in weight_map.items():
        # A shard is a plain file name next to the index: never a path out of the directory.
        if not isinstance(name, str) or not name or Path(name).name != name or name[0] == ".":
            raise WeightsError(f"{index_path}: weight_map[{key!r}] = {name!r} is not a shard "
                               "file name in the export directory")
    return weight_map


class SafetensorsWeights:
    """The safetensors weights of a model directory, single-file or sharded, read lazily.

    ``model.safetensors`` wins over ``model.safetensors.index.json`` (as in transformers).
    Opening checks that the directory, the index and every shard it names exist; each file's
    header is checked when the file is first used (:meth:`check` checks them all now).
    Tensors are read one at a time from the memory-mapped files.  Use as a context manager,
    or call :meth:`close`, to release the files.
    """

    def __init__(self, directory: str | os.PathLike[str], framework: str = "pt",
                 device: str = "cpu") -> None:
        self.directory = Path(directory)
        self.framework, self.device = framework, device
        self._handles: dict[Path, Any] = {}
        if not self.directory.is_dir():
            raise WeightsNotFoundError(f"{self.directory}: weights directory does not exist")
        index_path = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if single.is_file():
            self.index_path: Path | None = None
            self._map = dict.fromkeys(self._handle(single).keys(), single)
            self.files: list[Path] = [single]
        elif index_path.is_file():
            self.index_path = index_path
            self._map = {key: self.directory / name
                         for key, name in _read_index(index_path).items()}
            for key, file in self._map.items():
                if not file.is_file():
                    raise WeightsNotFoundError(
                        f"{index_path} maps {key} to {file.name}, which is not in "
                        f"{self.directory}")
            self.files = sorted(set(self._map.values()))
        else:
            raise WeightsNotFoundError(
                f"{single}: missing (neither {SINGLE_FILE} nor {INDEX_FILE} in "
                f"{self.directory}; only safetensors checkpoints are read)")

    def _handle(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = open_safetensors(file, self.framework, self.device)
        return handle

    def check(self) -> None:
        """Open every file now: raise :class:`WeightsError` on the first unreadable one."""
        for file in self.files:
            self._handle(file)

    def keys(self) -> list[str]:
        """The tensor names (of the index, or of the single file)."""
        return list(self._map)

    def __contains__(self, name: object) -> bool:
        return name in self._map

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``."""
        if name not in self._map:
            raise WeightsError(f"{self.index_path or self.directory / SINGLE_FILE}: "
                               f"no tensor {name!r}")
        return self._map[name]

    def _checked_handle(self, name: str) -> Any:
        file = self.file_of(name)
        handle = self._handle(file)
        if name not in handle.keys():  # the index lists it, the shard lacks it
            raise WeightsError(f"{file}: has no tensor {name!r} (listed in {self.index_path})")
        return handle

    def get_tensor(self, name: str) -> Any:
        """Tensor ``name`` (only its bytes are read)."""
        return self._checked_handle(name).get_tensor(name)

    def get_shape(self, name: str) -> list[int]:
        """Shape of tensor ``name``, from the header only."""
        return self._checked_handle(name).get_slice(name).get_shape()

    def file_shapes(self, file: Path) -> dict[str, list[int]]:
        """Every tensor stored in ``file`` (one of :attr:`files`) with its shape, header only."""
        handle = self._handle(file)
        return {name: handle.get_slice(name).get_shape() for name in handle.keys()}

    def tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, tensor)`` for ``names`` (default: all), reading each on demand."""
        for name in self.keys() if names is None else names:
            yield name, self.get_tensor(name)

    def close(self) -> None:
        """Release the open files (tensors already read stay valid)."""
        self._handles.clear()

    def __enter__(self) -> SafetensorsWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
