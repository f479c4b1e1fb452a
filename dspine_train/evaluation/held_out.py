"""Simulated acceptance length on held-out data (METHOD 1 "Inference", 2.4).

For a block anchored at a, the draft proposes d_1..d_{B-1} with the real decode (`draft.walk`,
transition cache included) from the training forward (no replacement); a DSpark draft proposes
d_1..d_B with its Markov head's left-to-right walk (`draft.dspark_walk`), a Domino draft
d_1..d_{B-1} (or d_1..d_B with shifted labels) with its GRU's walk (`draft.domino_walk`), and a
DFlash2 draft d_1..d_{B-1} with its candidate selector's walk (`draft.dflash2_walk`), as they are
served. The
target's greedy token for position a+k is g_k = argmax p_target(. | x_{<a+k}). Slot k is
accepted when every slot j <= k has d_j == g_j *and* the data token x_{a+j} == g_j: the prefix
is then one the target itself would have produced greedily, so the verification is exactly what
a greedy decode would see. tau = 1 + accepted (the bonus token), in [1, B] (DSpark: [1, B+1]).

`simulated_acceptance_counts` is the one evaluation loop: the trainer runs it on its held-out
split every `eval.every` steps (each process a share), and the ablation runs it again on any
exported draft (`scripts.tools.ablation.simulated`), so both measure the same blocks the same way.
`simulated_block_accepts` evaluates every block of a fixed `BlockPlan` instead, one count per
block (`block_metrics.BlockResults`).

The trainer imports this module, so it imports nothing from training: the held-out rows come in
as any `HeldOutRows` (`training.data.TokenBatches`), the plan of batches as row indices
(`training.data.evaluation_plan`), and the slot rule is `block_metrics.accepted_prefix`, applied
inside `DraftStep`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..objective import batch_generator, sample_anchors

# Offset that keeps the eval anchor draws apart from the training ones.
EVAL_SEED_OFFSET = 1 << 40


class HeldOutBatch(Protocol):
    """A padded batch of held-out rows (`training.data.Batch`)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device: torch.device) -> HeldOutBatch: ...


class HeldOutRows(Protocol):
    """The held-out rows, collated into batches by row index (`training.data.TokenBatches`)."""

    def collate(self, rows: list[int]) -> HeldOutBatch: ...


# ------------------------------------------------------------------------- the evaluation loop
@torch.no_grad()
def simulated_acceptance_counts(
    step: Callable[..., torch.Tensor],
    batches: HeldOutRows,
    plan: Sequence[list[int]],
    features: Callable[[HeldOutBatch], Any],
    *,
    seed: int,
    num_anchors: int,
    block_size: int,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    eval_chunks: int = 0,
) -> torch.Tensor:
    """This process's `block_counts` sums over its share of `plan` (see the module docstring).

    `step` is the `DraftStep` (or the engine wrapping it), called with `evaluate=True`;
    `features(batch)` gives the target's `.context` and `.final_hidden` for a batch on `device`.
    Process `rank` takes batches rank, rank + world_size, ...; a process past the plan's end
    repeats a batch counted as 0, so every process makes the same calls (ZeRO-3). The anchors of
    plan entry i are drawn from `batch_generator(seed + EVAL_SEED_OFFSET, i)`, the same on any
    world size. Sum the result over processes, then `stats_from_counts`.
    """
    total = None
    for i in range(math.ceil(len(plan) / world_size)):
        index = i * world_size + rank
        real = index < len(plan)
        batch = batches.collate(plan[index % len(plan)]).to(device)
        feats = features(batch)
        gen = batch_generator(seed + EVAL_SEED_OFFSET, index % len(plan))
        anchors, anchor_mask = sample_anchors(batch.loss_mask.cpu(), num_anchors, block_size, gen)
        counts = step(
            batch.input_ids, feats.context, feats.final_hidden, batch.loss_mask,
            anchors.to(device), anchor_mask.to(device), evaluate=True, eval_chunks=eval_chunks,
        ) * float(real)
        total = counts if total is None else total + counts
    return total


# ------------------------------------------------------------------ every held-out block
@dataclass
class BlockPlan:
    """A fixed set of held-out blocks and the forwards that evaluate them.

    rows, anchors (N,): block i is anchored at `anchors[i]` of dataset row `rows[i]`, sorted
    by (row, anchor), each (row, anchor) once. entries: the forwards, each a list of
    batch elements, each an array of block indices of one row (at most `anchors_per_forward`).
    """

    rows: np.ndarray
    anchors: np.ndarray
    entries: list[list[np.ndarray]]

    @property
    def blocks(self) -> int:
        """Number of blocks in the plan."""
        return int(self.rows.size)


def every_block_plan(
    loss_masks: Sequence[Sequence[int]], max_length: int, batch_size: int,
    anchors_per_forward: int, max_blocks: int | None = None, seed: int = 0,
) -> BlockPlan:
    """Every anchor the trainer may draw in every held-out row (`objective.sample_anchors`:
    loss_mask[a] and loss_mask[a+1] both 1, rows cut to `max_length`), each once; when there
    are more than `max_blocks`, a fixed uniform draw of `max_blocks` of them (seeded), so every
    block is equally likely whatever its row's length. Forwards hold `batch_size` row chunks
    of at most `anchors_per_forward` blocks, chunks of similar length together."""
    rows_list, anchors_list = [], []
    for row, mask in enumerate(loss_masks):
        m = np.asarray(mask[:max_length], dtype=bool)
        valid = np.flatnonzero(m[:-1] & m[1:])
        rows_list.append(np.full(valid.size, row, dtype=np.int64))
        anchors_list.append(valid.astype(np.int64))
    rows = np.concatenate(rows_list) if rows_list else np.zeros(0, np.int64)
    anchors = np.concatenate(anchors_list) if anchors_list else np.zeros(0, np.int64)
    if max_blocks is not None and rows.size > max_blocks:
        keep = np.sort(np.random.default_rng([seed, 7]).choice(rows.size, max_blocks,
                                                               replace=False))
        rows, anchors = rows[keep], anchors[keep]
    chunks: list[np.ndarray] = []
    lengths = {row: min(len(m), max_length) for row, m in enumerate(loss_masks)}
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if rows.size else []
    bounds = list(starts) + [rows.size]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        for c in range(lo, hi, anchors_per_forward):
            chunks.append(np.arange(c, min(c + anchors_per_forward, hi)))
    chunks.sort(key=lambda idx: -lengths[int(rows[idx[0]])])
    entries = [chunks[i:i + batch_size] for i in range(0, len(chunks), batch_size)]
    return BlockPlan(rows, anchors, entries)


@torch.no_grad()
def simulated_block_accepts(
    step: Callable[..., Any],
    batches: HeldOutRows,
    plan: BlockPlan,
    features: Callable[[HeldOutBatch], Any],
    *,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    eval_chunks: int = 0,
) -> torch.Tensor:
    """Accepted drafts of every block of `plan` this process evaluates, (N,) float, 0 at the
    others: summed over processes it is every block's count (`block_metrics.BlockResults`).

    `step` is the `DraftStep`; process `rank` takes entries rank, rank + world_size, ...; a
    process past the end repeats an entry counted as nothing, so all make the same calls.
    """
    accepted = torch.zeros(plan.blocks, dtype=torch.float32)
    if not plan.entries:
        return accepted.to(device)
    for i in range(math.ceil(len(plan.entries) / world_size)):
        index = i * world_size + rank
        real = index < len(plan.entries)
        entry = plan.entries[index % len(plan.entries)]
        batch = batches.collate([int(plan.rows[idx[0]]) for idx in entry]).to(device)
        feats = features(batch)
        width = max(idx.size for idx in entry)
        anchors = torch.zeros(len(entry), width, dtype=torch.long)
        mask = torch.zeros(len(entry), width, dtype=torch.bool)
        for b, idx in enumerate(entry):
            anchors[b, :idx.size] = torch.as_tensor(plan.anchors[idx])
            mask[b, :idx.size] = True
        prefix = step(
            batch.input_ids, feats.context, feats.final_hidden, batch.loss_mask,
            anchors.to(device), mask.to(device), evaluate="blocks", eval_chunks=eval_chunks,
        )  # (b * width, Bk-1)
        if not real:
            continue
        counts = prefix.sum(-1).reshape(len(entry), width).float().cpu()
        for b, idx in enumerate(entry):
            accepted[torch.as_tensor(idx)] = counts[b, :idx.size]
    return accepted.to(device)
