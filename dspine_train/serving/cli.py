r"""Command line: serve a target and a DSpine draft over OpenAI's HTTP API.

    python -m dspine_train.serving --target TARGET_DIR --draft DRAFT_DIR \
        [--host 127.0.0.1] [--port 8000] [--served-model-name NAME] \
        [--max-batch-size 8] [--batch-window-ms 5] [--max-new-tokens 128] \
        [--device cuda] [--dtype bfloat16] [--ngram ...] [--adaptive] [--num-draft-tokens 7] \
        [--tree-paths 1 --tree-nodes N] [--ar] [--warmup]

The engine flags are those of `python -m dspine_train.engine` (`--batch-size` is named
`--max-batch-size` here: the engine's batch capacity and the largest batch the scheduler
forms). `--max-new-tokens` is a request's budget when it gives no `max_tokens`. Flag values are
checked before any model is loaded; a bad one is reported in one line naming it, with exit
status 2. SIGTERM / Ctrl-C finish the requests in flight, then exit. See docs/SERVING.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspine_train.engine.cli import (
    add_model_arguments,
    add_round_arguments,
    build_engine,
    engine_argument_problem,
    round_argument_problem,
)
from dspine_train.engine.engine import Engine
from dspine_train.engine.errors import (
    CheckpointError,
    GenerationInputError,
    IncompatibleDraftError,
)
from dspine_train.serving.config import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    """The server's arguments: the engine's model and round flags plus the HTTP ones."""
    parser = argparse.ArgumentParser(
        prog="python -m dspine_train.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    add_round_arguments(parser)
    serve = parser.add_argument_group("serving")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the draft's directory name, "
                       "else the target's)")
    serve.add_argument("--max-batch-size", dest="batch_size", type=int, default=8,
                       help="requests per engine batch (the engine's cache capacity)")
    serve.add_argument("--batch-window-ms", type=float, default=5.0,
                       help="how long the scheduler waits for more requests to batch")
    serve.add_argument("--max-new-tokens", type=int, default=128,
                       help="a request's token budget when it gives no max_tokens")
    serve.add_argument("--warmup", action="store_true",
                       help="compile / capture the steps for batch sizes 1..max before serving")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    return parser


def serving_argument_problem(args: argparse.Namespace) -> str | None:
    """The first unusable flag, as a message naming it, or None."""
    if args.batch_size < 1:  # the engine's check names its own flag, --batch-size
        return f"--max-batch-size must be >= 1, got {args.batch_size}"
    problem = engine_argument_problem(args) or round_argument_problem(args)
    if problem:
        return problem
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535, got {args.port}"
    if args.batch_window_ms < 0:
        return f"--batch-window-ms must be >= 0, got {args.batch_window_ms}"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    return None


def server_config(args: argparse.Namespace, engine: Engine) -> ServerConfig:
    """The app's settings from the flags; the engine decides whether rounds are speculative."""
    name = args.served_model_name or Path(args.draft or args.target).resolve().name
    speculative = (engine.draft is not None or engine.ngram is not None) and not args.ar
    return ServerConfig(
        model_name=name,
        default_max_tokens=args.max_new_tokens,
        max_batch_size=args.batch_size,
        batch_window_ms=args.batch_window_ms,
        speculative=speculative,
        num_draft_tokens=args.num_draft_tokens if speculative else None,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m dspine_train.serving` (and `dspine-train serve`); returns the
    exit status once the server has stopped."""
    args = build_parser().parse_args(argv)
    problem = serving_argument_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # Imported after the flags are checked: the web stack is the `serve` extra.
    import uvicorn

    from dspine_train.serving.app import create_app

    try:
        engine = build_engine(args)
        config = server_config(args, engine)
        if config.speculative and engine.draft is not None:
            engine.configure_tree(args.tree_paths, args.tree_nodes)
        if args.warmup:
            sizes = range(1, min(args.batch_size, engine.max_batch_size) + 1)
            engine.warmup(batch_sizes=list(sizes))
        app = create_app(engine, config)
    except (CheckpointError, IncompatibleDraftError, GenerationInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Uvicorn handles SIGINT / SIGTERM: it stops accepting, lets in-flight requests finish,
    # then runs the app's shutdown (the scheduler drains its queue).
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
