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


# ------------------------------------------------------------------ the trainer's evaluation
def _greedy_continuation(target, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def test_trainer_evaluation_of_dspark_blocks_matches_a_plain_python_reference():
    """`DraftStep`'s simulated acceptance of a DSpark draft: each block decoded as served (the
    Markov walk, slot j drafting token a+j+1 after the token drafted at slot j-1), a draft
    accepted while it, the target's greedy token and the data token agree inside the
    supervised response; per-position rates = share of blocks with >= k accepted."""
    from dspine_train.evaluation.block_metrics import block_counts, stats_from_counts
    from dspine_train.training.draft_step import DraftStep

    target = tiny_target(seed=4)
    bk = 4
    draft = tiny_draft(target, method="dspark", markov_rank=32, block_size=bk).eval()
    ids = _greedy_continuation(target, [5, 77, 140], 21)
    ids[13] = (ids[13] + 1) % 256  # one data token off the target's greedy path
    seq = torch.tensor([ids])
    loss_mask = torch.ones_like(seq)
    loss_mask[0, :2] = 0
    loss_mask[0, 18] = 0  # a gap in the response cuts the blocks that run through it
    with torch.no_grad():
        greedy = target(seq).logits[0].argmax(-1).tolist()  # greedy[t]: the target after ids[..t]
    # A Markov head that knows the target's next token after each token's first occurrence
    # (a strong bias), so blocks are accepted to different depths.
    succ: dict[int, int] = {}
    for t, x in enumerate(ids):
        succ.setdefault(x, greedy[t])
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.zero_()
        draft.markov_head.markov_w2.weight.zero_()
        for r, (x, nxt) in enumerate(succ.items()):
            draft.markov_head.markov_w1.weight[x, r] = 1.0
            draft.markov_head.markov_w2.weight[nxt, r] = 40.0
    feats, final = context_features(target, draft, seq)
    valid = [a for a in range(len(ids) - 1) if loss_mask[0, a] and loss_mask[0, a + 1]]
    anchors = torch.tensor([valid + [0]])  # one padding block
    anchor_mask = torch.tensor([[True] * len(valid) + [False]])

    step = DraftStep(draft)
    prefix = step.accepted_prefixes(seq, feats, final, loss_mask, anchors, anchor_mask)
    stats = stats_from_counts(block_counts(prefix, anchor_mask.reshape(-1)))

    with torch.no_grad():
        hidden = draft(seq, feats, anchors, anchor_mask).hidden[0]  # (A, Bk, H)
    counts = []
    for i, a in enumerate(valid):
        prev, accepted = ids[a], 0
        for j in range(bk):
            logits = draft.dspark_block(hidden[i, j], torch.tensor(prev)).logits
            prev = int(logits.argmax())
            pos = a + j + 1
            supervised = pos < len(ids) and all(loss_mask[0, a + 1:pos + 1].tolist())
            if not (supervised and prev == greedy[a + j] == ids[pos]):
                break
            accepted += 1
        counts.append(accepted)
    assert len(set(counts)) >= 3 and max(counts) == bk  # a case with something to count
    assert prefix[:len(valid)].sum(-1).tolist() == counts
    assert stats.blocks == len(valid)
    assert stats.position_rates() == pytest.approx(
        [sum(c >= k for c in counts) / len(valid) for k in range(1, bk + 1)])
    assert stats.tau == pytest.approx(1 + sum(counts) / len(valid))
