"""The transition-cache walk equals a naive serial decode, greedy and sampled (SPEC 2.4)."""

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
            out.anchor_ids, cand, draft.config.vocab_size,
        )
    assert walked.q is None
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
            out.anchor_ids, cand, draft.config.vocab_size, temperature,
            torch.Generator().manual_seed(123),
        )
    assert torch.equal(walked.tokens, naive.tokens)
    torch.testing.assert_close(walked.q, naive.q, rtol=1e-10, atol=1e-12)
    # q is a distribution over the slot's candidates that gives the sampled token mass
    torch.testing.assert_close(walked.q.sum(-1), torch.ones_like(walked.q.sum(-1)), rtol=0, atol=1e-6)
    picked = walked.q.gather(-1, walked.tokens[..., None])
    assert (picked > 0).all()
    outside = torch.ones_like(walked.q, dtype=torch.bool).scatter_(-1, cand, False)
    assert (walked.q[outside] == 0).all()


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
