"""The ablation table's rows (`scripts/ablate.py`): each variant's budget, read back from its
run's own saved config, its final losses and its evaluation; and whether the runs differ only
where the variants say.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dspine_train.evaluation.block_metrics import BlockResults

from .records import AblationRow, Evaluation, RunBudget
from .runner import BLOCKS_FILE, RUN_CONFIG, StudySettings, source_run_dir
from .variants import REFERENCE, Variant

# settings of the training study's own stages (final evaluation, plan, archive, report), which
# the ablation does not run
STUDY_ONLY = ("final_max_blocks", "plan_steps", "report_stem", "command", "archive_dir")


def settings_record(settings: StudySettings) -> dict[str, Any]:
    """The settings the ablation ran with, as JSON-ready values."""
    return {key: str(value) if isinstance(value, Path) else value
            for key, value in asdict(settings).items() if key not in STUDY_ONLY}


def collect_row(settings: StudySettings, variant: Variant, evaluation: Evaluation) -> AblationRow:
    """One table row: the variant, the budget its weights were trained with (read back from
    the run's own saved config), its final losses and its evaluation."""
    from dspine_train.training.tracking import read_metrics

    from .report import final_losses
    from .simulated import load_run_config

    run_dir = source_run_dir(settings, variant)
    config = load_run_config(run_dir / RUN_CONFIG)
    history = read_metrics(run_dir / "metrics.jsonl")
    trainer_tau = [row["eval/tau"] for row in history if "eval/tau" in row]
    timing_path = run_dir / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    budget = RunBudget(
        dir=str(run_dir), recipe=config.name, steps=config.optim.max_steps, seed=config.seed,
        train_path=config.data.train_path,
        offline_features_dir=config.data.offline_features_dir,
        batch_size=config.data.batch_size, num_anchors=config.data.num_anchors,
        max_length=config.data.max_length, lr=config.optim.lr,
        precision=config.precision.value)
    return AblationRow(
        variant=variant.name, description=variant.description, switches=variant.switches(),
        trained=variant.trained, reuse=variant.reuse, run=budget,
        train_wall_s=timing.get("train_wall_s"),
        resumed_from_step=timing.get("resumed_from_step", 0),
        final_losses=final_losses(history, config.optim.max_steps),
        # the trainer evaluated the source variant's decode, not a derived one's
        trainer_sim_tau=trainer_tau[-1] if trainer_tau and variant.trained else None,
        simulated=evaluation.simulated,
        paired_vs_dspine=_paired_vs_reference(settings, variant),
        engine=evaluation.engine)


def _paired_vs_reference(settings: StudySettings, variant: Variant) -> dict[str, float] | None:
    """The variant's simulated tau minus the reference's on the same held-out blocks, with
    SEs."""
    from dspine_train.evaluation.block_metrics import paired_difference

    mine = settings.run_dir(variant) / BLOCKS_FILE
    reference = settings.out_dir / REFERENCE / BLOCKS_FILE
    if variant.name == REFERENCE or not (mine.is_file() and reference.is_file()):
        return None
    try:
        return paired_difference(BlockResults.load(mine), BlockResults.load(reference))
    except ValueError:  # other blocks (another block size): no paired figure
        return None


def same_budget(rows: Sequence[AblationRow]) -> bool:
    """Whether every row's weights were trained with the same data, budget and seed."""
    return len({row.run.key() for row in rows}) == 1


def config_differences(settings: StudySettings, variants: Sequence[Variant]) -> list[str]:
    """Keys of the trained runs' saved configs that differ, besides the variants' overrides.

    Empty when the runs are identical except for what the study changes on purpose (a recipe
    edited between two runs would show up here).
    """
    from omegaconf import OmegaConf

    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for key, value in node.items():
                out.update(flat(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: node}

    trained = [v for v in variants if v.trained]
    switched = {o.split("=", 1)[0] for v in trained for o in v.overrides}
    configs = []
    for variant in trained:
        config = flat(OmegaConf.to_container(OmegaConf.load(settings.run_dir(variant) / RUN_CONFIG)))
        for key in ["output_dir", *switched]:
            config.pop(key, None)
        configs.append(config)
    keys = sorted({k for c in configs for k in c})
    return [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
