"""DSpark's objective (`dspine_train.dspark_objective`): DeepSpec's loss, chunked."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dspine_train.dspark_objective import dspark_loss
from dspine_train.objective import sample_anchors, slot_weights
from tests._model_helpers import USED_VOCAB, context_features, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=2)


def _dspark(target, seed=0, **fields):
    draft = tiny_draft(target, seed=seed, method="dspark", markov_rank=12, loss_gamma=4.0,
                       **fields)
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # heads large enough to matter
        draft.markov_head.markov_w2.weight.normal_(std=0.3)
        draft.confidence_head.proj.weight.normal_(std=0.3)
    return draft


def _batch(seed=0, seq=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, USED_VOCAB, (2, seq), generator=g)
    loss_mask = torch.zeros(2, seq, dtype=torch.long)
    loss_mask[0, 8:] = 1
    loss_mask[1, 4:20] = 1
    loss_mask[1, 24:] = 1
    loss_mask[0, 14] = 0  # a one-token gap: blocks that run over it are cut
    return ids, loss_mask


def _forward(draft, target, ids, loss_mask, seed=0):
    feats, final = context_features(target, draft, ids)
    anchors, mask = sample_anchors(loss_mask, 6, draft.config.block_size,
                                   torch.Generator().manual_seed(seed))
    return draft(ids, feats, anchors, mask), final, anchors, mask


def test_slot_weights_start_at_one_on_the_anchor_slot_and_cut_at_a_gap():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    # a DSpark block of 4 slots (predicting a+1..a+4) is weighted as `slot_weights` weighs a
    # block of 5, which the objective calls
    w = slot_weights(loss_mask, torch.tensor([[1, 6]]), torch.tensor([[True, True]]),
                     block_size=5, gamma=4.0)
    decay = [math.exp(-j / 4.0) for j in range(4)]
    # anchor 1: slots predict positions 2, 3, 4 (unsupervised), 5 -> cut at slot 2
    torch.testing.assert_close(w[0, 0], torch.tensor([decay[0], decay[1], 0.0, 0.0]))
    # anchor 6: positions 7, 8, 9 in the sequence, 10 past its end
    torch.testing.assert_close(w[0, 1], torch.tensor([decay[0], decay[1], decay[2], 0.0]))


def _deepspec_reference(draft, ids, out, final, loss_mask, anchors, mask):
    """DeepSpec's `_collect_local_terms` + `_build_loss` (one process), written out over the
    whole (B, A, Bk, V) grid from the forward's raw states."""
    cfg = draft.config
    bsz, seq_len = loss_mask.shape
    bk = cfg.block_size
    label_pos = anchors[..., None] + torch.arange(1, bk + 1)  # (B, A, Bk)
    valid = (label_pos < seq_len) & (torch.gather(
        loss_mask, 1, label_pos.clamp_max(seq_len - 1).view(bsz, -1)).view_as(label_pos) > 0)
    eval_mask = (valid & mask[..., None]).int().cumprod(-1).float()
    weights = eval_mask * torch.exp(-torch.arange(bk).float() / cfg.loss_gamma)
    labels = torch.gather(ids, 1, label_pos.clamp_max(seq_len - 1).view(bsz, -1))
    labels = labels.view_as(label_pos)
    prev = torch.cat([out.anchor_ids[..., None], labels[..., :-1]], dim=-1)
    normed = draft.norm(out.hidden)
    logits = normed @ draft._target_head.T + draft.markov_head.markov_w2(
        draft.markov_head.markov_w1(prev))
    conf = draft.confidence_head.proj(torch.cat([normed, draft.markov_head.markov_w1(prev)],
                                                -1)).squeeze(-1)
    target_pos = (label_pos - 1).clamp_max(seq_len - 1)
    target_hidden = final[torch.arange(bsz)[:, None, None], target_pos]
    p_t = torch.softmax(target_hidden @ draft._target_head.T, -1)
    p_d = torch.softmax(logits, -1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         reduction="none").view_as(weights)
    l1 = (p_d - p_t).abs().sum(-1)
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()  # DeepSpec detaches the acceptance target
    bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
    den = weights.sum() + 1e-6
    return (0.1 * (ce * weights).sum() / den + 0.9 * (l1 * weights).sum() / den
            + 1.0 * (bce * weights).sum() / den)


def test_loss_equals_deepspecs_formula(target):
    ids, loss_mask = _batch()
    draft = _dspark(target)
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    loss, metrics = dspark_loss(draft, out, final, loss_mask, anchors, mask)
    with torch.no_grad():
        ref = _deepspec_reference(draft, ids, out, final, loss_mask, anchors, mask)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-4, atol=1e-5)
    assert metrics["confidence_bce"] > 0 and 0 < metrics["acceptance"] < 1
    assert metrics["supervised_slots"] > 0


def test_chunked_loss_and_gradients_equal_unchunked(target):
    ids, loss_mask = _batch()
    draft = _dspark(target)
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    big, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=4096)
    big.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "fc.weight"} <= set(grads)
    draft.zero_grad()
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    small, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=5)
    small.backward()
    torch.testing.assert_close(small, big)
    for n, g in grads.items():
        torch.testing.assert_close(dict(draft.named_parameters())[n].grad, g, rtol=1e-4,
                                   atol=1e-6, msg=n)


def test_without_distillation_it_is_the_label_ce(target):
    ids, loss_mask = _batch()
    draft = _dspark(target, distill=False)
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    loss, metrics = dspark_loss(draft, out, final, loss_mask, anchors, mask)
    torch.testing.assert_close(loss.detach(), metrics["backbone_ce"])
    assert metrics["backbone_l1"] == 0 and metrics["confidence_bce"] == 0


def test_loss_goes_down_when_training(target):
    ids, loss_mask = _batch(seed=4)
    draft = _dspark(target, seed=4)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(20):
        out, final, anchors, mask = _forward(draft, target, ids, loss_mask, seed=step)
        loss, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_other_methods_are_refused(target):
    ids, loss_mask = _batch()
    draft = tiny_draft(target, method="dflash")
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    with pytest.raises(ValueError, match="dspark_loss: a method: dflash draft"):
        dspark_loss(draft, out, final, loss_mask, anchors, mask)


@pytest.mark.parametrize("distill", [True, False])
def test_gradients_made_in_forward_equal_autograds_of_deepspecs_formula(target, distill):
    """The fused terms (gradients made in forward, `DSparkVocabTerms`) against autograd through
    the written-out reference, for every parameter the loss reaches."""
    ids, loss_mask = _batch(seed=3)
    draft = _dspark(target, distill=distill)
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    loss, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=7)
    loss.backward()
    fused = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    if distill:
        ref = _deepspec_reference(draft, ids, out, final, loss_mask, anchors, mask)
    else:
        with torch.no_grad():  # the same loss, through autograd (checkpointed chunks)
            expected, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask)
        with torch.enable_grad(), _unfused():
            ref, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask)
        torch.testing.assert_close(ref.detach(), expected)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-4, atol=1e-5)
    ref.backward()
    reference = {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}
    assert set(fused) == set(reference)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "fc.weight"} <= set(fused)
    for n, g in reference.items():
        torch.testing.assert_close(fused[n], g, rtol=1e-4, atol=1e-6, msg=n)


def _unfused():
    """The checkpointed path (as under ZeRO-3) for this block."""
    from unittest import mock

    import dspine_train.dspark_objective as objective

    return mock.patch.object(objective, "_zero3_partitioned", lambda draft: True)


@pytest.mark.parametrize("fields", [
    {"markov_rank": 0, "enable_confidence_head": False, "confidence_head_with_markov": False},
    {"confidence_head_with_markov": False},
])
def test_fused_gradients_without_the_markov_head_or_its_confidence_input(target, fields):
    """The heads DSpark can go without: no Markov head (no w2 in the fused terms), or a
    confidence head on the hidden state alone; fused gradients equal the checkpointed path's."""
    ids, loss_mask = _batch(seed=5)
    draft = tiny_draft(target, method="dspark", loss_gamma=4.0, **fields)
    assert (draft.markov_head is None) == (fields.get("markov_rank") == 0)
    grads = []
    for unfused in (False, True):
        draft.zero_grad()
        out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
        if unfused:
            with _unfused():
                loss, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=6)
        else:
            loss, _ = dspark_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=6)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()
                                      if p.grad is not None}))
    (fused_loss, fused), (ref_loss, reference) = grads
    torch.testing.assert_close(fused_loss, ref_loss)
    assert set(fused) == set(reference) and "fc.weight" in fused
    for n, g in reference.items():
        torch.testing.assert_close(fused[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_a_batch_without_supervised_slots_gives_a_zero_loss_that_backpropagates(target):
    ids, loss_mask = _batch()
    draft = _dspark(target)
    out, final, anchors, mask = _forward(draft, target, ids, loss_mask)
    loss, metrics = dspark_loss(draft, out, final, torch.zeros_like(loss_mask), anchors, mask)
    assert float(loss.detach()) == 0.0 and metrics["supervised_slots"] == 0
    loss.backward()  # reaches the parameters, with zero gradients
    assert draft.fc.weight.grad is not None and not draft.fc.weight.grad.any()
