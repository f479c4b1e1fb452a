"""Acceptance arithmetic on hand-built draft and target distributions."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from dspine_train.engine import clip_at_eos, greedy_accept, rejection_accept
from dspine_train.engine.sampling import target_probs

V = 6


def _one_hot_logits(tokens: list[list[int]]) -> torch.Tensor:
    """Logits whose argmax at each position is the given token: (B, T, V)."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float() * 5.0


def test_greedy_never_always_sometimes():
    target = _one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[0, 2, 3], [1, 2, 3], [1, 2, 5]])  # never / always / sometimes
    acc = greedy_accept(drafts, target)
    assert acc.num_accepted.tolist() == [0, 3, 2]
    # Accepted drafts, then the target's own token at the first mismatch (or after the last).
    assert acc.tokens[0, :1].tolist() == [1]
    assert acc.tokens[1].tolist() == [1, 2, 3, 4]
    assert acc.tokens[2, :3].tolist() == [1, 2, 3]
    assert acc.accepted.tolist() == [[False] * 3, [True] * 3, [True, True, False]]


def test_greedy_stops_at_first_mismatch_even_if_later_tokens_match():
    target = _one_hot_logits([[1, 2, 3, 4]])
    acc = greedy_accept(torch.tensor([[1, 0, 3]]), target)
    assert acc.num_accepted.tolist() == [1]
    assert acc.tokens[0, :2].tolist() == [1, 2]


def test_rejection_never_always_sometimes():
    p = torch.full((3, 3, V), 1.0 / V)
    p[0] = torch.nn.functional.one_hot(torch.tensor([4, 4, 4]), V).float()  # p(draft) = 0
    q = torch.nn.functional.one_hot(torch.tensor([[0, 0]] * 3), V).float()  # drafts always 0
    drafts = torch.zeros(3, 2, dtype=torch.long)
    p[1, :2] = torch.nn.functional.one_hot(torch.tensor([0, 0]), V).float()  # p == q: accept
    p[2, 0] = torch.nn.functional.one_hot(torch.tensor(0), V).float()  # accept the first only
    p[2, 1] = torch.nn.functional.one_hot(torch.tensor(5), V).float()
    acc = rejection_accept(drafts, q, p, torch.Generator().manual_seed(0))
    assert acc.num_accepted.tolist() == [0, 2, 1]
    assert acc.tokens[0, 0].item() == 4  # residual max(0, p - q) is all on token 4
    assert acc.tokens[2, :2].tolist() == [0, 5]


def test_rejection_output_is_distributed_as_target():
    """First committed token over many rows follows p, not q (and the test can tell them apart)."""
    rows, gen = 20000, torch.Generator().manual_seed(0)
    p_row = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.25, 0.0])
    q_row = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    q = q_row.expand(rows, 2, V)
    drafts = torch.multinomial(q_row, rows * 2, replacement=True, generator=gen).view(rows, 2)
    p = p_row.expand(rows, 3, V)
    acc = rejection_accept(drafts, q, p, gen)
    first = torch.bincount(acc.tokens[:, 0], minlength=V).double()
    second = torch.bincount(acc.tokens[acc.num_accepted >= 1, 1], minlength=V).double()
    for counts in (first, second):
        keep = p_row > 0
        assert counts[~keep].sum() == 0
        expected = p_row[keep].double() * counts.sum()
        assert chisquare(counts[keep], expected).pvalue > 1e-3
    # The draft's own distribution is clearly rejected by the same test.
    assert chisquare(first[:5], q_row[:5].double() / q_row[:5].sum() * first.sum()).pvalue < 1e-6


def test_all_accepted_bonus_comes_from_last_position():
    p = torch.zeros(1, 3, V)
    p[0, 0, 2] = p[0, 1, 3] = p[0, 2, 5] = 1.0
    q = torch.nn.functional.one_hot(torch.tensor([[2, 3]]), V).float()
    acc = rejection_accept(torch.tensor([[2, 3]]), q, p)
    assert acc.num_accepted.tolist() == [2]
    assert acc.tokens.tolist() == [[2, 3, 5]]


def test_eos_inside_accepted_block_stops_exactly_there():
    eos = torch.tensor([9])
    target = torch.nn.functional.one_hot(torch.tensor([[4, 9, 7, 8], [4, 5, 7, 9]]), 10).float()
    acc = greedy_accept(torch.tensor([[4, 9, 7], [4, 5, 7]]), target)
    assert acc.num_accepted.tolist() == [3, 3]
    counts, hit = clip_at_eos(acc.tokens, acc.num_accepted + 1, eos)
    assert counts.tolist() == [2, 4]  # row 0 keeps [4, 9]; row 1's bonus is the EOS
    assert hit.tolist() == [True, True]
    # An EOS past the committed count (a rejected draft) does not count.
    counts, hit = clip_at_eos(torch.tensor([[4, 5, 9]]), torch.tensor([2]), eos)
    assert counts.tolist() == [2] and hit.tolist() == [False]


def test_target_probs_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert target_probs(logits, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(target_probs(logits, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top_p = 0.8 keeps {0.5, 0.3}: the mass before 0.15 is already 0.8.
    torch.testing.assert_close(
        target_probs(logits, 1.0, top_p=0.8), torch.tensor([[0.625, 0.375, 0, 0]])
    )
    hot = target_probs(logits, 2.0)
    assert hot[0, 3] > 0.05 and torch.isclose(hot.sum(), torch.tensor(1.0))


def test_sparse_rejection_output_is_distributed_as_target():
    """q over K < V candidates per slot (ids + probabilities, as the draft proposes): the first
    two committed tokens follow p, including the residual max(0, p - q) at a rejection, which
    only holds the K subtracted entries; the candidates differ by row and slot."""
    rows, gen = 20000, torch.Generator().manual_seed(1)
    p_row = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.25, 0.0])
    # Two candidate sets (K = 3), alternating by row; q concentrates where p is small.
    sets = torch.tensor([[0, 2, 4], [5, 1, 3]])
    laws = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    pick = torch.arange(rows * 2).view(rows, 2) % 2  # (B, g): which set each slot uses
    candidates, q = sets[pick], laws[pick]  # (B, g, K)
    index = torch.multinomial(q.view(-1, 3), 1, generator=gen).view(rows, 2)
    drafts = candidates.gather(2, index[..., None]).squeeze(2)
    p = p_row.expand(rows, 3, V)
    acc = rejection_accept(drafts, q, p, gen, candidates=candidates)
    first = torch.bincount(acc.tokens[:, 0], minlength=V).double()
    second = torch.bincount(acc.tokens[acc.num_accepted >= 1, 1], minlength=V).double()
    for counts in (first, second):
        keep = p_row > 0
        assert counts[~keep].sum() == 0
        assert chisquare(counts[keep], p_row[keep].double() * counts.sum()).pvalue > 1e-3
    # Both paths happened: drafts accepted and rejected.
    assert 0 < int((acc.num_accepted == 0).sum()) < rows


def test_sparse_q_equals_the_same_q_dense():
    """The same draws with q given sparse or scattered dense into the vocabulary: same result."""
    rows = 64
    gen = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(rows, 4, V, generator=gen), -1)
    candidates = torch.stack([torch.randperm(V, generator=gen)[:4] for _ in range(rows * 3)])
    candidates = candidates.view(rows, 3, 4)
    q = torch.softmax(torch.randn(rows, 3, 4, generator=gen), -1)
    drafts = candidates[..., 0]
    dense = torch.zeros(rows, 3, V).scatter_(-1, candidates, q)
    sparse = rejection_accept(drafts, q, p, torch.Generator().manual_seed(3), candidates=candidates)
    full = rejection_accept(drafts, dense, p, torch.Generator().manual_seed(3))
    assert torch.equal(sparse.tokens, full.tokens)
    assert torch.equal(sparse.num_accepted, full.num_accepted)
