"""The DSpine objective (SPEC 2.3): weights, anchors, curriculum, chunking, switches, learning."""

from __future__ import annotations

import math

import pytest
import torch

from dspine_train.objective import (
    alignment_scale,
    dspine_loss,
    replacement_probability,
    sample_anchors,
    slot_weights,
)
from tests._model_helpers import (
    USED_VOCAB,
    context_features,
    randomise_injection,
    tiny_draft,
    tiny_target,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=2)


def _batch(seed=0, seq=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, USED_VOCAB, (2, seq), generator=g)
    loss_mask = torch.zeros(2, seq, dtype=torch.long)
    loss_mask[0, 8:] = 1
    loss_mask[1, 4:20] = 1
    loss_mask[1, 24:] = 1
    return ids, loss_mask


def test_slot_weights_decay_and_cut_at_first_unsupervised_slot():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    anchors = torch.tensor([[1, 7]])
    w = slot_weights(loss_mask, anchors, torch.tensor([[True, True]]), block_size=5, gamma=7.0)
    decay = [math.exp(-k / 7.0) for k in range(4)]
    # anchor 1: slots predict positions 2,3,4,5 -> mask 1,1,0,(1) -> cut at position 4
    torch.testing.assert_close(w[0, 0], torch.tensor([decay[0], decay[1], 0.0, 0.0]))
    # anchor 7: positions 8, 9 in the sequence, 10, 11 past its end
    torch.testing.assert_close(w[0, 1], torch.tensor([decay[0], decay[1], 0.0, 0.0]))
    masked = slot_weights(loss_mask, anchors, torch.tensor([[True, False]]), 5, 7.0)
    assert (masked[0, 1] == 0).all()


def test_sample_anchors_only_where_anchor_and_next_are_supervised():
    _, loss_mask = _batch()
    anchors, mask = sample_anchors(loss_mask, num_anchors=50, block_size=4,
                                   generator=torch.Generator().manual_seed(0))
    assert anchors.shape == mask.shape == (2, 31)
    for b in range(2):
        chosen = anchors[b][mask[b]]
        assert chosen.tolist() == sorted(set(chosen.tolist()))
        assert all(loss_mask[b, a] == 1 and loss_mask[b, a + 1] == 1 for a in chosen.tolist())
        valid = int((loss_mask[b, :-1].bool() & loss_mask[b, 1:].bool()).sum())
        assert len(chosen) == valid  # fewer valid positions than requested: all taken
    few, few_mask = sample_anchors(loss_mask, 3, 4, torch.Generator().manual_seed(1))
    assert few.shape == (2, 3) and few_mask.all()


def test_replacement_curriculum_schedule():
    assert replacement_probability(0, 600) == 0.5
    assert replacement_probability(99, 600) == 0.5
    assert replacement_probability(150, 600) == pytest.approx(0.25)
    assert replacement_probability(200, 600) == 0.0
    assert replacement_probability(599, 600) == 0.0


def test_alignment_warmup():
    assert alignment_scale(0, 0.5, 150) == 0.0
    assert alignment_scale(75, 0.5, 150) == pytest.approx(0.25)
    assert alignment_scale(1000, 0.5, 150) == 0.5


def _loss(draft, target, ids, loss_mask, step=200, chunk_size=1024, seed=0):
    feats, final = context_features(target, draft, ids)
    anchors, mask = sample_anchors(loss_mask, 6, draft.config.block_size,
                                   torch.Generator().manual_seed(seed))
    out = draft(ids, feats, anchors, mask)
    return dspine_loss(draft, out, final, loss_mask, anchors, mask, step, chunk_size=chunk_size)


def test_chunked_loss_and_gradients_equal_unchunked(target):
    ids, loss_mask = _batch()
    draft = tiny_draft(target)
    randomise_injection(draft)
    big, m_big = _loss(draft, target, ids, loss_mask, chunk_size=4096)
    big.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()
    small, m_small = _loss(draft, target, ids, loss_mask, chunk_size=5)
    small.backward()
    torch.testing.assert_close(small, big)
    for n, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
    assert set(m_big) >= {"backbone_ce", "backbone_l1", "refine_ce", "refine_l1", "alignment",
                          "top1_acc", "candidate_coverage", "loss"}


def test_switches_change_the_objective(target):
    ids, loss_mask = _batch()
    draft = tiny_draft(target)
    randomise_injection(draft)
    full, m = _loss(draft, target, ids, loss_mask)
    c = draft.config.ce_weight
    backbone = c * m["backbone_ce"] + (1 - c) * m["backbone_l1"]
    refine = c * m["refine_ce"] + (1 - c) * m["refine_l1"]
    align = 0.5 * m["backbone_ce"] * m["alignment"]
    torch.testing.assert_close(full.detach(), backbone + refine + align)

    draft.config.distill = False
    draft.config.refine_weight = 0.0
    draft.config.alignment_weight = 0.0
    try:
        ce_only, m2 = _loss(draft, target, ids, loss_mask)
        torch.testing.assert_close(ce_only.detach(), m2["backbone_ce"])
        assert "refine_ce" not in m2 and "alignment" not in m2
        draft.config.token_ce_intermediate = True
        with_inter, m3 = _loss(draft, target, ids, loss_mask)
        assert m3["token_ce_intermediate"] > 0
        torch.testing.assert_close(with_inter.detach(), m3["backbone_ce"] + m3["token_ce_intermediate"])
    finally:
        draft.config.distill = True
        draft.config.refine_weight = 1.0
        draft.config.alignment_weight = 0.5
        draft.config.token_ce_intermediate = False


def test_loss_goes_down_when_training(target):
    ids, loss_mask = _batch(seed=4)
    draft = tiny_draft(target, seed=4)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(25):
        loss, _ = _loss(draft, target, ids, loss_mask, step=200, seed=step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    # the zero-initialised writes have learned something
    assert any(w.weight.abs().sum() > 0 for w in draft.injection.writes)


def test_distillation_target_is_the_targets_own_distribution():
    """p_target comes from the target's normed final state through its head, unchanged.

    The target's final norm is scaled like a real model's (its gains are far from 1), so
    passing the state through the draft's norm again would change p_target.
    """
    from dspine_train.objective import _vocab_terms

    target = tiny_target(seed=5)
    with torch.no_grad():
        target.model.norm.weight.mul_(6.0)
    draft = tiny_draft(target, seed=5)
    ids, _ = _batch(seed=5)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    final = out.hidden_states[-1].reshape(-1, out.hidden_states[-1].shape[-1])
    expected = torch.softmax(out.logits.reshape(-1, out.logits.shape[-1]).float(), dim=-1)
    hidden = torch.randn(final.shape, generator=torch.Generator().manual_seed(0))
    labels = ids.reshape(-1)
    _, l1, _, cand, p_cand = _vocab_terms(draft, hidden, final, labels, k=6)
    torch.testing.assert_close(p_cand, expected.gather(-1, cand), rtol=1e-4, atol=1e-6)
    draft_p = torch.softmax(draft.logits(hidden).float(), dim=-1)
    torch.testing.assert_close(l1, (draft_p - expected).abs().sum(-1), rtol=1e-4, atol=1e-5)
