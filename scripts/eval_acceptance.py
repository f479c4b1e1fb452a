r"""Measure exported DSpine drafts: the same command as `dspine-train eval`.

    python scripts/eval_acceptance.py --target artifacts/default_target \
        --draft artifacts/demo/train/final --bench humaneval,sharegpt --out artifacts/eval

The arguments, outputs and exit statuses are those of `dspine_train.evaluation.cli` (its
docstring, or `--help`); this file is kept so existing command lines keep working.
"""

import sys

from dspine_train.evaluation.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
