r"""The ablation study (METHOD 2.5): DFlash, DSpine and DSpine with one part off, same budget.

Trains every variant on the same target, data, steps, batch, anchors and seed (the target's
features are computed once into an offline cache that all runs share), evaluates each export
with the evaluation harness (engine-measured tau at each temperature on held-out benchmark
prompts, per-position acceptance) and the trainer's simulated tau, and writes one table as
markdown, JSON and PNG, with the exact command and git commit.

    python scripts/ablate.py --smoke --out /tmp/ablation_smoke        # tiny random target, quick
    python scripts/ablate.py --steps 150 --features artifacts/demo/features \
        --report docs/results/ablation_cpu                   # on the demo's data and features
    python scripts/ablate.py --variants dspine,dspine_no_tcache --steps 300 --set data.num_anchors=64

Variants (`--variants`, default all): dflash, dspine, dspine_no_alignment, dspine_token_ce,
dspine_no_tcache (dspine's weights decoded without the transition cache; not retrained); they
are defined in `scripts/tools/ablation/variants.py`, with the training study's.
A rerun with the same --out skips the feature cache, every variant whose export exists and
every evaluation already done with the same settings; an interrupted training resumes from its
last checkpoint. Exit status 1 with a message on bad input or a failed stage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.tools.ablation.variants import ABLATION  # noqa: E402

SMOKE_STEPS = 8
SMOKE_PROMPT_CHARS = 400
DEFAULT_MAX_PROMPT_CHARS = 2000  # the evaluation harness's default


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="ablation directory (default artifacts/ablation, or "
                        "artifacts/ablation_smoke with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random target and synthetic data: the whole study in ~1 minute")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {','.join(ABLATION.rows)} (default: all)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per trained variant (default 150; {SMOKE_STEPS} "
                        "with --smoke)")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (default 0)")
    p.add_argument("--recipe", default=None,
                   help="train.py recipe (default qwen2.5_coder_0.5b; tiny with --smoke)")
    p.add_argument("--target", default="artifacts/default_target",
                   help="target model directory (default artifacts/default_target)")
    p.add_argument("--data", default="artifacts/demo/data/tokenized",
                   help="tokenised training data with a train and an eval split (default: the "
                        "demo's, written by `python scripts/demo.py --stages ...,tokenize`)")
    p.add_argument("--features", type=Path, default=None,
                   help="an existing offline feature cache of this data and recipe to reuse "
                        "(default: <out>/features, computed once)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py (Hydra) override for every run, e.g. data.num_anchors=16; "
                        "repeatable")
    p.add_argument("--benches", default="humaneval,sharegpt",
                   help="evaluation-harness benchmarks (default humaneval,sharegpt)")
    p.add_argument("--temperatures", default="0,1", help="engine temperatures (default 0,1)")
    p.add_argument("--limit", type=int, default=None,
                   help="held-out prompts per benchmark (default 8; 2 with --smoke)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt (default 64; 16 with --smoke)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="drafted tokens verified per round (default: block size - 1)")
    p.add_argument("--measure-ar", action="store_true",
                   help="also run plain decoding of every benchmark: tokens/s, speedup and the "
                        "lossless check at temperature 0 (always on with --smoke)")
    p.add_argument("--eval-batch-size", type=int, default=1,
                   help="prompts the engine decodes together (default 1); tau does not depend "
                        "on it, tokens/s becomes batched throughput")
    p.add_argument("--jobs", type=int, default=1,
                   help="trainings run side by side (default 1; 2 suits tiny models on 2 cores)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the feature cache and each training (OMP_NUM_THREADS) "
                        "and, without --eval-threads, of the evaluation; 1 is much faster on a "
                        "CPU that another job shares (default: torch's choice; 1 with --smoke)")
    p.add_argument("--eval-threads", type=int, default=None,
                   help="torch threads of the evaluation (default: --threads)")
    p.add_argument("--report", type=Path, default=None,
                   help="path stem of the report: <stem>.md/.json/.png (default <out>/ablation)")
    p.add_argument("--title", default=None, help="report title")
    args = p.parse_args(argv)
    for flag in ("steps", "jobs", "threads", "eval_threads", "limit", "max_new_tokens",
                 "eval_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for value in args.overrides:
        if "=" not in value:
            p.error(f"--set expects KEY=VALUE, got {value!r}")
    try:
        args.variant_list = ABLATION.select(args.variants.split(",") if args.variants else None)
        args.temperature_list = [float(t) for t in args.temperatures.split(",")]
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the study; 0 on success, 1 with a message on failure."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from scripts.tools.ablation.ablation_report import write_ablation_report
    from scripts.tools.ablation.ablation_rows import (
        collect_row,
        config_differences,
        same_budget,
        settings_record,
    )
    from scripts.tools.ablation.report import data_summary, git_commit
    from scripts.tools.ablation.runner import (
        EVERY_BLOCK,
        TOKEN_TABLE,
        StudyError,
        StudySettings,
        ensure_features,
        evaluate_variant,
        harness_evaluator,
        prepare_variants,
    )

    out = (args.out or REPO / ("artifacts/ablation_smoke" if args.smoke
                               else "artifacts/ablation")).resolve()
    target, data = args.target, args.data
    threads = args.threads or (1 if args.smoke else None)
    if threads:
        # The stage subprocesses inherit it; this process (the evaluation) follows it too.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
    if args.smoke:
        from scripts.tools.ablation.smoke import write_smoke_assets

        target, data = write_smoke_assets(out / "assets")
    target = str(Path(target).resolve())
    data = str(Path(data).resolve())
    for role, path in (("--target", target), ("--data", data)):
        if not Path(path).exists():
            print(f"error: {role}: {path} does not exist (the demo's stages write both: "
                  "python scripts/demo.py --stages target,prompts,regenerate,tokenize)",
                  file=sys.stderr)
            return 1
    overrides = [f"model.target_path={target}", f"data.train_path={data}"]
    if args.smoke:
        overrides += ["logging.progress_bar=false"]
    overrides += args.overrides
    steps = args.steps or (SMOKE_STEPS if args.smoke else 150)
    settings = StudySettings(
        out_dir=out,
        recipe=args.recipe or ("tiny" if args.smoke else "qwen2.5_coder_0.5b"),
        steps=steps,
        seed=args.seed,
        overrides=overrides,
        benches=args.benches.split(","),
        temperatures=args.temperature_list,
        limit=args.limit or (2 if args.smoke else 8),
        max_new_tokens=args.max_new_tokens or (16 if args.smoke else 64),
        num_draft_tokens=args.num_draft_tokens,
        # plain decoding of the tiny target costs nothing; it adds the lossless check
        measure_ar=args.measure_ar or args.smoke,
        eval_batch_size=args.eval_batch_size,
        # the tiny target holds 512 positions: keep its prompts short
        max_prompt_chars=SMOKE_PROMPT_CHARS if args.smoke else DEFAULT_MAX_PROMPT_CHARS,
        eval_seed=args.seed,
        features_override=args.features.resolve() if args.features else None,
        # one token table for every run (it depends only on the target); evaluate once, at
        # the end, on every held-out block; checkpoint every quarter, so an interrupted
        # variant resumes instead of restarting
        token_table=out / TOKEN_TABLE,
        eval_every=0,
        eval_max_blocks=EVERY_BLOCK,
        checkpoint_every=max(1, steps // 4),
    )
    commit, dirty = git_commit(REPO)
    try:
        ensure_features(settings)
        prepare_variants(settings, args.variant_list, jobs=args.jobs)
        if args.eval_threads:
            import torch

            torch.set_num_threads(args.eval_threads)
        evaluate = harness_evaluator(target, settings)
        rows = [collect_row(settings, v, evaluate_variant(settings, v, evaluate))
                for v in args.variant_list]
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    differences = config_differences(settings, args.variant_list)
    reference = json.loads((settings.export_dir(args.variant_list[0]) / "config.json")
                           .read_text())
    run = rows[0].run
    meta = {
        "title": args.title or ("DSpine ablation (smoke: tiny random target)" if args.smoke
                                else "DSpine ablation"),
        "command": shlex.join(["python", "scripts/ablate.py", *argv]),
        "git_commit": commit,
        "git_dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {_device()}, "
                   f"{threads or 'default'} torch thread(s) per training, {args.jobs} training(s) "
                   f"at a time, {args.eval_threads or threads or 'default'} thread(s) for the "
                   "evaluation",
        "target": _shown(target),
        "draft": ", ".join(f"{k} {reference[k]}" for k in
                           ("num_layers", "block_size", "transfer_dim", "candidate_k")),
        "train_path": _shown(data),
        "data_summary": data_summary(data),
        "features_dir": _shown(settings.features_dir),
        "batch_size": run.batch_size,
        "num_anchors": run.num_anchors,
        "max_length": run.max_length,
        "lr": run.lr,
        "same_budget": same_budget(rows) and not differences,
        "config_differences": differences,
        "settings": settings_record(settings),
    }
    paths = write_ablation_report(rows, meta, args.report or out / "ablation")
    print(paths[0].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _shown(path: str | Path) -> str:
    """A path as the report shows it: relative to the repository when inside it."""
    path = Path(path)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _device() -> str:
    import torch

    return f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    sys.exit(main())
