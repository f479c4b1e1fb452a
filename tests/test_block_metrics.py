"""Per-block simulated evaluation: the block plan, standard errors, paired differences."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspine_train.evaluation.block_metrics import (
    BlockResults,
    clustered_se,
    mean_se,
    paired_difference,
)
from dspine_train.evaluation.held_out import every_block_plan, simulated_block_accepts

MASKS = [
    [0, 0, 1, 1, 1, 1, 0],        # anchors 2, 3, 4
    [0, 1, 1, 0, 1, 1, 1, 1, 1],  # anchors 1, 4, 5, 6, 7
    [0, 0, 0, 1],                 # none (one supervised token)
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # 0..10, cut to max_length 10: 0..8
]


def brute_force_blocks(masks: list[list[int]], max_length: int) -> set[tuple[int, int]]:
    return {(r, a) for r, m in enumerate(masks) for a in range(min(len(m), max_length) - 1)
            if m[a] and m[a + 1]}


def test_mean_se_matches_statistics() -> None:
    values = [0, 3, 1, 1, 7, 2, 0, 0, 4]
    assert mean_se(np.array(values)) == pytest.approx(
        statistics.stdev(values) / math.sqrt(len(values)), rel=1e-12)


def test_clustered_se_against_independent_computations() -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 8, size=40).astype(float)
    # one block per row: the clustered SE is the plain one
    assert clustered_se(values, np.arange(40)) == pytest.approx(mean_se(values), rel=1e-12)
    # every row's blocks repeat one value k times: it is the SE over the rows' values
    per_row = [3.0, 0.0, 5.0, 1.0, 1.0, 6.0]
    k = 7
    repeated = np.repeat(per_row, k)
    rows = np.repeat(np.arange(len(per_row)), k)
    expected = statistics.stdev(per_row) / math.sqrt(len(per_row))
    assert clustered_se(repeated, rows) == pytest.approx(expected, rel=1e-12)
    # while the plain SE, treating the k copies as independent, is much smaller
    assert mean_se(repeated) < 0.5 * expected
    # a literal loop of the formula on an unbalanced sample, cluster labels unordered
    labels = np.array([5, 5, 9, 2, 9, 9, 2, 5, 7, 7])
    x = np.array([1.0, 2.0, 0.0, 4.0, 1.0, 3.0, 0.0, 2.0, 6.0, 5.0])
    m = sum(x) / len(x)
    totals = {g: sum(x[i] - m for i in range(len(x)) if labels[i] == g) for g in set(labels)}
    groups = len(totals)
    loop = math.sqrt(groups / (groups - 1) * sum(t * t for t in totals.values())) / len(x)
    assert clustered_se(x, labels) == pytest.approx(loop, rel=1e-12)


def test_block_results_summary() -> None:
    results = BlockResults(rows=[0, 0, 1, 1, 1], anchors=[1, 2, 1, 3, 5],
                           accepted=[3, 0, 1, 7, 0], block_size=8)
    assert results.blocks == 5 and results.tau == pytest.approx(1 + 11 / 5)
    assert results.position_rates()[:4] == pytest.approx([3 / 5, 2 / 5, 2 / 5, 1 / 5])
    assert results.tau_se == pytest.approx(statistics.stdev([3, 0, 1, 7, 0]) / math.sqrt(5))
    metrics = results.as_metrics()
    assert metrics["eval/blocks"] == 5 and "eval/tau_se_row" in metrics


def test_accepted_beyond_the_drafts_of_a_block_is_refused() -> None:
    """A DSpark block drafts block_size tokens: its records must say so (num_drafts), or the
    per-position rates would silently drop the last slot."""
    rows, anchors, accepted = np.zeros(3), np.arange(3), np.array([0, 8, 2])
    with pytest.raises(ValueError, match=r"0\.\.7"):
        BlockResults(rows, anchors, accepted, block_size=8)
    results = BlockResults(rows, anchors, accepted, block_size=8, num_drafts=8)
    assert results.position_rates()[-1] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="accepted must lie"):
        BlockResults(rows, anchors, np.array([0, -1, 2]), block_size=8)


def test_paired_difference_of_hand_built_records(tmp_path) -> None:
    rows, anchors = [0, 0, 1, 2, 2, 2], [3, 4, 1, 0, 2, 5]
    a = BlockResults(rows, anchors, [3, 2, 0, 1, 4, 0], block_size=8)
    b = BlockResults(rows, anchors, [2, 2, 1, 0, 1, 0], block_size=8)
    diff = [1, 0, -1, 1, 3, 0]
    paired = paired_difference(a, b)
    assert paired["diff"] == pytest.approx(a.tau - b.tau) == pytest.approx(sum(diff) / 6)
    assert paired["se"] == pytest.approx(statistics.stdev(diff) / math.sqrt(6))
    # clustered: row totals of the centred differences are 1-2m, -1-m, 4-3m
    m = sum(diff) / 6
    totals = [1 - 2 * m, -1 - m, 4 - 3 * m]
    assert paired["se_row"] == pytest.approx(math.sqrt(1.5 * sum(t * t for t in totals)) / 6)
    # records survive a save/load round trip, and blocks must match to be paired
    a.save(tmp_path / "a.npz")
    again = BlockResults.load(tmp_path / "a.npz")
    assert paired_difference(again, b) == paired
    other = BlockResults(rows, [3, 4, 1, 0, 2, 6], [0] * 6, block_size=8)
    with pytest.raises(ValueError, match="same blocks"):
        paired_difference(a, other)


def test_every_held_out_block_is_planned_once() -> None:
    plan = every_block_plan(MASKS, max_length=10, batch_size=2, anchors_per_forward=3)
    blocks = list(zip(plan.rows.tolist(), plan.anchors.tolist()))
    assert len(blocks) == len(set(blocks))
    assert set(blocks) == brute_force_blocks(MASKS, 10)
    used = np.concatenate([idx for entry in plan.entries for idx in entry])
    assert sorted(used.tolist()) == list(range(plan.blocks))  # each block in one forward
    for entry in plan.entries:
        assert len(entry) <= 2
        for idx in entry:
            assert idx.size <= 3 and len(set(plan.rows[idx].tolist())) == 1


def test_a_capped_plan_is_a_fixed_uniform_draw() -> None:
    masks = [[1] * 30 for _ in range(5)] + [[1] * 4 for _ in range(50)]
    every = brute_force_blocks(masks, 64)
    plan = every_block_plan(masks, 64, 4, 8, max_blocks=60, seed=3)
    drawn = set(zip(plan.rows.tolist(), plan.anchors.tolist()))
    assert len(drawn) == 60 and drawn <= every
    again = every_block_plan(masks, 64, 4, 8, max_blocks=60, seed=3)
    assert np.array_equal(plan.anchors, again.anchors) and np.array_equal(plan.rows, again.rows)
    # uniform over blocks, not rows: long rows (145 of 295 blocks) get about half the draws,
    # where "up to k anchors per row" would give them 5 of 55 rows' worth
    long_share = float((plan.rows < 5).mean())
    assert 0.3 < long_share < 0.7


def test_block_accepts_map_back_to_their_blocks_across_processes() -> None:
    """A fake draft accepting (anchor + row) % 4 drafts at each anchor: every block's count
    comes back at its own index, summed over two processes as the all-reduce does."""
    plan = every_block_plan(MASKS, 10, batch_size=2, anchors_per_forward=2)

    def collate(rows):
        width = max(min(len(MASKS[r]), 10) for r in rows)
        batch = SimpleNamespace(rows=torch.tensor(rows), loss_mask=torch.zeros(len(rows), width),
                                input_ids=torch.zeros(len(rows), width, dtype=torch.long))
        batch.to = lambda device: batch
        return batch
    batches = SimpleNamespace(collate=collate)

    def step(input_ids, context, final_hidden, loss_mask, anchors, mask, evaluate, eval_chunks):
        assert evaluate == "blocks"
        rows = context[:, None].expand_as(anchors)
        counts = ((anchors + rows) % 4) * mask
        return (torch.arange(7)[None, None] < counts[..., None]).float().reshape(-1, 7)

    def features(batch):
        return SimpleNamespace(context=batch.rows, final_hidden=None)

    total = sum(simulated_block_accepts(step, batches, plan, features, rank=r, world_size=2)
                for r in range(2))
    expected = (plan.anchors + plan.rows) % 4
    assert total.long().tolist() == expected.tolist()
