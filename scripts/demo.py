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
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

# The stages, their records and the runner live in scripts/tools/demo/; this script keeps the
# command line. The names below are the ones the tests reach through `demo`.
from scripts.tools.child_runs import offline_env  # noqa: E402
from scripts.tools.demo.records import Demo, DemoError, StageRecord  # noqa: E402
from scripts.tools.demo.runner import SPECS, STAGES, final_report, run_stage  # noqa: E402
from scripts.tools.demo.settings import (  # noqa: E402
    resolve_draft_shape,
    resolve_dtype,
    train_config,
)
from scripts.tools.demo.stages import (  # noqa: E402
    STAGE_FUNCS,
    stage_evaluate,
    stage_regenerate,
)

__all__ = ["SPECS", "STAGES", "STAGE_FUNCS", "Demo", "DemoError", "build_parser", "main",
           "parse_list", "resolve_dtype", "run_stage", "stage_evaluate", "stage_regenerate",
           "train_config"]


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
                           "engine's own greedy ones (unless --answer-dtype says otherwise)")
    data.add_argument("--answer-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                      help="the target's dtype when it answers the prompts. auto: the dtype "
                           "the engine evaluates in, so the answers are its greedy ones; "
                           "bfloat16 on a CPU reproduces demos made before answers followed "
                           "the engine (their simulated tau, with a warning that some answers "
                           "are not the engine's)")
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
