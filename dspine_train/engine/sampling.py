"""Turning target logits into the distribution p and drawing tokens, without host syncs.

The same `target_probs` is used by plain decoding and by speculative verification, so the
distribution the speculative path is lossless against is exactly the one `generate_ar` samples.
Draws use the exponential race (`modeling.exponential_race`: `argmax(p / E)`, E ~ Exp(1)),
which needs no `.item()` and takes an explicit `torch.Generator` for reproducibility.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspine_train.modeling.exponential_race import exponential_noise, race


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Float32 probabilities `(..., V)` after temperature and nucleus (top-p) filtering.

    `temperature == 0` is greedy: a one-hot distribution on the argmax, which makes the
    rejection rule reduce to exact-match acceptance.
    """
    logits = logits.float()
    if temperature <= 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return tempered_probs(logits, temperature, top_p)


def tempered_probs(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float = 1.0
) -> torch.Tensor:
    """`target_probs` at a temperature > 0, which may be a 0-dim tensor (an input of a captured
    step: one graph serves every temperature)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = _top_p_filter(probs, top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`; renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # A token stays when the mass of the tokens ranked above it is still below top_p
    # (the most likely token always stays).
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of `probs (..., V)` -> `(...)` long."""
    return race(probs, exponential_noise(probs.shape, generator, probs.device))


def next_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Greedy argmax at `temperature == 0`, else a draw from `target_probs`."""
    if temperature <= 0.0:
        return logits.argmax(-1)
    return sample(target_probs(logits, temperature, top_p), generator)


@dataclass
class Sampler:
    """Decoding settings of one call; `scale` is the temperature as a 0-dim float32 tensor on
    the generator's device (an input of the sampling steps, made once per call)."""

    temperature: float
    top_p: float
    generator: torch.Generator
    scale: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.scale = torch.full((), self.temperature, device=self.generator.device)
