r"""Measure exported DSpine drafts with the inference engine: tau, per-position acceptance, speed.

    dspine-train eval --target artifacts/default_target \
        --draft artifacts/demo/train/final --bench humaneval,sharegpt,my_prompts.jsonl \
        --temperatures 0,1 --limit 8 --max-new-tokens 64 --out artifacts/eval

(`python scripts/eval_acceptance.py` and `python -m dspine_train.evaluation.cli` take the same
arguments.)

Benchmarks: ``humaneval`` and ``sharegpt`` are the prompts the data recipes hold out from
training (never trained on; the split is recorded in the results), any other name is a local
JSONL file of prompts (``{"prompt": ...}`` or ``messages`` rows). ``--draft`` may be repeated,
as ``NAME=DIR`` to name the variant (default: the directory name). Writes ``results.json``,
``results.md`` and ``acceptance.png`` to ``--out`` and prints the markdown. At temperature 0 each
prompt's speculative output is compared with plain decoding (lossless check); the exit status is
1 on bad input and 3 when that check fails.

Parity mode (``--parity --data DIR``): on the rows of a tokenised dataset (``--split``, the
trainer's held-out ``eval`` split by default) the engine decodes each prompt at T=0 and the
trainer's simulated evaluation runs on the same teacher-forced rows at the engine's anchors
(`dspine_train.evaluation.parity`). Prints per-position acceptance of both with SEs, the paired
difference, the trainer's every-anchor figure and the engine's walk replayed on it, and
warnings when they differ by more than 2 SE; writes ``parity.json`` and ``parity.md``.

    dspine-train eval --parity --target artifacts/default_target \
        --draft artifacts/demo/draft --data artifacts/demo/data/tokenized --limit 20 --out out
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_prep.benchmarks import load_benchmark
from dspine_train.benchmark_prompts import BenchmarkError
from dspine_train.engine.cli import device_problem
from dspine_train.engine.errors import (
    CheckpointError,
    GenerationInputError,
    IncompatibleDraftError,
)
from dspine_train.evaluation.harness import (
    RESULTS_FORMAT,
    BenchResult,
    evaluate,
    plot_results,
    results_markdown,
    save_results,
)
from dspine_train.output_lock import OutputLockedError, lock_output
from dspine_train.owned_dir import OwnedDirError, check_no_overlap

EXIT_BAD_INPUT = 1
_DTYPES = ("bfloat16", "float16", "float32")
EXIT_NOT_LOSSLESS = 3


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def _variant(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep:
        return Path(text).name, Path(text)
    return name, Path(path)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (also used by the tests)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, type=Path, help="target model directory")
    parser.add_argument("--draft", required=True, action="append", type=_variant,
                        help="exported draft directory, or NAME=DIR (repeatable)")
    parser.add_argument("--bench", default="humaneval,sharegpt",
                        help="comma-separated: humaneval, sharegpt, or JSONL paths")
    parser.add_argument("--temperatures", type=_floats, default=None,
                        help="comma-separated (default 0,1; --parity decodes at 0 only)")
    parser.add_argument("--limit", type=int, default=8,
                        help="prompts per benchmark (--parity: rows of the split)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="new tokens per prompt (default 64; --parity: whole responses)")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="drafts verified per round, g (default: block size - 1)")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--tree-paths", type=int, default=1,
                        help="verify a token tree of the top-M lattice paths per round (1: chain)")
    parser.add_argument("--tree-nodes", type=int, default=None,
                        help="nodes of that tree per round (default: tree-paths x g)")
    parser.add_argument("--no-ar", action="store_true",
                        help="skip plain decoding (no speedup, no lossless check)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parity = parser.add_argument_group("parity mode")
    parity.add_argument("--parity", action="store_true",
                        help="engine vs the trainer's simulated evaluation on dataset rows")
    parity.add_argument("--data", type=Path, default=None,
                        help="tokenised dataset directory (data_prep.tokenize output)")
    parity.add_argument("--split", default="eval", help="dataset split (default: eval)")
    parity.add_argument("--dtype", choices=_DTYPES, default="float32",
                        help="dtype of the target and draft in both paths (default: float32)")
    return parser


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first flag that cannot be honoured as given, as a message naming it, or None:
    checked before anything is loaded, so no setting is silently ignored or replaced."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if args.tree_paths < 1:
        return f"--tree-paths must be >= 1, got {args.tree_paths}"
    if args.tree_nodes is not None and args.tree_paths == 1:
        return (f"--tree-nodes {args.tree_nodes} sizes a token tree: it needs --tree-paths > 1 "
                "(the chain verifies --num-draft-tokens nodes)")
    if args.parity:
        # Parity decodes the chain at T=0, as the trainer's simulation walks it.
        given = [flag for flag, value in (("--temperatures", args.temperatures is not None),
                                          ("--tree-paths", args.tree_paths != 1))
                 if value]
        if given:
            return (f"--parity compares the trainer's T=0 chain with the engine's; "
                    f"{' and '.join(given)} would not apply: drop them")
    return device_problem(args.device) if args.device is not None else None


def run_parity_mode(args: argparse.Namespace) -> int:
    """`--parity`: the check of `dspine_train.evaluation.parity` on `--data`; writes parity.json/.md."""
    import json

    import torch

    from dspine_train.evaluation.parity import parity_from_dataset
    from dspine_train.training.errors import TrainingError

    if args.data is None or len(args.draft) != 1:
        print("error: --parity needs --data and exactly one --draft", file=sys.stderr)
        return EXIT_BAD_INPUT
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        report = parity_from_dataset(
            args.target, args.draft[0][1], args.data, split=args.split, limit=args.limit,
            max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
            device=device, dtype=getattr(torch, args.dtype))
    except (TrainingError, ValueError, OSError, CheckpointError, IncompatibleDraftError,
            GenerationInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parity.json").write_text(json.dumps(report.to_json(), indent=1) + "\n")
    markdown = report.markdown()
    (args.out / "parity.md").write_text(markdown)
    print(markdown)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {args.out / 'parity.json'}, parity.md")
    return 0


def _is_own_results(path: Path) -> bool:
    """Whether `path` is a results file this script wrote (`save_results`' format)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == RESULTS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def out_problem(args: argparse.Namespace) -> str | None:
    """Why `--out` may not be written, checked before any model is loaded: a file, a directory
    overlapping an input (inside a draft export, which `push_to_hub` would upload with the
    results; the target; a benchmark file; `--data`), or one whose results.json this script
    did not write. None when it may."""
    out = args.out
    if out.exists() and not out.is_dir():
        return (f"--out {out}: exists and is not a directory (results.json, results.md and "
                "acceptance.png are written into it); give a directory")
    benches = [Path(b.strip()) for b in args.bench.split(",") if b.strip()]
    inputs = {"--target": [args.target], "--draft": [path for _, path in args.draft],
              "--bench": [path for path in benches if path.exists()], "--data": [args.data]}
    try:
        check_no_overlap(out, "--out", "eval_acceptance.py", inputs)
    except OwnedDirError as err:
        return str(err)
    results = out / "results.json"
    if not args.parity and results.exists() and not _is_own_results(results):
        return (f"--out {out}: {results.name} there was not written by eval_acceptance.py; "
                "refusing to replace it -- choose another directory")
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status. `--out` is checked, then held for the run
    (`dspine_train.output_lock`: a second evaluation into it is refused by name)."""
    args = build_parser().parse_args(argv)
    problem = argument_problem(args) or out_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with lock_output(args.out, "--out"):
            return run(args)
    except OutputLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    """The evaluation (or `--parity`) of the parsed `args`, into the locked `--out`."""
    if args.parity:
        return run_parity_mode(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = 64
    if args.temperatures is None:
        args.temperatures = [0.0, 1.0]
    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    names = [name for name, _ in args.draft]
    if len(set(names)) != len(names):
        print(f"error: --draft names must differ, got {names}", file=sys.stderr)
        return EXIT_BAD_INPUT
    results: dict[str, list[BenchResult]] = {}
    try:
        loaded = [load_benchmark(bench, limit=args.limit, seed=args.seed) for bench in benches]
        for name, draft in args.draft:
            results[name] = evaluate(
                args.target, draft, loaded, args.temperatures,
                max_new_tokens=args.max_new_tokens,
                num_draft_tokens=args.num_draft_tokens, measure_ar=not args.no_ar,
                seed=args.seed, batch_size=args.batch_size, device=args.device,
                tree_paths=args.tree_paths, tree_nodes=args.tree_nodes)
    except (BenchmarkError, CheckpointError, IncompatibleDraftError, GenerationInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    metadata = {"target": str(args.target), "drafts": {n: str(p) for n, p in args.draft},
                "command": " ".join(sys.argv)}
    save_results(results, args.out / "results.json", metadata=metadata)
    markdown = results_markdown(results)
    (args.out / "results.md").write_text(markdown)
    plot_results(results, args.out / "acceptance.png")
    print(markdown)
    print(f"wrote {args.out / 'results.json'}, results.md, acceptance.png")
    failed = [f"{n}/{r.bench}" for n, rows in results.items() for r in rows if r.lossless is False]
    if failed:
        print(f"error: speculative output differs from plain decoding at T=0 for {failed}",
              file=sys.stderr)
        return EXIT_NOT_LOSSLESS
    return 0


if __name__ == "__main__":
    sys.exit(main())
