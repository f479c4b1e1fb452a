"""Evaluation harness: engine-measured acceptance of exported drafts on offline benchmarks.

    from data_prep.benchmarks import load_benchmark
    from dspine_train.evaluation.harness import evaluate, results_markdown, plot_results, save_results
    benches = [load_benchmark(name, limit=8) for name in ("humaneval", "sharegpt")]
    results = {"dspine": evaluate(target_dir, draft_dir, benches, [0.0, 1.0])}
    print(results_markdown(results))

Every number comes from the inference engine running real speculative decoding (never from a
training-time simulation): tau and per-position acceptance from its verifications, tokens/s of
speculative decoding against plain decoding of the same target on the same prompts, and, at
temperature 0, whether both produced the same tokens for every prompt (lossless).

The harness measures `Benchmark`s (`dspine_train.benchmark_prompts`: prompts, their ids and the
split record) that the caller loads; `data_prep.benchmarks.load_benchmark` reads the builtin
held-out sets (``humaneval``, ``sharegpt``: the data pipeline's own held-out split, so a draft
trained on those recipes has never seen a benchmark prompt) and local JSONL prompt files. Like the
engine it sits beside, this module imports nothing from `data_prep`, from training or from a CLI
module (a test checks it); every result records the split settings and the ids of the prompts it
used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from dspine_train.benchmark_prompts import Benchmark, BenchmarkError, Messages
from dspine_train.checkpoint_io import write_atomic, write_text_atomic
from dspine_train.engine.stats import GenerationStats, sum_stats
from dspine_train.markdown_table import markdown_table

if TYPE_CHECKING:  # annotations only; `build_engine` imports it where it builds one
    from dspine_train.engine import Engine

RESULTS_FORMAT = "dspine-eval-results/1"

# ---------------------------------------------------------------------------------- results
@dataclass
class BenchResult:
    """Engine-measured acceptance and speed of one draft on one benchmark at one temperature.

    tau: tokens committed per target verification (accepted drafts + bonus), in [1, block];
    per_position: share of verifications accepting draft token k (k = 1..g), so
    ``tau = 1 + sum(per_position)``; tokens_per_s_*: new tokens per second of wall time
    (prefill included), speculative and plain decoding; speedup: their ratio; lossless: at
    temperature 0, whether speculative and plain decoding gave the same tokens for every prompt
    (None when not checked: sampling, or no plain run); *_ms_per_step: mean draft and target
    forward time per speculative round. The fields after ``verify_ms_per_step`` record what
    was measured: g, the block size, the prompts with their split, and the token-tree budget
    (``tree_paths`` lattice paths in ``tree_nodes`` nodes per round; 1 and 0 for the chain).
    """

    bench: str
    temperature: float
    num_prompts: int
    new_tokens: int
    tau: float
    per_position: list[float]
    tokens_per_s_spec: float
    tokens_per_s_ar: float | None
    speedup: float | None
    lossless: bool | None
    draft_ms_per_step: float
    verify_ms_per_step: float
    num_draft_tokens: int = 0
    block_size: int = 0
    batch_size: int = 1
    max_new_tokens: int = 0
    prompt_ids: list[str] = field(default_factory=list)
    split: dict[str, Any] = field(default_factory=dict)
    tree_paths: int = 1
    tree_nodes: int = 0


def encode_messages(tokenizer: Any, prompts: Sequence[Messages],
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Token ids of chat prompts, through the chat template (as the engine encodes a prompt),
    rendered with `chat_template_kwargs` (the engine's: those of the draft's training rows)."""
    if tokenizer is None:
        raise BenchmarkError("the target has no tokenizer; the benchmarks are chat prompts")
    if not getattr(tokenizer, "chat_template", None):
        source = getattr(tokenizer, "name_or_path", None) or "the target"
        raise BenchmarkError(f"{source}: the target's tokenizer has no chat template (a base "
                             "model?); the benchmarks are chat prompts: evaluate a chat model, "
                             "or add a chat_template to its tokenizer_config.json")
    encoded = []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
        encoded.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return encoded


def _run(engine: Engine, ids: list[list[int]], batch_size: int, speculative: bool, desc: str,
         **kwargs: Any) -> tuple[list[list[int]], GenerationStats]:
    """Generate for every prompt in batches; the new tokens per prompt and the summed stats."""
    method = engine.generate if speculative else engine.generate_ar
    tokens, parts = [], []
    for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch", leave=False):
        result = method(ids[start:start + batch_size], chat=False, **kwargs)
        tokens.extend(result.token_ids)
        parts.append(result.stats)
    return tokens, sum_stats(parts)


def evaluate(target: str | Path, draft: str | Path, benches: Sequence[Benchmark],
             temperatures: list[float], *, max_new_tokens: int = 64,
             num_draft_tokens: int | None = None, measure_ar: bool = True, seed: int = 0,
             engine: Engine | None = None, batch_size: int = 1, device: str | None = None,
             ar_cache: dict[tuple, tuple[list[list[int]], GenerationStats]] | None = None,
             tree_paths: int = 1, tree_nodes: int | None = None,
             ) -> list[BenchResult]:
    """Run speculative (and plain) decoding of ``draft`` on each benchmark and temperature.

    ``benches``: loaded benchmarks (`data_prep.benchmarks.load_benchmark`); ``seed`` seeds the
    sampling. ``engine``: a ready `Engine` holding the draft to measure (then ``target``/``draft`` are
    only recorded); otherwise one is built on ``device`` (CUDA when available). Prompts run
    ``batch_size`` at a time (1 = single-sequence latency, where speculative decoding pays
    off); ``num_draft_tokens`` is g, the drafts verified per round (None: block size - 1).
    A short warm-up call of each mode runs before anything is timed. ``ar_cache``: a dict
    shared between calls on the same target and machine; plain decoding of a (benchmark,
    temperature, settings) already in it is reused instead of run again (it does not depend
    on the draft). ``tree_paths`` M > 1 verifies a token tree of the top-M lattice paths in at
    most ``tree_nodes`` nodes per round (`Engine.configure_tree`; default M x g) instead of the
    chain; the engine is left set to that budget.
    """
    if not benches or not temperatures:
        raise BenchmarkError("give at least one benchmark and one temperature")
    if any(t < 0 or not math.isfinite(t) for t in temperatures):
        raise BenchmarkError(f"temperatures must be finite and >= 0, got {temperatures}")
    if max_new_tokens < 1 or batch_size < 1:
        raise BenchmarkError("max_new_tokens and batch_size must be >= 1")
    loaded = list(benches)
    if not all(isinstance(bench, Benchmark) for bench in loaded):
        raise BenchmarkError("benches: give loaded `Benchmark`s "
                             "(data_prep.benchmarks.load_benchmark), not names")
    if engine is None:
        engine = build_engine(target, draft, loaded, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, device=device,
                              tree_paths=tree_paths, tree_nodes=tree_nodes)
    if engine.draft is None:
        raise BenchmarkError("the engine has no draft to evaluate")
    g = engine.num_predictions if num_draft_tokens is None else int(num_draft_tokens)
    try:
        engine.configure_tree(tree_paths, tree_nodes)
    except ValueError as err:  # GenerationInputError: a bad budget, named
        raise BenchmarkError(f"tree budget: {err}") from err
    kwargs = getattr(engine, "chat_template_kwargs", None)
    encoded = [encode_messages(engine.tokenizer, bench.prompts, kwargs) for bench in loaded]

    warm = encoded[0][:1]  # one-time allocations and lazy inits stay out of the timings
    engine.generate(warm, max_new_tokens=4, chat=False, num_draft_tokens=g)
    if measure_ar and not ar_cache:  # a filled cache means the target ran warm before
        engine.generate_ar(warm, max_new_tokens=4, chat=False)

    results = []
    for bench, ids in zip(loaded, encoded):
        for temperature in temperatures:
            common = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
            label = f"{bench.name} T={temperature:g}"
            spec_tokens, spec = _run(engine, ids, batch_size, True, f"{label} spec g={g}",
                                     num_draft_tokens=g, **common)
            ar_speed = speedup = lossless = None
            if measure_ar:
                key = (bench.name, tuple(bench.ids), float(temperature), max_new_tokens, seed,
                       batch_size)
                cached = ar_cache.get(key) if ar_cache is not None else None
                if cached is None:
                    cached = _run(engine, ids, batch_size, False, f"{label} AR", **common)
                    if ar_cache is not None:
                        ar_cache[key] = cached
                ar_tokens, ar = cached
                ar_speed = ar.tokens_per_s
                speedup = spec.tokens_per_s / ar_speed if ar_speed else None
                # Sampling draws differ between the two modes; only greedy output must match.
                lossless = spec_tokens == ar_tokens if temperature == 0 else None
            results.append(BenchResult(
                bench=bench.name, temperature=float(temperature), num_prompts=len(ids),
                new_tokens=spec.new_tokens, tau=spec.tau,
                per_position=spec.per_position_acceptance, tokens_per_s_spec=spec.tokens_per_s,
                tokens_per_s_ar=ar_speed, speedup=speedup, lossless=lossless,
                draft_ms_per_step=spec.draft_ms_per_step,
                verify_ms_per_step=spec.verify_ms_per_step, num_draft_tokens=g,
                block_size=engine.block_size, batch_size=batch_size,
                max_new_tokens=max_new_tokens, prompt_ids=list(bench.ids), split=bench.split,
                tree_paths=spec.tree_paths, tree_nodes=spec.tree_nodes))
    return results



def build_engine(target: str | Path, draft: str | Path, benches: Sequence[Benchmark], *,
                 max_new_tokens: int, batch_size: int = 1, device: str | None = None,
                 tree_paths: int = 1, tree_nodes: int | None = None,
                 dtype: torch.dtype | None = None, ngram_tokens: int = 0) -> Engine:
    """An `Engine` for ``target`` + ``draft`` with caches just long enough for ``benches``
    (and for a verified round of a token tree of that budget, where it is wider than a block:
    ``tree_nodes``, by default ``tree_paths`` x (block - 1); plus ``ngram_tokens`` where hybrid
    rounds add an n-gram branch, `Engine.configure_ngram`), the target in ``dtype`` (None:
    the engine's default, the checkpoint's on CUDA and float32 on a CPU)."""
    from transformers import AutoTokenizer

    from dspine_train.engine import Engine
    from dspine_train.target_config import read_target_config

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target))
    except (OSError, ValueError) as err:
        raise BenchmarkError(f"{target}: cannot load the target's tokenizer ({err})") from err
    draft_config = json.loads((Path(draft) / "config.json").read_text()) \
        if (Path(draft) / "config.json").is_file() else {}
    kwargs = draft_config.get("chat_template_kwargs")
    longest = max(len(ids) for bench in benches
                  for ids in encode_messages(tokenizer, bench.prompts, kwargs))
    block = draft_config.get("block_size")
    block = block if isinstance(block, int) else 16  # a bad one is the engine's to name
    width = (block - 1) if tree_paths <= 1 else (tree_nodes or tree_paths * (block - 1))
    needed = longest + max_new_tokens + max(block, width + ngram_tokens) + 1
    try:
        config = read_target_config(target)
    except (OSError, ValueError) as err:
        raise BenchmarkError(str(err)) from err
    positions = getattr(getattr(config, "text_config", None) or config,
                        "max_position_embeddings", None)
    # Never beyond the target's positions: a request that needs more is refused at generate,
    # naming the prompt, max_new_tokens and that bound.
    return Engine.from_pretrained(target, draft, device=device, dtype=dtype, tokenizer=tokenizer,
                                  max_batch_size=batch_size,
                                  max_seq_len=min(needed, positions or needed))


# ---------------------------------------------------------------------------------- reports
def _columns(results: dict[str, list[BenchResult]]) -> list[tuple[str, float]]:
    """(bench, temperature) pairs in first-seen order across all variants."""
    seen: dict[tuple[str, float], None] = {}
    for rows in results.values():
        for r in rows:
            seen.setdefault((r.bench, r.temperature), None)
    return list(seen)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _lossless(value: bool | None) -> str:
    return {True: "yes", False: "**NO**", None: "n/a"}[value]


def results_markdown(results: dict[str, list[BenchResult]]) -> str:
    """Markdown tables: tau per variant x (benchmark, temperature), speed, per-position rates."""
    columns = _columns(results)
    tau_rows = []
    for name, rows in results.items():
        by_key = {(r.bench, r.temperature): r.tau for r in rows}
        taus = [by_key.get(key) for key in columns]
        present = [t for t in taus if t is not None]
        mean = sum(present) / len(present) if present else None
        tau_rows.append([name, *(_fmt(t) for t in taus), _fmt(mean)])
    lines = ["#### Acceptance length tau (engine-measured)", "",
             *markdown_table(["variant", *(f"{b} T={t:g}" for b, t in columns), "mean"],
                             tau_rows, align="l" + "r" * (len(columns) + 1))]

    speed_rows = [
        [name, r.bench, f"{r.temperature:g}", r.num_draft_tokens,
         "chain" if r.tree_paths <= 1 else f"{r.tree_paths}/{r.tree_nodes}", r.num_prompts,
         r.new_tokens, f"{r.tau:.2f}", f"{r.tokens_per_s_spec:.1f}",
         _fmt(r.tokens_per_s_ar, ".1f"), "-" if r.speedup is None else f"{r.speedup:.2f}x",
         f"{r.draft_ms_per_step:.1f}", f"{r.verify_ms_per_step:.1f}", _lossless(r.lossless)]
        for name, rows in results.items() for r in rows]
    lines += ["", "#### Speed: speculative vs plain decoding of the same target", "",
              *markdown_table(["variant", "bench", "T", "g", "tree M/N", "prompts", "new tokens",
                               "tau", "tok/s spec", "tok/s AR", "speedup", "draft ms/step",
                               "verify ms/step", "lossless"], speed_rows,
                              align="llrrrrrrrrrrrl")]

    width = max((len(r.per_position) for rows in results.values() for r in rows), default=0)
    position_rows = [
        [name, r.bench, f"{r.temperature:g}", *(f"{p:.2f}" for p in r.per_position),
         *["-"] * (width - len(r.per_position))]
        for name, rows in results.items() for r in rows]
    lines += ["", "#### Per-position acceptance (share of rounds accepting draft token k)", "",
              *markdown_table(["variant", "bench", "T", *range(1, width + 1)], position_rows,
                              align="llr" + "r" * width)]
    return "\n".join(lines) + "\n"


def plot_results(results: dict[str, list[BenchResult]], path: str | Path) -> None:
    """PNG: tau bars per (benchmark, temperature) for each variant, and per-position acceptance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = _columns(results)
    names = list(results)
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(columns) + 5), 4.2))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        by_key = {(r.bench, r.temperature): r.tau for r in results[name]}
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(columns))]
        heights = [by_key.get(key, 0.0) for key in columns]
        drawn = bars.bar(xs, heights, width, label=name)
        bars.bar_label(drawn, fmt="%.2f", fontsize=7)
    bars.set_xticks(range(len(columns)), [f"{b}\nT={t:g}" for b, t in columns], fontsize=8)
    bars.set_ylabel("acceptance length tau")
    bars.set_title("tau (engine-measured)")
    bars.axhline(1.0, color="grey", linewidth=0.8)
    bars.legend(fontsize=7)

    coldest = min((t for _, t in columns), default=0.0)
    for name in names:
        for r in results[name]:
            if r.temperature == coldest and r.per_position:
                curves.plot(range(1, len(r.per_position) + 1), r.per_position, marker="o",
                            label=f"{name} / {r.bench}")
    curves.set_xlabel("draft position k")
    curves.set_ylabel("share of rounds accepting token k")
    curves.set_ylim(0.0, 1.0)
    curves.set_title(f"per-position acceptance, T={coldest:g}")
    curves.legend(fontsize=7)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def save_results(results: dict[str, list[BenchResult]], path: str | Path, *,
                 metadata: dict[str, Any] | None = None) -> None:
    """JSON ``{"format", "metadata", "results": {variant: [BenchResult fields]}}``."""
    payload = {"format": RESULTS_FORMAT, "metadata": metadata or {},
               "results": {name: [asdict(r) for r in rows] for name, rows in results.items()}}
    text = json.dumps(payload, indent=1, default=str) + "\n"
    write_text_atomic(path, text)


def load_results(path: str | Path) -> dict[str, list[BenchResult]]:
    """Read what `save_results` wrote (unknown extra fields of newer files are ignored)."""
    payload = json.loads(Path(path).read_text())
    if payload.get("format") != RESULTS_FORMAT:
        raise BenchmarkError(f"{path}: not a {RESULTS_FORMAT} results file")
    known = {f.name for f in fields(BenchResult)}
    return {name: [BenchResult(**{k: v for k, v in row.items() if k in known}) for row in rows]
            for name, rows in payload["results"].items()}
