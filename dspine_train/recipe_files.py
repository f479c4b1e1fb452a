"""Where the Hydra recipes are: `recipes/` beside the package in a checkout (an editable
install too), else the copy a wheel installs inside the package (`dspine_train/recipes`)."""

from __future__ import annotations

from pathlib import Path


def recipes_dir() -> Path:
    """The recipes' directory: the checkout's `recipes/` where there is one, else the
    package's own copy; `FileNotFoundError` names both where neither exists."""
    checkout = Path(__file__).resolve().parents[1] / "recipes"
    if (checkout / "config.yaml").is_file():
        return checkout
    packaged = Path(__file__).resolve().parent / "recipes"  # where setup.py installs them
    if (packaged / "config.yaml").is_file():
        return packaged
    raise FileNotFoundError(
        f"no recipes: neither {checkout} (a checkout) nor {packaged} (an installed package) "
        "holds config.yaml; reinstall dspine-train")


RECIPES_DIR = recipes_dir()


def resolve_recipe_path(path: str) -> Path:
    """A path a recipe names: absolute or relative to the working directory where it exists
    there, else relative to the recipes' directory (`deepspeed/zero2.json`,
    `targets/qwen3_8b`), so a recipe's files are found from any directory."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return RECIPES_DIR / candidate
