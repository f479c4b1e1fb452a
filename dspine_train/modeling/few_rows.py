"""Linear layers for the few-row products of drafting and verifying on a CPU.

A drafted block or a verified tree multiplies each weight by a handful of rows. On a CPU,
`F.linear` runs such a product as a GEMM that repacks the whole weight on every call, which
costs 2-3x the one-row product for 2 to 8 rows (`scripts/bench_verify_rows.py` measures it on
the target). The same product with the weight as the left operand, `(W @ x^T)^T`, skips that
repacking. Each output is the same length-`in_features` dot product either way; only the
summation order inside the kernel may differ (float32 results agree to about 1e-5), as it
already does between one row and several rows with `F.linear`. Other devices, and more rows,
always take `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows, a CPU product runs weight-first (where `few_rows_linear` is asked to).
FEW_ROWS = 16


def few_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    max_rows: int = FEW_ROWS,
    min_rows: int = 1,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed weight-first on a CPU for `min_rows`..`max_rows`
    rows (the rows of `x (..., in)` are all its leading entries)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not min_rows <= rows <= max_rows:
        return F.linear(x, weight, bias)
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class Projection(nn.Linear):
    """An `nn.Linear` (same parameters and state-dict names) whose CPU forward runs 2 to
    `weight_first_rows` rows weight-first (`few_rows_linear`); 0, the default, never does,
    and one row always takes `F.linear`."""

    weight_first_rows: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias, max_rows=self.weight_first_rows,
                               min_rows=2)


def set_weight_first_rows(module: nn.Module, rows: int) -> None:
    """Run 2..`rows` rows weight-first in every `Projection` under `module` (0: never)."""
    if rows < 0:
        raise ValueError(f"weight_first_rows must be >= 0, got {rows}")
    for sub in module.modules():
        if isinstance(sub, Projection):
            sub.weight_first_rows = rows
