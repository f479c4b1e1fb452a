"""The replacement curriculum of METHOD 2.2, read from the draft's config.

For a share p of the blocks, the first `replacement_layers` layers hear the *true* predecessor's
code instead of the predicted feature; p holds at `replacement_probability` for the first
`replacement_hold_ratio` of training and falls linearly to 0 at `replacement_end_ratio`
(`objective.replacement_probability`). The trainer draws the blocks with each step's generator,
so a resumed run draws the same ones.
"""

from __future__ import annotations

import torch

from ..modeling import DSpineConfig
from ..objective import replacement_probability


def replacement_share(config: DSpineConfig, step: int, total_steps: int) -> float:
    """p at optimizer step `step` of `total_steps` for the draft of `config`."""
    return replacement_probability(step, total_steps, config.replacement_probability,
                                   config.replacement_hold_ratio, config.replacement_end_ratio)


def replacement_mask(
    config: DSpineConfig,
    step: int,
    total_steps: int,
    shape: torch.Size | tuple[int, ...],
    generator: torch.Generator,
) -> tuple[torch.Tensor, float]:
    """The blocks (`shape`, usually (B, A)) that hear true predecessors at `step`, drawn on the
    CPU from `generator`, and the share p they were drawn with."""
    share = replacement_share(config, step, total_steps)
    return torch.rand(shape, generator=generator) < share, share
