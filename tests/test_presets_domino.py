"""Domino's published settings: recipe qwen3_8b_domino and preset domino_published hold
SpecForge's Qwen3-8B Domino draft (configs/qwen3-8b-domino.json, the online example's loss)."""

from __future__ import annotations

from pathlib import Path

from dspine_train.training.config import compose_train_config
from dspine_train.training.memory_plan.for_recipe import plan_draft_config
from tests.test_presets import _demo_draft, _preset, target_config  # noqa: F401 - the fixture

DOMINO_PUBLISHED = {"method": "domino", "num_layers": 5, "block_size": 16,
                    "target_layer_ids": [1, 9, 17, 25, 33], "loss_gamma": 7.0,
                    "domino_emb_dim": 256, "domino_gru_hidden_dim": 1024,
                    "domino_prefix_len": 1, "domino_shift_label": True,
                    "domino_lambda_start": 1.0, "domino_lambda_decay_ratio": 1.0}


def test_the_domino_recipe_is_specforges_published_draft_for_qwen3_8b() -> None:
    config = compose_train_config("recipe=qwen3_8b_domino")
    draft = plan_draft_config(config)
    assert draft.target_num_layers == 36 and draft.num_predictions == 16  # shifted labels
    for name, value in DOMINO_PUBLISHED.items():
        assert getattr(draft, name) == value, name
    assert (draft.injection, draft.block_attention, draft.transition_cache) == (
        False, "bidirectional", False)
    dspine = compose_train_config("recipe=qwen3_8b")
    assert config.data == dspine.data and config.optim == dspine.optim
    assert config.world_size == dspine.world_size


def test_the_domino_preset_holds_the_recipes_values_at_any_recipes_depth(
        target_config: Path) -> None:  # noqa: F811 - the fixture
    preset = _preset("domino_published")["model"]
    assert set(preset) == set(DOMINO_PUBLISHED) - {"num_layers", "target_layer_ids"}
    ours_config, ours = _demo_draft(target_config)
    config, draft = _demo_draft(target_config, "preset=domino_published")
    for name in preset:
        assert getattr(draft, name) == DOMINO_PUBLISHED[name], name
    for name in ("num_layers", "target_layer_ids"):
        assert getattr(draft, name) == getattr(ours, name), name
    assert config.data == ours_config.data and config.optim == ours_config.optim


def test_the_memory_plan_counts_domino_heads_and_its_block_of_b_predictions() -> None:
    from dspine_train.training.memory_plan.for_recipe import memory_plan_for

    domino = memory_plan_for(compose_train_config("recipe=qwen3_8b_domino"))
    dflash = memory_plan_for(compose_train_config("recipe=qwen3_8b_domino",
                                                  "model.method=dflash",
                                                  "model.domino_prefix_len=null",
                                                  "model.domino_shift_label=null"))
    assert domino.total_bytes > dflash.total_bytes


def test_the_memory_plan_counts_the_real_domino_drafts_parameters() -> None:
    import torch

    from dspine_train.training.memory_plan.parameters import (
        draft_parameter_counts,
        method_fields_of,
    )
    from tests.test_memory_plan import M, N, R, _real_draft, tiny_config

    for shift in (False, True):
        draft = _real_draft(N, method="domino", domino_gru_hidden_dim=24, domino_emb_dim=12,
                            domino_shift_label=shift)
        counts = draft_parameter_counts(
            tiny_config(), draft_num_layers=N, transfer_dim=R, message_size=M,
            num_context_layers=draft.config.num_context_layers,
            method_fields=method_fields_of(draft.config))
        assert sum(counts.values()) == sum(p.numel() for p in draft.parameters())
        gru_mlp = [draft.prefix_gru, draft.embed_proj]
        assert counts["method_heads"] == sum(p.numel() for m in gru_mlp for p in m.parameters())
        assert torch.device("meta") == draft.fc.weight.device
