"""The demo's driver: the stage order and cache keys, running a stage or skipping a finished
one (resuming an interrupted one), and the final report."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from dspine_train.markdown_table import markdown_table

from .records import Demo, DemoError, StageRecord, environment, fingerprint, write_json
from .stages import STAGE_FUNCS, stage_train

STAGES = ("target", "prompts", "regenerate", "tokenize", "token_table", "features", "train",
          "export", "evaluate")


@dataclass
class StageSpec:
    """A stage: what it reads, its settings (the cache key) and what it writes."""

    needs: tuple[str, ...]
    settings: Callable[[argparse.Namespace], dict[str, Any]]
    outputs: tuple[str, ...]


SPECS: dict[str, StageSpec] = {
    "target": StageSpec((), lambda a: {"target": str(a.target)}, ()),
    "prompts": StageSpec(("target",), lambda a: {
        "num_prompts": a.num_prompts, "files": [str(p) for p in a.prompts],
        "max_prompt_chars": a.max_prompt_chars}, ("data/prompts.jsonl", "data/split.json")),
    "regenerate": StageSpec(("prompts",), lambda a: {
        "max_new_tokens": a.max_new_tokens, "temperature": 0.0, "dtype": a.answer_dtype},
        ("data/regenerated",)),
    "tokenize": StageSpec(("regenerate",), lambda a: {"eval_fraction": a.eval_fraction,
                                                       "max_length": 1024},
                          ("data/tokenized",)),
    "token_table": StageSpec(("target",), lambda a: {"recipe": a.recipe,
                                                     "overrides": a.train_override},
                             ("token_table.safetensors",)),
    "features": StageSpec(("tokenize", "token_table"), lambda a: {
        "recipe": a.recipe, "layers": a.draft_layers, "dtype": a.dtype,
        "overrides": a.train_override},
        ("features",)),
    "train": StageSpec(("features",), lambda a: {
        "recipe": a.recipe, "steps": a.steps, "layers": a.draft_layers, "block": a.block_size,
        "anchors": a.num_anchors, "dtype": a.dtype, "draft_vocab_size": a.draft_vocab_size,
        "overrides": a.train_override},
        ("train",)),
    "export": StageSpec(("train",), lambda a: {}, ("draft",)),
    "evaluate": StageSpec(("export",), lambda a: {
        "bench": a.bench, "prompts": a.eval_prompts, "max_new_tokens": a.eval_max_new_tokens,
        "parity_rows": a.parity_rows, "dtype": a.serve_dtype,
        "temperatures": a.temperatures, "g": a.num_draft_tokens}, ("eval",)),
}


def run_stage(demo: Demo, name: str, force: bool) -> tuple[StageRecord, bool]:
    """Run one stage unless its record matches; return (record, whether it ran)."""
    spec = SPECS[name]
    upstream = []
    for need in spec.needs:
        marker = demo.marker(need)
        if marker is None:
            raise DemoError(f"stage {name} needs stage {need}, which has not run; "
                            f"run it first (e.g. --stages {need},{name})")
        upstream.append(marker)
    key = fingerprint(spec.settings(demo.args), upstream)
    done = demo.marker(name)
    if done is not None and done.fingerprint == key and not force and name != "target":
        return done, False
    started_path = demo.stages_dir / f"{name}.started.json"
    started = json.loads(started_path.read_text()) if started_path.is_file() else None
    resume = started is not None and started.get("fingerprint") == key and done is None
    if not resume:  # other settings or inputs: start from nothing
        for output in spec.outputs:
            target = demo.path(output)
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(
                missing_ok=True)
    (demo.stages_dir / f"{name}.json").unlink(missing_ok=True)
    write_json(started_path, {"fingerprint": key})
    start = time.perf_counter()
    summary = stage_train(demo, resume) if name == "train" else STAGE_FUNCS[name](demo)
    record = StageRecord(stage=name, fingerprint=key,
                         run_id=summary.pop("run_id", uuid.uuid4().hex),
                         seconds=round(time.perf_counter() - start, 1),
                         finished_at=time.strftime("%Y-%m-%d %H:%M:%S"), summary=summary,
                         environment=environment(demo.args.threads))
    write_json(demo.stages_dir / f"{name}.json", asdict(record))
    started_path.unlink(missing_ok=True)
    return record, True


def final_report(demo: Demo, records: dict[str, StageRecord], ran: dict[str, bool]) -> str:
    """Stage times, the evaluation tables and the trainer's simulated tau, as markdown."""
    rows = []
    for name, record in records.items():
        summary = {k: v for k, v in record.summary.items()
                   if k not in ("simulated_per_position", "assembly")}
        rows.append((name, record.seconds, "ran" if ran[name] else "cached",
                     json.dumps(summary, default=str)[:160]))
    lines = ["## DSpine demo", "",
             *markdown_table(["stage", "seconds", "this run", "summary"], rows, align="lrll")]
    total = sum(r.seconds for r in records.values())
    lines += ["", f"Total stage time: {total:.0f} s ({total / 60:.1f} min), "
              f"load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores.", ""]
    train = demo.marker("train")
    if train and train.summary.get("simulated_tau") is not None:
        rates = ", ".join(f"{r:.2f}" for r in train.summary["simulated_per_position"] or [])
        lines += [f"Trainer's simulated tau (held-out rows of the training data, greedy, full "
                  f"block): {train.summary['simulated_tau']:.2f}; per position: {rates}", ""]
    results_md = demo.path("eval", "results.md")
    if results_md.is_file():
        lines.append(results_md.read_text())
    parity_md = demo.path("eval", "parity.md")
    if parity_md.is_file():  # the two figures side by side, with any >2 SE warning
        lines += ["", parity_md.read_text()]
    return "\n".join(lines)
