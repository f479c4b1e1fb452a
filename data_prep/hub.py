"""Prompt rows from datasets on the Hugging Face Hub (``data.source.hub``).

Each entry is loaded with ``datasets.load_dataset(name, config, split=..., revision=...)``
(downloaded once into the ``datasets`` cache, ``HF_HOME`` / ``HF_DATASETS_CACHE``), its
columns are mapped onto the record shape the local readers accept (``id`` + ``messages``), and
the rows go through the same reader as local ``datasets`` inputs
(:func:`~data_prep.readers.read_dataset_rows`): the same row checks, then the same
de-duplication, held-out hashing and accounting in :func:`~data_prep.sources.load_source`.

Problems loading an entry are :class:`~data_prep.schema.DataError` lines naming the entry
(``data.source.hub[i]``), its repository and what to do; with ``HF_HUB_OFFLINE=1`` a dataset
that is not in the cache says so.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from typing import Any

from data_prep.config import HubSourceConfig
from data_prep.readers import ReadResult, RecordMap, read_dataset_rows
from data_prep.schema import DataError


def entry_label(entry: HubSourceConfig) -> str:
    """How rows of ``entry`` are named in reports: ``org/name[/config]/split``."""
    return "/".join(part for part in (entry.name, entry.config, entry.split) if part)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_hub_split(entry: HubSourceConfig, key: str) -> Any:
    """The entry's split as a ``datasets.Dataset``; failures are one line naming ``key``."""
    import datasets  # deferred: importing datasets costs a second

    where = f"{key} ({entry.name})"
    try:
        return datasets.load_dataset(entry.name, entry.config, split=entry.split,
                                     revision=entry.revision)
    except ConnectionError as error:
        # datasets raises ConnectionError both offline and when the Hub cannot be reached
        if datasets.config.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE, or datasets' HF_DATASETS_OFFLINE
            raise DataError(f"{where}: not in the local datasets cache and offline mode is on "
                            f"(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); run once with network "
                            f"access (both unset) to download it, or point HF_HOME / "
                            f"HF_DATASETS_CACHE at a cache holding it") from None
        raise DataError(f"{where}: cannot reach the Hub ({_first_line(error)}) and the dataset "
                        f"is not cached; check the network or HF_ENDPOINT, or set "
                        f"HF_HUB_OFFLINE=1 to use a cached copy") from None
    except datasets.exceptions.DatasetNotFoundError as error:
        message = _first_line(error)
        field = "revision" if message.startswith("Revision") else "name"
        hint = ("; log in (hf auth login) or set HF_TOKEN"
                if "gated" in message or "authenticated" in message else "")
        raise DataError(f"{key}.{field}: {message}{hint}") from None
    except ValueError as error:
        message = _first_line(error)
        if message.startswith("Unknown split"):
            raise DataError(f"{key}.split: {entry.name}: {message}") from None
        if message.startswith("BuilderConfig") or "Config name is missing" in message:
            raise DataError(f"{key}.config: {entry.name}: {message}") from None
        raise DataError(f"{where}: cannot load it: {message}") from None
    except (OSError, datasets.exceptions.DatasetsError) as error:
        raise DataError(f"{where}: cannot load it: {_first_line(error)}") from None


def _check_columns(entry: HubSourceConfig, key: str, columns: list[str]) -> None:
    """Every column the mapping names exists (a typo would otherwise skip every row)."""
    named = {name: getattr(entry, name) for name in (
        "messages_field", "prompt_field", "response_field", "system_field")}
    for name, column in named.items():
        if column is not None and column not in columns:
            raise DataError(f"{key}.{name}: {entry_label(entry)} has no column {column!r} "
                            f"(columns: {', '.join(columns)})")
    if entry.prompt_field is None and entry.messages_field is None and not (
            {"messages", "conversations"} & set(columns)):
        raise DataError(f"{key}.messages_field: {entry_label(entry)} has neither a 'messages' "
                        f"nor a 'conversations' column (columns: {', '.join(columns)}); name "
                        f"the column of turns, or set prompt_field/response_field")
    if entry.id_field is not None and entry.id_field not in columns:
        raise DataError(f"{key}.id_field: {entry_label(entry)} has no column "
                        f"{entry.id_field!r} (columns: {', '.join(columns)})")


def record_map(entry: HubSourceConfig) -> RecordMap:
    """Turn one Hub row into the ``{"id", "messages"}`` record the row checks read."""
    roles = dict(entry.roles)

    def renamed(turn: Any) -> Any:
        if not isinstance(turn, Mapping):
            return turn  # normalisation reports it as bad_message
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        return {**turn, "role": roles[role]} if role in roles else turn

    def to_record(row: Any) -> Any:
        if not isinstance(row, Mapping):
            return row
        if entry.prompt_field is not None:
            messages = []
            if entry.system_field is not None and row.get(entry.system_field):
                messages.append({"role": "system", "content": row[entry.system_field]})
            messages.append({"role": "user", "content": row.get(entry.prompt_field)})
            if entry.response_field is not None:
                messages.append({"role": "assistant", "content": row.get(entry.response_field)})
        else:
            field = entry.messages_field
            if field is None:
                field = "messages" if row.get("messages") is not None else "conversations"
            messages = row.get(field)
            if roles and isinstance(messages, list):
                messages = [renamed(turn) for turn in messages]
        return {"id": row.get(entry.id_field or "id"), "messages": messages}

    return to_record


def sample_indices(total: int, max_rows: int | None, seed: int, label: str) -> list[int] | None:
    """Row indices (ascending) of a seeded sample of ``max_rows`` rows, or None for all.

    A permutation seeded by the source seed and the entry's name: the same settings read the
    same rows, and raising ``max_rows`` only adds rows.  Not a prefix of the split, because Hub
    sets are often concatenations sorted by origin (Open-PerfectBlend is).
    """
    if max_rows is None or total <= max_rows:
        return None
    import numpy as np

    generator = np.random.default_rng([seed, zlib.crc32(label.encode())])
    return sorted(generator.permutation(total)[:max_rows].tolist())


def read_hub(entry: HubSourceConfig, index: int, *, strict: bool, seed: int,
             tally: dict[str, int] | None = None) -> Iterator[ReadResult]:
    """Every row of Hub entry ``index`` (or its ``max_rows`` sample), mapped and checked.

    ``tally["not_read"]`` grows by the rows of the split that ``max_rows`` left out.
    """
    key = f"data.source.hub[{index}]"
    dataset = load_hub_split(entry, key)
    _check_columns(entry, key, list(dataset.column_names))
    label = entry_label(entry)
    indices = sample_indices(len(dataset), entry.max_rows, seed, label)
    if tally is not None and indices is not None:
        tally["not_read"] = tally.get("not_read", 0) + len(dataset) - len(indices)
    yield from read_dataset_rows(dataset, label, strict=strict, record_map=record_map(entry),
                                 indices=indices)
