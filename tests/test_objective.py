"""The DSpine objective (METHOD 2.3): weights, anchors, curriculum, chunking, switches, learning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

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


def _reference_objective(draft, target, ids, loss_mask, anchors, anchor_mask, out, step):
    """METHOD 2.3 written out slot by slot, from the forward's raw states, not from the objective.

    For block j of sequence b anchored at a, slot k predicts ids[b, a+k]; it is supervised while
    loss_mask[b, a+1..a+k] are all 1 (weight exp(-(k-1)/gamma)); p_target is the target's own
    distribution at position a+k-1; the refinement rewrites the last layer's pre-injection state
    with the *true* predecessor ids[b, a+k-1]; the alignment reads every layer's output after
    its injection through that layer's readout and compares it with the label's code.
    """
    cfg, inj = draft.config, draft.injection
    head = target.lm_head.weight
    with torch.no_grad():
        final = target(ids, output_hidden_states=True).hidden_states[-1]  # (B, S, H), normed
    sums: dict[str, float] = {}

    def add(name, value, weight):
        sums[name] = sums.get(name, 0.0) + float(value) * weight
        sums[name + "/w"] = sums.get(name + "/w", 0.0) + weight

    seq_len = ids.shape[1]
    for b in range(ids.shape[0]):
        for j in range(anchors.shape[1]):
            if not anchor_mask[b, j]:
                continue
            a = int(anchors[b, j])
            for k in range(1, cfg.block_size):
                pos = a + k
                if pos >= seq_len or not bool(loss_mask[b, a + 1 : pos + 1].all()):
                    break
                w = math.exp(-(k - 1) / cfg.loss_gamma)
                label = int(ids[b, pos])
                logits = draft.logits(out.hidden[b, j, k]).float()  # (V,)
                p_target = torch.softmax(final[b, pos - 1] @ head.T, dim=-1)
                add("backbone_ce", -torch.log_softmax(logits, -1)[label], w)
                add("backbone_l1", (torch.softmax(logits, -1) - p_target).abs().sum(), w)
                add("top1_acc", int(logits.argmax()) == label, 1.0)
                cand = torch.topk(logits, cfg.candidate_k).indices.tolist()
                add("candidate_coverage", label in cand, 1.0)
                # last-write refinement with the true predecessor, by hand (METHOD 2.2 / 2.4)
                h = out.pre_injection[b, j, k]
                f_recv = inj.scale * F.normalize(inj.readouts[-1](h), dim=-1)
                f_pred = inj.scale * draft.token_codes[int(ids[b, pos - 1])]
                gate = torch.sigmoid(inj.gate_recv(f_recv) + inj.gate_pred(f_pred))
                rms = h.pow(2).mean().add(cfg.rms_norm_eps).sqrt()
                refined = h + rms * inj.writes[-1](gate * inj.message(f_pred))
                scores = draft.norm(refined) @ head[cand].T  # (K,)
                if label in cand:
                    add("refine_ce", -torch.log_softmax(scores, -1)[cand.index(label)], w)
                elif cfg.refine_normalization == "supervised":  # an uncovered slot adds zero
                    add("refine_ce", 0.0, w)
                p_cand = p_target[cand]
                if p_cand.sum() > cfg.distill_mass_threshold:
                    diff = torch.softmax(scores, -1) - p_cand / p_cand.sum()
                    add("refine_l1", diff.abs().sum(), w)
                cosines = [
                    F.cosine_similarity(inj.readouts[layer](layer_out[b, j, k]),
                                        draft.token_codes[label], dim=0)
                    for layer, layer_out in enumerate(out.layer_hidden)
                ]
                per_layer = 1 - torch.stack(cosines)  # METHOD 2.3: one term per layer, summed
                add("alignment", per_layer.sum() if cfg.alignment_layer_reduction == "sum"
                    else per_layer.mean(), w)
    ref = {name: sums[name] / sums[name + "/w"] for name in sums if not name.endswith("/w")}
    c = cfg.ce_weight
    beta = alignment_scale(step, cfg.alignment_weight, cfg.alignment_warmup_steps)
    ref["loss"] = (c * ref["backbone_ce"] + (1 - c) * ref["backbone_l1"]
                   + cfg.refine_weight * (c * ref["refine_ce"] + (1 - c) * ref["refine_l1"])
                   + beta * ref["backbone_ce"] * ref["alignment"])
    return ref


def _forward_for_reference(draft, target, ids, loss_mask, seed=0):
    feats, final = context_features(target, draft, ids)
    anchors, mask = sample_anchors(loss_mask, 6, draft.config.block_size,
                                   torch.Generator().manual_seed(seed))
    out = draft(ids, feats, anchors, mask, return_layer_hidden=True)
    return final, anchors, mask, out


SETTINGS = [{}, {"ce_weight": 0.6}, {"loss_gamma": 1.5}, {"candidate_k": 3},
            {"alignment_warmup_steps": 400}, {"alignment_layer_reduction": "mean"},
            {"refine_normalization": "supervised"}]


@pytest.mark.parametrize("fields", SETTINGS, ids=[",".join(f) or "defaults" for f in SETTINGS])
def test_objective_equals_a_slot_by_slot_computation_of_the_spec(target, fields):
    """Labels, p_target positions, supervision cuts, refinement and alignment features, each
    checked against `_reference_objective` (not against the metrics the objective returns),
    at the defaults and with each objective setting moved: c, gamma, K, the alignment's
    warm-up (beta at step 200 of 400), its reduction over layers and the refinement CE's
    normalisation (over covered slots, or over every supervised slot as SpecForge)."""
    ids, loss_mask = _batch()
    loss_mask[0, 14] = loss_mask[1, 10] = 0  # one-token gaps: blocks that run over them are cut
    draft = tiny_draft(target, **fields)
    randomise_injection(draft)
    final, anchors, mask, out = _forward_for_reference(draft, target, ids, loss_mask)
    loss, metrics = dspine_loss(draft, out, final, loss_mask, anchors, mask, step=200)
    with torch.no_grad():
        ref = _reference_objective(draft, target, ids, loss_mask, anchors, mask, out, step=200)
    assert set(ref) == {"backbone_ce", "backbone_l1", "top1_acc", "candidate_coverage",
                        "refine_ce", "refine_l1", "alignment", "loss"}
    assert 0 < ref["candidate_coverage"] < 1  # both branches of the refinement CE are exercised
    for name, value in ref.items():
        torch.testing.assert_close(metrics[name].double(), torch.tensor(value, dtype=torch.double),
                                   rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(loss.detach().double(), torch.tensor(ref["loss"],
                               dtype=torch.double), rtol=1e-4, atol=1e-5)


def test_switched_off_terms_leave_exactly_the_token_ce(target):
    """distill off, no refinement, no alignment: the loss is the reference's label CE alone;
    the intermediate-layer CE switched on adds exactly its own term."""
    ids, loss_mask = _batch()
    draft = tiny_draft(target)
    randomise_injection(draft)
    draft.config.distill = False
    draft.config.refine_weight = 0.0
    draft.config.alignment_weight = 0.0
    final, anchors, mask, out = _forward_for_reference(draft, target, ids, loss_mask)
    ce_only, m2 = dspine_loss(draft, out, final, loss_mask, anchors, mask, step=200)
    with torch.no_grad():
        ref = _reference_objective(draft, target, ids, loss_mask, anchors, mask, out, 200)
    torch.testing.assert_close(ce_only.detach().double(),
                               torch.tensor(ref["backbone_ce"], dtype=torch.double),
                               rtol=1e-4, atol=1e-5)
    assert "refine_ce" not in m2 and "alignment" not in m2
    draft.config.token_ce_intermediate = True
    with_inter, m3 = _loss(draft, target, ids, loss_mask)
    assert m3["token_ce_intermediate"] > 0
    torch.testing.assert_close(with_inter.detach(), m3["backbone_ce"] + m3["token_ce_intermediate"])


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
    from dspine_train.objective import full_vocab_terms

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
    _, l1, _, cand, p_cand = full_vocab_terms(draft, hidden, final, labels, k=6)
    torch.testing.assert_close(p_cand, expected.gather(-1, cand), rtol=1e-4, atol=1e-6)
    draft_p = torch.softmax(draft.logits(hidden).float(), dim=-1)
    torch.testing.assert_close(l1, (draft_p - expected).abs().sum(-1), rtol=1e-4, atol=1e-5)
