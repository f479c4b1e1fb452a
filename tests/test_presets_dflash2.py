"""DFlash2's published settings: the preset `dflash2_published` and the recipe
`qwen3_8b_dflash2` (as `test_presets.py` checks DSpark's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import Qwen2Config

from dspine_train.training.config import compose_train_config
from tests._train_helpers import DEFAULT_TARGET, REPO
from tests.test_presets import _demo_draft

DFLASH2_PUBLISHED = {"method": "dflash2", "num_layers": 5, "block_size": 16,
                     "target_layer_ids": [1, 9, 17, 25, 33], "loss_gamma": 7.0, "distill": True,
                     "selector_weight": 1.0, "conv_kernel_size": 2, "conv_group_size": 16,
                     "selector_rank": 256, "selector_top_k": 16}


@pytest.fixture(scope="module")
def target_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("default_target_config")
    Qwen2Config(**DEFAULT_TARGET).save_pretrained(path)
    return path


def test_the_dflash2_recipe_is_the_published_draft_for_qwen3_8b() -> None:
    from dspine_train.training.memory_plan.for_recipe import plan_draft_config

    config = compose_train_config("recipe=qwen3_8b_dflash2")
    draft = plan_draft_config(config)  # the Qwen3-8B config under recipes/targets/
    assert draft.target_num_layers == 36 and draft.num_predictions == 15
    for name, value in DFLASH2_PUBLISHED.items():
        assert getattr(draft, name) == value, name
    # the backbone DFlash2 fixes: DFlash's (no injection, bidirectional block)
    assert (draft.injection, draft.block_attention, draft.transition_cache) == (
        False, "bidirectional", False)
    dspine = compose_train_config("recipe=qwen3_8b")
    assert config.data == dspine.data and config.optim == dspine.optim
    assert config.world_size == dspine.world_size


def test_the_dflash2_preset_holds_the_recipes_values_at_any_recipes_depth(
        target_config: Path) -> None:
    preset = OmegaConf.to_container(OmegaConf.load(
        REPO / "recipes" / "preset" / "dflash2_published.yaml"))["model"]
    assert set(preset) == set(DFLASH2_PUBLISHED) - {"num_layers", "target_layer_ids"}
    ours_config, ours = _demo_draft(target_config)
    config, draft = _demo_draft(target_config, "preset=dflash2_published")
    for name in preset:  # a null field: DSpineConfig's (or method: dflash2's) default
        assert getattr(draft, name) == DFLASH2_PUBLISHED[name], name
    for name in ("num_layers", "target_layer_ids"):
        assert getattr(draft, name) == getattr(ours, name), name
    assert config.data == ours_config.data and config.optim == ours_config.optim
