"""Command line: convert an exported draft to a checkpoint format.

    python -m dspine_train.export SRC_DIR OUT_DIR --format dflash|dspine|specforge|speculators|deepspec [--verifier T]

`--format dflash` writes what z-lab's `DFlashDraftModel` (and the serving stacks that follow its
format) load: only a draft trained with `method: dflash` can be written so. `--format dspine`
writes this project's own export (which also carries the DFlash keys, under its own
`architectures` name). `--format specforge` writes SpecForge's `DSpineDraftModel` checkpoint (a
DSpine draft), or its `DominoDraftModel` checkpoint for a `method: domino` draft (SGLang serves
it under DFLASH). `--format speculators` writes vLLM's own format (what the `speculators`
package writes; `vllm serve OUT_DIR` detects it) for a DFlash, a DSpark (`method: dspark`) or a
DFlash2 (`method: dflash2`) draft; it names the target model, `--verifier` or by default the path
the draft was trained against. `--format deepspec` writes DeepSpec's own DSpark checkpoint
(`Qwen3DSparkModel`, which vLLM serves natively; a `method: dspark` draft only). SRC_DIR may be a
dspine, dflash, specforge (DSpine or Domino) or deepspec export, or a speculators DSpark or DFlash2
one. OUT_DIR is built beside itself and swapped in whole; it must
be new, empty or an export (it is never a target model, a dataset, or a directory overlapping
SRC_DIR), and is locked for the run. A bad argument, an unconvertible draft, a refused OUT_DIR
or one in use by another export is reported in one line, exit status 2; a failed write (a full
disk) in one line saying the old OUT_DIR is intact, exit status 1.
"""

from __future__ import annotations

import argparse
import sys

import transformers

from dspine_train.cli_errors import existing_output, os_error_line, write_os_error
from dspine_train.formats import FORMATS, FormatError, export_dir
from dspine_train.output_lock import OutputLockedError


def main(argv: list[str] | None = None) -> int:
    """Run the conversion; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m dspine_train.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="an exported draft directory (dspine, dflash, specforge "
                        "or deepspec format, or a speculators DSpark draft)")
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--format", required=True, choices=FORMATS, dest="fmt",
                        help="dflash: DFlashDraftModel's format; dspine: this project's own; "
                             "specforge: SpecForge's DSpineDraftModel (DominoDraftModel for a "
                             "domino draft); "
                             "speculators: vLLM's (the speculators package's); "
                             "deepspec: DeepSpec's DSpark (Qwen3DSparkModel)")
    parser.add_argument("--verifier", default=None,
                        help="speculators: the target model's path or hub id written as the "
                             "verifier (default: the target the draft was trained against)")
    args = parser.parse_args(argv)
    if args.verifier is not None and args.fmt != "speculators":
        print(f"error: --verifier names the target in the speculators format only, not in "
              f"--format {args.fmt}", file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()  # one line of output, not a loading bar
    kept = args.out if existing_output(args.out) else None
    try:
        out = export_dir(args.source, args.out, args.fmt, verifier=args.verifier)
    except (FormatError, OutputLockedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a full disk: safetensors' error wraps the OS error
        os_error = write_os_error(err)
        if os_error is None:
            raise
        print(f"error: {os_error_line(os_error, f'OUT_DIR {args.out}', kept)}", file=sys.stderr)
        return 1
    print(f"wrote {args.fmt} draft to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
