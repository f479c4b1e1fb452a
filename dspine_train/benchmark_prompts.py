"""The benchmark record: prompts the data pipeline loads and the evaluation harness measures.

`data_prep.benchmarks.load_benchmark` builds a `Benchmark` (the builtin held-out sets, local
JSONL files) and `dspine_train.evaluation.harness.evaluate` measures one; both import it from here,
so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Messages = list[dict[str, str]]


class BenchmarkError(ValueError):
    """A benchmark cannot be loaded or evaluated; the message names the file, line or field."""


@dataclass
class Benchmark:
    """Prompts of one benchmark, their row ids, and how they were chosen (the split record)."""

    name: str
    prompts: list[Messages]
    ids: list[str]
    split: dict[str, Any]
