"""The demo's stages, one function each: each runs its job under the demo's output directory and
returns the figures its stage record keeps (`run_id`, when present, names the run)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.tools.child_runs import offline_env, run_logged

from .records import Demo, DemoError, files_digest, write_json
from .settings import train_config, train_overrides


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
    `--answer-dtype`: by default the dtype the engine evaluates in (so the answers are the
    engine's greedy ones)."""
    from data_prep.regenerate import greedy_local_job, run_regeneration, summary_line

    args = demo.args
    data = greedy_local_job(
        demo.path("data", "prompts.jsonl"), demo.target, demo.path("data", "regenerated"),
        max_new_tokens=args.max_new_tokens, batch_size=args.regen_batch_size,
        dtype=args.answer_dtype)
    report = run_regeneration(data)
    print(summary_line(report))
    if report["done"] == 0:
        raise DemoError(f"regeneration produced no row; see {data.regenerate.output_dir}")
    return {**{k: report[k] for k in ("input", "done", "failed", "skipped",
                                      "completion_tokens")}, "dtype": args.answer_dtype}


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
    features = demo.path("features")
    return {"bytes": sum(p.stat().st_size for p in features.rglob("*") if p.is_file()),
            "sha256": files_digest(features)}


def stage_train(demo: Demo, resume: bool) -> dict[str, Any]:
    """`python train.py` on the cached features; resumes an interrupted run of the same stage."""
    overrides = train_overrides(demo)
    if resume:
        overrides.append("checkpoint.resume_from=latest")
    run_logged([sys.executable, "train.py", *overrides], demo.path("logs", "train.log"),
               "training the draft", env=offline_env(demo.args.threads), error=DemoError)
    info = json.loads(demo.path("train", "final", "training_info.json").read_text())
    return {"simulated_tau": info.get("tau"),
            "simulated_per_position": info.get("acceptance_by_position"), "steps": info["step"],
            "weights_sha256": files_digest(demo.path("train", "final", "model.safetensors"))}


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




STAGE_FUNCS: dict[str, Callable[[Demo], dict[str, Any]]] = {
    "target": stage_target, "prompts": stage_prompts, "regenerate": stage_regenerate,
    "tokenize": stage_tokenize, "token_table": stage_token_table, "features": stage_features,
    "export": stage_export, "evaluate": stage_evaluate,
}
