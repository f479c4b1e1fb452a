"""The optimizer of a run: AdamW over the draft's trainable parameters (`OptimConfig`).

Norms and biases get no weight decay. `optim.betas` is (0.9, 0.95) by default, this project's
choice; SpecForge trains DSpine with torch's default (0.9, 0.999) (`recipes/preset/`).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import OptimConfig


def build_optimizer(module: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `module`'s trainable parameters with `optim`'s rate, betas, epsilon and
    weight decay (matrices only: 1-d parameters and norms are not decayed)."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr, betas=(float(optim.betas[0]), float(optim.betas[1])), eps=optim.eps,
    )
