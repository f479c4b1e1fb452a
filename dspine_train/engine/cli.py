r"""Command line: generate with a target and a DSpine draft, print texts and speed.

    python -m dspine_train.engine --target TARGET_DIR --draft DRAFT_DIR --prompts prompts.txt \
        [--max-new-tokens 128] [--temperature 0] [--top-p 1] [--no-chat] [--stop "###"] \
        [--num-draft-tokens 7] [--batch-size 8] [--device cpu] [--dtype float32] \
        [--ar] [--ngram [--ngram-max-n 3 --ngram-min-n 1 --ngram-tokens 7]] [--adaptive] \
        [--output results.json]

Prompts: a `.jsonl` file of `{"prompt": ...}` rows (or JSON strings), else one prompt per line,
in UTF-8 without a byte-order mark. Without `--draft` (or with `--ar`) it decodes plainly with
the target alone. `--ngram` adds n-gram candidates (prompt lookup) to every round's tree, or is
the whole proposal without `--draft`; `--adaptive` picks each round's shape (plain step, n-gram,
draft, both) by measured cost. Flag values, the prompts file and the `--output` location are checked before
any model is loaded; a bad one is reported in one line naming it, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from dspine_train.checkpoint_io import write_text_atomic
from dspine_train.engine.engine import Engine, GenerationResult
from dspine_train.engine.errors import (
    CheckpointError,
    GenerationInputError,
    IncompatibleDraftError,
)
from dspine_train.engine.ngram import MATCH_POLICIES, NgramConfig
from dspine_train.engine.prompts import read_prompts, utf8_problem
from dspine_train.engine.stats import GenerationStats, sum_stats
from dspine_train.writable import output_file_problem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_engine_arguments(parser: argparse.ArgumentParser, prompts_required: bool = True) -> None:
    """Arguments shared by the CLI and `scripts/bench_engine.py` (whose `--compare` can take
    benchmarks instead of a prompts file)."""
    parser.add_argument("--prompts", required=prompts_required,
                        help="prompts file (.jsonl or one per line)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that build an `Engine` (checkpoints, device, caches, n-gram candidates),
    shared with the server (`dspine_train.serving.cli`); `build_engine` also reads
    `args.batch_size`, which each caller defines under its own flag."""
    parser.add_argument("--target", required=True, help="target model directory (HF layout)")
    parser.add_argument("--draft", default=None, help="exported DSpine draft directory")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: target)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="cache length per sequence")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights dtype (default: the checkpoint's on CUDA, float32 on CPU)",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run CUDA steps eager")
    parser.add_argument(
        "--chat-template-kwargs",
        default=None,
        help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\' '
        "(default: what the draft's export records, i.e. how its training rows were rendered)",
    )
    defaults = NgramConfig()
    ngram = parser.add_argument_group("n-gram candidates (prompt lookup) and round shapes")
    ngram.add_argument("--ngram", action="store_true",
                       help="add each sequence's n-gram continuation to every round's tree "
                       "(without --draft: the n-gram mode)")
    ngram.add_argument("--ngram-max-n", type=int, default=defaults.max_n,
                       help="longest suffix looked up (default: %(default)s)")
    ngram.add_argument("--ngram-min-n", type=int, default=defaults.min_n,
                       help="shortest suffix looked up (default: %(default)s)")
    ngram.add_argument("--ngram-tokens", type=int, default=defaults.num_tokens,
                       help="continuation tokens per proposal (default: %(default)s)")
    ngram.add_argument("--ngram-match", choices=MATCH_POLICIES, default=defaults.match,
                       help="which earlier occurrence continues a suffix (default: %(default)s)")
    ngram.add_argument("--adaptive", action="store_true",
                       help="verify per round the shape (plain step, n-gram, draft, both) with "
                       "the most expected tokens per second, by measured cost")


def add_round_arguments(parser: argparse.ArgumentParser) -> None:
    """How a speculative round verifies (`--num-draft-tokens`, `--tree-*`, `--ar`); shared
    with the server. Checked by `round_argument_problem`."""
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="draft tokens verified per round (default: the block's predictions, "
        "block_size - 1, or block_size for a dspark draft or a shift-label domino draft)",
    )
    parser.add_argument("--ar", action="store_true", help="plain decoding even with a draft")
    parser.add_argument(
        "--tree-paths",
        type=int,
        default=1,
        help="verify a token tree of this many lattice paths per round (greedy; 1: the chain)",
    )
    parser.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        help="at most this many tree nodes per round (default: tree paths x draft tokens)",
    )


def round_argument_problem(args: argparse.Namespace) -> str | None:
    """The first unusable `add_round_arguments` value, as a message naming the flag, or None."""
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        return f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}"
    if args.tree_paths < 1:
        return f"--tree-paths must be >= 1, got {args.tree_paths}"
    if args.tree_nodes is not None and args.tree_nodes < 1:
        return f"--tree-nodes must be >= 1, got {args.tree_nodes}"
    if args.tree_nodes is not None and args.tree_paths == 1:
        return (f"--tree-nodes {args.tree_nodes} sizes a token tree: it needs --tree-paths > 1 "
                "(the chain verifies --num-draft-tokens nodes)")
    return None


def ngram_config(args: argparse.Namespace) -> NgramConfig | None:
    """The `--ngram*` flags as an `NgramConfig` (None without `--ngram`); a bad value raises
    `GenerationInputError` naming its flag."""
    if not args.ngram:
        return None
    return NgramConfig(max_n=args.ngram_max_n, min_n=args.ngram_min_n,
                       num_tokens=args.ngram_tokens, match=args.ngram_match)


def device_problem(name: str) -> str | None:
    """Why `--device name` cannot be used here (not a torch device, or CUDA without CUDA),
    as a message naming the flag, or None."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {name}: CUDA is not available here (use --device cpu)"
    return None


def engine_argument_problem(args: argparse.Namespace) -> str | None:
    """The first unusable `add_engine_arguments` value, as a message naming the flag, or None."""
    if args.batch_size < 1:
        return f"--batch-size must be >= 1, got {args.batch_size}"
    if args.max_seq_len is not None and args.max_seq_len < 1:
        return f"--max-seq-len must be >= 1, got {args.max_seq_len}"
    problem = device_problem(args.device)
    if problem:
        return problem
    try:
        ngram_config(args)
    except GenerationInputError as err:
        return str(err)
    if args.chat_template_kwargs is not None:
        try:
            value = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as err:
            return f"--chat-template-kwargs is not JSON ({err})"
        if not isinstance(value, dict):
            return f"--chat-template-kwargs must be a JSON object, got {args.chat_template_kwargs}"
    return None


def build_engine(args: argparse.Namespace) -> Engine:
    """An `Engine` from parsed `add_engine_arguments` arguments (checked first, see
    `engine_argument_problem`; a bad value raises `GenerationInputError`)."""
    problem = engine_argument_problem(args)
    if problem:
        raise GenerationInputError(problem)
    kwargs = {"max_batch_size": args.batch_size, "cuda_graphs": not args.no_cuda_graphs}
    if args.max_seq_len is not None:
        kwargs["max_seq_len"] = args.max_seq_len
    if args.chat_template_kwargs is not None:
        kwargs["chat_template_kwargs"] = json.loads(args.chat_template_kwargs)
    kwargs.update(ngram=ngram_config(args), adaptive=args.adaptive)
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


def _generation_argument_problem(args: argparse.Namespace) -> str | None:
    """The first unusable generation flag of `main`, as a message naming it, or None."""
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature must be a finite number >= 0, got {args.temperature}"
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        return f"--top-p must be in (0, 1], got {args.top_p}"
    problem = round_argument_problem(args)
    if problem:
        return problem
    if "" in args.stop:
        return "--stop '': an empty stop string would end every answer after its first token"
    return None


def _prompts_file_problem(path: Path) -> str | None:
    """Why the prompts file cannot be read as UTF-8 text (naming file and line), or None.

    A missing file and bad rows are `read_prompts`' to report.
    """
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError as err:
        return f"--prompts {path}: cannot read ({err.strerror})"
    problem = utf8_problem(path, data)
    return f"--prompts {problem}" if problem else None


def _write_output(path: Path, report: dict) -> str | None:
    """Write `report` as JSON to `path` atomically; the error message on failure, else None.

    The results go to a temporary file beside `path` that replaces it at the end, and is
    removed on any failure, so `path` is never half-written.
    """
    try:
        write_text_atomic(path, json.dumps(report, indent=1))
    except OSError as err:
        return f"--output {path}: cannot write ({err.strerror or err})"
    return None


def _is_engine_output(path: Path) -> bool:
    """Whether `path` is a results file this CLI wrote (a JSON object of results and stats)."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and set(report) == {"results", "stats"}


def _output_problem(args: argparse.Namespace) -> str | None:
    """Why `--output` may not be written: unwritable, inside (or equal to) an input -- the
    draft's weights, the prompts -- or an existing file this CLI did not write; else None."""
    inputs = {"--target": [args.target], "--draft": [args.draft], "--prompts": [args.prompts],
              "--tokenizer": [args.tokenizer]}
    return output_file_problem(args.output, "--output", "the engine", inputs,
                               is_own=_is_engine_output)


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
    add_round_arguments(parser)
    parser.add_argument("--output", default=None, help="write results and stats as JSON here")
    args = parser.parse_args(argv)
    problem = (
        engine_argument_problem(args)
        or _generation_argument_problem(args)
        or _prompts_file_problem(Path(args.prompts))
        or (_output_problem(args) if args.output else None)
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    try:
        prompts = read_prompts(args.prompts)
        engine = build_engine(args)
        speculative = (engine.draft is not None or engine.ngram is not None) and not args.ar
        if speculative and engine.draft is not None:
            engine.configure_tree(args.tree_paths, args.tree_nodes)
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
        + (f", rounds {stats.round_shapes}" if stats.round_shapes else "")
    )
    if args.output:
        problem = _write_output(Path(args.output), {"results": rows, "stats": summary})
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
    return 0
