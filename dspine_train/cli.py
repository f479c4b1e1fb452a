"""The `dspine-train` command: one subcommand per pipeline step, thin over each step's own main.

    dspine-train --help                       # the pipeline, in order, with an example chain
    dspine-train STEP --help                  # that step's own arguments
    dspine-train train recipe=tiny            # == python train.py recipe=tiny
    python -m dspine_train.cli STEP ARGS...   # the same, without the installed script

Every argument after the step name is passed unchanged to the step's existing entry point, so
each takes the grammar it always took: Hydra overrides (`data=NAME`, `recipe=NAME key=value`)
for the recipe-driven steps, flags for the others. A recipe-driven step runs as
`python -m MODULE` would (Hydra resolves its recipes and names its log from the module's file);
the others call `main(argv)` and exit with its status. An unknown step exits 2 naming the valid
ones. `serve` runs `dspine_train.serving.cli` when this build has it, else exits 2 saying so.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

PROG = "dspine-train"
EXIT_USAGE = 2
HELP_WIDTH = 98


@dataclass(frozen=True)
class Step:
    """One subcommand: the module holding its entry point and what it reads and writes."""

    name: str
    module: str
    summary: str  # what the step reads -> what it writes, for the pipeline help
    hydra: bool = False  # a Hydra main: run as `python -m module` (it reads sys.argv itself)


STEPS: tuple[Step, ...] = (
    Step("regenerate", "data_prep.regenerate",
         "data=NAME: the recipe's prompts -> the target's answers, JSONL shards in "
         "data.regenerate.output_dir", hydra=True),
    Step("tokenize", "data_prep.tokenize",
         "data=NAME: those conversations -> token ids and loss masks, train/eval splits in "
         "data.tokenize.output_dir", hydra=True),
    Step("cache-features", "dspine_train.training.cache_features",
         "recipe=NAME: the tokenised data through the target -> its features in "
         "data.offline_features_dir (optional: else train runs the target online)", hydra=True),
    Step("token-table", "dspine_train.token_table",
         "--target DIR: the target's LM head -> PCA-whitened token codes, --out FILE"),
    Step("train", "dspine_train.training.train",
         "recipe=NAME [key=value ...]: data, target, token table -> checkpoints, metrics and "
         "the draft's export in output_dir/final (and best/)", hydra=True),
    Step("export", "dspine_train.export",
         "SRC_DIR OUT_DIR --format F: an exported draft -> dflash, dspine, specforge or "
         "speculators checkpoint"),
    Step("generate", "dspine_train.engine.cli",
         "--target DIR --draft DIR --prompts FILE: texts, tau and tokens/s (--output JSON)"),
    Step("eval", "dspine_train.evaluation.cli",
         "--target DIR --draft DIR --out DIR: tau, per-position acceptance, speed, lossless "
         "check -> results.json/.md, acceptance.png"),
    Step("push", "dspine_train.hub_cli",
         "EXPORT_DIR --repo-id ORG/NAME: the export and a model card -> a Hugging Face Hub "
         "repository (--dry-run: the plan only)"),
    Step("serve", "dspine_train.serving.cli",
         "--target DIR --draft DIR [--port N]: an OpenAI-compatible HTTP server (docs/SERVING.md)"),
)
STEP_NAMES = tuple(step.name for step in STEPS)

EXAMPLE = """\
  dspine-train regenerate data=default_target_humaneval
  dspine-train tokenize data=default_target_humaneval
  dspine-train cache-features recipe=qwen2.5_coder_0.5b $DATA
  dspine-train token-table --target artifacts/default_target \\
      --out artifacts/demo/token_table.safetensors
  dspine-train train recipe=qwen2.5_coder_0.5b $DATA
  dspine-train export outputs/qwen2.5_coder_0.5b/final artifacts/specforge_draft --format specforge
  dspine-train generate --target artifacts/default_target \\
      --draft outputs/qwen2.5_coder_0.5b/final --prompts prompts.txt
  dspine-train eval --target artifacts/default_target \\
      --draft outputs/qwen2.5_coder_0.5b/final --out artifacts/eval
  dspine-train push outputs/qwen2.5_coder_0.5b/final --repo-id ORG/NAME --dry-run
where DATA='data.train_path=artifacts/data/humaneval/tokenized' (tokenize's output; the
target is artifacts/default_target: `python -m data_prep.default_target` writes it).
On a CPU in about a minute, with a tiny random target and its data written on first use:
  dspine-train train recipe=tiny"""


def pipeline_help() -> str:
    """`dspine-train --help`: the steps in pipeline order, what each reads and writes, an example."""
    width = max(len(name) for name in STEP_NAMES)
    lines = [f"usage: {PROG} STEP [ARGS ...]", "",
             "Train and serve DSpine draft models for lossless speculative decoding. The steps,",
             "in pipeline order (each reads what the ones before it wrote):", ""]
    for step in STEPS:  # the summary wrapped beside the name
        lines += textwrap.wrap(step.summary, HELP_WIDTH, initial_indent=f"  {step.name:<{width}}  ",
                               subsequent_indent=" " * (width + 4))
    lines += ["", "Example chain (the embedded Qwen2.5-Coder-0.5B target):",
              EXAMPLE, "",
              f"`{PROG} STEP --help` shows a step's own arguments; every argument after STEP",
              "is passed to it unchanged."]
    return "\n".join(lines)


def unknown_step_message(name: str) -> str:
    """The one-line error for a step that does not exist, naming the valid ones."""
    return (f"{PROG}: error: unknown step {name!r}; choose one of: {', '.join(STEP_NAMES)} "
            f"(`{PROG} --help` describes them)")


@contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    """`sys.argv` as the step's entry point reads it, restored afterwards."""
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def run_step(step: Step, argv: list[str]) -> int:
    """Run `step` with `argv` (the arguments after its name); returns the exit status."""
    if step.hydra:
        # As `python -m module`: Hydra resolves the recipes and names the log from the file.
        with _argv([step.module, *argv]):
            try:
                runpy.run_module(step.module, run_name="__main__", alter_sys=True)
            except SystemExit as exit_:
                return _status(exit_.code)
        return 0
    try:
        module = importlib.import_module(step.module)
    except ImportError as err:
        if step.name != "serve":
            raise
        print(f"{PROG}: error: `serve` is not available in this build ({step.module} does not "
              f"import: {err})", file=sys.stderr)
        return EXIT_USAGE
    with _argv([f"{PROG} {step.name}", *argv]):  # argparse's usage line: `dspine-train STEP`
        try:
            return _status(module.main(argv))
        except SystemExit as exit_:  # argparse: --help (0), a bad flag (2)
            return _status(exit_.code)


def _status(code: object) -> int:
    """An exit code as `sys.exit` turns it into a process status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the installed `dspine-train` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(pipeline_help(), file=sys.stderr)
        return EXIT_USAGE
    if args[0] in ("-h", "--help", "help"):
        print(pipeline_help())
        return 0
    steps = {step.name: step for step in STEPS}
    if args[0] not in steps:
        print(unknown_step_message(args[0]), file=sys.stderr)
        return EXIT_USAGE
    return run_step(steps[args[0]], args[1:])


if __name__ == "__main__":
    sys.exit(main())
