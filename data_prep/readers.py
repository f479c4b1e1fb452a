"""Readers for the conversation files users bring, all yielding the normalised schema.

Containers (chosen by ``fmt``, or by the path when ``fmt="auto"``):

* ``jsonl``    one JSON object per line (``.jsonl``, ``.jsonl.gz``; a ``.json`` file whose first
               character is ``{`` is read this way too);
* ``json``     one JSON array of objects (``.json``), parsed record by record with
               ``json.JSONDecoder.raw_decode`` so a file truncated at the end (the ShareGPT V3
               release is) still yields every complete record;
* ``datasets`` a directory written by ``Dataset.save_to_disk`` (read with ``load_from_disk``),
               or a ``.parquet`` / ``.arrow`` / ``.csv`` file or a directory of such files
               (read with ``load_dataset``).

A directory of JSON/JSONL files is read file by file, in name order.  A directory with no data
file, or holding a file of another kind, is an error naming it (hidden files, ``*.md`` and
``LICENSE*`` files are ignored).
A UTF-8 byte order mark at the start of a JSON/JSONL file is accepted (Windows editors write
one).

Inside a container each record is ShareGPT-style (``conversations`` of ``from``/``value``) or
OpenAI-style (``messages`` of ``role``/``content``), detected per record.  Bad rows are yielded
as :class:`~data_prep.schema.SkippedRow` with a reason, or raise
:class:`~data_prep.schema.DataError` naming file and line when ``strict``.  Text is decoded
with ``surrogateescape`` so that undecodable bytes reach the row validator (reason
``invalid_utf8``) instead of failing the whole file.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.schema import Conversation, DataError, RowError, RowRef, SkippedRow, normalise_record


@dataclass(frozen=True)
class ReadRow:
    """A valid row and where it came from."""

    ref: RowRef
    conversation: Conversation


ReadResult = ReadRow | SkippedRow
RecordMap = Callable[[Any], Any]

FORMATS = ("auto", "jsonl", "json", "datasets")
_DATASETS_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def detect_format(path: Path) -> str:
    """The container format ``fmt="auto"`` picks for ``path``."""
    if path.is_dir() or path.suffix in _DATASETS_BUILDERS:
        return "datasets"
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".json"):
        with _open_text(path) as handle:
            head = handle.read(4096).lstrip()
        return "json" if head.startswith("[") else "jsonl"
    raise DataError(f"{path}: cannot tell the format from the name; set format to "
                    f"one of {', '.join(FORMATS[1:])}")


def _open_text(path: Path):
    # utf-8-sig drops a leading byte order mark and is plain UTF-8 otherwise
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="surrogateescape")
    return open(path, encoding="utf-8-sig", errors="surrogateescape")


def _ignored(relative: Path) -> bool:
    """Files a data directory may hold besides data: hidden ones, a README, a licence."""
    return (any(part.startswith(".") for part in relative.parts) or relative.suffix == ".md"
            or relative.name.startswith("LICENSE"))


def data_files(directory: Path) -> list[Path]:
    """The data files of a plain directory input, checked: at least one, all of one kind.

    Raises :class:`DataError` naming the directory when it holds none, or the first file that
    is neither JSON/JSONL nor a ``datasets`` file, or a mix of the two kinds.
    """
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and not _ignored(p.relative_to(directory)))
    if not files:
        raise DataError(f"{directory}: the directory holds no data file")
    kinds = {}
    for file in files:
        if file.name.endswith(_JSON_SUFFIXES):
            kinds[file] = "json"
        elif file.suffix in _DATASETS_BUILDERS:
            kinds[file] = "datasets"
        else:
            raise DataError(f"{file}: not a data file (expected "
                            f"{', '.join(_JSON_SUFFIXES + tuple(_DATASETS_BUILDERS))})")
    if len(set(kinds.values())) > 1:
        raise DataError(f"{directory}: mixes JSON files and {', '.join(_DATASETS_BUILDERS)} "
                        f"files; give them as separate inputs")
    return files


def _outcome(record: Any, ref: RowRef, strict: bool, record_map: RecordMap | None) -> ReadResult:
    try:
        if record_map is not None:
            record = record_map(record)
        return ReadRow(ref, normalise_record(record, ref))
    except RowError as error:
        if strict:
            raise DataError(f"{ref}: {error.reason}: {error.detail}") from None
        raw_id = record.get("id") if isinstance(record, dict) else None
        return SkippedRow(ref, error.reason, error.detail,
                          raw_id if isinstance(raw_id, str) else None)


def read_jsonl(path: Path, *, strict: bool = False,
               record_map: RecordMap | None = None) -> Iterator[ReadResult]:
    """Rows of a JSON-lines file; blank lines are not rows."""
    with _open_text(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            ref = RowRef(path.name, line_number)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                if strict:
                    raise DataError(f"{ref}: malformed_json: {error.msg}") from None
                yield SkippedRow(ref, "malformed_json", error.msg)
                continue
            yield _outcome(record, ref, strict, record_map)


def read_json_array(path: Path, *, strict: bool = False,
                    record_map: RecordMap | None = None) -> Iterator[ReadResult]:
    """Rows of a JSON array file, one ``raw_decode`` per element.

    Parsing cannot resynchronise inside an array, so the first element that fails to decode
    ends the file: the unreadable tail is reported as one skipped row (``malformed_json``),
    which is exactly the truncated last record of the ShareGPT release.
    """
    with _open_text(path) as handle:
        text = handle.read()
    decoder = json.JSONDecoder()
    position = len(text) - len(text.lstrip())
    if not text.startswith("[", position):
        raise DataError(f"{path.name}:1: expected a JSON array ('[')")
    position += 1
    line, line_position = 1, 0
    while True:
        # Skip whitespace and the separating comma between elements.
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        line += text.count("\n", line_position, position)
        line_position = position
        ref = RowRef(path.name, line)
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            detail = f"cannot parse from here to the end of the file ({error.msg}); truncated file?"
            if strict:
                raise DataError(f"{ref}: malformed_json: {detail}") from None
            yield SkippedRow(ref, "malformed_json", detail)
            return
        yield _outcome(record, ref, strict, record_map)


def read_datasets(path: Path, *, split: str = "train", strict: bool = False,
                  record_map: RecordMap | None = None) -> Iterator[ReadResult]:
    """Rows of a local ``datasets`` dataset; the line of a row is its 1-based index."""
    import datasets  # deferred: importing datasets costs a second and most inputs are JSONL

    if path.is_dir() and ((path / "dataset_info.json").exists()
                          or (path / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{path}: no split {split!r}; it has {sorted(loaded)}")
            loaded = loaded[split]
    else:
        if path.is_dir():
            data_files(path)
            arguments = {"path": str(path), "split": split}
        else:
            builder = _DATASETS_BUILDERS.get(path.suffix)
            if builder is None:
                raise DataError(f"{path}: datasets format needs a directory or one of "
                                f"{', '.join(_DATASETS_BUILDERS)}")
            arguments = {"path": builder, "data_files": str(path), "split": "train"}
        try:
            loaded = datasets.load_dataset(**arguments)
        except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DataError(f"{path}: cannot read it as a dataset: {first}") from None
    yield from read_dataset_rows(loaded, path.name, strict=strict, record_map=record_map)


def read_dataset_rows(dataset: Any, source: str, *, strict: bool = False,
                      record_map: RecordMap | None = None,
                      indices: Iterable[int] | None = None) -> Iterator[ReadResult]:
    """Rows of a loaded ``datasets.Dataset``, named ``source:<1-based row index>``.

    ``indices`` (0-based, ascending) reads only those rows; local ``datasets`` inputs and Hub
    datasets both come through here, so their rows get the same checks.
    """
    if indices is None:
        for index, record in enumerate(dataset, start=1):
            yield _outcome(record, RowRef(source, index), strict, record_map)
        return
    indices = [int(index) for index in indices]
    for index, record in zip(indices, dataset.select(indices)):
        yield _outcome(record, RowRef(source, index + 1), strict, record_map)


def read_rows(path: str | Path, *, fmt: str = "auto", split: str = "train", strict: bool = False,
              record_map: RecordMap | None = None) -> Iterator[ReadResult]:
    """Yield every row of ``path`` as a :class:`ReadRow` or a :class:`SkippedRow`.

    ``record_map`` transforms each raw record before normalisation (the HumanEval source
    uses it to turn a coding task into a user prompt).
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if fmt not in FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if path.is_dir() and fmt in ("auto", "jsonl", "json") and not (
            (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        files = data_files(path)
        if files[0].name.endswith(_JSON_SUFFIXES):
            return _read_json_files(files, strict=strict, record_map=record_map)
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "jsonl":
        return read_jsonl(path, strict=strict, record_map=record_map)
    if fmt == "json":
        return read_json_array(path, strict=strict, record_map=record_map)
    return read_datasets(path, split=split, strict=strict, record_map=record_map)


def _read_json_files(files: list[Path], *, strict: bool,
                     record_map: RecordMap | None) -> Iterator[ReadResult]:
    for file in files:
        if detect_format(file) == "json":
            yield from read_json_array(file, strict=strict, record_map=record_map)
        else:
            yield from read_jsonl(file, strict=strict, record_map=record_map)
