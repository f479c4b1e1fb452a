"""Recipe presets (`recipes/preset/`): SpecForge's objective and published settings as study
variants on top of a recipe, at the recipe's draft size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import Qwen2Config

from dspine_train.training.planning import plan_draft_config
from tests._train_helpers import DEFAULT_TARGET
from tests._train_helpers import compose_recipe as _compose


@pytest.fixture(scope="module")
def target_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("default_target_config")
    Qwen2Config(**DEFAULT_TARGET).save_pretrained(path)
    return path


def _demo_draft(target_config: Path, *overrides: str):
    config = _compose("recipe=qwen2.5_coder_0.5b", *overrides)
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, target_config_path=str(target_config)))
    return config, plan_draft_config(config)


def test_specforge_published_preset_on_the_demo_recipe(target_config: Path) -> None:
    ours_config, ours = _demo_draft(target_config)
    config, draft = _demo_draft(target_config, "preset=specforge_published")
    # SpecForge's configs/qwen3-8b-dspine.json: rank 1024 capped at H, message 512, K 16,
    # warm-up 146, 3 replacement layers; gamma 7 (its trainer's default)
    assert draft.transfer_dim == 896 == DEFAULT_TARGET["hidden_size"]
    assert (draft.message_size, draft.candidate_k, draft.loss_gamma) == (512, 16, 7.0)
    assert (draft.alignment_warmup_steps, draft.replacement_layers) == (146, 3)
    assert (draft.ce_weight, draft.alignment_weight, draft.replacement_probability) == (0.1, 0.5, 0.5)
    # ... with its objective and optimiser
    assert (draft.refine_normalization, draft.alignment_layer_reduction,
            draft.readout_init) == ("supervised", "sum", "directions")
    assert config.optim.betas == [0.9, 0.999]
    # at our draft's size, with a token table of its own rank
    for name in ("num_layers", "block_size", "target_layer_ids"):
        assert getattr(draft, name) == getattr(ours, name), name
    assert (ours.num_layers, ours.block_size, ours.target_layer_ids) == (2, 8, [1, 21])
    assert ours.transfer_dim != draft.transfer_dim
    assert config.model.token_table_path is None
    assert ours_config.model.token_table_path is not None
    # the rest of the recipe (data, steps, optimiser schedule) is unchanged
    assert config.data == ours_config.data and config.optim.lr == ours_config.optim.lr
    assert config.optim.max_steps == ours_config.optim.max_steps


def test_specforge_objective_preset_keeps_the_recipes_settings(target_config: Path) -> None:
    _, ours = _demo_draft(target_config)
    config, draft = _demo_draft(target_config, "preset=specforge_objective")
    assert (draft.refine_normalization, draft.alignment_layer_reduction,
            draft.readout_init) == ("supervised", "sum", "directions")
    assert config.optim.betas == [0.9, 0.999]
    changed = {k for k, v in draft.to_dict().items() if ours.to_dict().get(k) != v}
    assert changed == {"refine_normalization", "readout_init"}  # sum is already the default


def test_a_command_line_override_still_wins_over_a_preset(target_config: Path) -> None:
    _, draft = _demo_draft(target_config, "preset=specforge_published", "model.candidate_k=8")
    assert draft.candidate_k == 8
