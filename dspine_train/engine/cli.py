"""Command line: generate with a target and a DSpine draft, print texts and speed.

    python -m dspine_train.engine --target TARGET_DIR --draft DRAFT_DIR --prompts prompts.txt \
        [--max-new-tokens 128] [--temperature 0] [--top-p 1] [--no-chat] [--stop "###"] \
        [--num-draft-tokens 7] [--batch-size 8] [--device cpu] [--dtype float32] \
        [--ar] [--output results.json]

Prompts: a `.jsonl` file of `{"prompt": ...}` rows (or JSON strings), else one prompt per line.
Without `--draft` (or with `--ar`) it decodes plainly with the target alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from dspine_train.engine.engine import Engine, GenerationResult
from dspine_train.engine.errors import (
    CheckpointError,
    GenerationInputError,
    IncompatibleDraftError,
)
from dspine_train.engine.prompts import read_prompts
from dspine_train.engine.stats import GenerationStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by the CLI and `scripts/bench_engine.py`."""
    parser.add_argument("--target", required=True, help="target model directory (HF layout)")
    parser.add_argument("--draft", default=None, help="exported DSpine draft directory")
    parser.add_argument("--prompts", required=True, help="prompts file (.jsonl or one per line)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: target)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    parser.add_argument("--max-seq-len", type=int, default=None, help="cache length per sequence")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights dtype (default: the checkpoint's on CUDA, float32 on CPU)",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run CUDA steps eager")
    parser.add_argument("--seed", type=int, default=0)


def build_engine(args: argparse.Namespace) -> Engine:
    """An `Engine` from parsed `add_engine_arguments` arguments."""
    kwargs = {"max_batch_size": args.batch_size, "cuda_graphs": not args.no_cuda_graphs}
    if args.max_seq_len is not None:
        kwargs["max_seq_len"] = args.max_seq_len
    return Engine.from_pretrained(
        args.target,
        args.draft,
        device=args.device,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        tokenizer=args.tokenizer,
        **kwargs,
    )


def run_batches(
    engine: Engine, prompts: list[str], batch_size: int, speculative: bool, desc: str, **kwargs
) -> tuple[list[GenerationResult], GenerationStats]:
    """Generate for all prompts in batches; return per-batch results and summed stats."""
    results = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch"):
        batch = prompts[start : start + batch_size]
        method = engine.generate if speculative else engine.generate_ar
        results.append(method(batch, **kwargs))
    return results, sum_stats([r.stats for r in results])


def sum_stats(parts: list[GenerationStats]) -> GenerationStats:
    """Counters and times of several calls added up (rates are then recomputed from them)."""
    total = GenerationStats(mode=parts[0].mode, accepted_at=[0] * len(parts[0].accepted_at))
    for part in parts:
        for name in (
            "num_sequences",
            "prompt_tokens",
            "new_tokens",
            "steps",
            "verifications",
            "committed",
            "prefill_s",
            "draft_s",
            "verify_s",
            "total_s",
        ):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        total.accepted_at = [a + b for a, b in zip(total.accepted_at, part.accepted_at)]
    return total


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m dspine_train.engine`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m dspine_train.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(parser)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="draft tokens verified per round (default: block_size - 1)",
    )
    parser.add_argument("--ar", action="store_true", help="plain decoding even with a draft")
    parser.add_argument("--output", default=None, help="write results and stats as JSON here")
    args = parser.parse_args(argv)

    try:
        prompts = read_prompts(args.prompts)
        engine = build_engine(args)
        speculative = engine.draft is not None and not args.ar
        kwargs = dict(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            chat=not args.no_chat,
            stop=args.stop,
            seed=args.seed,
        )
        if speculative:
            kwargs["num_draft_tokens"] = args.num_draft_tokens
        results, stats = run_batches(
            engine,
            prompts,
            args.batch_size,
            speculative,
            "speculative" if speculative else "autoregressive",
            **kwargs,
        )
    except (CheckpointError, IncompatibleDraftError, GenerationInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    rows = []
    texts = [t for r in results for t in (r.texts or [None] * len(r.token_ids))]
    ids = [t for r in results for t in r.token_ids]
    reasons = [f for r in results for f in r.finish_reasons]
    for prompt, text, tokens, reason in zip(prompts, texts, ids, reasons):
        rows.append({"prompt": prompt, "text": text, "token_ids": tokens, "finish_reason": reason})
        print(f"### {prompt}\n{text if text is not None else tokens}\n")
    summary = stats.to_dict()
    print(
        f"{stats.mode}: {stats.new_tokens} tokens in {stats.total_s:.2f} s "
        f"({stats.tokens_per_s:.1f} tok/s), tau {stats.tau:.2f}, "
        f"draft {stats.draft_ms_per_step:.2f} ms/step, "
        f"verify {stats.verify_ms_per_step:.2f} ms/step"
    )
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")  # never leave a half-written file
        tmp.write_text(json.dumps({"results": rows, "stats": summary}, indent=1))
        tmp.replace(out)
    return 0
