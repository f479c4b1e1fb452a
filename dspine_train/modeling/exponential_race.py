"""The exponential race: drawing a token from a distribution with no host sync.

`argmax(p / E)` over the last axis, E ~ Exp(1), is a draw from p. The draft's conditional walk
(`transition_cache`) and the engine's sampling (`engine.sampling`, `engine.tree_verify`) both
draw this way; the noise is drawn ahead and passed in, so a sampling step is a pure function of
tensors (it can be compiled and captured).
"""

from __future__ import annotations

import torch


def exponential_noise(
    shape: tuple[int, ...] | torch.Size,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Float32 Exp(1) draws: the randomness of `race`, drawn ahead so that a step that samples
    takes it as an input (a pure function of tensors, which can be compiled and captured)."""
    return torch.empty(shape, device=device).exponential_(1.0, generator=generator)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: `argmax(p / E)` over the last axis is a draw from `p (..., V)` when
    `noise` E holds independent Exp(1) draws of the same shape (E_i / p_i ~ Exp(p_i): the
    smallest is i with probability p_i)."""
    return (probs / noise).argmax(-1)
