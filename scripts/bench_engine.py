r"""Benchmark the engine: plain decoding vs DSpine speculative decoding on the same prompts.

    python scripts/bench_engine.py --target TARGET_DIR --draft DRAFT_DIR --prompts prompts.txt \
        [--max-new-tokens 128] [--batch-sizes 1 8] [--num-draft-tokens 3 7 15] \
        [--device cuda --dtype bfloat16] [--output bench_results/engine.json]

For each batch size it runs plain decoding once and speculative decoding once per number of
verified draft tokens g (greedy), after one warm-up call each, and prints a table: tau, tokens/s,
speedup over plain decoding, draft and verify ms per step, and whether the outputs are identical
(they must be). Then it times the parts of one draft step: the transition-cache decode against a
naive serial refine (METHOD 2.4 goal: <= 0.5x), and the share of the draft forward spent in the
injection modules (goal: <= 5%). Results are also written as JSON.

With `--tree-paths 1,2,4,8` it also compares chain (1) and token-tree verification (M > 1
lattice paths in at most `--tree-nodes` nodes, default M x g) per batch size and g: the budgets
run interleaved (`--tree-rounds` passes over all of them, so drift on a shared machine hits
every budget alike), and a second table gives tau per verification, verify and draft ms per
step, tokens/s and the ratios to the chain, and whether the outputs equal plain decoding.

With `--compare` it instead runs every decoding mode side by side, one prompt at a time, on the
same prompts (the held-out HumanEval and ShareGPT prompts by default, `--bench` / `--prompts`):
transformers' own plain and prompt-lookup decoding (`--prompt-lookup-tokens`, default 7), and
the engine's plain, DSpine chain, DSpine tree, n-gram (`--ngram-*`), hybrid, hybrid tree and
adaptive modes (`--compare-modes` picks some), interleaved over `--rounds` passes, greedy, then
a sampling pass (`--compare-temperature`, tau only). It prints a markdown table (tau, tokens/s,
speed-up over plain decoding, lossless) and writes the rows as JSON;
`scripts/tools/bench/side_by_side.py` says how each figure is measured.

    python scripts/bench_engine.py --compare --target TARGET_DIR --draft DRAFT_DIR \
        --bench humaneval,sharegpt --bench-prompts 12 --max-new-tokens 64 --dtype float32 \
        --output bench_results/compare.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

from dspine_train.benchmark_prompts import BenchmarkError  # noqa: E402
from dspine_train.engine.cli import (  # noqa: E402
    add_engine_arguments,
    build_engine,
    engine_argument_problem,
    run_batches,
)
from dspine_train.engine.errors import (  # noqa: E402
    CheckpointError,
    GenerationInputError,
    IncompatibleDraftError,
)
from dspine_train.engine.prompts import read_prompts  # noqa: E402
from dspine_train.engine.stats import GenerationStats, sum_stats, time_calls  # noqa: E402
from scripts.tools.bench.forced_replay import ReplayError  # noqa: E402
from scripts.tools.bench.prompt_log import PromptLogError  # noqa: E402
from scripts.tools.bench.side_by_side import (  # noqa: E402
    add_compare_arguments,
    compare_argument_problem,
    first_difference,
    run_compare,
)

if TYPE_CHECKING:
    from dspine_train.engine import Engine


@dataclass
class EngineRun:
    """One decoding mode at one (batch, g) over every prompt: a row of `runs`."""

    mode: str  # "autoregressive" or "speculative"
    batch: int
    g: int  # draft tokens per round; 0 for plain decoding
    stats: GenerationStats  # summed over the prompts
    speedup: float  # tokens/s over plain decoding's at this batch
    identical: bool  # the same tokens as plain decoding

    def to_json(self) -> dict[str, object]:
        """The row as the report writes it (the stats' counters and rates inline)."""
        return {"mode": self.mode, "batch": self.batch, "g": self.g, **self.stats.to_dict(),
                "speedup": self.speedup, "identical": self.identical}


@dataclass
class TreeRun:
    """One tree budget (paths 1: the chain) at one (batch, g): a row of `tree_runs`."""

    stats: GenerationStats  # summed over the interleaved passes
    batch: int
    g: int
    paths: int
    nodes: int  # verified nodes per round (g for the chain)
    identical: bool
    first_difference: list[int] | None  # [prompt, token] where the output leaves plain decoding
    tau_vs_chain: float = 0.0
    verify_ms_vs_chain: float = 0.0
    tokens_per_s_vs_chain: float = 0.0

    @property
    def mode(self) -> str:
        return "tree" if self.paths > 1 else "chain"

    def to_json(self) -> dict[str, object]:
        """The row as the report writes it (the stats' counters and rates first)."""
        return {**self.stats.to_dict(), "mode": self.mode, "batch": self.batch, "g": self.g,
                "paths": self.paths, "nodes": self.nodes, "identical": self.identical,
                "first_difference": self.first_difference, "tau_vs_chain": self.tau_vs_chain,
                "verify_ms_vs_chain": self.verify_ms_vs_chain,
                "tokens_per_s_vs_chain": self.tokens_per_s_vs_chain}


def _ratio(value: float, base: float) -> float:
    return value / base if base else 0.0


def time_call(fn, device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `fn()` after one warm-up, in seconds.

    The minimum, not the median: on a shared machine other processes only ever add time.
    """
    fn()
    return min(time_calls(fn, device, repeats))


def draft_step_costs(engine: Engine, prompts: list[str], chat: bool, repeats: int) -> dict[str, float]:
    """Time the pieces of one draft step on the first prompts' committed context."""
    from dspine_train.modeling.transition_cache import naive_serial_walk, top_candidates

    draft, device = engine.draft, engine.device
    batch = prompts[: engine.max_batch_size]
    engine.generate(batch, max_new_tokens=4, chat=chat)  # leaves a committed context behind
    cache = engine.draft_cache
    anchors = torch.zeros(len(batch), dtype=torch.long, device=device)
    logits, pre, recv = draft.draft_forward(cache, anchors)

    def table_walk():
        return draft.walk(pre, recv, logits, anchors)

    def serial_walk():
        cand = top_candidates(logits, draft.config.candidate_k)
        return naive_serial_walk(
            draft.refined_scores, pre[:, 1:], recv, anchors, cand
        )

    costs = {
        "draft_forward_ms": 1e3
        * time_call(lambda: draft.draft_forward(cache, anchors), device, repeats),
        "transition_walk_ms": 1e3 * time_call(table_walk, device, repeats),
        "naive_serial_refine_ms": 1e3 * time_call(serial_walk, device, repeats),
    }
    costs["walk_vs_serial"] = costs["transition_walk_ms"] / costs["naive_serial_refine_ms"]
    if draft.config.injection:
        # Same forward with the injection switched off: the difference is what injection costs.
        draft.config.injection = False
        try:
            plain = 1e3 * time_call(lambda: draft.draft_forward(cache, anchors), device, repeats)
        finally:
            draft.config.injection = True
        costs["draft_forward_no_injection_ms"] = plain
        costs["injection_share"] = max(0.0, 1.0 - plain / costs["draft_forward_ms"])
    return costs


def parse_int_list(text: str) -> list[int]:
    """`"1,2,4,8"` -> `[1, 2, 4, 8]`."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def tree_comparison(
    engine: Engine, prompts: list[str], batch: int, g: int, paths: list[int],
    nodes: list[int | None], rounds: int, ar_ids: list[list[int]], common: dict[str, object],
) -> list[TreeRun]:
    """Chain vs tree budgets at one (batch, g), interleaved over `rounds` passes."""
    budgets = list(zip(paths, nodes))
    parts: dict[tuple[int, int | None], list[GenerationStats]] = {b: [] for b in budgets}
    for m, n in budgets:  # warm-up of every budget's shapes
        engine.configure_tree(m, n)
        engine.generate(prompts[:batch], max_new_tokens=4, chat=common["chat"], num_draft_tokens=g)
    outputs = {b: [] for b in budgets}
    # Interleaved per batch of prompts: drift on a shared machine hits every budget alike.
    for r in range(rounds):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            for m, n in budgets:
                engine.configure_tree(m, n)
                result = engine.generate(chunk, num_draft_tokens=g, **common)
                parts[(m, n)].append(result.stats)
                if r == 0:
                    outputs[(m, n)] += result.token_ids
            print(f"tree budgets: pass {r}, prompts {start}..{start + len(chunk) - 1} done",
                  flush=True)
    engine.configure_tree(1, None)
    rows = []
    for m, n in budgets:
        total = sum_stats(parts[(m, n)])
        rows.append(TreeRun(total, batch, g, m, total.tree_nodes if m > 1 else g,
                            identical=outputs[(m, n)] == ar_ids,
                            first_difference=first_difference(outputs[(m, n)], ar_ids)))
    chain = next((r for r in rows if r.paths == 1), rows[0]).stats
    for row in rows:
        row.tau_vs_chain = _ratio(row.stats.tau, chain.tau)
        row.verify_ms_vs_chain = _ratio(row.stats.verify_ms_per_step, chain.verify_ms_per_step)
        row.tokens_per_s_vs_chain = _ratio(row.stats.tokens_per_s, chain.tokens_per_s)
    return rows


def print_tree_table(rows: list[TreeRun]) -> None:
    """The chain-vs-tree table."""
    header = (
        f"{'batch':>6}{'g':>4}{'M':>4}{'N':>5}{'tau':>7}{'tau x':>7}{'verify ms':>11}"
        f"{'verify x':>10}{'draft ms':>10}{'tok/s':>9}{'tok/s x':>9}{'identical':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.batch:>6}{r.g:>4}{r.paths:>4}{r.nodes:>5}{r.stats.tau:>7.2f}"
            f"{r.tau_vs_chain:>7.2f}{r.stats.verify_ms_per_step:>11.2f}"
            f"{r.verify_ms_vs_chain:>10.2f}{r.stats.draft_ms_per_step:>10.2f}"
            f"{r.stats.tokens_per_s:>9.1f}{r.tokens_per_s_vs_chain:>9.2f}{str(r.identical):>11}"
        )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser, prompts_required=False)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        nargs="+",
        default=None,
        help="values of g to compare (default: block_size - 1)",
    )
    parser.add_argument("--repeats", type=int, default=20, help="repeats of the step timings")
    parser.add_argument(
        "--tree-paths", type=parse_int_list, default=None,
        help="compare these tree budgets (lattice paths per round, 1 = the chain), e.g. 1,2,4,8",
    )
    parser.add_argument(
        "--tree-nodes", type=parse_int_list, default=None,
        help="node budget per --tree-paths entry (one value for all, or one each; "
        "default: paths x g)",
    )
    parser.add_argument("--tree-rounds", type=int, default=2, help="interleaved passes")
    parser.add_argument(
        "--tree-only", action="store_true",
        help="with --tree-paths: plain decoding and the tree comparison only (its budget 1 is "
        "the chain), no separate speculative runs",
    )
    parser.add_argument(
        "--skip-step-costs", action="store_true", help="do not time the draft step's parts"
    )
    parser.add_argument("--output", default="bench_results/engine.json")
    add_compare_arguments(parser)
    args = parser.parse_args()
    if args.compare:
        problem = engine_argument_problem(args) or compare_argument_problem(args)
        if problem:
            parser.error(problem)
        try:
            sys.exit(run_compare(args))
        except (CheckpointError, IncompatibleDraftError, GenerationInputError,
                BenchmarkError, PromptLogError, ReplayError) as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
    if args.prompts is None:
        parser.error("--prompts is required (or --compare, which can take --bench)")
    if args.draft is None:
        parser.error("--draft is required for the benchmark")

    tree_nodes: list[int | None] = []
    if args.tree_paths is not None:
        given = args.tree_nodes or [None]
        if len(given) not in (1, len(args.tree_paths)):
            parser.error("--tree-nodes takes one value or one per --tree-paths entry")
        tree_nodes = given * len(args.tree_paths) if len(given) == 1 else given
        # The chain ignores the node budget.
        tree_nodes = [None if m == 1 else n for m, n in zip(args.tree_paths, tree_nodes)]
    if args.tree_only and args.tree_paths is None:
        parser.error("--tree-only needs --tree-paths")
    prompts = read_prompts(args.prompts)
    args.batch_size = max(args.batch_sizes)
    engine = build_engine(args)
    chat = not args.no_chat
    g_values = args.num_draft_tokens or [engine.num_predictions]
    common = dict(max_new_tokens=args.max_new_tokens, chat=chat, seed=args.seed)

    rows: list[EngineRun] = []
    tree_rows: list[TreeRun] = []
    for batch in args.batch_sizes:
        engine.generate_ar(prompts[:batch], max_new_tokens=8, chat=chat)  # warm-up (and capture)
        ar_results, ar = run_batches(engine, prompts, batch, False, f"AR b={batch}", **common)
        ar_ids = [t for r in ar_results for t in r.token_ids]
        rows.append(EngineRun("autoregressive", batch, 0, ar, speedup=1.0, identical=True))
        for g in g_values:
            if args.tree_only:
                tree_rows += tree_comparison(
                    engine, prompts, batch, g, args.tree_paths, tree_nodes,
                    args.tree_rounds, ar_ids, common,
                )
                continue
            engine.generate(prompts[:batch], max_new_tokens=8, chat=chat, num_draft_tokens=g)
            results, spec = run_batches(
                engine, prompts, batch, True, f"spec b={batch} g={g}", num_draft_tokens=g, **common
            )
            ids = [t for r in results for t in r.token_ids]
            rows.append(EngineRun("speculative", batch, g, spec,
                                  speedup=_ratio(spec.tokens_per_s, ar.tokens_per_s),
                                  identical=ids == ar_ids))
            if args.tree_paths is not None:
                tree_rows += tree_comparison(
                    engine, prompts, batch, g, args.tree_paths, tree_nodes,
                    args.tree_rounds, ar_ids, common,
                )

    costs = {} if args.skip_step_costs else draft_step_costs(engine, prompts, chat, args.repeats)

    header = (
        f"{'mode':<15}{'batch':>6}{'g':>4}{'tau':>7}{'tok/s':>9}{'speedup':>9}"
        f"{'draft ms':>10}{'verify ms':>11}{'identical':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.mode:<15}{row.batch:>6}{row.g:>4}{row.stats.tau:>7.2f}"
            f"{row.stats.tokens_per_s:>9.1f}{row.speedup:>9.2f}"
            f"{row.stats.draft_ms_per_step:>10.2f}{row.stats.verify_ms_per_step:>11.2f}"
            f"{str(row.identical):>11}"
        )
    print()
    if tree_rows:
        print_tree_table(tree_rows)
    for name, value in costs.items():
        print(f"{name:<32}{value:10.3f}")

    report = {
        "target": args.target,
        "draft": args.draft,
        "device": str(engine.device),
        "dtype": str(engine.target.dtype),
        "host": platform.node(),
        "torch_threads": torch.get_num_threads(),
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "runs": [row.to_json() for row in rows],
        "tree_runs": [row.to_json() for row in tree_rows],
        "tree_rounds": args.tree_rounds if tree_rows else 0,
        "draft_step_costs": costs,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
