"""Upload an exported DSpine draft to the Hub: the same command as `dspine-train push`.

    python scripts/push_to_hub.py EXPORT_DIR --repo-id ORG/NAME [--public] [--dry-run]

The arguments and exit statuses are those of `dspine_train.hub_cli` (its docstring, or
`--help`); this file is kept so existing command lines keep working.
"""

import sys

from dspine_train.hub_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
