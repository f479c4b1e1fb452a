"""`model.warm_start_layers`: the draft's decoder layers start as copies of chosen target layers.

The copy is read from the target's safetensors (no target model is built), tensor for tensor;
everything else is the cold draft of the same seed. Bad choices are refused by name before
any tensor is copied, and a trainer run with offline features starts from the copied layers.
"""

from __future__ import annotations

import pytest
from _model_helpers import USED_VOCAB, tiny_target
from safetensors.torch import load_file

from dspine_train.formats import load_draft
from dspine_train.modeling import DSpineDraftModel
from dspine_train.token_table import build_token_table
from dspine_train.training.config import ConfigError, ModelConfig, compose_train_config
from dspine_train.training.draft_builder import build_draft, draft_config_for
from dspine_train.training.errors import TrainingError
from tests._train_helpers import check_ok, run_module, run_train, tiny_overrides

SMALL = dict(num_layers=2, transfer_dim=16, message_size=16, candidate_k=4)
LAYERS = [4, 1]  # draft layer 0 <- target layer 4, draft layer 1 <- target layer 1


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny 6-layer Qwen3 target saved as safetensors, and another one whose MLP is narrower."""
    root = tmp_path_factory.mktemp("layer_warm")
    target = tiny_target(seed=0)
    target.save_pretrained(root / "target")
    narrow = tiny_target(seed=1)
    narrow.config.intermediate_size = 96
    type(narrow)(narrow.config).save_pretrained(root / "narrow")
    table = build_token_table(target.lm_head.weight.detach().float(), SMALL["transfer_dim"])
    return {"root": root, "target": target, "table": table}


def _draft(world, seed: int = 3, target: str = "target", **fields) -> DSpineDraftModel:
    """The step-0 draft as the trainer builds it (`draft_config_for`, then `build_draft`)."""
    hf = world["target"]
    m = ModelConfig(target_path=str(world["root"] / target), **{**SMALL, **fields})
    config = draft_config_for(m, hf.config, USED_VOCAB)
    return build_draft(m, config, world["table"], hf.config, seed)


def test_copied_layers_are_the_targets_and_the_rest_is_the_cold_init(world):
    lines: list[str] = []
    hf = world["target"]
    m = ModelConfig(target_path=str(world["root"] / "target"), warm_start_layers=LAYERS, **SMALL)
    config = draft_config_for(m, hf.config, USED_VOCAB)
    warm = build_draft(m, config, world["table"], hf.config, 3, log=lines.append).state_dict()
    cold = _draft(world).state_dict()
    theirs = hf.state_dict()
    copied = 0
    for name, value in warm.items():
        if name.startswith("layers."):
            i, local = name.split(".", 2)[1:]
            source = theirs[f"model.layers.{LAYERS[int(i)]}.{local}"]
            assert value.dtype == source.dtype and value.equal(source), name
            # a real copy: the cold draft's layer differs (its norms are ones, not the target's)
            assert not value.equal(cold[name]) or "norm" in name
            copied += 1
        else:  # fc, hidden_norm, norm, injection, readouts, token codes: the cold init
            assert value.equal(cold[name]), name
    assert copied == 2 * 11  # q/k/v/o, q/k norms, gate/up/down, the two RMSNorms
    assert lines and "target layers [4, 1] (22 tensors copied)" in lines[0]


def test_a_narrower_draft_layer_is_refused_by_layer_and_tensor_before_any_copy(world):
    with pytest.raises(TrainingError, match=r"model\.warm_start_layers: draft layer 0 cannot take "
                       r"target layer 4: tensor mlp\.down_proj\.weight is \[64, 96\] in the "
                       r"target, \[64, 128\] in the draft"):
        _draft(world, target="narrow", warm_start_layers=LAYERS)


@pytest.mark.parametrize("layers, message", [
    ([2], r"model\.warm_start_layers: 1 entries for a 2-layer draft"),
    ([2, 6], r"model\.warm_start_layers: \[6\] outside 0\.\.5 for the 6-layer target"),
])
def test_a_bad_layer_choice_is_refused_by_name(world, layers, message):
    with pytest.raises(TrainingError, match=message):
        _draft(world, warm_start_layers=layers)


def test_warm_start_layers_with_init_from_is_refused(world, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.warm_start_layers and model\.init_from"):
        compose_train_config("recipe=tiny", f"model.init_from={tmp_path}",
                             "model.warm_start_layers=[2,3]")
    with pytest.raises(TrainingError, match=r"model\.warm_start_layers and model\.init_from"):
        _draft(world, warm_start_layers=LAYERS, init_from=str(tmp_path))


def test_the_study_variant_composes():
    from scripts.tools.ablation.variants import VARIANTS

    config = compose_train_config("recipe=qwen2.5_coder_0.5b",
                                  *VARIANTS["dspine_warm_start"].hydra_overrides())
    assert config.model.warm_start_layers == [22, 23]


@pytest.mark.slow  # one feature-cache pass and one DeepSpeed run of the tiny recipe (~20 s)
def test_train_py_with_offline_features_starts_from_the_target_layers(tiny_assets, tmp_path):
    """Offline features (the trainer never builds the target), one step at lr 0: the exported
    draft's layers are the target's layers 3 and 0, read from its safetensors."""
    features = tmp_path / "features"
    common = tiny_overrides(tiny_assets, tmp_path / "run", f"data.offline_features_dir={features}")
    check_ok(run_module(["-m", "dspine_train.training.cache_features", *common]))
    proc = run_train([*common, "model.warm_start_layers=[3,0]", "optim.max_steps=1",
                      "optim.lr=0", "eval.every=0"])
    check_ok(proc)
    assert "model.warm_start_layers: draft layers <- target layers [3, 0]" in proc.stdout
    state = load_draft(tmp_path / "run" / "final").state_dict()
    target = load_file(tiny_assets["target"] / "model.safetensors")
    layers = [k for k in state if k.startswith("layers.")]
    assert layers
    for name in layers:
        i, local = name.split(".", 2)[1:]
        assert state[name].equal(target[f"model.layers.{[3, 0][int(i)]}.{local}"]), name
