"""DFlash2's decoder layer: a DFlash layer with grouped dynamic causal convolutions around its
attention and its MLP (z-lab's DFlash2; speculators `models/dflash2/model_definitions.py`).

Each sublayer (attention, MLP) is wrapped by one `GroupedDynamicCausalConv`: its input (after
the pre-norm) and its output are each convolved along the block's slots, causally and inside the
block (slot t mixes slots t, t-1, ..., t-kernel+1 of its own block; taps that would reach into
the block before are zero). The hidden channels fall into groups of `conv_group_size`; every
channel has a static tap weight (`base_kernel`, (2, kernel, H): input side, output side) and
every group a dynamic one that the sublayer's *input* predicts per slot (`kernel_projection`,
H -> 2 * kernel * groups, both sides at once). Both start as the identity (tap 0 at one, the
others and the projection at zero), so an untrained DFlash2 layer is exactly a DFlash layer.

Parameter names are the reference ones (`attention_conv.{base_kernel,kernel_projection.weight}`,
`mlp_conv.*`), so speculators' checkpoints map one to one. The context (the fused target
features) is projected by the attention's k/v as in DFlash and is never convolved.
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration_dspine import DSpineConfig
from .layers import Attend, DSpineDecoderLayer


def grouped_dynamic_conv(
    hidden: torch.Tensor,
    delta_kernel: torch.Tensor,
    base_kernel: torch.Tensor,
    block_size: int,
    group_size: int,
) -> torch.Tensor:
    """Convolve each block's slots causally: out[t] = sum_j x[t-j] * (base[j] + delta[t, j]).

    hidden (B, Q, H) with Q = whole blocks of `block_size` slots laid end to end; delta_kernel
    (B, Q, kernel, groups) the dynamic taps of each slot, one per channel group; base_kernel
    (kernel, H) the static taps. Tap j of slot t < j would read the block before: it is zero.
    """
    bsz, q_len, width = hidden.shape
    kernel = base_kernel.shape[0]
    groups = width // group_size
    x = hidden.view(bsz, q_len // block_size, block_size, groups, group_size)  # (B, A, Bk, G, g)
    delta = delta_kernel.view(bsz, q_len // block_size, block_size, kernel, groups)
    out = None
    for tap in range(kernel):
        coefficient = (base_kernel[tap].to(x.dtype).view(groups, group_size)
                       + delta[..., tap, :, None])  # (B, A, Bk, G, g)
        if tap == 0:
            shifted = x
        else:  # slot t reads slot t - tap of its own block; the first `tap` slots read zeros
            shifted = torch.cat((torch.zeros_like(x[:, :, :tap]), x[:, :, :-tap]), dim=2)
        term = shifted * coefficient
        out = term if out is None else out + term
    return out.reshape(bsz, q_len, width)


class GroupedDynamicCausalConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer, both driven by the
    sublayer's input (`prepare` convolves the input and returns the output side's taps,
    `finish` convolves the output with them)."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int,
                 group_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups,
                                           bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: tap 0 of both sides at one, every other tap and the projection zero."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0].fill_(1.0)
        self.kernel_projection.weight.zero_()

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, Q, H) the sublayer's normed input -> (its convolution (B, Q, H), the
        output side's dynamic taps (B, Q, kernel, groups))."""
        kernels = self.kernel_projection(hidden).view(
            *hidden.shape[:-1], 2, self.kernel_size, self.num_groups)  # (B, Q, 2, kernel, G)
        out = grouped_dynamic_conv(hidden, kernels[..., 0, :, :], self.base_kernel[0],
                                   self.block_size, self.group_size)
        return out, kernels[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, delta_kernel: torch.Tensor) -> torch.Tensor:
        """The sublayer's output (B, Q, H) convolved with `prepare`'s output-side taps."""
        return grouped_dynamic_conv(hidden, delta_kernel, self.base_kernel[1], self.block_size,
                                    self.group_size)


class DFlash2DecoderLayer(DSpineDecoderLayer):
    """A DFlash layer whose attention and MLP are each wrapped by a `GroupedDynamicCausalConv`:
    norm -> conv in -> attention -> conv out -> residual, then the same around the MLP."""

    def __init__(self, config: DSpineConfig) -> None:
        super().__init__(config)
        sizes = dict(hidden_size=config.hidden_size, block_size=config.block_size,
                     kernel_size=config.conv_kernel_size, group_size=config.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(**sizes)
        self.mlp_conv = GroupedDynamicCausalConv(**sizes)

    def reset_convolutions(self) -> None:
        """Both convolutions back to the identity (a DFlash layer)."""
        self.attention_conv.reset_parameters()
        self.mlp_conv.reset_parameters()

    def forward_block(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attend: Attend) -> torch.Tensor:
        x, out_kernel = self.attention_conv.prepare(self.input_layernorm(hidden))
        q = self.self_attn.project_q(x, cos, sin)
        k, v = self.self_attn.project_kv(x, cos, sin)
        hidden = hidden + self.attention_conv.finish(attend(q, k, v), out_kernel)
        x, out_kernel = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(x), out_kernel)
