"""Domino's objective: SpecForge's formula, chunking, the base-weight schedule, learning.

The formula is written out here over the whole block grid (SpecForge's `OnlineDominoModel`: the
final and base logits of every slot, CE against the labels, weights exp(-(i-1)/gamma)), with
this project's one supervision rule (a block's supervision stops at its first unsupervised
target).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspine_train.domino_objective import domino_loss, lambda_base
from dspine_train.objective import slot_weights
from tests._model_helpers import context_features, tiny_draft, tiny_target

IDS = torch.tensor([[3, 17, 200, 45, 9, 88, 120, 7, 61, 30, 11, 5],
                    [8, 2, 99, 14, 150, 6, 70, 71, 19, 4, 40, 41]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1],
                     [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
ANCHORS = torch.tensor([[2, 4, 7], [0, 3, 6]])
ANCHOR_MASK = torch.tensor([[True, True, True], [True, True, False]])


def _setup(shift: bool, prefix: int):
    target = tiny_target(seed=3)
    draft = tiny_draft(target, method="domino", block_size=5, domino_emb_dim=12,
                       domino_gru_hidden_dim=20, domino_shift_label=shift,
                       domino_prefix_len=prefix, loss_gamma=3.0)
    torch.manual_seed(7)
    with torch.no_grad():
        draft.embed_proj[2].weight.normal_(std=0.5)
    feats, _ = context_features(target, draft, IDS)
    return draft, feats


def _formula(draft, out, lam):
    """SpecForge's loss over the whole (B, A, P) grid, written out."""
    cfg = draft.config
    p = cfg.num_predictions
    first = cfg.block_size - p
    w = slot_weights(MASK, ANCHORS, ANCHOR_MASK, p + 1, cfg.loss_gamma)
    states = draft.domino_prev_states(out.prev_ids)
    corrected = (torch.arange(1, p + 1) > cfg.domino_prefix_len).expand_as(w)
    final, base = draft.domino_logits(out.hidden[:, :, first:], states, corrected)
    labels = out.labels.clamp_min(0)
    ce_f = F.cross_entropy(final.flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    ce_b = F.cross_entropy(base.flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    return ((1 - lam) * (w * ce_f).sum() + lam * (w * ce_b).sum()) / w.sum()


@pytest.mark.parametrize("shift,prefix", [(False, 0), (True, 1)])
def test_loss_is_the_formula_and_chunking_changes_nothing(shift, prefix):
    draft, feats = _setup(shift, prefix)
    out = draft(IDS, feats, ANCHORS, ANCHOR_MASK)
    step, total = 3, 10  # lambda = 1 - 3 / 5 with SpecForge's default ratio 0.5
    lam = lambda_base(step, total, 1.0, 0.5)
    assert lam == pytest.approx(0.4)
    loss, metrics = domino_loss(draft, out, MASK, ANCHORS, ANCHOR_MASK, step, total,
                                chunk_size=1000)
    torch.testing.assert_close(loss, _formula(draft, out, lam), rtol=1e-5, atol=1e-6)
    assert metrics["lambda_base"].item() == pytest.approx(0.4)
    mix = 0.6 * metrics["domino_ce"] + 0.4 * metrics["backbone_ce"]
    torch.testing.assert_close(metrics["loss"], mix)
    grads = torch.autograd.grad(loss, [draft.prefix_gru.weight_hh_l0, draft.embed_proj[0].weight,
                                       draft.fc.weight])
    assert all(g.abs().sum() > 0 for g in grads)
    out2 = draft(IDS, feats, ANCHORS, ANCHOR_MASK)
    chunked, _ = domino_loss(draft, out2, MASK, ANCHORS, ANCHOR_MASK, step, total, chunk_size=3)
    torch.testing.assert_close(chunked, loss, rtol=1e-6, atol=1e-6)
    grads2 = torch.autograd.grad(chunked, [draft.prefix_gru.weight_hh_l0,
                                           draft.embed_proj[0].weight, draft.fc.weight])
    for a, b in zip(grads, grads2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lambda_schedule_is_specforges():
    assert [lambda_base(s, 10, 1.0, 1.0) for s in (0, 5, 10, 12)] == [1.0, 0.5, 0.0, 0.0]
    assert lambda_base(2, 10, 1.0, 0.5) == pytest.approx(0.6)
    assert lambda_base(0, 1, 0.3, 0.5) == pytest.approx(0.3)  # at least one decay step
    assert lambda_base(7, 10, 1.0, 0.5) == 0.0


def test_the_loss_goes_down_and_other_methods_are_refused():
    draft, feats = _setup(False, 0)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(15):
        out = draft(IDS, feats, ANCHORS, ANCHOR_MASK)
        loss, _ = domino_loss(draft, out, MASK, ANCHORS, ANCHOR_MASK, step, 15)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    target = tiny_target(seed=3)
    other = tiny_draft(target, method="dflash", block_size=5)
    feats, _ = context_features(target, other, IDS)
    with pytest.raises(ValueError, match="method: dflash"):
        domino_loss(other, other(IDS, feats, ANCHORS, ANCHOR_MASK), MASK, ANCHORS, ANCHOR_MASK)


@pytest.mark.parametrize("shift,prefix,step", [(False, 0, 3), (True, 1, 3), (False, 1, 10)])
def test_gradients_made_in_forward_equal_autograds_of_the_formula(shift, prefix, step):
    """`DominoVocabTerms` (both CEs' gradients made in forward, in chunks) against autograd
    through the written-out formula, every parameter the loss reaches (lambda 0.4, and 0)."""
    draft, feats = _setup(shift, prefix)
    lam = lambda_base(step, 10, 1.0, 0.5)
    grads = []
    for path in ("fused", "formula"):
        draft.zero_grad()
        out = draft(IDS, feats, ANCHORS, ANCHOR_MASK)
        if path == "fused":
            loss, _ = domino_loss(draft, out, MASK, ANCHORS, ANCHOR_MASK, step, 10, chunk_size=4)
        else:
            loss = _formula(draft, out, lam)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()
                                      if p.grad is not None}))
    (fused_loss, fused), (ref_loss, reference) = grads
    torch.testing.assert_close(fused_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert {"embed_proj.2.weight", "embed_proj.0.weight", "prefix_gru.weight_hh_l0",
            "fc.weight"} <= set(fused)
    assert set(fused) == set(reference)
    for n, g in reference.items():
        torch.testing.assert_close(fused[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_a_batch_without_supervised_tokens_gives_a_zero_loss_that_backpropagates():
    draft, feats = _setup(False, 0)
    out = draft(IDS, feats, ANCHORS, ANCHOR_MASK)
    loss, metrics = domino_loss(draft, out, torch.zeros_like(MASK), ANCHORS, ANCHOR_MASK, 3, 10)
    assert float(loss.detach()) == 0.0 and metrics["supervised_slots"] == 0
    loss.backward()
    assert draft.fc.weight.grad is not None and not draft.fc.weight.grad.any()
