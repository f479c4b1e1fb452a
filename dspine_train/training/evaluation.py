"""Simulated acceptance length on held-out data (METHOD 1 "Inference", 2.4).

For a block anchored at a, the draft proposes d_1..d_{B-1} with the real decode (`draft.walk`,
transition cache included) from the training forward (no replacement). The target's greedy
token for position a+k is g_k = argmax p_target(. | x_{<a+k}). Slot k is accepted when every
slot j <= k has d_j == g_j *and* the data token x_{a+j} == g_j: the prefix is then one the
target itself would have produced greedily, so the verification is exactly what a greedy
decode would see. tau = 1 + accepted (the bonus token), in [1, B].

`simulated_acceptance_counts` is the one evaluation loop: the trainer runs it on its held-out
split every `eval.every` steps (each process a share), and the ablation runs it again on any
exported draft (`scripts.tools.ablation.simulated`), so both measure the same blocks the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..objective import sample_anchors
from .data import Batch, TokenBatches, epoch_batches

# Offset that keeps the eval anchor draws apart from the training ones.
EVAL_SEED_OFFSET = 1 << 40


def accepted_prefix(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    data_tokens: torch.Tensor,
    supervised: torch.Tensor,
) -> torch.Tensor:
    """Per-slot "accepted so far" flags (..., Bk-1) as float 0/1.

    All inputs (..., Bk-1): draft tokens, the target's greedy tokens, the data tokens and
    whether the slot is inside the sequence's supervised response.
    """
    ok = (draft_tokens == target_tokens) & (data_tokens == target_tokens) & supervised
    return torch.cumprod(ok.float(), dim=-1)


@dataclass
class AcceptanceStats:
    """Accumulated acceptance over blocks.

    blocks: number of evaluated blocks; accepted: sum of accepted slots over blocks;
    per_position: (Bk-1,) blocks whose first k slots were all accepted, k = 1..Bk-1.
    """

    blocks: float = 0.0
    accepted: float = 0.0
    per_position: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted + the bonus token)."""
        return 1.0 + self.accepted / max(self.blocks, 1.0)

    def position_rates(self) -> list[float]:
        """Share of blocks whose first k drafted tokens were all accepted, k = 1..Bk-1."""
        return [p / max(self.blocks, 1.0) for p in self.per_position]

    def as_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat metrics for logging: tau, blocks and the per-position rates."""
        out = {f"{prefix}tau": self.tau, f"{prefix}blocks": self.blocks}
        for k, rate in enumerate(self.position_rates(), start=1):
            out[f"{prefix}accept_pos{k}"] = rate
        return out


def block_counts(prefix: torch.Tensor, block_valid: torch.Tensor) -> torch.Tensor:
    """Sums for `AcceptanceStats`: [blocks, accepted, per-position...] as one float tensor.

    prefix (..., Bk-1) from `accepted_prefix`; block_valid (...,) marks real (not padding)
    blocks. One tensor so that all processes can sum it with a single all-reduce.
    """
    weight = block_valid.float()[..., None]
    per_position = (prefix * weight).reshape(-1, prefix.shape[-1]).sum(0)  # (Bk-1,)
    blocks = block_valid.float().sum()
    return torch.cat((blocks[None], per_position.sum()[None], per_position))


def stats_from_counts(counts: torch.Tensor) -> AcceptanceStats:
    """Inverse of `block_counts` (after summing over processes and batches)."""
    values = counts.tolist()
    return AcceptanceStats(blocks=values[0], accepted=values[1], per_position=values[2:])


# ------------------------------------------------------------------------- the evaluation loop
def batch_generator(seed: int, index: int) -> torch.Generator:
    """The RNG of one global batch: same draws on any world size and after any resume."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def evaluation_plan(
    lengths: np.ndarray, batch_size: int, num_anchors: int, max_blocks: int, seed: int
) -> list[list[int]]:
    """The held-out batches evaluated: one length-grouped epoch, cut to about `max_blocks`
    blocks (`batch_size * num_anchors` per batch, at least one batch)."""
    plan = epoch_batches(lengths, batch_size, 0, seed, True, 8)
    return plan[: max(1, math.ceil(max_blocks / (batch_size * num_anchors)))]


@torch.no_grad()
def simulated_acceptance_counts(
    step: Callable[..., torch.Tensor],
    batches: TokenBatches,
    plan: Sequence[list[int]],
    features: Callable[[Batch], Any],
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
    batches: TokenBatches,
    plan: BlockPlan,
    features: Callable[[Batch], Any],
    *,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    eval_chunks: int = 0,
) -> torch.Tensor:
    """Accepted drafts of every block of `plan` this process evaluates, (N,) float, 0 at the
    others: summed over processes it is every block's count (`block_stats.BlockResults`).

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
