"""Layer-wise gated adjacent injection (METHOD 2.2) and the last-write refinement (METHOD 2.4).

After draft layer l, every drafted slot t reads its own prediction feature and its
predecessor's, both *before* any write of this layer, and receives a gated message:

    f_t      = sqrt(r) * normalize(R_l h_t)                      readout into the transfer space
    f_pred   = sqrt(r) * T[x_anchor]   for t = 1,  f_{t-1}  for t >= 2
    g        = sigmoid(G_recv f_t + G_pred f_pred + b)
    h_t     <- h_t + rms(h_t) * W_l(g * M(f_pred))

M, G_recv, G_pred are shared by all layers; R_l and W_l are per layer. W_l and G_pred start at
zero, so an untrained draft is exactly its DFlash backbone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_dspine import DSpineConfig


class AdjacentInjection(nn.Module):
    """The readouts, the shared message/gate and the per-layer writes of METHOD 2.2."""

    def __init__(self, config: DSpineConfig) -> None:
        super().__init__()
        r, m, h = config.transfer_dim, config.message_size, config.hidden_size
        self.scale = math.sqrt(r)
        self.eps = config.rms_norm_eps
        self.readouts = nn.ModuleList(nn.Linear(h, r, bias=False) for _ in range(config.num_layers))
        self.message = nn.Linear(r, m, bias=False)
        self.gate_recv = nn.Linear(r, m, bias=True)
        self.gate_pred = nn.Linear(r, m, bias=False)
        self.writes = nn.ModuleList(nn.Linear(m, h, bias=False) for _ in range(config.num_layers))

    def features(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Prediction features sqrt(r) * normalize(R_l h): (..., H) -> (..., r)."""
        return self.scale * F.normalize(self.readouts[layer](hidden), dim=-1)

    def write(
        self, layer: int, hidden: torch.Tensor, f_recv: torch.Tensor, f_pred: torch.Tensor
    ) -> torch.Tensor:
        """h + rms(h) * W_l(g * M(f_pred)); hidden (..., H), f_recv / f_pred (..., r)."""
        gate = torch.sigmoid(self.gate_recv(f_recv) + self.gate_pred(f_pred))
        update = self.writes[layer](gate * self.message(f_pred))
        rms = hidden.float().pow(2).mean(-1, keepdim=True).add(self.eps).sqrt().to(hidden.dtype)
        return hidden + rms * update

    def inject(
        self,
        layer: int,
        blocks: torch.Tensor,
        anchor_codes: torch.Tensor,
        true_pred_codes: torch.Tensor | None = None,
        replace_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The injection after `layer` on blocks (..., Bk, H); anchor_codes (..., r).

        Returns the updated blocks (slot 0, the anchor, unchanged) and the slots' pre-injection
        features (..., Bk-1, r). `true_pred_codes` (..., Bk-1, r) replace the predicted
        predecessor features of the blocks in `replace_mask` (...,) (the replacement curriculum).
        """
        slots = blocks[..., 1:, :]
        f_recv = self.features(layer, slots)
        f_pred = predecessor_features(f_recv, anchor_codes)
        if replace_mask is not None and true_pred_codes is not None:
            f_pred = torch.where(replace_mask[..., None, None], true_pred_codes, f_pred)
        updated = self.write(layer, slots, f_recv, f_pred)
        return torch.cat((blocks[..., :1, :], updated), dim=-2), f_recv


def predecessor_features(
    features: torch.Tensor, anchor_codes: torch.Tensor
) -> torch.Tensor:
    """Predecessor feature of every drafted slot.

    features (..., B-1, r) are slots 1..B-1's own features; anchor_codes (..., r) is sqrt(r) T[x_a].
    Slot 1's predecessor is the anchor, slot t >= 2's is slot t-1's feature.
    """
    return torch.cat((anchor_codes.unsqueeze(-2), features[..., :-1, :]), dim=-2)
