"""The method's settings are config fields, each doing what METHOD says it does.

The replacement curriculum (METHOD 2.2: share, hold, end and layers), checked by which blocks
and layers it reaches; the readout initialisation and Adam betas where this project and
SpecForge differ; fields of older exports. The objective's weights (c, gamma, K, the alignment's
warm-up and reduction, `refine_normalization`) are checked against the slot-by-slot reference in
`tests/test_objective.py`. All on the tiny draft of `tests/_model_helpers.py` with its injection
randomised so every part is live.
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


def _forward(draft, batch, target, replace=None):
    """The training forward of `draft` on `batch` (per-layer outputs kept); `replace` (B, A)."""
    ids, loss_mask = batch
    feats, _ = context_features(target, draft, ids)
    anchors, mask = sample_anchors(loss_mask, 8, draft.config.block_size,
                                   torch.Generator().manual_seed(0))
    return draft(ids, feats, anchors, mask, replace, return_layer_hidden=True)


def _changed_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, A): the blocks whose states (B, A, Bk, H) differ between two forwards."""
    return (a - b).abs().flatten(2).amax(-1) > 1e-6


# ------------------------------------------------------------------ METHOD 2.2 curriculum
@pytest.mark.parametrize("probability", [0.0, 0.5, 1.0])
def test_the_curriculum_replaces_exactly_the_blocks_it_draws(target, batch, probability) -> None:
    """p = 0 gives exactly the loss without the curriculum, p = 1 replaces all 16 blocks, and
    in between the blocks whose states change are the drawn ones, and only those."""
    draft = _draft(target, replacement_probability=probability)
    mask, share = replacement_mask(draft.config, 0, TOTAL, (2, 8),
                                   torch.Generator().manual_seed(0))
    assert share == probability
    plain = _forward(draft, batch, target)
    replaced = _forward(draft, batch, target, mask)
    changed = _changed_blocks(replaced.hidden, plain.hidden)
    assert torch.equal(changed, mask)
    assert int(changed.sum()) == {0.0: 0, 1.0: 16}.get(probability, int(mask.sum()))
    if probability == 0.5:
        assert 0 < int(changed.sum()) < 16
    if probability == 0.0:
        torch.testing.assert_close(_loss(draft, target, batch, replace=mask)[0],
                                   _loss(draft, target, batch)[0], rtol=0, atol=0)


def test_replacement_reaches_exactly_the_first_replacement_layers(target, batch) -> None:
    """With every block replaced, layer i hears the true predecessor iff i < replacement_layers:
    k and k + 1 replaced layers agree on layers 0..k-1 and part at layer k; 0 is no curriculum."""
    every_block = torch.ones(2, 8, dtype=torch.bool)
    layers = [_forward(_draft(target, replacement_layers=k), batch, target, every_block).layer_hidden
              for k in range(4)]
    plain = _forward(_draft(target, replacement_layers=3), batch, target).layer_hidden
    for i in range(3):
        torch.testing.assert_close(layers[0][i], plain[i], rtol=0, atol=0)
    for k in range(3):
        for i in range(k):
            torch.testing.assert_close(layers[k][i], layers[k + 1][i], rtol=0, atol=0)
        assert _changed_blocks(layers[k][k], layers[k + 1][k]).all(), k


@pytest.mark.parametrize(("fields", "share"), [
    ({}, 0.25),  # METHOD 2.2: 0.5 held to 1/6 of training, 0 at 1/3: a quarter is half-way
    ({"replacement_hold_ratio": 0.3}, 0.5),  # still held at a quarter of training
    ({"replacement_end_ratio": 0.2}, 0.0),  # already ended
])
def test_the_drawn_share_of_blocks_follows_hold_and_end(target, fields, share) -> None:
    cfg = tiny_draft(target, **fields).config
    mask, drawn_with = replacement_mask(cfg, 30, TOTAL, (64, 64), torch.Generator().manual_seed(0))
    assert drawn_with == pytest.approx(share)
    assert float(mask.float().mean()) == pytest.approx(share, abs=0.03)


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
def test_readout_init_whitened_or_directions(target) -> None:
    whitened = tiny_draft(target, readout_init="whitened")
    directions = tiny_draft(target, readout_init="directions")
    table = random_token_table(whitened)
    torch.testing.assert_close(directions.injection.readouts[0].weight, table.directions.T)
    torch.testing.assert_close(whitened.injection.readouts[0].weight,
                               (table.directions / table.eigenvalues.sqrt()).T)


def test_adam_betas_reach_the_optimizer(target) -> None:
    for betas in ([0.9, 0.95], [0.9, 0.999]):
        opt = build_optimizer(tiny_draft(target), OptimConfig(lr=1e-2, betas=betas))
        assert all(group["betas"] == tuple(betas) for group in opt.param_groups)


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
