"""Draft defaults live in `DSpineConfig` only: the recipe schema is derived from its fields
(typed, default None), recipes state only what they change, and `plan_only` builds the same
draft config as the trainer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from transformers import Qwen2Config

from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.training.config import ModelConfig, TrainConfig, compose_train_config
from dspine_train.training.errors import TrainingError
from dspine_train.training.inputs import check_inputs
from dspine_train.training.memory_plan.for_recipe import memory_plan_for, plan_draft_config
from dspine_train.training.tiny_assets import tiny_target_config
from tests._train_helpers import DEFAULT_TARGET, REPO

RECIPES = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))
DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head",
                 "confidence_head_with_markov")
DOMINO_FIELDS = ("domino_emb_dim", "domino_gru_hidden_dim", "domino_prefix_len",
                 "domino_shift_label")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")



def _with_readable_target(config: TrainConfig, tmp_path: Path, tiny_assets: dict) -> TrainConfig:
    """`config`, its target made readable as a run would find it: the tiny target written
    (with its tokenizer), or a config of the default target's architecture when it is absent."""
    m = config.model
    if m.tiny_random_target:
        model = dataclasses.replace(m, target_path=str(tiny_assets["target"]))
    elif m.target_config_path or Path(m.target_path).is_dir():
        return config
    else:
        Qwen2Config(**DEFAULT_TARGET).save_pretrained(tmp_path / "target_config")
        model = dataclasses.replace(m, target_config_path=str(tmp_path / "target_config"))
    return dataclasses.replace(config, model=model)


def _other_value(name: str, base: object) -> object:
    """A valid value of draft field `name` that differs from `base` (for the tiny target)."""
    if name == "target_layer_ids":
        return [0, 2]
    if name == "mask_token_id":
        return 510
    if name == "draft_vocab_size":
        return 300
    if name == "sliding_window":
        return 64  # at least the block
    if name == "method":
        return "dflash" if base == "dspine" else "dspine"
    if name == "markov_head_type":
        return "vanilla"  # the one variant implemented; the others are refused by name
    if name == "conv_group_size":
        return base // 2  # still a divisor of the hidden size
    if name == "block_attention":
        return "bidirectional" if base == "causal" else "causal"
    choices = {"readout_init": ("whitened", "directions"),
               "alignment_layer_reduction": ("sum", "mean"),
               "refine_normalization": ("covered", "supervised")}
    if name in choices:
        return next(v for v in choices[name] if v != base)
    if name == "replacement_end_ratio":
        return (base + 1) / 2  # stays above the hold ratio and at most 1
    if isinstance(base, bool):
        return not base
    if isinstance(base, int):
        return base + 1
    if isinstance(base, float):
        return base / 2
    raise AssertionError(f"no test value for DSpineConfig.{name} ({base!r}): add one here")


def _hydra(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def test_schema_draft_fields_are_dspine_fields_with_no_default_of_their_own() -> None:
    schema = {f.name: f for f in dataclasses.fields(ModelConfig)}
    draft = DSpineConfig.draft_fields()
    own = set(DSpineConfig.own_fields())
    # every DSpineConfig field is set by a recipe, taken from the target, or fixed
    assert own == set(draft) | set(DSpineConfig.target_fields) | set(DSpineConfig.fixed_fields)
    assert not set(draft) & set(DSpineConfig.target_fields)
    # the fields `from_target` takes from the target are exactly `target_fields`
    derived = DSpineConfig.target_derived_fields(tiny_target_config(), 500)
    assert set(derived) == set(DSpineConfig.target_fields)
    # the schema reaches every draft field, and none carries a default of its own
    missing = sorted(set(draft) - set(schema))
    assert not missing, f"DSpineConfig fields the recipe schema cannot set: {missing}"
    own_defaults = {name: schema[name].default for name in draft if schema[name].default is not None}
    assert not own_defaults, f"the schema restates DSpineConfig defaults: {own_defaults}"
    assert not (set(schema) & set(DSpineConfig.target_fields))
    assert ModelConfig(target_path="t").draft_overrides() == {}


@pytest.mark.parametrize("name", list(DSpineConfig.draft_fields()))
def test_every_draft_field_reaches_the_draft_from_the_command_line(name: str) -> None:
    # DSpark's head settings belong to `method: dspark` (any other method fixes them off)
    method = ["model.method=dspark"] if name in DSPARK_FIELDS else []
    if name in DOMINO_FIELDS:  # and Domino's GRU settings to `method: domino`
        method = ["model.method=domino"]
    if name in DFLASH2_FIELDS:  # and DFlash2's settings to `method: dflash2`
        method = ["model.method=dflash2"]
    recipe = compose_train_config("recipe=tiny", *method)
    # the value the recipe's draft has (a field `method` fixes defaults to None: the method's)
    base = getattr(plan_draft_config(recipe), name)
    value = _other_value(name, base)
    config = compose_train_config("recipe=tiny", *method, f"model.{name}={_hydra(value)}")
    assert getattr(plan_draft_config(config), name) == value


@pytest.mark.parametrize(
    "override",
    ["model.num_layers=abc", "model.injection=maybe", "model.block_attention=sideways",
     "model.target_layer_ids=abc", "model.loss_gamma=x"],
)
def test_draft_fields_keep_their_types(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigCompositionException, match=key):
        compose_train_config("recipe=tiny", override)


@pytest.mark.parametrize("recipe", RECIPES)
def test_no_recipe_restates_a_dspine_default(recipe: str, tmp_path: Path, tiny_assets: dict) -> None:
    """Every draft field a recipe sets changes the draft `DSpineConfig.from_target` builds."""
    config = _with_readable_target(compose_train_config(f"recipe={recipe}"), tmp_path, tiny_assets)
    draft = plan_draft_config(config).to_dict()
    restated = []
    for name in config.model.draft_overrides():
        without = dataclasses.replace(config, model=dataclasses.replace(config.model, **{name: None}))
        try:
            unchanged = plan_draft_config(without).to_dict() == draft
        except (ValueError, TrainingError):  # the recipe needs it (e.g. `method` for its heads)
            continue
        if unchanged:
            restated.append(f"model.{name}")
    assert not restated, f"recipe {recipe} restates DSpineConfig defaults: {restated}"


@pytest.mark.parametrize("extra", [(), ("model.attention_bias=true",)])
def test_plan_draft_is_the_trainers_draft(tiny_assets: dict, tmp_path: Path, extra) -> None:
    config = compose_train_config(
        "recipe=tiny", f"model.target_path={tiny_assets['target']}",
        f"data.train_path={tiny_assets['data']}", f"output_dir={tmp_path}", *extra)
    trainer_draft = check_inputs(config).draft_config
    assert plan_draft_config(config).to_dict() == trainer_draft.to_dict()
    # and the plan counts that draft's parameters
    draft = DSpineDraftModel(trainer_draft)
    assert memory_plan_for(config).draft_parameters == sum(p.numel() for p in draft.parameters())
