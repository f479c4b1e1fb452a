"""The train command: compose a recipe, then plan or train, build, export.

    dspine-train train recipe=tiny                                # CPU, under a minute
    accelerate launch train.py recipe=qwen3_8b                    # the published setting
    accelerate launch train.py recipe=qwen3_8b deepspeed=zero3 optim.lr=3e-4
    python train.py recipe=qwen3_8b plan_only=true world_size=8   # per-GPU memory, no weights

`train.py` (the repository's root) and `python -m dspine_train.training.train` run the same main
with the same override grammar. Recipes live in `recipes/` (Hydra groups over the schema in
dspine_train/training/config.py); any field can be overridden on the command line. Outputs go
to `output_dir`: checkpoints/, metrics.jsonl, training_curves.png and the exports final/ and
best/ (`DSpineDraftModel.from_pretrained(<output_dir>/final)`).

The module is named `train` because Hydra names the run's log after the module holding the
main (`<output_dir>/train.log`, as it always was).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from dspine_train.training.config import (
    RECIPES_DIR,
    ConfigError,
    register_configs,
    to_train_config,
)
from dspine_train.training.errors import TrainingError
from dspine_train.training.recipe_help import exit_on_help

register_configs()


# An absolute config path: Hydra resolves a relative one against the calling file or module,
# which differs between `python train.py`, `python -m` and the installed command.
@hydra.main(config_path=str(RECIPES_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Compose the recipe, then plan or train, build, export."""
    try:
        config = to_train_config(cfg)
        if config.plan_only:
            from dspine_train.training.memory_plan.for_recipe import memory_plan_for

            print(memory_plan_for(config).table())
            return
        from dspine_train.training.trainer import run_training

        result = run_training(config)
    except (ConfigError, TrainingError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    if result.is_main:
        print(f"done: {result.steps} steps; draft exported to {result.final_export}"
              + (f"; best tau {result.best_tau:.3f} at {result.best_export}"
                 if result.best_tau is not None else ""))


def run() -> None:
    """Command line: the recipe help without a `recipe=` (before Hydra, which needs a recipe to
    compose its own help), else Hydra's main on `sys.argv`."""
    exit_on_help(__doc__)
    main()


if __name__ == "__main__":
    run()
