"""The method's settings are config fields: each one changes the loss.

METHOD 2.2 / 2.3 settings (curriculum share, hold, end and layers; alignment warm-up and its sum
over layers; c, gamma, K) and the options where this project and SpecForge differ
(`refine_normalization`, `alignment_layer_reduction`, `readout_init`, Adam betas), on the tiny
draft of `tests/_model_helpers.py` with its injection randomised so every part is live.
"""

from __future__ import annotations

import json

import pytest
import torch

from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.objective import dspine_loss, sample_anchors
from dspine_train.training.config import OptimConfig
from dspine_train.training.curriculum import replacement_mask, replacement_share
from dspine_train.training.optimizer import build_optimizer
from tests._model_helpers import (
    USED_VOCAB,
    context_features,
    random_token_table,
    randomise_injection,
    tiny_draft,
    tiny_target,
)

TOTAL = 120  # training steps of the curriculum tests


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=3)


@pytest.fixture(scope="module")
def batch(target):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, USED_VOCAB, (2, 40), generator=g)
    loss_mask = torch.ones(2, 40, dtype=torch.long)
    loss_mask[:, :4] = 0
    return ids, loss_mask


def _draft(target, **fields) -> DSpineDraftModel:
    draft = tiny_draft(target, seed=0, **fields)
    randomise_injection(draft)
    return draft


def _loss(draft, target, batch, step=400, replace=None):
    """(loss, metrics) of one forward on `batch`; `replace` (B, A) selects replaced blocks."""
    ids, loss_mask = batch
    feats, final = context_features(target, draft, ids)
    anchors, mask = sample_anchors(loss_mask, 8, draft.config.block_size,
                                   torch.Generator().manual_seed(0))
    out = draft(ids, feats, anchors, mask, replace)
    with torch.no_grad():
        return dspine_loss(draft, out, final, loss_mask, anchors, mask, step)


def _curriculum_loss(target, batch, step, **fields):
    """The loss at `step` of `TOTAL` with the blocks the curriculum of `fields` replaces."""
    draft = _draft(target, **fields)
    mask, share = replacement_mask(draft.config, step, TOTAL, (2, 8),
                                   torch.Generator().manual_seed(0))
    loss, _ = _loss(draft, target, batch, replace=mask)
    return loss, mask, share


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_defaults_are_the_specs() -> None:
    cfg = DSpineConfig()
    # METHOD 2.2: first 3 layers, p 0.5 held for 1/6 of training, 0 from 1/3
    assert (cfg.replacement_layers, cfg.replacement_probability) == (3, 0.5)
    assert (cfg.replacement_hold_ratio, cfg.replacement_end_ratio) == (1 / 6, 1 / 3)
    # METHOD 2.3: c 0.1, gamma 7, K 16, beta 0.5 over ~150 steps, one alignment term per layer
    assert (cfg.ce_weight, cfg.loss_gamma, cfg.candidate_k) == (0.1, 7.0, 16)
    assert (cfg.alignment_weight, cfg.alignment_warmup_steps) == (0.5, 150)
    assert cfg.alignment_layer_reduction == "sum"
    # this project's choices where METHOD is silent (docs/ARCHITECTURE.md, "Deviations")
    assert (cfg.refine_normalization, cfg.readout_init) == ("covered", "whitened")
    assert OptimConfig().betas == [0.9, 0.95]


# ------------------------------------------------------------------ METHOD 2.3 weights
# c, gamma, K, the alignment's warm-up and its reduction over layers: each checked exactly
# against the slot-by-slot reference (tests/test_objective.py, SETTINGS).


def test_refinement_normalisation_covered_or_supervised(target, batch) -> None:
    """"covered" averages the refinement CE over slots whose label is a candidate; SpecForge's
    "supervised" over every supervised slot, the uncovered ones adding zero (so it is smaller)."""
    covered, m_cov = _loss(_draft(target, refine_normalization="covered"), target, batch)
    every, m_every = _loss(_draft(target, refine_normalization="supervised"), target, batch)
    assert 0 < float(m_cov["candidate_coverage"]) < 1
    assert float(m_every["refine_ce"]) < float(m_cov["refine_ce"])
    assert _differs(covered, every)


# ------------------------------------------------------------------ METHOD 2.2 curriculum
def test_replacement_probability_changes_the_loss(target, batch) -> None:
    base, mask, share = _curriculum_loss(target, batch, 0, replacement_probability=0.5)
    none, no_mask, no_share = _curriculum_loss(target, batch, 0, replacement_probability=0.0)
    assert (share, no_share) == (0.5, 0.0)
    assert mask.any() and not no_mask.any()
    assert _differs(base, none)


def test_replacement_hold_ratio_changes_the_loss(target, batch) -> None:
    step = 30  # a quarter of training: falling under the METHOD 2.2 schedule, held under 0.3
    spec, mask, share = _curriculum_loss(target, batch, step)
    held, held_mask, held_share = _curriculum_loss(target, batch, step,
                                                   replacement_hold_ratio=0.3)
    assert share == pytest.approx(0.25) and held_share == 0.5
    assert held_mask.sum() > mask.sum()  # the same draws, more of them under 0.5
    assert _differs(spec, held)


def test_replacement_end_ratio_changes_the_loss(target, batch) -> None:
    step = 30
    spec, _, share = _curriculum_loss(target, batch, step)
    ended, mask, ended_share = _curriculum_loss(target, batch, step, replacement_end_ratio=0.2)
    assert share == pytest.approx(0.25) and ended_share == 0.0 and not mask.any()
    assert _differs(spec, ended)


def test_replacement_layers_change_the_loss(target, batch) -> None:
    every_block = torch.ones(2, 8, dtype=torch.bool)
    one, _ = _loss(_draft(target, replacement_layers=1), target, batch, replace=every_block)
    three, _ = _loss(_draft(target, replacement_layers=3), target, batch, replace=every_block)
    assert _differs(one, three)
    # no replacement layer: the replaced blocks run exactly as without the curriculum
    zero, _ = _loss(_draft(target, replacement_layers=0), target, batch, replace=every_block)
    plain, _ = _loss(_draft(target, replacement_layers=0), target, batch)
    torch.testing.assert_close(zero, plain)


def test_replacement_share_follows_the_configured_schedule(target) -> None:
    cfg = tiny_draft(target, replacement_probability=0.8, replacement_hold_ratio=0.25,
                     replacement_end_ratio=0.75).config
    assert replacement_share(cfg, 0, 100) == 0.8
    assert replacement_share(cfg, 24, 100) == 0.8
    assert replacement_share(cfg, 50, 100) == pytest.approx(0.4)
    assert replacement_share(cfg, 75, 100) == 0.0


@pytest.mark.parametrize("fields, message", [
    ({"replacement_probability": 1.5}, "replacement_probability"),
    ({"replacement_hold_ratio": 0.5, "replacement_end_ratio": 0.4}, "replacement_hold_ratio"),
    ({"alignment_warmup_steps": -1}, "alignment_warmup_steps"),
    ({"refine_normalization": "all"}, "refine_normalization"),
])
def test_bad_settings_name_the_field(target, fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        DSpineConfig.from_target(target.config, used_vocab_size=USED_VOCAB, **fields)


# ------------------------------------------------------------------ init and optimiser
def test_readout_init_whitened_or_directions(target, batch) -> None:
    whitened = tiny_draft(target, readout_init="whitened")
    directions = tiny_draft(target, readout_init="directions")
    table = random_token_table(whitened)
    torch.testing.assert_close(directions.injection.readouts[0].weight, table.directions.T)
    torch.testing.assert_close(whitened.injection.readouts[0].weight,
                               (table.directions / table.eigenvalues.sqrt()).T)
    _, m_white = _loss(whitened, target, batch)
    _, m_dir = _loss(directions, target, batch)
    assert _differs(m_white["alignment"], m_dir["alignment"])


def test_adam_betas_reach_the_optimizer(target) -> None:
    def train(betas):
        draft = tiny_draft(target)
        opt = build_optimizer(draft, OptimConfig(lr=1e-2, betas=betas))
        params = [p for p in draft.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):  # Adam's first step ignores the betas (bias correction)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return opt, draft.fc.weight.detach().clone()

    ours, w_ours = train([0.9, 0.95])
    theirs, w_theirs = train([0.9, 0.999])
    assert ours.param_groups[0]["betas"] == (0.9, 0.95)
    assert theirs.param_groups[0]["betas"] == (0.9, 0.999)
    assert _differs(w_ours, w_theirs)


# ------------------------------------------------------------------ older exports
def test_an_export_without_the_new_fields_loads_with_what_it_was_trained_with(target, tmp_path):
    draft = tiny_draft(target)
    draft.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    fields = json.loads(path.read_text())
    for name in ("replacement_probability", "replacement_hold_ratio", "replacement_end_ratio",
                 "readout_init", "alignment_layer_reduction", "refine_normalization"):
        fields.pop(name)
    path.write_text(json.dumps(fields))
    loaded = DSpineDraftModel.from_pretrained(tmp_path).config
    # the values every draft exported before these fields existed was trained with
    assert loaded.alignment_layer_reduction == "mean"
    assert (loaded.refine_normalization, loaded.readout_init) == ("covered", "whitened")
    assert (loaded.replacement_probability, loaded.replacement_hold_ratio,
            loaded.replacement_end_ratio) == (0.5, 1 / 6, 1 / 3)
    # a field that is not one of those stays required
    fields.pop("loss_gamma")
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="config.json lacks loss_gamma"):
        DSpineDraftModel.from_pretrained(tmp_path)
