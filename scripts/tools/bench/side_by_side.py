"""`bench_engine.py --compare`: every decoding mode side by side on the same prompts.

The modes are rows of `(name, family, runner)` (`build_modes`; adding a mode is one line):
transformers' own plain decoding and prompt-lookup decoding (`hf_reference`, the reference run
by transformers itself), and the engine's plain decoding, DSpine chain, DSpine tree, n-gram
only (no draft), hybrid (the draft's chain plus the n-gram branch), hybrid tree (the draft's
tree plus the n-gram branch) and adaptive (the hybrid tree's engine choosing each round's shape
by measured cost, `engine.round_planner`). The engine modes share one loaded target
(`load_engines`). Rows that need a draft are left out without `--draft`, and the report says so.

Every prompt is decoded alone (transformers' assisted generation takes a batch of one), from
the same token ids in every mode, greedy. The modes alternate prompt by prompt and repeat over
`--rounds` passes, so load on a shared machine hits them alike; times and counts add up over
the passes. Per benchmark and mode the report gives:

- tau: new tokens that target forwards after the prefill produced, per such forward
  (`GenerationStats.tau` for the engine; for transformers see `hf_reference`), 1 for plain;
- tokens/s: new tokens per second of decoding wall time (prefill included; the engine's
  compile / CUDA-graph capture excluded), and its ratio to plain decoding of the same family
  (engine modes over the engine's plain decoding, transformers' over transformers') and to
  transformers' plain decoding (the one reference common to every row);
- lossless: whether every prompt's output equals plain decoding of the same family, token for
  token (plus, in the JSON, whether it equals transformers' plain decoding).

Each prompt's results (every mode of it) are appended to a JSON-lines log as soon as the
prompt is done (`--compare-log`, `prompt_log`), and a progress line is printed; the same command
resumes an interrupted run from the log and builds the report from it.

A sampling pass follows (`--compare-temperature`, plain modes left out): tau only, over
`--sampling-rounds` rounds, each with its own seeds (a sampled answer takes one of many
trajectories, and how much a proposer can copy depends on which: one draw per prompt is a noisy
estimate of a mode's tau, so every row also carries the standard error of its tau, clustered by
prompt).
Sampled outputs depend on each mode's random draws, so they are neither compared token by
token nor timed against a plain run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspine_train.benchmark_prompts import BenchmarkError
from dspine_train.checkpoint_io import write_text_atomic
from dspine_train.engine import Engine
from dspine_train.engine.errors import GenerationInputError
from dspine_train.engine.ngram import NgramConfig
from dspine_train.evaluation.block_metrics import ratio_se
from dspine_train.markdown_table import markdown_table
from scripts.tools.bench.forced_replay import (
    REPLAYABLE,
    ForcedAnswer,
    ForcedAnswerProcessor,
    ReplayLog,
    forced_engine_target,
    logged_answers,
    replay_answers,
    replay_rows,
    replay_table,
)
from scripts.tools.bench.hf_reference import Decoded, HFReference
from scripts.tools.bench.prompt_log import PromptLog

# (ids, temperature, seed) -> what one prompt's decoding produced and cost
Runner = Callable[[list[int], float, int], Decoded]
# every mode's name, in table order (`build_modes` lists the same ones, with their runners)
MODE_NAMES = ("HF plain", "HF prompt lookup", "engine plain", "DSpine chain", "DSpine tree",
              "n-gram", "hybrid", "hybrid tree", "adaptive")


@dataclass
class Mode:
    """One row of the comparison: `family` "hf" or "engine" picks its plain baseline."""

    name: str
    family: str
    run: Runner
    plain: bool = False  # the family's plain decoding (no sampling pass: tau is 1 by definition)
    # (ids, answer) -> the mode's greedy decoding forced to `answer` (`forced_replay`); None:
    # the mode's sampled rounds do not verify point masses only, so it is not replayed
    replay: Callable[[list[int], list[int]], Decoded] | None = None


@dataclass
class CompareRow:
    """One mode on one benchmark at one temperature, summed over the rounds (module doc)."""

    bench: str
    mode: str
    family: str
    temperature: float
    num_prompts: int
    rounds: int
    new_tokens: int
    verifications: int  # target forwards after the prefill
    verified_tokens: int  # new tokens those forwards produced
    tau: float
    seconds: float
    tokens_per_s: float
    tau_se: float | None = None  # standard error of tau, clustered by prompt (>= 2 prompts)
    speedup: float | None = None  # over plain decoding of the same family (greedy only)
    speedup_vs_hf_plain: float | None = None  # over transformers' plain decoding (greedy only)
    lossless: bool | None = None  # equals the family's plain decoding (greedy only)
    same_as_hf_plain: bool | None = None
    first_difference: list[int] | None = None  # [prompt, token] where it leaves plain decoding


@dataclass
class Totals:
    """Running sums of one (benchmark, mode, temperature)."""

    new_tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)  # the first round's, per prompt
    # prompt index -> [verified tokens, verifications] summed over the rounds
    per_prompt: dict[int, list[int]] = field(default_factory=dict)

    def add(self, decoded: Decoded, first_round: bool, prompt: int = 0) -> None:
        self.new_tokens += len(decoded.tokens)
        self.seconds += decoded.seconds
        sums = self.per_prompt.setdefault(prompt, [0, 0])
        sums[0] += decoded.verified_tokens
        sums[1] += decoded.verifications
        if first_round:
            self.outputs.append(decoded.tokens)

    @property
    def verified_tokens(self) -> int:
        return sum(v for v, _ in self.per_prompt.values())

    @property
    def verifications(self) -> int:
        return sum(f for _, f in self.per_prompt.values())

    def tau_se(self) -> float | None:
        """The standard error of tau (new tokens over target forwards) clustered by prompt
        (`block_metrics.ratio_se`); None under two prompts."""
        return ratio_se([(v, f) for v, f in self.per_prompt.values()])


def first_difference(got: list[list[int]], want: list[list[int]]) -> list[int] | None:
    """`[prompt index, token index]` of the first token where `got` leaves `want`, or None."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return [i, j]
        if len(a) != len(b):
            return [i, min(len(a), len(b))]
    return None


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--compare` options of `bench_engine.py`."""
    group = parser.add_argument_group("side by side (--compare)")
    group.add_argument(
        "--compare", action="store_true",
        help="every mode side by side, one prompt at a time: transformers' plain and "
        "prompt-lookup decoding, the engine's plain, DSpine chain / tree, n-gram, hybrid and "
        "adaptive modes (--batch-sizes and the step timings do not apply)")
    group.add_argument(
        "--bench", default=None,
        help="comma-separated benchmarks: humaneval, sharegpt (the data recipes' held-out "
        "parts) or JSONL files (default: humaneval,sharegpt, or only --prompts when given)")
    group.add_argument("--bench-prompts", type=int, default=12, help="prompts per benchmark")
    group.add_argument("--rounds", type=int, default=2, help="interleaved passes over the modes")
    group.add_argument("--prompt-lookup-tokens", type=int, default=7,
                       help="transformers' prompt_lookup_num_tokens")
    group.add_argument("--prompt-lookup-max-ngram", type=int, default=None,
                       help="transformers' max_matching_ngram_size (default: its own, 2)")
    group.add_argument("--compare-tree-paths", type=int, default=4,
                       help="lattice paths of the DSpine tree and hybrid rows")
    group.add_argument("--compare-tree-nodes", type=int, default=None,
                       help="their node budget (default: paths x g)")
    group.add_argument("--compare-temperature", type=float, default=1.0,
                       help="temperature of the sampling pass (tau only); 0 skips it")
    group.add_argument("--sampling-rounds", type=int, default=1,
                       help="rounds of the sampling pass, each drawing anew (its tau's standard "
                       "error shrinks with them)")
    group.add_argument("--compare-modes", default=None,
                       help="comma-separated mode names to run (default: every one available): "
                       + ", ".join(MODE_NAMES) + "; the n-gram rows take the --ngram-* values "
                       "(--ngram itself is not needed)")
    group.add_argument(
        "--replay-sampled", nargs="?", const="all", default=None, metavar="BENCHES",
        help="after the sampling pass, replay every sampled answer in the log through every "
        "point-mass mode (prompt lookup, n-gram, DSpine tree, hybrid, hybrid tree): each "
        "mode's sampled tau on common draws, paired differences, and the check that a mode "
        "replays its own draws to the forward (forced_replay; resumable from "
        "<log>.replay.jsonl); optionally only these comma-separated benchmarks")
    group.add_argument("--compare-log", default=None,
                       help="JSON-lines file of every decoded prompt, appended as the run goes; "
                       "the same command resumes from it (default: --output's name with "
                       ".prompts.jsonl)")


def log_path(args: argparse.Namespace) -> Path:
    """Where the per-prompt results go: `--compare-log`, or beside `--output`."""
    if args.compare_log:
        return Path(args.compare_log)
    out = Path(args.output)
    return out.with_name(out.stem + ".prompts.jsonl")


def compare_argument_problem(args: argparse.Namespace) -> str | None:
    """The first unusable `--compare` value, as a message naming the flag, or None."""
    for flag in ("bench_prompts", "rounds", "sampling_rounds", "prompt_lookup_tokens",
                 "compare_tree_paths", "max_new_tokens"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}"
    for flag in ("prompt_lookup_max_ngram", "compare_tree_nodes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            return f"--{flag.replace('_', '-')} must be >= 1, got {value}"
    if args.compare_tree_nodes is not None and args.compare_tree_paths == 1:
        return (f"--compare-tree-nodes {args.compare_tree_nodes} sizes a token tree: it needs "
                "--compare-tree-paths > 1")
    if not (math.isfinite(args.compare_temperature) and args.compare_temperature >= 0):
        return f"--compare-temperature must be a finite number >= 0, got {args.compare_temperature}"
    try:
        ngram_config(args)
    except GenerationInputError as err:
        return str(err)
    unknown = sorted(set(selected_modes(args)) - set(MODE_NAMES))
    if unknown:
        return f"--compare-modes: unknown mode(s) {unknown}; modes are {', '.join(MODE_NAMES)}"
    return None


def selected_modes(args: argparse.Namespace) -> list[str]:
    """The mode names `--compare-modes` asks for (every mode when not given)."""
    if not args.compare_modes:
        return list(MODE_NAMES)
    return [m.strip() for m in args.compare_modes.split(",") if m.strip()]


# ---------------------------------------------------------------------------------- engines
def ngram_config(args: argparse.Namespace) -> NgramConfig:
    """The n-gram rows' `NgramConfig`, from the engine's `--ngram-*` flags."""
    return NgramConfig(max_n=args.ngram_max_n, min_n=args.ngram_min_n,
                       num_tokens=args.ngram_tokens, match=args.ngram_match)


def load_engines(args: argparse.Namespace, ngram: NgramConfig) -> dict[str, Engine]:
    """Engines for one prompt at a time that share one loaded target (and draft): "main"
    (the draft, for plain decoding and the DSpine rows), "ngram" (no draft), and with a draft
    "hybrid" (draft + n-gram) and "adaptive" (the same, each round's shape by measured cost).

    One copy of the weights serves them all. Each engine sizes the target's caches when it is
    built (all alike here), so every engine is built before any of them runs: on CUDA their
    graphs are then all captured on the same cache buffers.
    """
    from dspine_train.engine.cli import DTYPES

    kwargs: dict[str, Any] = {"max_batch_size": 1, "cuda_graphs": not args.no_cuda_graphs}
    if args.max_seq_len is not None:
        kwargs["max_seq_len"] = args.max_seq_len
    if args.chat_template_kwargs is not None:
        kwargs["chat_template_kwargs"] = json.loads(args.chat_template_kwargs)
    main = Engine.from_pretrained(args.target, args.draft, device=args.device,
                                  dtype=DTYPES[args.dtype] if args.dtype else None,
                                  tokenizer=args.tokenizer, **kwargs)
    kwargs.update(eos_token_ids=main.eos_token_ids,
                  chat_template_kwargs=main.chat_template_kwargs)
    engines = {"main": main,
               "ngram": Engine(main.target, None, main.tokenizer, ngram=ngram, **kwargs)}
    if main.draft is not None:
        engines["hybrid"] = Engine(main.target, main.draft, main.tokenizer, ngram=ngram,
                                   **kwargs)
        engines["adaptive"] = Engine(main.target, main.draft, main.tokenizer, ngram=ngram,
                                     adaptive=True, **kwargs)
    return engines


def engine_runner(engine: Any, max_new_tokens: int, speculative: bool,
                  tree: tuple[int, int | None] | None = None,
                  num_draft_tokens: int | None = None) -> Runner:
    """A runner of `engine.generate` (speculative) or `engine.generate_ar`; `tree` is the
    (paths, nodes) budget set before each call, so one engine serves the chain and the tree."""

    def run(ids: list[int], temperature: float, seed: int) -> Decoded:
        if tree is not None:
            engine.configure_tree(*tree)
        options: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=temperature,
                                       chat=False, seed=seed)
        if speculative:
            if num_draft_tokens is not None:
                options["num_draft_tokens"] = num_draft_tokens
            result = engine.generate([ids], **options)
        else:
            result = engine.generate_ar([ids], **options)
        stats = result.stats
        return Decoded(list(result.token_ids[0]), stats.verifications, stats.committed,
                       stats.total_s)

    return run


def hf_runner(hf: HFReference, max_new_tokens: int, lookup: int | None,
              max_ngram: int | None) -> Runner:
    """A runner of transformers' `generate`: plain, or prompt lookup with `lookup` tokens."""

    def run(ids: list[int], temperature: float, seed: int) -> Decoded:
        return hf.generate(ids, max_new_tokens, temperature=temperature, seed=seed,
                           prompt_lookup_tokens=lookup, max_matching_ngram=max_ngram)

    return run


@dataclass
class Setup:
    """The loaded models, the modes they serve, and the modes left out (with why)."""

    modes: list[Mode]
    skipped: dict[str, str]
    tokenizer: Any
    chat_template_kwargs: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    ngram: NgramConfig
    num_draft_tokens: int | None
    vocab_size: int


def build_modes(args: argparse.Namespace) -> Setup:
    """Load what the modes need and list them (the one place a mode is added)."""
    n = args.max_new_tokens
    ngram = ngram_config(args)
    engines = load_engines(args, ngram)
    main = engines["main"]
    g = (args.num_draft_tokens or [main.block_size - 1])[0] if main.draft is not None else None
    chain, tree = (1, None), (args.compare_tree_paths, args.compare_tree_nodes)
    hf = HFReference(args.target, device=main.device, dtype=main.target.dtype,
                     eos_token_ids=main.eos_token_ids,
                     pad_token_id=getattr(main.tokenizer, "pad_token_id", None))

    def spec(kind: str, budget: tuple[int, int | None] | None) -> Runner | None:
        engine = engines.get(kind)
        if engine is None or (engine.draft is None and kind != "ngram"):
            return None
        return engine_runner(engine, n, True, budget, g if engine.draft is not None else None)

    forced = ForcedAnswer()

    def engine_replay(runner: Runner) -> Callable[[list[int], list[int]], Decoded]:
        def replay(ids: list[int], answer: list[int]) -> Decoded:
            forced.set(ids, answer, main.device)
            with forced_engine_target(main.target, forced):
                return runner(ids, 0.0, args.seed)
        return replay

    def hf_replay(ids: list[int], answer: list[int]) -> Decoded:
        return hf.generate(ids, n, prompt_lookup_tokens=args.prompt_lookup_tokens,
                           max_matching_ngram=args.prompt_lookup_max_ngram,
                           logits_processor=ForcedAnswerProcessor(len(ids), answer))

    candidates: list[tuple[str, str, Runner | None]] = [
        ("HF plain", "hf", hf_runner(hf, n, None, None)),
        ("HF prompt lookup", "hf",
         hf_runner(hf, n, args.prompt_lookup_tokens, args.prompt_lookup_max_ngram)),
        ("engine plain", "engine", engine_runner(main, n, False)),
        ("DSpine chain", "engine", spec("main", chain)),
        ("DSpine tree", "engine", spec("main", tree)),
        ("n-gram", "engine", spec("ngram", None)),
        ("hybrid", "engine", spec("hybrid", chain)),  # the draft's chain + the n-gram branch
        ("hybrid tree", "engine", spec("hybrid", tree)),
        ("adaptive", "engine", spec("adaptive", tree)),  # per round: the best shape by cost
    ]
    wanted = set(selected_modes(args))
    modes, skipped = [], {}
    for name, family, runner in candidates:
        if name not in wanted:
            continue
        if runner is None:
            skipped[name] = "no --draft given"
            continue
        mode = Mode(name, family, runner, plain=name in ("HF plain", "engine plain"))
        if name in REPLAYABLE:
            mode.replay = hf_replay if family == "hf" else engine_replay(runner)
        modes.append(mode)
    return Setup(modes, skipped, main.tokenizer, dict(main.chat_template_kwargs), main.device,
                 main.target.dtype, ngram, g, main.target.config.vocab_size)


# ---------------------------------------------------------------------------------- prompts
def load_benchmarks(args: argparse.Namespace, setup: Setup) -> list[tuple[str, list[list[int]],
                                                                          dict[str, Any]]]:
    """(name, token ids per prompt, what the prompts are) of every benchmark, encoded once
    the way the engine encodes them (the draft's chat template settings)."""
    from dspine_train.engine.prompts import encode_prompts, read_prompts

    out = []
    if args.prompts:
        texts = read_prompts(args.prompts)[: args.bench_prompts]
        ids = encode_prompts(texts, setup.tokenizer, chat=not args.no_chat,
                             vocab_size=setup.vocab_size,
                             chat_template_kwargs=setup.chat_template_kwargs)
        out.append((Path(args.prompts).stem, ids, {"source": str(args.prompts)}))
    names = args.bench.split(",") if args.bench else ([] if args.prompts
                                                      else ["humaneval", "sharegpt"])
    if names:
        from data_prep.benchmarks import load_benchmark
        from dspine_train.evaluation.harness import encode_messages

        for name in (n.strip() for n in names if n.strip()):
            bench = load_benchmark(name, limit=args.bench_prompts)
            ids = encode_messages(setup.tokenizer, bench.prompts, setup.chat_template_kwargs)
            out.append((bench.name, ids, {"prompt_ids": list(bench.ids), "split": bench.split}))
    return out


# ---------------------------------------------------------------------------------- running
def run_pass(modes: list[Mode], benches: list[tuple[str, list[list[int]], dict]],
             temperature: float, rounds: int, seed: int, skipped: dict[str, str],
             log: PromptLog) -> tuple[list[Mode], dict[tuple[str, str], Totals]]:
    """Every mode on every prompt, alternating prompt by prompt, `rounds` times; the modes
    that ran and their totals. A mode that refuses to sample is left out of a sampling pass
    (named in `skipped`); at temperature 0 every mode must run. Prompts already in `log` are
    read from it; every prompt decoded here is appended to it as soon as it is done."""
    keys = [(temperature, r, bench, i) for r in range(rounds)
            for bench, prompts, _ in benches for i in range(len(prompts))]
    todo = [k for k in keys if log.get(k) is None]
    if todo:
        ready = _warm_up(modes, benches[0][1][0], temperature, seed, skipped)
    else:  # everything was decoded by an earlier run: its modes are the ones it logged
        logged = log.get(keys[0]) or {}
        ready = [m for m in modes if m.name in logged]
    totals = {(b, m.name): Totals() for b, _, _ in benches for m in ready}
    ids_of = {bench: prompts for bench, prompts, _ in benches}
    started, decoded = time.perf_counter(), 0
    for key in keys:
        _, r, bench, index = key
        results = log.get(key)
        if results is None:
            ids = ids_of[bench][index]
            # round r's seeds follow round r - 1's: every (round, prompt) draws anew
            draw = seed + r * len(ids_of[bench]) + index
            results = {m.name: m.run(ids, temperature, draw) for m in ready}
            log.append(key, results)
            decoded += 1
            spent = time.perf_counter() - started
            print(f"T={temperature:g} pass {r + 1}/{rounds} {bench} prompt {index + 1}/"
                  f"{len(ids_of[bench])}: {sum(d.seconds for d in results.values()):.1f} s "
                  f"({decoded}/{len(todo)} to decode, {spent / 60:.1f} min so far)", flush=True)
        for mode in ready:
            totals[(bench, mode.name)].add(results[mode.name], r == 0, index)
    if len(todo) < len(keys):
        print(f"T={temperature:g}: {len(keys) - len(todo)} of {len(keys)} prompt passes read "
              f"from {log.path}", flush=True)
    return ready, totals


def _warm_up(modes: list[Mode], ids: list[int], temperature: float, seed: int,
             skipped: dict[str, str]) -> list[Mode]:
    """Run each mode once on `ids` so lazy inits, allocations and captures stay out of the
    timings; the modes that can run at this temperature."""
    ready = []
    for mode in modes:
        try:
            mode.run(ids[:], temperature, seed)
        except GenerationInputError as err:
            if temperature == 0:
                raise
            skipped[f"{mode.name} (T={temperature:g})"] = str(err)
            continue
        ready.append(mode)
    return ready


def make_rows(totals: dict[tuple[str, str], Totals], modes: list[Mode],
              benches: list[tuple[str, list[list[int]], dict]], temperature: float,
              rounds: int) -> list[CompareRow]:
    """The rows of one pass; greedy rows get speed-ups and the lossless check."""
    greedy = temperature == 0
    plain_of = {m.family: m.name for m in modes if m.plain}
    rows = []
    for bench, prompts, _ in benches:
        hf_plain = totals.get((bench, "HF plain"))
        for mode in modes:
            t = totals[(bench, mode.name)]
            row = CompareRow(
                bench=bench, mode=mode.name, family=mode.family, temperature=temperature,
                num_prompts=len(prompts), rounds=rounds, new_tokens=t.new_tokens,
                verifications=t.verifications, verified_tokens=t.verified_tokens,
                tau=t.verified_tokens / t.verifications if t.verifications else 0.0,
                seconds=t.seconds, tokens_per_s=t.new_tokens / t.seconds if t.seconds else 0.0,
                tau_se=t.tau_se())
            plain = totals.get((bench, plain_of.get(mode.family, "")))
            if greedy and plain is not None:
                row.speedup = _ratio(row.tokens_per_s, plain.new_tokens, plain.seconds)
                row.lossless = t.outputs == plain.outputs
                row.first_difference = first_difference(t.outputs, plain.outputs)
            if greedy and hf_plain is not None:
                row.speedup_vs_hf_plain = _ratio(row.tokens_per_s, hf_plain.new_tokens,
                                                 hf_plain.seconds)
                row.same_as_hf_plain = t.outputs == hf_plain.outputs
            rows.append(row)
    return rows


def _ratio(tokens_per_s: float, base_tokens: int, base_seconds: float) -> float | None:
    base = base_tokens / base_seconds if base_seconds else 0.0
    return tokens_per_s / base if base else None


def compare_table(rows: list[CompareRow]) -> str:
    """The rows as a markdown table (sampling rows: tau only)."""
    def num(value: float | None, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    cells = []
    for r in rows:
        greedy = r.temperature == 0
        lossless = "-" if r.lossless is None else ("yes" if r.lossless else "**no**")
        cells.append([r.bench, r.mode, f"{r.temperature:g}", f"{r.tau:.2f}", num(r.tau_se),
                      num(r.tokens_per_s if greedy else None, ".1f"), num(r.speedup),
                      num(r.speedup_vs_hf_plain), lossless])
    header = ["benchmark", "mode", "T", "tau", "SE", "tok/s", "x plain", "x HF plain",
              "lossless"]
    return "\n".join(markdown_table(header, cells, align="llrrrrrrl"))


def run_compare(args: argparse.Namespace) -> int:
    """The whole `--compare` run: prints the table, writes `--output`; the exit status."""
    setup = build_modes(args)
    benches = load_benchmarks(args, setup)
    for name, why in setup.skipped.items():
        print(f"mode {name!r} left out: {why}")
    log = PromptLog(log_path(args), {
        "target": args.target, "draft": args.draft, "dtype": str(setup.dtype),
        "device": str(setup.device), "torch_threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens, "num_draft_tokens": setup.num_draft_tokens,
        "tree": [args.compare_tree_paths, args.compare_tree_nodes],
        "prompt_lookup": [args.prompt_lookup_tokens, args.prompt_lookup_max_ngram],
        "ngram": asdict(setup.ngram), "seed": args.seed, "modes": [m.name for m in setup.modes],
        "benchmarks": {name: len(ids) for name, ids, _ in benches}})
    print(f"per-prompt log: {log.path} ({len(log.done)} prompt passes already there)")
    ran, totals = run_pass(setup.modes, benches, 0.0, args.rounds, args.seed, setup.skipped, log)
    rows = make_rows(totals, ran, benches, 0.0, args.rounds)
    if args.compare_temperature > 0:
        sampled = [m for m in setup.modes if not m.plain]
        ran, totals = run_pass(sampled, benches, args.compare_temperature,
                               args.sampling_rounds, args.seed, setup.skipped, log)
        rows += make_rows(totals, ran, benches, args.compare_temperature, args.sampling_rounds)
    table = compare_table(rows)
    print("\n" + table + "\n")
    replay = None
    if args.replay_sampled and args.compare_temperature > 0:
        replay = run_replay(setup, benches, log, args.compare_temperature, args.replay_sampled)
    report = {
        "target": args.target, "draft": args.draft, "device": str(setup.device),
        "dtype": str(setup.dtype), "host": platform.node(),
        "torch_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds, "num_draft_tokens": setup.num_draft_tokens,
        "tree": {"paths": args.compare_tree_paths, "nodes": args.compare_tree_nodes},
        "prompt_lookup": {"num_tokens": args.prompt_lookup_tokens,
                          "max_matching_ngram_size": args.prompt_lookup_max_ngram},
        "ngram": asdict(setup.ngram),
        "benchmarks": {name: {"num_prompts": len(ids), **about} for name, ids, about in benches},
        "skipped_modes": setup.skipped,
        "rows": [asdict(r) for r in rows],
        "table": table,
        "replay": replay,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


def run_replay(setup: Setup, benches: list[tuple[str, list[list[int]], dict]], log: PromptLog,
               temperature: float, wanted: str = "all") -> dict[str, Any]:
    """`--replay-sampled`: every logged answer at `temperature` through every replayable mode
    (`forced_replay`); prints the table, returns the report's part."""
    replayers = {m.name: m.replay for m in setup.modes if m.replay is not None}
    names = [b for b, _, _ in benches]
    if wanted != "all":
        chosen = [b.strip() for b in wanted.split(",") if b.strip()]
        unknown = sorted(set(chosen) - set(names))
        if unknown:
            raise BenchmarkError(f"--replay-sampled: unknown benchmark(s) {unknown}; this run "
                                 f"has {', '.join(names)}")
        names = [b for b in names if b in chosen]
    # benchmark by benchmark, so a run stopped part way has whole benchmarks replayed
    answers = sorted((a for a in logged_answers(log.done, temperature) if a.bench in names),
                     key=lambda a: (names.index(a.bench), a.prompt, a.round))
    replay_log = ReplayLog(log.path.with_name(log.path.stem + ".replay.jsonl"))
    print(f"replay: {len(answers)} sampled answers x {len(replayers)} modes "
          f"({len(replay_log.done)} replays already in {replay_log.path})", flush=True)
    totals = replay_answers(replayers, {b: ids for b, ids, _ in benches}, answers, replay_log)
    reference = "HF prompt lookup" if "HF prompt lookup" in replayers else None
    rows = replay_rows(totals, names, list(replayers), reference)
    table = replay_table(rows)
    print(f"\nT={temperature:g}, every mode replayed on the same {len(answers)} answers:\n\n"
          f"{table}\n")
    return {"temperature": temperature, "answers": len(answers), "log": str(replay_log.path),
            "rows": [asdict(r) for r in rows], "table": table}
