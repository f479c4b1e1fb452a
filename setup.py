"""Packaging beyond pyproject.toml: the recipes travel inside the package.

`recipes/` stays at the top of the repository (Hydra reads it there in a checkout); a wheel
installs the same files as `dspine_train/recipes`, where `dspine_train.recipe_files` finds
them when there is no checkout. Everything else is declared in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["dspine_train*", "data_prep*"]), "dspine_train.recipes"],
    package_dir={"dspine_train.recipes": "recipes"},
    package_data={"dspine_train.recipes": ["*.yaml", "**/*.yaml", "**/*.json", "**/*.md"]},
)
