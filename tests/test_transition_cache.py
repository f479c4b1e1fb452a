"""The transition-cache walk equals a naive serial decode, greedy and sampled (METHOD 2.4)."""

from __future__ import annotations

import pytest
import torch

from dspine_train.modeling.transition_cache import naive_serial_walk, top_candidates
from tests._model_helpers import (
    USED_VOCAB,
    context_features,
    randomise_injection,
    tiny_draft,
    tiny_target,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=5).double()


def _block_outputs(target, block_size, k, seed):
    draft = tiny_draft(target, seed=seed, dtype=torch.float64, block_size=block_size, candidate_k=k)
    randomise_injection(draft, seed=seed, std=0.3)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, USED_VOCAB, (3, 30), generator=g)
    feats, _ = context_features(target, draft, ids)
    anchors = torch.tensor([[4, 12], [9, 20], [0, 25]])
    with torch.no_grad():
        out = draft(ids, feats, anchors)
        logits = draft.logits(out.hidden[..., 1:, :])
    return draft, out, logits


@pytest.mark.parametrize(("block_size", "k"), [(2, 1), (4, 3), (6, 6), (9, 16)])
def test_walk_equals_naive_serial_decode_greedy(target, block_size, k):
    draft, out, logits = _block_outputs(target, block_size, k, seed=block_size)
    with torch.no_grad():
        walked = draft.walk(out.pre_injection, out.recv_features, logits, out.anchor_ids)
        cand = top_candidates(logits, k)
        naive = naive_serial_walk(
            draft.refined_scores, out.pre_injection[..., 1:, :], out.recv_features,
            out.anchor_ids, cand,
        )
    assert walked.q is None and walked.candidates is None
    assert torch.equal(walked.tokens, naive.tokens)
    # the walk really conditions: with trained writes it is not the per-slot argmax everywhere
    if k > 1 and block_size > 4:
        assert not torch.equal(walked.tokens, logits.argmax(-1))


@pytest.mark.parametrize(("block_size", "k"), [(4, 3), (6, 6), (9, 16)])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_walk_equals_naive_serial_decode_sampled(target, block_size, k, temperature):
    draft, out, logits = _block_outputs(target, block_size, k, seed=10 + block_size)
    with torch.no_grad():
        walked = draft.walk(
            out.pre_injection, out.recv_features, logits, out.anchor_ids, temperature,
            torch.Generator().manual_seed(123),
        )
        cand = top_candidates(logits, k)
        naive = naive_serial_walk(
            draft.refined_scores, out.pre_injection[..., 1:, :], out.recv_features,
            out.anchor_ids, cand, temperature, torch.Generator().manual_seed(123),
        )
    assert torch.equal(walked.tokens, naive.tokens)
    torch.testing.assert_close(walked.q, naive.q, rtol=1e-10, atol=1e-12)
    # q stays sparse: a distribution over each slot's K candidates, which hold the sampled token
    assert walked.q.shape == cand.shape and torch.equal(walked.candidates, cand)
    torch.testing.assert_close(walked.q.sum(-1), torch.ones_like(walked.q.sum(-1)), rtol=0, atol=1e-6)
    drawn = cand == walked.tokens[..., None]
    assert (drawn.sum(-1) == 1).all() and (walked.q[drawn] > 0).all()


def test_transition_cache_off_decodes_each_slot_by_argmax(target):
    draft, out, logits = _block_outputs(target, 6, 4, seed=3)
    draft.config.transition_cache = False
    try:
        walked = draft.walk(out.pre_injection, out.recv_features, logits, out.anchor_ids)
    finally:
        draft.config.transition_cache = True
    assert torch.equal(walked.tokens, logits.argmax(-1))


def test_without_injection_the_walk_is_the_per_slot_argmax(target):
    draft = tiny_draft(target, dtype=torch.float64, injection=False, candidate_k=5)
    ids = torch.randint(0, USED_VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    feats, _ = context_features(target, draft, ids)
    with torch.no_grad():
        out = draft(ids, feats, torch.tensor([[3, 10]] * 2))
        logits = draft.logits(out.hidden[..., 1:, :])
        walked = draft.walk(out.pre_injection, out.recv_features, logits, out.anchor_ids)
    assert torch.equal(walked.tokens, logits.argmax(-1))


def test_each_sampled_slot_follows_its_q_given_the_sampled_predecessor(target):
    """The walk's q for slot t is the law the token was drawn from, given the token drawn at
    slot t - 1: over many noise draws, slot t's tokens grouped by their predecessor follow that
    group's (common) q row."""
    from scipy.stats import chisquare

    draft, out, logits = _block_outputs(target, 6, 4, seed=7)
    rows = 20000
    pre, recv = out.pre_injection[:1, :1], out.recv_features[:1, :1]  # one block
    pre, recv = pre.expand(rows, -1, -1, -1), recv.expand(rows, -1, -1, -1)
    anchors, block_logits = out.anchor_ids[:1, :1].expand(rows, -1), logits[:1, :1]
    with torch.no_grad():
        walked = draft.walk(pre, recv, block_logits.expand(rows, -1, -1, -1), anchors, 1.0,
                            torch.Generator().manual_seed(0))
    tokens, q, cand = walked.tokens[:, 0], walked.q[:, 0], walked.candidates[:, 0]
    tested = 0
    for t in range(tokens.shape[-1]):
        previous = tokens[:, t - 1] if t else torch.zeros_like(tokens[:, 0])
        for value in previous.unique():
            group = previous == value
            if group.sum() < 500:
                continue
            law, ids = q[group, t], cand[group, t]
            assert torch.allclose(law, law[:1].expand_as(law))
            assert torch.equal(ids, ids[:1].expand_as(ids))
            counts = (ids[:1] == tokens[group, t][:, None]).sum(0).double()
            expected = law[0].double() / law[0].double().sum() * group.sum()
            keep = expected > 0
            assert counts[~keep].sum() == 0
            assert chisquare(counts[keep], expected[keep]).pvalue > 1e-3, (t, int(value))
            tested += 1
    assert tested > 2 * tokens.shape[-1]  # slots were drawn after several predecessors each
