"""`model.init_from` = a DSpine export: the run continues that draft under the recipe's objective.

The export fixes the structure (a recipe that sets another value is refused by name, one that
leaves a field unset takes the export's); the recipe's objective fields replace the export's;
every weight is the export's, bit for bit; an export made for another target is refused.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

from dspine_train.training.config import ModelConfig
from dspine_train.training.draft_builder import build_draft, draft_config_for
from dspine_train.training.errors import TrainingError
from dspine_train.training.initialisation.from_export import STRUCTURE_FIELDS

VOCAB = 200
# The export's structure and objective, none of them the schema's defaults.
EXPORTED = dict(num_layers=2, block_size=6, target_layer_ids=[0, 3], transfer_dim=16,
                message_size=16, candidate_k=4, ce_weight=0.3, alignment_weight=0.25,
                loss_gamma=5.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target (5 layers) and a DSpine draft export for it with random weights."""
    root = tmp_path_factory.mktemp("export_init")
    hf = build_tiny_target(root / "target", "qwen3", num_hidden_layers=5, eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=VOCAB)
    draft = tiny_draft(hf, VOCAB, **EXPORTED)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # no zero-initialised tensor left: a copy is checked on every value
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    draft.save_pretrained(root / "export")
    return {"root": root, "hf": hf, "draft": draft}


def _model_cfg(world, init_from=None, **fields) -> ModelConfig:
    return ModelConfig(target_path=str(world["root"] / "target"),
                       init_from=str(init_from or world["root"] / "export"), **fields)


def test_the_export_s_structure_and_the_recipe_s_objective(world):
    m = _model_cfg(world, block_size=6, alignment_weight=0.0, loss_gamma=2.0)
    config = draft_config_for(m, world["hf"].config, VOCAB)
    exported = world["draft"].config
    for name in STRUCTURE_FIELDS:  # set by the recipe to the same value, or left unset
        assert getattr(config, name) == getattr(exported, name), name
    assert (config.alignment_weight, config.loss_gamma) == (0.0, 2.0)  # the recipe's
    assert config.ce_weight == 0.3  # unset in the recipe: the export's, not the default
    assert config.target_name_or_path == m.target_path

    draft = build_draft(m, config, None, world["hf"].config, seed=0)
    assert draft.config.alignment_weight == 0.0 and draft.config.loss_gamma == 2.0
    state, reference = draft.state_dict(), world["draft"].state_dict()
    assert state.keys() == reference.keys()
    assert all(state[k].equal(reference[k]) for k in reference)


def test_a_recipe_that_sets_another_structure_is_refused_by_name(world):
    m = _model_cfg(world, num_layers=3, block_size=6, transfer_dim=32)
    with pytest.raises(TrainingError, match=r"model\.num_layers=3 \(the export has 2\), "
                                            r"model\.transfer_dim=32 \(the export has 16\)") as err:
        draft_config_for(m, world["hf"].config, VOCAB)
    assert "block_size" not in str(err.value)  # the same value as the export's is no conflict


def test_an_export_for_another_target_is_refused_by_name(world, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(world["root"] / "export", other)
    fields = json.loads((other / "config.json").read_text())
    fields["rms_norm_eps"] = 0.5
    (other / "config.json").write_text(json.dumps(fields))
    m = _model_cfg(world, init_from=other)
    with pytest.raises(TrainingError, match=r"made for another target: rms_norm_eps=0\.5"):
        draft_config_for(m, world["hf"].config, VOCAB)


def test_an_export_missing_a_field_is_named(world, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(world["root"] / "export", broken)
    fields = json.loads((broken / "config.json").read_text())
    del fields["block_size"]
    (broken / "config.json").write_text(json.dumps(fields))
    with pytest.raises(TrainingError, match=r"model\.init_from: .*lacks block_size"):
        draft_config_for(_model_cfg(world, init_from=broken), world["hf"].config, VOCAB)


@pytest.mark.parametrize(("method", "fmt", "heads"), [
    ("dspark", "speculators", dict(markov_rank=8)),
    ("dspark", "deepspec", dict(markov_rank=8)),
    ("dflash2", "speculators", dict(selector_rank=8, selector_top_k=4, conv_group_size=8)),
    ("dflash2", "dflash", dict(selector_rank=8, selector_top_k=4, conv_group_size=8,
                               sliding_window=16)),
    ("domino", "specforge", dict(domino_emb_dim=8, domino_gru_hidden_dim=12)),
])
def test_a_published_checkpoint_of_another_method_is_continued_bit_for_bit(
        world, tmp_path, method, fmt, heads):
    """`model.init_from` = a DSpark, DFlash2 or Domino checkpoint in the format its servers
    read: the run trains that method's draft, every weight (heads included) the checkpoint's,
    and a recipe that resizes a head is refused by name."""
    from dspine_train.export import main as export_main

    draft = tiny_draft(world["hf"], VOCAB, method=method, num_layers=2, block_size=6,
                       target_layer_ids=[0, 3], transfer_dim=16, message_size=16, **heads)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    draft.save_pretrained(tmp_path / "ours")
    verifier = ["--verifier", str(world["root"] / "target")] if fmt == "speculators" else []
    assert export_main([str(tmp_path / "ours"), str(tmp_path / fmt), "--format", fmt,
                        *verifier]) == 0
    m = _model_cfg(world, init_from=tmp_path / fmt)
    config = draft_config_for(m, world["hf"].config, VOCAB)
    assert config.method == method
    assert config.sliding_window == heads.get("sliding_window")  # z-lab's window carried over
    continued = build_draft(m, config, None, world["hf"].config, seed=0)
    # every parameter the method runs (not DSpine's injection, off in these methods, nor its
    # token table: the formats carry neither)
    assert not draft.config.injection

    def used(model):
        return {k: v for k, v in model.named_parameters() if not k.startswith("injection.")}

    theirs, ours = used(continued), used(draft)
    assert set(theirs) == set(ours)
    for name, value in ours.items():
        assert theirs[name].equal(value), name
    field, value = next(iter(heads.items()))
    with pytest.raises(TrainingError, match=f"model.{field}"):
        draft_config_for(_model_cfg(world, init_from=tmp_path / fmt, **{field: value * 2}),
                         world["hf"].config, VOCAB)
