"""Recipe presets (`recipes/preset/`): SpecForge's objective and published settings as study
variants on top of a recipe, at the recipe's draft size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import Qwen2Config

from dspine_train import DSpineConfig
from dspine_train.training.config import compose_train_config
from dspine_train.training.memory_plan.for_recipe import plan_draft_config
from tests._train_helpers import DEFAULT_TARGET, REPO


@pytest.fixture(scope="module")
def target_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("default_target_config")
    Qwen2Config(**DEFAULT_TARGET).save_pretrained(path)
    return path


def _demo_draft(target_config: Path, *overrides: str):
    config = compose_train_config("recipe=qwen2.5_coder_0.5b", *overrides)
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, target_config_path=str(target_config)))
    return config, plan_draft_config(config)


def _preset(name: str) -> dict:
    """The `model` and `optim` keys a preset file sets (its own and its defaults' presets)."""
    node = OmegaConf.load(REPO / "recipes" / "preset" / f"{name}.yaml")
    fields: dict = {}
    for parent in node.get("defaults", []):
        if parent != "_self_":
            for group, values in _preset(parent).items():
                fields.setdefault(group, {}).update(values)
    for group in ("model", "optim"):
        if group in node:
            fields.setdefault(group, {}).update(OmegaConf.to_container(node[group]))
    return fields


def test_specforge_published_preset_on_the_demo_recipe(target_config: Path) -> None:
    ours_config, ours = _demo_draft(target_config)
    config, draft = _demo_draft(target_config, "preset=specforge_published")
    preset = _preset("specforge_published")
    defaults = DSpineConfig.from_target(Qwen2Config(**DEFAULT_TARGET), mask_token_id=0,
                                        num_layers=ours.num_layers)
    # a set field wins; a null one resets the recipe's value to DSpineConfig's default, capped
    # by the target (transfer rank 1024 capped at H)
    for name, value in preset["model"].items():
        if name == "token_table_path":
            continue
        expected = getattr(defaults, name) if value is None else value
        assert getattr(draft, name) == expected, name
    assert draft.transfer_dim == DEFAULT_TARGET["hidden_size"] < DSpineConfig.transfer_dim
    assert config.optim.betas == preset["optim"]["betas"]
    # the preset changes what the recipe sets: otherwise the check above proves nothing
    assert {n for n in preset["model"] if getattr(ours, n, None) != getattr(draft, n, None)} >= {
        "transfer_dim", "message_size", "candidate_k", "loss_gamma", "alignment_warmup_steps"}
    # at our draft's size, with a token table of its own rank
    for name in ("num_layers", "block_size", "target_layer_ids"):
        assert getattr(draft, name) == getattr(ours, name), name
    assert config.model.token_table_path is None
    assert ours_config.model.token_table_path is not None
    # the rest of the recipe (data, steps, optimiser schedule) is unchanged
    assert config.data == ours_config.data and config.optim.lr == ours_config.optim.lr
    assert config.optim.max_steps == ours_config.optim.max_steps


def test_specforge_objective_preset_keeps_the_recipes_settings(target_config: Path) -> None:
    _, ours = _demo_draft(target_config)
    config, draft = _demo_draft(target_config, "preset=specforge_objective")
    preset = _preset("specforge_objective")
    for name, value in preset["model"].items():
        assert getattr(draft, name) == value, name
    assert config.optim.betas == preset["optim"]["betas"]
    # it moves exactly the fields it sets to another value than the recipe's, nothing else
    changed = {k for k, v in draft.to_dict().items() if ours.to_dict().get(k) != v}
    assert changed == {n for n, v in preset["model"].items() if getattr(ours, n) != v}
    assert changed  # otherwise the check above proves nothing


def test_a_command_line_override_still_wins_over_a_preset(target_config: Path) -> None:
    _, draft = _demo_draft(target_config, "preset=specforge_published", "model.candidate_k=8")
    assert draft.candidate_k == 8


# ---------------------------------------------------------------------------- DSpark
DSPARK_PUBLISHED = {"method": "dspark", "num_layers": 5, "block_size": 7,
                    "target_layer_ids": [1, 9, 17, 25, 33], "loss_gamma": 4.0, "ce_weight": 0.1,
                    "confidence_weight": 1.0, "distill": True, "markov_rank": 256,
                    "markov_head_type": "vanilla", "enable_confidence_head": True,
                    "confidence_head_with_markov": True}


def test_the_dspark_recipe_is_deepspecs_published_draft_for_qwen3_8b() -> None:
    config = compose_train_config("recipe=qwen3_8b_dspark")
    draft = plan_draft_config(config)  # the Qwen3-8B config under recipes/targets/
    assert draft.target_num_layers == 36 and draft.num_predictions == 7
    for name, value in DSPARK_PUBLISHED.items():
        assert getattr(draft, name) == value, name
    # the backbone DSpark fixes: DFlash's (no injection, bidirectional block, per-slot decode)
    assert (draft.injection, draft.block_attention, draft.transition_cache) == (
        False, "bidirectional", False)
    # the same data and budget as the DSpine recipe it is compared with
    dspine = compose_train_config("recipe=qwen3_8b")
    assert config.data == dspine.data and config.optim == dspine.optim
    assert config.world_size == dspine.world_size


def test_the_dspark_preset_holds_the_recipes_values_at_any_recipes_depth(
        target_config: Path) -> None:
    preset = _preset("dspark_published")["model"]
    assert set(preset) == set(DSPARK_PUBLISHED) - {"num_layers", "target_layer_ids"}
    ours_config, ours = _demo_draft(target_config)
    config, draft = _demo_draft(target_config, "preset=dspark_published")
    for name in preset:  # a null field: DSpineConfig's (or method: dspark's) default
        assert getattr(draft, name) == DSPARK_PUBLISHED[name], name
    for name in ("num_layers", "target_layer_ids"):  # the recipe's draft depth and context
        assert getattr(draft, name) == getattr(ours, name), name
    assert config.data == ours_config.data and config.optim == ours_config.optim
