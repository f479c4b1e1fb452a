"""DFlash2's objective (`dspine_train.dflash2_objective`): speculators' loss, chunked.

The reference is `speculators==0.9.0`'s `models/dflash2/metrics.compute_metrics` (the eager
KL, the selector's K-way CE), fed the same draft's tensors laid out as its forward lays them
out ([1, blocks * B, ...], slot 0 the anchor, masked).
"""

from __future__ import annotations

import pytest
import torch
from speculators.losses import eager
from speculators.models.dflash2.metrics import compute_metrics, selector_training_candidates

from dspine_train.dflash2_objective import dflash2_loss
from tests._model_helpers import USED_VOCAB, context_features, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=2)


def _dflash2(target, seed=0, **fields):
    draft = tiny_draft(target, seed=seed, method="dflash2", selector_rank=12, selector_top_k=5,
                       conv_group_size=8, loss_gamma=4.0, **fields)
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # convolutions off the identity, a selector that matters
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn_like(conv.base_kernel) * 0.3)
                conv.kernel_projection.weight.normal_(std=0.05)
        draft.candidate_selector.predecessor_codebook.normal_(std=0.5)
        draft.candidate_selector.successor_codebook.normal_(std=0.5)
    return draft


def _case(draft, target, seq=40, num_anchors=5):
    """Every position supervised and anchors whose blocks end inside the sequence, so the
    reference's per-position mask and our cut-at-a-gap weights are the same slots."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, USED_VOCAB, (1, seq), generator=g)
    loss_mask = torch.ones(1, seq, dtype=torch.long)
    anchors = torch.tensor([[1, 7, 15, 22, 31]])[:, :num_anchors]
    mask = torch.ones_like(anchors, dtype=torch.bool)
    feats, final = context_features(target, draft, ids)
    return ids, loss_mask, anchors, mask, feats, final


def _reference_loss(draft, out, final, anchors):
    """speculators' loss on our forward's tensors (one sequence)."""
    cfg = draft.config
    bk, k = cfg.block_size, cfg.selector_top_k
    hidden = out.hidden[0]  # (A, Bk, H)
    normed = draft.norm(hidden)
    unary = draft.logits(hidden).reshape(1, -1, cfg.vocab_size)  # (1, A*Bk, V)
    pos = (anchors[0, :, None] + torch.arange(bk) - 1).clamp_min(0)  # slot k reads a+k-1
    targets = draft.target_logits(final[0, pos.reshape(-1)])[None]  # (1, A*Bk, V)
    prev = torch.cat([out.anchor_ids[0, :, None], out.prev_ids[0]], dim=-1)  # (A, Bk)
    cand = unary.topk(k, dim=-1).indices
    training, place, contains = selector_training_candidates(cand, targets.argmax(-1))
    scores = draft.candidate_selector.score_candidates(unary, normed.reshape(1, -1, hidden.shape[-1]),
                                                       prev.reshape(1, -1), training)
    loss_mask = torch.ones(1, unary.shape[1])
    loss_mask[:, ::bk] = 0  # the anchor slot is not a prediction
    loss, metrics = compute_metrics(
        unary_logits=unary, targets=targets, training_candidate_ids=training,
        candidate_logits=scores, target_positions=place, contains_target=contains,
        loss_mask=loss_mask, block_size=bk, top_k=k, loss_config={
            "kl_div": (eager.kl_div_loss, 1.0)}, tv_loss_fn=eager.tv_loss,
        gamma=cfg.loss_gamma, selector_loss_alpha=cfg.selector_weight)
    return loss, metrics


def test_the_loss_is_speculators_dflash2_loss(target):
    for weight in (1.0, 0.25):
        draft = _dflash2(target, selector_weight=weight)
        ids, loss_mask, anchors, mask, feats, final = _case(draft, target)
        out = draft(ids, feats, anchors, mask, use_flex=False)
        loss, metrics = dflash2_loss(draft, out, final, loss_mask, anchors, mask)
        ref, ref_metrics = _reference_loss(draft, out, final, anchors)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        # and its two terms, each: the unary KL and the selector CE
        unary_only = ref_metrics["unary_loss_sum"]
        torch.testing.assert_close(loss - weight * ref_metrics["selector_loss_sum"], unary_only,
                                   rtol=1e-5, atol=1e-6)
        assert metrics["supervised_slots"] == anchors.numel() * (draft.config.block_size - 1)
        # the gradient reaches the backbone, the convolutions and the selector
        loss.backward()
        for name in ("candidate_selector.predecessor_codebook",
                     "candidate_selector.successor_codebook",
                     "candidate_selector.hidden_projection.weight",
                     "layers.0.attention_conv.kernel_projection.weight",
                     "layers.1.mlp_conv.base_kernel", "fc.weight"):
            grad = dict(draft.named_parameters())[name].grad
            assert grad is not None and grad.abs().sum() > 0, name


def test_chunks_and_padding_change_nothing(target):
    draft = _dflash2(target)
    ids, loss_mask, anchors, mask, feats, final = _case(draft, target)
    loss_mask[0, 25] = 0  # a gap: the blocks over it are cut there
    mask[0, 4] = False  # a padding anchor
    out = draft(ids, feats, anchors, mask, use_flex=False)
    whole, m1 = dflash2_loss(draft, out, final, loss_mask, anchors, mask)
    parts, m2 = dflash2_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=3)
    torch.testing.assert_close(whole, parts)
    for key in m1:
        torch.testing.assert_close(m1[key], m2[key])
    # slots: anchors 1, 7, 15 whole (3 x 5), 22 cut before position 25 (slots 1, 2)
    assert m1["supervised_slots"] == 3 * 5 + 2
    # a selector weight of zero leaves the unary KL alone
    draft.config.selector_weight = 0.0
    kl, m3 = dflash2_loss(draft, out, final, loss_mask, anchors, mask)
    assert 0 < kl < whole
    assert 0.0 <= m3["candidate_coverage"] <= 1.0 and 0.0 <= m3["selector_acc"] <= 1.0


def test_without_distill_the_label_is_the_target(target):
    draft = _dflash2(target, distill=False)
    ids, loss_mask, anchors, mask, feats, final = _case(draft, target)
    out = draft(ids, feats, anchors, mask, use_flex=False)
    loss, metrics = dflash2_loss(draft, out, final, loss_mask, anchors, mask)
    assert metrics["backbone_kl"] == 0.0
    # the unary term is the label's CE, and the label is the selector's hard target: with the
    # labels swapped for the target's greedy tokens, the distilled run's selector term returns
    greedy = draft.target_logits(final).argmax(-1)
    greedy_out = draft(torch.cat([ids[:, :1], greedy[:, :-1]], dim=1), feats, anchors, mask,
                       use_flex=False)
    assert greedy_out.labels.shape == out.labels.shape
    draft.config.distill = True
    _, distilled = dflash2_loss(draft, greedy_out, final, loss_mask, anchors, mask)
    draft.config.distill = False
    _, labelled = dflash2_loss(draft, greedy_out, final, loss_mask, anchors, mask)
    torch.testing.assert_close(labelled["selector_ce"], distilled["selector_ce"])
    assert loss > 0 and torch.isfinite(loss)


@pytest.mark.parametrize("distill", [True, False])
def test_gradients_made_in_forward_equal_autograds(target, distill):
    """The fused unary terms (`UnaryVocabTerms`: the unary gradient made in forward, the
    selector's through its candidates' head rows) against autograd through the terms written
    out (`_slot_terms`, the no-gradient path, here with gradients), every parameter."""
    from unittest import mock

    import dspine_train.dflash2_objective as objective

    draft = _dflash2(target, distill=distill)
    ids, loss_mask, anchors, mask, feats, final = _case(draft, target)
    loss_mask[0, 25] = 0
    grads = []
    for path in ("fused", "autograd"):
        draft.zero_grad()
        out = draft(ids, feats, anchors, mask, use_flex=False)
        if path == "fused":
            loss, _ = dflash2_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=4)
        else:
            def plain(draft, hidden, prev, labels, coef, target):
                terms = objective._slot_terms(draft, hidden, prev, labels, target)
                return ((coef * terms[0]).sum(), *terms)

            with mock.patch.object(objective, "_fused_terms", plain):
                loss, _ = dflash2_loss(draft, out, final, loss_mask, anchors, mask, chunk_size=4)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()
                                      if p.grad is not None}))
    (fused_loss, fused), (ref_loss, reference) = grads
    torch.testing.assert_close(fused_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(fused) == set(reference)
    assert {"candidate_selector.predecessor_codebook", "fc.weight"} <= set(fused)
    for n, g in reference.items():
        torch.testing.assert_close(fused[n], g, rtol=1e-4, atol=1e-6, msg=n)
    if distill:  # and against speculators' loss, through its own autograd
        draft.zero_grad()
        out = draft(ids, feats, anchors, mask, use_flex=False)
        loss_mask[0, 25] = 1
        ours, _ = dflash2_loss(draft, out, final, loss_mask, anchors, mask)
        ours.backward()
        ours_grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        draft.zero_grad()
        out = draft(ids, feats, anchors, mask, use_flex=False)
        ref, _ = _reference_loss(draft, out, final, anchors)
        ref.backward()
        for n, p in draft.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(ours_grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_a_batch_without_supervised_slots_gives_a_zero_loss_that_backpropagates(target):
    draft = _dflash2(target)
    ids, loss_mask, anchors, mask, feats, final = _case(draft, target)
    out = draft(ids, feats, anchors, mask, use_flex=False)
    loss, metrics = dflash2_loss(draft, out, final, torch.zeros_like(loss_mask), anchors, mask)
    assert float(loss.detach()) == 0.0 and metrics["supervised_slots"] == 0
    loss.backward()
    assert draft.fc.weight.grad is not None and not draft.fc.weight.grad.any()
