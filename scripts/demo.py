"""The whole DSpine pipeline on the embedded Qwen2.5-Coder-0.5B target, on a CPU (`make demo`).

    python scripts/demo.py                        # every stage; finished stages are skipped
    python scripts/demo.py --stages evaluate --force evaluate --num-draft-tokens 7,3,1
    python scripts/demo.py --num-prompts 256 --steps 300 --threads 1

Stages, in order (each writes `<out>/stages/<stage>.json` when done and is skipped next time
unless its settings, an earlier stage, or `--force` changed):

    target       assemble the embedded target from the demo packages (cached; --target skips it)
    prompts      single-turn training prompts: the train parts of HumanEval and ShareGPT (the
                 held-out parts of the same data recipes are the benchmarks; split.json records it)
    regenerate   the target answers every prompt, greedy (resumable)
    tokenize     chat template + loss masks, with a train/eval split
    token_table  PCA-whitened token codes of the target's lm_head
    features     the target's context features of every row, cached once (the costly forward)
    train        `train.py recipe=qwen2.5_coder_0.5b` on the cached features (DeepSpeed)
    export       check the exported draft loads and copy it to <out>/draft
    evaluate     the engine on held-out prompts: tau, per-position acceptance, tokens/s
                 speculative vs plain decoding and the lossless check at temperature 0, tau
                 and per-position acceptance when sampling (the evaluation harness)

Everything lands under `--out` (default artifacts/demo, git-ignored); the final table is also
written to <out>/demo_report.md. A stage that fails prints why and the demo exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

from dspine_train.markdown_table import markdown_table  # noqa: E402
from scripts.tools.child_runs import offline_env, run_logged  # noqa: E402

STAGES = ("target", "prompts", "regenerate", "tokenize", "token_table", "features", "train",
          "export", "evaluate")


class DemoError(RuntimeError):
    """A stage cannot run or failed; the message says which and why."""


# ---------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    run = p.add_argument_group("what to run")
    run.add_argument("--out", type=Path, default=REPO / "artifacts" / "demo",
                     help="directory of every demo artifact (default: artifacts/demo)")
    run.add_argument("--stages", default="all",
                     help=f"comma-separated stages to run, or all ({', '.join(STAGES)})")
    run.add_argument("--force", default="",
                     help="comma-separated stages to redo even if done (or all); later stages "
                          "follow because their input changed")
    run.add_argument("--threads", type=int, default=None,
                     help="torch threads (default: all cores; 1 is faster on a busy machine)")
    data = p.add_argument_group("data")
    data.add_argument("--target", type=Path, default=None,
                      help="use this target directory instead of assembling the embedded one")
    data.add_argument("--num-prompts", type=int, default=320,
                      help="training prompts: up to half HumanEval (its train part holds 122 "
                           "within the default --max-prompt-chars), the rest ShareGPT")
    data.add_argument("--prompts", type=Path, action="append", default=[],
                      help="train on these conversation files instead (JSONL/JSON rows with "
                           "messages or conversations, as data_prep reads them; repeatable)")
    data.add_argument("--max-prompt-chars", type=int, default=1500,
                      help="leave out longer prompts (CPU time grows with length)")
    data.add_argument("--max-new-tokens", type=int, default=128,
                      help="tokens the target generates per answer (greedy)")
    data.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                      help="the target's dtype when its features are cached, and the draft's "
                           "training precision (bf16 or fp32). auto: bfloat16 on CUDA or a CPU "
                           "with native bf16 (AVX512-BF16, AMX, Arm BF16), else float32. The "
                           "target answers the prompts in the dtype the engine evaluates in "
                           "(float32 on a CPU, bfloat16 on CUDA), so that its answers are the "
                           "engine's own greedy ones")
    data.add_argument("--regen-batch-size", type=int, default=16,
                      help="answers generated together (16 measured fastest on 2 cores)")
    data.add_argument("--eval-fraction", type=float, default=0.1,
                      help="share of rows in the trainer's eval split (simulated tau)")
    train = p.add_argument_group("draft training")
    train.add_argument("--recipe", default="qwen2.5_coder_0.5b", help="train.py recipe")
    train.add_argument("--steps", type=int, default=450,
                       help="optimizer steps (the default: ~3 epochs of the default prompts)")
    train.add_argument("--draft-layers", type=int, default=None,
                       help="draft layers (default: the recipe's, for the demo recipe "
                            "recipes/model/qwen2.5_coder_0.5b.yaml's)")
    train.add_argument("--block-size", type=int, default=None,
                       help="block size B (default: the recipe's)")
    train.add_argument("--num-anchors", type=int, default=16, help="blocks per sequence")
    train.add_argument("--draft-vocab-size", type=int, default=32768, metavar="N",
                       help="prune the draft's vocabulary to the N most frequent tokens of the "
                            "training data (verification still uses the target's whole "
                            "vocabulary: lossless); 0 keeps the whole vocabulary. The default "
                            "halves the demo's step for -0.002 tau in the training study "
                            "(docs/results/study_qwen2.5-coder-0.5b/findings.md)")
    train.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                       help="extra Hydra override for train.py and the feature cache")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--bench", default="humaneval,sharegpt",
                    help="benchmarks: humaneval, sharegpt (held-out parts) or JSONL paths")
    ev.add_argument("--eval-prompts", type=int, default=4, help="prompts per benchmark")
    ev.add_argument("--eval-max-new-tokens", type=int, default=48)
    ev.add_argument("--temperatures", default="0,1")
    ev.add_argument("--num-draft-tokens", default="full",
                    help="values of g (drafts verified per round) to compare, full = block - 1; "
                         "the first runs at every temperature, the others at the first only")
    ev.add_argument("--parity-rows", type=int, default=10,
                    help="rows of the eval split for the parity check (engine vs the trainer's "
                         "simulated evaluation on the same blocks, whole responses); 0 skips it")
    return p


def parse_list(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated stage list; `all` means every stage."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if items == ["all"]:
        return list(known)
    unknown = [s for s in items if s not in known]
    if unknown:
        raise DemoError(f"{flag}: unknown stage(s) {unknown}; stages are {', '.join(known)}")
    return items


# ---------------------------------------------------------------------------------- stage records
@dataclass
class StageRecord:
    """A finished stage, as `stages/<stage>.json` holds it."""

    stage: str
    fingerprint: str  # hash of the stage's settings and its upstream runs (`fingerprint`)
    run_id: str  # what a downstream stage's fingerprint reads
    seconds: float
    finished_at: str
    summary: dict[str, Any]  # the stage's own figures (JSON, a shape per stage)


@dataclass
class Demo:
    """Paths and settings shared by the stages."""

    args: argparse.Namespace
    out: Path
    target: Path

    @property
    def stages_dir(self) -> Path:
        """Where the stage records live."""
        return self.out / "stages"

    def path(self, *parts: str) -> Path:
        """A path under the demo's output directory."""
        return self.out.joinpath(*parts)

    def marker(self, stage: str) -> StageRecord | None:
        """The record of a finished stage, or None (also for a record this demo cannot read)."""
        try:
            return StageRecord(**json.loads((self.stages_dir / f"{stage}.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None


def fingerprint(settings: dict[str, Any], upstream: list[StageRecord]) -> str:
    """Hash of a stage's settings and the runs of the stages it reads."""
    payload = json.dumps({"settings": settings, "upstream": [m.run_id for m in upstream]},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def write_json(path: Path, data: Any) -> None:
    """Write JSON through a temporary file, so a record is never half-written."""
    from dspine_train.checkpoint_io import write_json_atomic

    write_json_atomic(path, data, default=str)


# ---------------------------------------------------------------------------------- stages
def stage_target(demo: Demo) -> dict[str, Any]:
    """Assemble (or check) the target; the run id is the target's identity, not a fresh id."""
    if demo.args.target is not None:
        if not (demo.target / "config.json").is_file():
            raise DemoError(f"--target {demo.target}: no config.json (not a model directory)")
        identity = (demo.target / "config.json").read_text()
        identity += str(sorted((p.name, p.stat().st_size)
                               for p in demo.target.glob("*.safetensors")))
        return {"target": str(demo.target),
                "run_id": hashlib.sha256(identity.encode()).hexdigest()[:16]}
    from data_prep.default_target import AssemblyError, assemble_default_target, read_assembly

    try:
        path = assemble_default_target(demo.target)
    except AssemblyError as err:
        raise DemoError(str(err)) from err
    record = read_assembly(path) or {}
    identity = ":".join(str(record.get(k)) for k in ("gguf_sha256", "dtype", "conversion_version"))
    return {"target": str(path), "assembly": record,
            "run_id": hashlib.sha256(identity.encode()).hexdigest()[:16]}


def stage_prompts(demo: Demo) -> dict[str, Any]:
    """Training prompts: train parts of HumanEval + ShareGPT (or the --prompts files)."""
    from data_prep.benchmarks import builtin_source, prompt_chars, prompt_messages
    from data_prep.config import SourceConfig, SourcePart
    from data_prep.sources import load_source, stable_subset

    args = demo.args
    chosen: list[dict[str, Any]] = []
    split: dict[str, Any] = {}

    def take(name: str, config: SourceConfig, count: int) -> None:
        rows = load_source(config).rows
        rows = [{"id": r["id"], "messages": prompt_messages(r)} for r in rows]
        rows = [r for r in rows if prompt_chars(r["messages"]) <= args.max_prompt_chars]
        picked = stable_subset(rows, count, config.seed)  # type: ignore[arg-type]
        chosen.extend(picked)
        split[name] = {"part": str(config.part), "heldout_fraction": config.heldout_fraction,
                       "split_seed": config.seed, "split_salt": "heldout",
                       "eligible": len(rows), "used": len(picked),
                       "train_ids": [r["id"] for r in picked]}

    if args.prompts:
        take("files", SourceConfig(paths=[str(p) for p in args.prompts], part=SourcePart.all),
             args.num_prompts)
    else:
        humaneval = builtin_source("humaneval", SourcePart.train)
        take("humaneval", humaneval, args.num_prompts // 2)
        take("sharegpt", builtin_source("sharegpt", SourcePart.train),
             args.num_prompts - len(chosen))
        for name in ("humaneval", "sharegpt"):
            heldout = load_source(builtin_source(name, SourcePart.heldout)).rows
            split[name]["heldout_ids"] = [r["id"] for r in heldout]
    if not chosen:
        raise DemoError("no training prompt left after the length filter "
                        f"(--max-prompt-chars {args.max_prompt_chars})")
    path = demo.path("data", "prompts.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in chosen))
    write_json(demo.path("data", "split.json"), split)
    return {"prompts": len(chosen), "by_source": {k: v["used"] for k, v in split.items()}}


def stage_regenerate(demo: Demo) -> dict[str, Any]:
    """The target answers each prompt greedily (so the trainer's simulated tau is exact), in
    the dtype the engine evaluates in (so the answers are the engine's greedy ones)."""
    from data_prep.regenerate import greedy_local_job, run_regeneration, summary_line

    args = demo.args
    data = greedy_local_job(
        demo.path("data", "prompts.jsonl"), demo.target, demo.path("data", "regenerated"),
        max_new_tokens=args.max_new_tokens, batch_size=args.regen_batch_size,
        dtype=args.serve_dtype)
    report = run_regeneration(data)
    print(summary_line(report))
    if report["done"] == 0:
        raise DemoError(f"regeneration produced no row; see {data.regenerate.output_dir}")
    return {**{k: report[k] for k in ("input", "done", "failed", "skipped",
                                      "completion_tokens")}, "dtype": args.serve_dtype}


def stage_tokenize(demo: Demo) -> dict[str, Any]:
    """Chat template + loss masks -> train/eval token datasets."""
    from transformers import AutoTokenizer

    from data_prep.shards import shard_paths
    from data_prep.tokenize import tokenize_files

    tokenizer = AutoTokenizer.from_pretrained(str(demo.target))
    report = tokenize_files(shard_paths(demo.path("data", "regenerated")), tokenizer,
                            demo.path("data", "tokenized"), max_length=1024,
                            eval_fraction=demo.args.eval_fraction, seed=0)
    if report["eval_rows"] == 0:
        raise DemoError("the eval split is empty; raise --eval-fraction or --num-prompts")
    return {k: report[k] for k in ("kept", "dropped", "train_rows", "eval_rows", "tokens",
                                   "supervised_tokens")}


def stage_token_table(demo: Demo) -> dict[str, Any]:
    """The token codes of the target's lm_head at the draft's transfer_dim (the recipe's, or
    DSpineConfig's default capped at the target's width when the recipe leaves it unset, as a
    preset such as `specforge_published` does)."""
    from dspine_train.token_table import TokenTableConfig, build_from_config
    from dspine_train.training.memory_plan.for_recipe import plan_draft_config

    transfer_dim = plan_draft_config(train_config(demo)).transfer_dim
    table = build_from_config(TokenTableConfig(target=str(demo.target),
                                               out=str(demo.path("token_table.safetensors")),
                                               transfer_dim=transfer_dim), progress=True)
    return {"transfer_dim": table.transfer_dim,
            "explained_variance": table.metadata["explained_variance_ratio"]}


def stage_features(demo: Demo) -> dict[str, Any]:
    """The target's context features of every row, once
    (`python -m dspine_train.training.cache_features`)."""
    shutil.rmtree(demo.path("features"), ignore_errors=True)
    run_logged([sys.executable, "-m", "dspine_train.training.cache_features",
                *train_overrides(demo)],
               demo.path("logs", "features.log"), "caching the target features",
               env=offline_env(demo.args.threads), error=DemoError)
    return {"bytes": sum(p.stat().st_size for p in demo.path("features").rglob("*") if p.is_file())}


def stage_train(demo: Demo, resume: bool) -> dict[str, Any]:
    """`python train.py` on the cached features; resumes an interrupted run of the same stage."""
    overrides = train_overrides(demo)
    if resume:
        overrides.append("checkpoint.resume_from=latest")
    run_logged([sys.executable, "train.py", *overrides], demo.path("logs", "train.log"),
               "training the draft", env=offline_env(demo.args.threads), error=DemoError)
    info = json.loads(demo.path("train", "final", "training_info.json").read_text())
    return {"simulated_tau": info.get("tau"),
            "simulated_per_position": info.get("acceptance_by_position"), "steps": info["step"]}


def stage_export(demo: Demo) -> dict[str, Any]:
    """Check the trainer's export loads as a draft for this target; publish it as <out>/draft."""
    from dspine_train.checkpoint_io import build_dir, clean_dead_builds, replace_dir
    from dspine_train.engine.validation import check_draft_files
    from dspine_train.modeling import DSpineDraftModel

    final = demo.path("train", "final")
    check_draft_files(final)
    draft = DSpineDraftModel.from_pretrained(str(final))
    clean_dead_builds(demo.path("draft"))
    tmp = build_dir(demo.path("draft"))
    try:
        shutil.copytree(final, tmp, dirs_exist_ok=True)
        replace_dir(tmp, demo.path("draft"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    params = sum(p.numel() for p in draft.parameters())
    return {"draft": str(demo.path("draft")), "parameters": params,
            "layers": draft.config.num_layers, "block_size": draft.config.block_size}


def stage_evaluate(demo: Demo) -> dict[str, Any]:
    """The harness on held-out prompts for each g; writes results.{json,md}, acceptance.png."""
    import torch

    from data_prep.benchmarks import load_benchmark
    from dspine_train.engine.ngram import NgramConfig
    from dspine_train.evaluation.harness import (
        build_engine,
        evaluate,
        plot_results,
        results_markdown,
        save_results,
    )

    args = demo.args
    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    draft = demo.path("draft")
    block = json.loads((draft / "config.json").read_text())["block_size"]
    g_values = []
    for item in args.num_draft_tokens.split(","):
        g = block - 1 if item.strip() == "full" else int(item)
        if not 1 <= g <= block - 1:
            raise DemoError(f"--num-draft-tokens: {g} is outside 1..{block - 1}")
        g_values.append(g)
    loaded = [load_benchmark(b, limit=args.eval_prompts) for b in benches]
    engine = build_engine(demo.target, draft, loaded, max_new_tokens=args.eval_max_new_tokens,
                          device="cuda" if torch.cuda.is_available() else "cpu",
                          dtype=getattr(torch, args.serve_dtype),
                          ngram_tokens=NgramConfig().num_tokens)
    ar_cache: dict = {}  # plain decoding does not depend on g: run it once
    results = {}
    for index, g in enumerate(dict.fromkeys(g_values)):
        # Further values of g only compare speed: the first temperature is enough. Plain
        # decoding (speed baseline, lossless check) runs greedy only: its speed does not
        # depend on the temperature, and sampled outputs are not comparable token by token.
        temps = temperatures if index == 0 else temperatures[:1]
        rows = []
        for greedy in (True, False):
            chosen = [t for t in temps if (t == 0) == greedy]
            if chosen:
                rows += evaluate(demo.target, draft, loaded, chosen,
                                 max_new_tokens=args.eval_max_new_tokens,
                                 num_draft_tokens=g, engine=engine,
                                 measure_ar=greedy, ar_cache=ar_cache)
        results[f"DSpine g={g}"] = rows
    # The engine's best default on a CPU: n-gram (prompt-lookup) branches merged into the
    # draft's tree, each round's shape chosen by measured cost. Greedy only: plain decoding is
    # reused from above, and the output must equal it.
    g = g_values[0]
    engine.configure_ngram(NgramConfig(), adaptive=True)
    results[f"hybrid g={g} (adaptive)"] = evaluate(
        demo.target, draft, loaded, [t for t in temperatures if t == 0] or [0.0],
        max_new_tokens=args.eval_max_new_tokens, num_draft_tokens=g, engine=engine,
        measure_ar=True, ar_cache=ar_cache)
    engine.configure_ngram(None)
    out = demo.path("eval")
    save_results(results, out / "results.json", metadata={"target": str(demo.target),
                                                          "draft": str(draft)})
    (out / "results.md").write_text(results_markdown(results))
    plot_results(results, out / "acceptance.png")
    rows = [r for rs in results.values() for r in rs]
    summary = {"lossless": all(r.lossless is not False for r in rows),
               "lossless_checked": sum(r.lossless is not None for r in rows),
               "results": str(out / "results.json")}
    if args.parity_rows > 0:
        summary.update(run_parity_check(demo, draft))
    return summary


def run_parity_check(demo: Demo, draft: Path) -> dict[str, Any]:
    """The parity check on the eval split (`dspine_train.evaluation.parity`): writes eval/parity.{json,md}
    and returns the figures the final report prints."""
    import torch

    from dspine_train.evaluation.parity import parity_from_dataset

    report = parity_from_dataset(demo.target, draft, demo.path("data", "tokenized"),
                                 split="eval", limit=demo.args.parity_rows,
                                 device="cuda" if torch.cuda.is_available() else "cpu",
                                 dtype=getattr(torch, demo.args.serve_dtype))
    out = demo.path("eval")
    write_json(out / "parity.json", report.to_json())
    (out / "parity.md").write_text(report.markdown())
    return {"parity_engine_tau": report.engine.tau,
            "parity_same_anchors_tau": report.simulated_same_anchors.tau,
            "parity_walk_tau": report.simulated_walk.tau,
            "parity_trainer_tau": report.simulated_all_anchors.tau,
            "parity_mismatched_rounds": report.mismatched_rounds,
            "parity_rounds": report.engine.blocks, "parity_warnings": report.warnings}


# ---------------------------------------------------------------------------------- training config
def train_overrides(demo: Demo) -> list[str]:
    """Hydra overrides shared by the feature cache and `train.py`.

    The target layers follow METHOD 1 for the chosen number of draft layers.
    """
    from dspine_train.modeling import default_target_layer_ids

    a = demo.args
    depth = json.loads((demo.target / "config.json").read_text())["num_hidden_layers"]
    layers = ",".join(str(i) for i in default_target_layer_ids(depth, a.draft_layers))
    return [f"recipe={a.recipe}", f"output_dir={demo.path('train')}",
            f"model.target_path={demo.target}",
            f"model.token_table_path={demo.path('token_table.safetensors')}",
            f"data.train_path={demo.path('data', 'tokenized')}",
            f"data.offline_features_dir={demo.path('features')}",
            f"optim.max_steps={a.steps}", f"model.num_layers={a.draft_layers}",
            f"model.target_layer_ids=[{layers}]",
            f"model.block_size={a.block_size}", f"data.num_anchors={a.num_anchors}",
            f"model.draft_vocab_size={a.draft_vocab_size or 'null'}",
            # features from the target in the dtype that answered the prompts; the draft in
            # the matching precision (bf16: bf16 weights and activations, fp32 master copy)
            f"model.target_dtype={a.dtype}",
            f"precision={'bf16' if a.dtype == 'bfloat16' else 'fp32'}",
            "logging.wandb=false", *a.train_override]


def resolve_dtype(args: argparse.Namespace) -> None:
    """Resolve the demo's two dtypes (printed; the stage records hold the resolved values, so a
    cached stage is redone if another machine resolves otherwise).

    `args.serve_dtype`: the dtype the target generates in. It answers the training prompts in
    it, and the engine evaluates and checks parity in it, so the answers are the engine's own
    greedy ones: float32 on a CPU, where the engine's lossless check is bit-exact and a bf16
    target rounds a one-row decode step and a multi-row verify differently at near-ties
    (docs/results/demo_2026-12-02), and bfloat16 on CUDA.

    `args.dtype` (`--dtype`): the cached features and the draft's training precision; `auto`
    is the dtype this machine runs fastest (bf16 where it computes bf16 natively).
    """
    import torch

    cuda = torch.cuda.is_available()
    args.serve_dtype = "bfloat16" if cuda else "float32"
    if args.dtype != "auto":
        return
    from data_prep.backends.local import native_bf16

    device = torch.device("cuda" if cuda else "cpu")
    args.dtype = "bfloat16" if native_bf16(device) else "float32"
    print(f"[demo] --dtype auto: {args.dtype} for the features and the training ({device.type}"
          f"{', native bf16' if args.dtype == 'bfloat16' else ', no native bf16'}); answers "
          f"and the engine in {args.serve_dtype}", flush=True)


def resolve_draft_shape(args: argparse.Namespace) -> None:
    """Fill `--draft-layers` / `--block-size` left unset with the recipe's values (its model
    group, then `--train-override`), or DSpineConfig's defaults where the recipe sets none: the
    recipe stays the one source of the draft's shape, and the stage records name it."""
    if args.draft_layers is not None and args.block_size is not None:
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dspine_train.modeling import DSpineConfig
    from dspine_train.training.config import ConfigError, compose_train_config

    try:
        model = compose_train_config(f"recipe={args.recipe}", *args.train_override).model
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        raise DemoError(f"training config (--recipe/--train-override): {err}") from err
    if args.draft_layers is None:
        args.draft_layers = model.num_layers or DSpineConfig.num_layers
    if args.block_size is None:
        args.block_size = model.block_size or DSpineConfig.block_size


def train_config(demo: Demo) -> Any:
    """The composed and validated training config (fails fast on a bad override)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dspine_train.training.config import ConfigError, compose_train_config

    try:
        return compose_train_config(*train_overrides(demo))
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        raise DemoError(f"training config (--recipe/--train-override): {err}") from err


# ---------------------------------------------------------------------------------- driver
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
        "max_new_tokens": a.max_new_tokens, "temperature": 0.0, "dtype": a.serve_dtype},
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
                         finished_at=time.strftime("%Y-%m-%d %H:%M:%S"), summary=summary)
    write_json(demo.stages_dir / f"{name}.json", asdict(record))
    started_path.unlink(missing_ok=True)
    return record, True


STAGE_FUNCS: dict[str, Callable[[Demo], dict[str, Any]]] = {
    "target": stage_target, "prompts": stage_prompts, "regenerate": stage_regenerate,
    "tokenize": stage_tokenize, "token_table": stage_token_table, "features": stage_features,
    "export": stage_export, "evaluate": stage_evaluate,
}


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


def main(argv: list[str] | None = None) -> int:
    """Run the selected stages; 0 on success, 1 with a message on failure."""
    args = build_parser().parse_args(argv)
    try:
        selected = parse_list(args.stages, STAGES, "--stages")
        forced = set(parse_list(args.force, STAGES, "--force")) if args.force else set()
        if args.threads is not None and args.threads < 1:
            raise DemoError("--threads must be >= 1")
        if args.parity_rows < 0:
            raise DemoError("--parity-rows must be >= 0 (0 skips the parity check)")
        if args.num_prompts < 2 or args.steps < 1:
            raise DemoError("--num-prompts must be >= 2 and --steps >= 1")
        if args.draft_vocab_size < 0:
            raise DemoError("--draft-vocab-size must be >= 0 (0 keeps the whole vocabulary)")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        resolve_draft_shape(args)
        resolve_dtype(args)
        os.environ.update({k: v for k, v in offline_env(args.threads).items()
                           if k.startswith(("HF_", "TRANSFORMERS_", "TOKENIZERS_"))})
        from data_prep.config import default_target_dir

        out = args.out.resolve()
        target = (args.target or default_target_dir()).resolve()
        demo = Demo(args, out, target)
        if {"token_table", "features", "train"} & set(selected) and (
                target / "config.json").is_file():
            train_config(demo)  # a bad recipe or override fails now, not after the data stages
        records: dict[str, StageRecord] = {}
        ran: dict[str, bool] = {}
        for index, name in enumerate(s for s in STAGES if s in selected):
            print(f"\n[demo] stage {index + 1}/{len(selected)}: {name}", flush=True)
            records[name], ran[name] = run_stage(demo, name, name in forced)
            state = "done" if ran[name] else "already done, skipped"
            print(f"[demo] {name}: {state} ({records[name].seconds} s)", flush=True)
    except KeyboardInterrupt:
        print("\n[demo] interrupted; rerun the same command to continue", file=sys.stderr)
        return 130
    except (DemoError, ValueError, OSError) as err:
        # The data, harness and engine errors are ValueErrors whose message names the file,
        # field or stage at fault; anything else is a bug and keeps its traceback.
        print(f"\nerror: {err}", file=sys.stderr)
        return 1
    report = final_report(demo, records, ran)
    demo.path("demo_report.md").write_text(report)
    print("\n" + report)
    print(f"[demo] report: {demo.path('demo_report.md')}")
    evaluated = records.get("evaluate")
    for warning in evaluated.summary.get("parity_warnings", []) if evaluated else []:
        print(f"warning: {warning}", file=sys.stderr)
    if evaluated and not evaluated.summary["lossless"]:
        print("error: speculative output differed from plain decoding at T=0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
