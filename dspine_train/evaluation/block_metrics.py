"""Acceptance of drafted blocks: the per-slot rule, its sums, per-block results and their SEs.

Pure functions of tensors and arrays (no training, no engine): the trainer's `DraftStep` and
its held-out loop (`evaluation.held_out`), the ablation and the parity check all count
acceptance with these.

A drafted slot k of a block is accepted when every slot j <= k has draft token == the target's
greedy token == the data token, inside the supervised response (`accepted_prefix`; METHOD 1
"Inference"). `block_counts` sums those flags over blocks into one tensor that processes
all-reduce; `AcceptanceStats` is the result.

The every-block evaluation (`held_out.simulated_block_accepts`) yields one number per block: the
drafts the target accepts there (0..B-1, or 0..B for a DSpark block of B drafts; tau of the
block = 1 + that), kept as `BlockResults`.
Blocks of one dataset row are not independent (a row the draft finds easy is easy at every
anchor), so besides the plain standard error of the mean over blocks this reports a per-row
clustered one, and two drafts evaluated on the very same blocks are compared *paired*: the mean
of their per-block differences, whose standard error removes the variance the blocks share.

Standard errors, for values x_1..x_N with mean m in clusters g = 1..G (the rows):

    se      = stdev(x) / sqrt(N)                                   (stdev with N - 1)
    se_row  = sqrt(G / (G - 1) * sum_g (sum_{i in g} (x_i - m))^2) / N

`se_row` is the cluster-robust (sandwich) standard error of a mean with the usual G / (G - 1)
small-sample factor; with one block per row it equals `se`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


# ------------------------------------------------------------------ per-slot acceptance
def accepted_prefix(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    data_tokens: torch.Tensor,
    supervised: torch.Tensor,
) -> torch.Tensor:
    """Per-slot "accepted so far" flags (..., P) as float 0/1, P the drafts of a block (Bk-1;
    DSpark: Bk).

    All inputs (..., P): draft tokens, the target's greedy tokens, the data tokens and
    whether the slot is inside the sequence's supervised response.
    """
    ok = (draft_tokens == target_tokens) & (data_tokens == target_tokens) & supervised
    return torch.cumprod(ok.float(), dim=-1)


@dataclass
class AcceptanceStats:
    """Accumulated acceptance over blocks.

    blocks: number of evaluated blocks; accepted: sum of accepted slots over blocks;
    per_position: (P,) blocks whose first k slots were all accepted, k = 1..P (P = Bk-1, or
    Bk for DSpark).
    """

    blocks: float = 0.0
    accepted: float = 0.0
    per_position: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted + the bonus token)."""
        return 1.0 + self.accepted / max(self.blocks, 1.0)

    def position_rates(self) -> list[float]:
        """Share of blocks whose first k drafted tokens were all accepted, k = 1..P."""
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


# --------------------------------------------------------- per-block results and their SEs
def mean_se(values: np.ndarray) -> float:
    """Standard error of the mean of `values` (sample standard deviation / sqrt(N))."""
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    return float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")


def clustered_se(values: np.ndarray, clusters: np.ndarray) -> float:
    """Cluster-robust standard error of the mean of `values`, clusters given per value
    (module docstring); nan with fewer than two clusters."""
    values = np.asarray(values, dtype=np.float64)
    clusters = np.asarray(clusters)
    if values.shape != clusters.shape:
        raise ValueError(f"values {values.shape} and clusters {clusters.shape} differ in shape")
    _, index = np.unique(clusters, return_inverse=True)
    groups = int(index.max()) + 1 if index.size else 0
    if groups < 2:
        return float("nan")
    sums = np.bincount(index, weights=values - values.mean(), minlength=groups)
    return float(math.sqrt(groups / (groups - 1) * float(np.sum(sums**2))) / values.size)


def ratio_se(sums: list[tuple[float, float]]) -> float | None:
    """Cluster-robust standard error of a ratio of sums, sum(v) / sum(f), from each cluster's
    sums (v, f) (the delta method: cluster g contributes v_g - r f_g); tau over target
    forwards with the prompts as clusters is one. None under two clusters."""
    kept = [(v, f) for v, f in sums if f]
    if len(kept) < 2:
        return None
    total = sum(f for _, f in kept)
    ratio = sum(v for v, _ in kept) / total
    spread = sum((v - ratio * f) ** 2 for v, f in kept)
    groups = len(kept)
    return math.sqrt(groups / (groups - 1) * spread) / total


@dataclass
class BlockResults:
    """The simulated evaluation of a fixed set of held-out blocks, one entry per block.

    rows: dataset row of each block (the cluster); anchors: its anchor position; accepted:
    drafts accepted there (0..num_drafts); block_size: the draft's block size; num_drafts: the
    drafts of a block (None: block_size - 1; a DSpark block drafts block_size).
    """

    rows: np.ndarray
    anchors: np.ndarray
    accepted: np.ndarray
    block_size: int
    num_drafts: int | None = None

    def __post_init__(self) -> None:
        if self.num_drafts is None:
            self.num_drafts = self.block_size - 1
        self.rows = np.asarray(self.rows, dtype=np.int64)
        self.anchors = np.asarray(self.anchors, dtype=np.int64)
        self.accepted = np.asarray(self.accepted, dtype=np.int64)
        if not self.rows.shape == self.anchors.shape == self.accepted.shape:
            raise ValueError("rows, anchors and accepted must have one entry per block")
        if self.accepted.size and not 0 <= self.accepted.min() <= self.accepted.max() \
                <= self.num_drafts:
            raise ValueError(f"accepted must lie in 0..{self.num_drafts} (the drafts of a "
                             f"block); got {self.accepted.min()}..{self.accepted.max()}: "
                             "a DSpark block drafts block_size tokens (pass num_drafts)")

    @property
    def blocks(self) -> int:
        """Number of blocks."""
        return int(self.accepted.size)

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted + the bonus token)."""
        return 1.0 + float(self.accepted.mean()) if self.blocks else float("nan")

    @property
    def tau_se(self) -> float:
        """Standard error of `tau` over blocks."""
        return mean_se(self.accepted)

    @property
    def tau_se_row(self) -> float:
        """Standard error of `tau` clustered by dataset row."""
        return clustered_se(self.accepted, self.rows)

    def position_rates(self) -> list[float]:
        """Share of blocks whose first k drafts were all accepted, k = 1..num_drafts."""
        if not self.blocks:
            return [float("nan")] * self.num_drafts
        return [float((self.accepted >= k).mean()) for k in range(1, self.num_drafts + 1)]

    def summary(self) -> dict[str, Any]:
        """The figures a report shows: blocks, rows, tau with both SEs, per-position rates."""
        return {"blocks": self.blocks, "rows": int(np.unique(self.rows).size), "tau": self.tau,
                "tau_se": self.tau_se, "tau_se_row": self.tau_se_row,
                "acceptance_by_position": self.position_rates()}

    def as_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat metrics for logging: tau, its SEs, blocks and the per-position rates."""
        out = {f"{prefix}tau": self.tau, f"{prefix}tau_se": self.tau_se,
               f"{prefix}tau_se_row": self.tau_se_row, f"{prefix}blocks": float(self.blocks)}
        for k, rate in enumerate(self.position_rates(), start=1):
            out[f"{prefix}accept_pos{k}"] = rate
        return out

    def save(self, path: Path) -> None:
        """Write the per-block records (`.npz`), for paired comparisons later."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, rows=self.rows, anchors=self.anchors, accepted=self.accepted,
                            block_size=np.int64(self.block_size),
                            num_drafts=np.int64(self.num_drafts))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> BlockResults:
        """Read records written by `save`."""
        with np.load(path) as data:
            # records written before `num_drafts` was saved are of B-1-draft blocks
            drafts = int(data["num_drafts"]) if "num_drafts" in data else None
            return cls(data["rows"], data["anchors"], data["accepted"], int(data["block_size"]),
                       drafts)


def paired_difference(a: BlockResults, b: BlockResults) -> dict[str, float]:
    """tau(a) - tau(b) on the same blocks, with its SE over blocks and clustered by row.

    Raises `ValueError` when the two were not evaluated on the same blocks (same rows and
    anchors, in the same order): an unpaired difference would not be what is reported.
    """
    if not (np.array_equal(a.rows, b.rows) and np.array_equal(a.anchors, b.anchors)):
        raise ValueError(f"paired difference needs the same blocks: {a.blocks} vs {b.blocks} "
                         "blocks, or other rows/anchors (evaluate both on one plan)")
    diff = a.accepted.astype(np.float64) - b.accepted.astype(np.float64)
    return {"diff": float(diff.mean()) if diff.size else float("nan"),
            "se": mean_se(diff), "se_row": clustered_se(diff, a.rows), "blocks": int(diff.size)}
