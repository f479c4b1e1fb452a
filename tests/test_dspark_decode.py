"""DSpark's left-to-right block decode (`markov_head.markov_walk`) is the trained network's.

Each drafted token must be what the training forward's logits give when its previous tokens are
the ones drafted before it (teacher forcing on the drafts): greedy its argmax, sampled a draw
from the softmax over its top-K with the q the walk reports.
"""

from __future__ import annotations

import pytest
import torch

from dspine_train.modeling.exponential_race import exponential_noise
from tests._model_helpers import context_features, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(seed=3)
    draft = tiny_draft(target, method="dspark", markov_rank=12, block_size=5)
    torch.manual_seed(5)
    with torch.no_grad():  # a bias strong enough to change the argmax
        draft.markov_head.markov_w1.weight.normal_(std=1.0)
        draft.markov_head.markov_w2.weight.normal_(std=1.0)
    ids = torch.tensor([[3, 17, 200, 45, 9, 88, 120, 7, 61]])
    feats, _ = context_features(target, draft, ids)
    cache = draft.new_context_cache(1, ids.shape[1] + 5)
    draft.append_context(cache, feats, torch.tensor([ids.shape[1]]))
    anchor = torch.tensor([11])
    base, pre, _ = draft.draft_forward(cache, anchor)
    return draft, base, pre, anchor


def _teacher_forced(draft, pre, anchor, tokens):
    """Slot logits (B, V) from the training path, previous tokens = anchor + the drafts."""
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    with torch.no_grad():
        return draft.dspark_block(pre, prev).logits[0]


def test_greedy_walk_is_the_argmax_of_the_teacher_forced_logits(setup):
    draft, base, pre, anchor = setup
    tokens = draft.dspark_walk(base, anchor).tokens
    assert tokens.shape == (1, 5)
    forced = _teacher_forced(draft, pre, anchor, tokens)
    assert forced.argmax(-1).tolist() == tokens[0].tolist()
    # the Markov term matters here: the base logits alone draft something else
    assert base[0].argmax(-1).tolist() != tokens[0].tolist()


def test_sampled_walk_reports_the_distribution_it_drew_from(setup):
    draft, base, pre, anchor = setup
    k = draft.num_candidates
    noise = exponential_noise((1, 5, k), torch.Generator().manual_seed(0))
    result = draft.dspark_walk(base, anchor, temperature=0.7, noise=noise)
    forced = _teacher_forced(draft, pre, anchor, result.tokens)
    top = torch.topk(forced, k, dim=-1)
    assert result.candidates[0].tolist() == top.indices.tolist()
    torch.testing.assert_close(result.q[0], torch.softmax(top.values / 0.7, dim=-1),
                               rtol=1e-5, atol=1e-6)
    assert (result.candidates == result.tokens[..., None]).any(-1).all()
    # a pure function of its inputs: the same noise, the same draft; a tensor temperature too
    again = draft.dspark_walk(base, anchor, temperature=torch.tensor([0.7]), noise=noise)
    assert again.tokens.equal(result.tokens)
    torch.testing.assert_close(again.q, result.q)


def test_without_a_markov_head_each_slot_is_its_own_argmax():
    target = tiny_target(seed=3)
    draft = tiny_draft(target, method="dspark", markov_rank=0, block_size=5)
    base = torch.randn(2, 5, target.config.vocab_size)
    tokens = draft.dspark_walk(base, torch.tensor([1, 2])).tokens
    assert tokens.equal(base.argmax(-1))
