"""Command line of the training study (`scripts/study.py`): `data`, `run` and `report`.

    python scripts/study.py data                     # prompts, regeneration, tokens, features
    python scripts/study.py run                      # every variant; finished ones are skipped
    python scripts/study.py run --variants dspine,dflash --stop-after 1   # one piece
    python scripts/study.py run --smoke              # 2 variants x 20 steps on the demo's data
    python scripts/study.py report                   # rewrite the report (after editing findings.md)
    python scripts/study.py steps                    # every variant's step time, side by side

The budget defaults to max(1,500 steps, 3 epochs) at the recipe's batch size.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from scripts.tools import REPO

from .study_data import StudyDataSettings, prepare

DEFAULT_ROOT = REPO / "artifacts" / "study"
TARGET_NAME = "qwen2.5-coder-0.5b"
# What a session must keep of the study is committed here: the target's answers and the
# archived variants (a working session keeps nothing else); the report lies beside it.
RECORD_DIR = REPO / "docs" / "results" / f"study_{TARGET_NAME}"
RECIPE = "qwen2.5_coder_0.5b"
MIN_STEPS = 1500
MIN_EPOCHS = 3.0


def variant_names(value: str) -> list[str]:
    """`--variants`: comma-separated names; a list naming none (`,`, empty) is refused rather
    than taken as "every variant", which is what leaving the option out means."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"{value!r} names no variant; give comma-separated names, or leave --variants out "
            "for the default set")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(prog="study.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                   help="study root: data/ and run/ live under it (default artifacts/study)")
    p.add_argument("--target", type=Path, default=REPO / "artifacts" / "default_target")
    sub = p.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="prompts, the target's answers, token data, features")
    data.add_argument("--sharegpt-train", type=int, default=1000)
    data.add_argument("--sharegpt-heldout", type=int, default=128)
    data.add_argument("--humaneval-heldout-fraction", type=float, default=0.62)
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--regen-dtype", default="bfloat16",
                      choices=("bfloat16", "float32", "float16"))
    data.add_argument("--regen-batch-size", type=int, default=16)
    data.add_argument("--stages", default="prompts,regenerate,tokenize,features")
    data.add_argument("--answers", type=Path, default=RECORD_DIR / "answers",
                      help="answers archive: restored instead of regenerating, written after "
                           "a regeneration (default %(default)s)")
    data.add_argument("--no-answers-archive", action="store_true",
                      help="neither restore nor write the answers archive")
    run = sub.add_parser("run", help="train and evaluate the variants, write the report")
    run.add_argument("--variants", type=variant_names, default=None,
                     help="comma-separated variants (default: every non-optional one)")
    run.add_argument("--steps", type=int, default=0,
                     help=f"optimizer steps (0: max({MIN_STEPS}, {MIN_EPOCHS:g} epochs))")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                     help="training precision of every variant (bf16: bf16 draft with fp32 "
                          "master weights, as the GPU recipes; the dspine_fp32 row checks it)")
    run.add_argument("--archive", type=Path, default=None,
                     help=f"archive of finished variants (default {RECORD_DIR / 'variants'}; "
                          "the smoke run: <out>/archive)")
    run.add_argument("--out", type=Path, default=None, help="default <root>/run")
    run.add_argument("--report-stem", type=Path, default=None,
                     help="report path without suffix (default docs/results/study_<target>_"
                          "<date>; the smoke run: <out>/report)")
    run.add_argument("--eval-every", type=int, default=250)
    run.add_argument("--eval-max-blocks", type=int, default=4096,
                     help="held-out blocks of the periodic evaluation (a fixed uniform draw)")
    run.add_argument("--final-max-blocks", type=int, default=16384,
                     help="held-out blocks of the final evaluation (0: every block)")
    run.add_argument("--checkpoint-every", type=int, default=250)
    run.add_argument("--plan-steps", type=int, default=4, help="steps timed per variant (0: none)")
    run.add_argument("--engine-prompts", type=int, default=20, help="held-out prompts per "
                     "benchmark for the final engine evaluation (0: none)")
    run.add_argument("--engine-new-tokens", type=int, default=64)
    run.add_argument("--stop-after", type=int, default=None,
                     help="stop after finishing this many variants (a piece of the study)")
    run.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                     help="extra train.py override shared by every variant (repeatable)")
    run.add_argument("--demo", type=Path, default=REPO / "artifacts" / "demo",
                     help="the demo's output (data and features) the smoke run trains on")
    run.add_argument("--smoke", action="store_true",
                     help="prove the runner: dspine and dflash, 20 steps, on the demo's data "
                          "and features (artifacts/demo), 4 engine prompts x 16 tokens")
    steps = sub.add_parser("steps", help="time one training step of every variant, "
                           "interleaved on the same batches (the report's step-time ratios)")
    steps.add_argument("--variants", type=variant_names, default=None,
                       help="comma-separated variants (default: every one, optional included)")
    steps.add_argument("--seed", type=int, default=0)
    steps.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    steps.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    steps.add_argument("--batches", type=int, default=3, help="training batches timed")
    steps.add_argument("--iters", type=int, default=6, help="timed steps per variant")
    steps.add_argument("--out", type=Path, default=None,
                       help=f"JSON written (default {RECORD_DIR}/step_times.json)")
    report = sub.add_parser("report", help="rewrite the report from the archive alone (after "
                            "editing its findings.md); nothing trains")
    report.add_argument("--archive", type=Path, default=RECORD_DIR / "variants")
    report.add_argument("--report-stem", type=Path, default=None,
                        help="default docs/results/study_<target>_<start date>")
    return p


def data_settings(args: argparse.Namespace) -> StudyDataSettings:
    """The data settings of `data` (and of `run`, which reads the same directory)."""
    return StudyDataSettings(
        data_dir=args.root / "data", target=args.target,
        sharegpt_train=getattr(args, "sharegpt_train", 1000),
        sharegpt_heldout=getattr(args, "sharegpt_heldout", 128),
        humaneval_heldout_fraction=getattr(args, "humaneval_heldout_fraction", 0.62),
        max_new_tokens=getattr(args, "max_new_tokens", 256),
        regen_dtype=getattr(args, "regen_dtype", "bfloat16"),
        regen_batch_size=getattr(args, "regen_batch_size", 16),
        answers_dir=None if getattr(args, "no_answers_archive", False)
        else getattr(args, "answers", None))


def shared_overrides(args: argparse.Namespace, data: StudyDataSettings) -> list[str]:
    """`train.py` overrides every variant and the feature cache share."""
    extra = getattr(args, "override", [])
    if getattr(args, "smoke", False):
        demo = args.demo
        return [f"model.target_path={args.target}",
                f"data.train_path={demo / 'data' / 'tokenized'}", *extra]
    return [f"model.target_path={args.target}", f"data.train_path={data.train_dataset}",
            # the features come from the same bf16 target that answered the prompts
            "model.target_dtype=bfloat16", f"data.max_length={data.max_length}",
            *([f"precision={args.precision}"] if hasattr(args, "precision") else []), *extra]


def default_steps(train_path: Path, batch_size: int) -> int:
    """max(MIN_STEPS, MIN_EPOCHS epochs) at `batch_size` rows a step."""
    from dspine_train.training.data import load_token_dataset

    rows = len(load_token_dataset(str(train_path), "train", "data.train_path"))
    return max(MIN_STEPS, math.ceil(MIN_EPOCHS * math.ceil(rows / batch_size)))


def started(archive: Path) -> str:
    """The study's start date (the report's name), recorded in the archive on its first run,
    so the report keeps one name over the sessions the study spans."""
    import json
    import time

    path = archive / "started.json"
    if not path.is_file():
        archive.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d")}) + "\n")
    return json.loads(path.read_text())["date"]


def run_command(args: argparse.Namespace) -> int:
    """`run`: the study (or its smoke run)."""
    from dspine_train.training.config import compose_train_config

    from .runner import StudyError, StudySettings
    from .study import run_study
    from .variants import STUDY

    data = data_settings(args)
    names = args.variants or []
    if args.smoke:
        names = names or ["dspine", "dflash"]
        args.steps = args.steps or 20
        args.engine_prompts, args.engine_new_tokens = min(args.engine_prompts, 4), 16
        args.eval_every, args.checkpoint_every = min(args.eval_every, 10), min(
            args.checkpoint_every, 10)
        args.eval_max_blocks = min(args.eval_max_blocks, 256)
    variants = STUDY.select(names)
    out = args.out or args.root / ("smoke" if args.smoke else "run")
    overrides = [f"recipe={RECIPE}", f"seed={args.seed}", *shared_overrides(args, data)]
    if args.smoke:
        features = args.demo / "features"
    else:
        features = args.root / "features"
    config = compose_train_config(*overrides, f"data.offline_features_dir={features}")
    if not Path(config.data.train_path).exists():
        raise StudyError(f"data.train_path {config.data.train_path}: the study data is not "
                         "ready; run `python scripts/study.py data` first (it resumes)")
    steps = args.steps or default_steps(Path(config.data.train_path), config.data.batch_size)
    benches = ([str(p) for p in data.bench_files().values()] if not args.smoke
               else ["humaneval", "sharegpt"])
    archive = args.archive or (out / "archive" if args.smoke else RECORD_DIR / "variants")
    stem = args.report_stem or (out / "report" if args.smoke else
                                RECORD_DIR.parent / f"study_{TARGET_NAME}_{started(archive)}")
    settings = StudySettings(
        out_dir=out, recipe=RECIPE, steps=steps, seed=args.seed,
        overrides=[o for o in overrides if not o.startswith(("recipe=", "seed="))],
        benches=benches, temperatures=[0.0], limit=args.engine_prompts,
        max_new_tokens=args.engine_new_tokens, measure_ar=True, features_override=features,
        eval_every=args.eval_every, eval_max_blocks=args.eval_max_blocks,
        final_max_blocks=args.final_max_blocks,
        checkpoint_every=args.checkpoint_every, plan_steps=args.plan_steps, report_stem=stem,
        archive_dir=archive,
        command=shlex.join([sys.executable, "scripts/study.py", *sys.argv[1:]]))
    run_study(settings, variants, target=str(args.target), stop_after=args.stop_after)
    return 0


def steps_command(args: argparse.Namespace) -> int:
    """`steps`: every variant's training step, interleaved in this process."""
    from dspine_train.training.config import compose_train_config

    from .report import git_commit
    from .runner import StudyError, StudySettings
    from .study import STEP_TIMES_FILE
    from .study_report import step_lines
    from .study_steps import time_steps, write_step_times
    from .variants import STUDY

    data = data_settings(args)
    variants = STUDY.select(args.variants or STUDY.rows)
    features = args.root / "features"
    overrides = [f"recipe={RECIPE}", f"seed={args.seed}", *shared_overrides(args, data)]
    config = compose_train_config(*overrides, f"data.offline_features_dir={features}")
    if not Path(config.data.train_path).exists():
        raise StudyError(f"{config.data.train_path}: the study's token data is not ready; run "
                         "`python scripts/study.py data` first (it resumes; `--stages "
                         "prompts,regenerate,tokenize` is all `steps` needs)")
    cached = features.is_dir()
    settings = StudySettings(
        out_dir=args.root / "steps", recipe=RECIPE,
        steps=default_steps(Path(config.data.train_path), config.data.batch_size),
        seed=args.seed, features_override=features,
        overrides=[o for o in overrides if not o.startswith(("recipe=", "seed="))])
    result = time_steps(settings, variants, args.root / "steps", args.batches, args.iters,
                        progress=lambda line: print(f"[steps] {line}", flush=True),
                        cached_features=cached)
    result["command"] = shlex.join([sys.executable, "scripts/study.py", *sys.argv[1:]])
    result["commit"], result["dirty"] = git_commit(REPO)
    print("\n".join(step_lines(result)))
    out = write_step_times(result, args.out or RECORD_DIR / STEP_TIMES_FILE)
    print(f"wrote {out}")
    return 0


def warn_without_native_bf16(args: argparse.Namespace) -> None:
    """Say so before the long stages when this CPU has no native bf16, the study's precision
    for the features and (by default) the rows: there each costs more (docs/STUDY.md)."""
    import torch

    from dspine_train.cpu_bf16 import native_bf16

    heavy = (args.command == "data" and "features" in args.stages) or (
        args.command == "run" and not args.smoke and args.precision == "bf16")
    if heavy and not torch.cuda.is_available() and not native_bf16(torch.device("cpu")):
        print("[study] warning: this CPU has no native bf16 (no avx512_bf16 / amx_bf16 in "
              "/proc/cpuinfo); the study computes its features and trains its rows in bf16, "
              "their matrix products in float32 here (cpu_bf16_matmul=auto), slower than "
              "where bf16 is native: the features take ~70 min, a row may not fit one session "
              "(docs/STUDY.md)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; a failure prints its message and returns 1."""
    from .runner import StudyError

    args = build_parser().parse_args(argv)
    warn_without_native_bf16(args)
    try:
        if args.command == "data":
            settings = data_settings(args)
            stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
            prepare(settings, stages=stages)
            if "features" in stages:
                from .study_data import cache_features

                cache_features(settings, [f"recipe={RECIPE}",
                                          *shared_overrides(args, settings)],
                               args.root / "features")
        elif args.command == "report":
            from .study import rewrite_report

            if args.report_stem is None and not (args.archive / "started.json").is_file():
                raise StudyError(f"{args.archive / 'started.json'}: missing, so the report's "
                                 "name is unknown; pass --report-stem or the study's --archive")
            stem = args.report_stem or (RECORD_DIR.parent /
                                        f"study_{TARGET_NAME}_{started(args.archive)}")
            for path in rewrite_report(args.archive, stem):
                print(f"wrote {path}")
        elif args.command == "steps":
            return steps_command(args)
        else:
            return run_command(args)
    except (StudyError, RuntimeError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
