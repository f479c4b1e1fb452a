"""`--help` for the commands that compose a training recipe (`train.py`, `cache_features`).

Hydra composes the config before it prints its help, and the primary config leaves `recipe`
unset (`???`), so a bare `--help` fails with a traceback. Without a `recipe=` argument the
commands print their own help instead: the usage, then the recipes and presets to choose from
(`recipes/recipe/`, `recipes/preset/`). With one, Hydra's help shows the composed config.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .config import RECIPES_DIR


def recipes_help(doc: str, recipes_dir: Path = RECIPES_DIR) -> str:
    """`doc` followed by the recipe and preset names found under `recipes_dir`."""
    lines = [doc.strip(), ""]
    for group, what in (("recipe", "recipe=NAME (required)"), ("preset", "preset=NAME")):
        names = sorted(p.stem for p in (recipes_dir / group).glob("*.yaml"))
        lines.append(f"{what}, from {recipes_dir / group}:")
        lines += [f"  {name}" for name in names] or ["  (none)"]
    lines += ["", "Any field can be overridden after the recipe (e.g. optim.lr=1e-3); "
              "`recipe=NAME --help` shows the composed config (Hydra's help)."]
    return "\n".join(lines)


def exit_on_help(doc: str, argv: list[str] | None = None) -> None:
    """Print `recipes_help(doc)` and exit 0 when `argv` asks for help without a recipe."""
    args = sys.argv[1:] if argv is None else argv
    asks = any(arg in ("--help", "-h") for arg in args)
    if asks and not any(arg.startswith("recipe=") for arg in args):
        print(recipes_help(doc))
        sys.exit(0)
