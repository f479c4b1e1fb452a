"""The chain round's draft: one block of proposals per anchor, greedy or sampled.

`ChainDrafter` owns the two draft steps of a chain round (greedy, and sampling with the
exponential race's Exp(1) draws passed in), built with the engine's step options (compiled and
CUDA-graph-captured on CUDA, like every engine step). The token tree's draft lives in
`engine.tree_verify`.

A block proposes `draft_predictions` tokens: block_size - 1 for DSpine and DFlash (the anchor
slot is the given token), block_size for DSpark, whose anchor slot predicts too and whose Markov
head decodes the block left to right (`DSpineDraftModel.propose`). A Domino draft's GRU decodes
its block left to right too (block_size - 1 tokens, or block_size with `domino_shift_label`). Either way a proposal is
tokens `(B, P)` and, when sampling, each slot's q over its candidates, drawn given the tokens
drafted before it: what the chain's rejection sampling needs. A DFlash2 block proposes
block_size - 1 tokens, decoded left to right by its candidate selector over each slot's top
`selector_top_k`: its q is the selector's softmax given the token drafted before the slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dspine_train.engine.cuda_graphs import StepCache
from dspine_train.engine.sampling import Sampler
from dspine_train.modeling.exponential_race import exponential_noise
from dspine_train.modeling.method_presets import SERIAL_HEAD_METHODS

# What decodes each chain-only method's block left to right (named in the engine's refusals).
SERIAL_HEADS = {"dspark": "DSpark's Markov head", "domino": "Domino's GRU",
                "dflash2": "DFlash2's candidate selector"}


def serial_head(draft: Any | None) -> str | None:
    """The head that decodes `draft`'s block left to right (`method: dspark`, `domino` or
    `dflash2`: `SERIAL_HEAD_METHODS`, whose anchor-predicting drafts are among them), or None:
    such a draft proposes one path and is served as a chain only (no token trees, no n-gram
    hybrid)."""
    method = None if draft is None else getattr(draft.config, "method", None)
    return SERIAL_HEADS[method] if method in SERIAL_HEAD_METHODS else None


def draft_predictions(config: Any) -> int:
    """Tokens one block of the draft with `config` proposes (`num_predictions`): block_size - 1,
    or block_size for DSpark; drafts without the property (test oracles) draft block_size - 1."""
    return int(getattr(config, "num_predictions", int(config.block_size) - 1))


class ChainDrafter:
    """The greedy and the sampling draft step of a chain round. `draft_cache()` returns the
    engine's current draft context cache."""

    def __init__(
        self,
        draft: torch.nn.Module | None,
        draft_cache: Callable[[], Any],
        step_options: dict[str, Any],
    ) -> None:
        self.draft = draft
        self.draft_cache = draft_cache
        self.greedy_steps = StepCache(self.greedy, "draft", **step_options)
        self.sample_steps = StepCache(self.sample, "sampling draft", **step_options)

    def step_inputs(
        self, anchors: torch.Tensor, sampler: Sampler
    ) -> tuple[StepCache, tuple[torch.Tensor, ...]]:
        """The draft step of this call (greedy or sampling) and its inputs for `anchors`.

        The sampling draft's randomness (the exponential race's Exp(1) draws) is drawn here from
        the call's generator, so the step itself is a pure function of tensors."""
        if sampler.temperature <= 0.0:
            return self.greedy_steps, (anchors,)
        noise = self.noise(anchors.shape[0], sampler.generator, anchors.device)
        return self.sample_steps, (anchors, noise, sampler.scale)

    @staticmethod
    def propose(
        step: StepCache, inputs: tuple[torch.Tensor, ...], num_draft_tokens: int, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The first g = `num_draft_tokens` of the draft's proposals for each anchor, and (when
        sampling) their q over the slots' candidates and the candidates, `(B, g, K)` each."""
        out = step(*inputs, kv_len=kv_len)
        tokens = out[0][:, :num_draft_tokens]
        if len(out) == 1:  # greedy
            return tokens, None, None
        return tokens, out[1][:, :num_draft_tokens], out[2][:, :num_draft_tokens]

    def noise(
        self, batch: int, generator: torch.Generator | None, device: torch.device
    ) -> torch.Tensor:
        """Exp(1) draws `(B, P, K)` for one sampling draft block (see `sample`)."""
        shape = (batch, draft_predictions(self.draft.config), self.draft.num_candidates)
        return exponential_noise(shape, generator, device)

    # ------------------------------------------------------------------ the steps
    def greedy(self, anchors: torch.Tensor, kv_len: int) -> tuple[torch.Tensor]:
        """Greedy proposals: tokens `(B, P)`."""
        return (self.draft.propose(self.draft_cache(), anchors, 0.0, None, kv_len=kv_len).tokens,)

    def sample(
        self, anchors: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled proposals: tokens `(B, P)`, q and candidates `(B, P, K)`, given the
        race's Exp(1) `noise (B, P, K)` and the 0-dim `temperature` tensor (one capture
        serves every temperature)."""
        proposal = self.draft.propose(
            self.draft_cache(), anchors, temperature, None, kv_len=kv_len, noise=noise
        )
        return proposal.tokens, proposal.q, proposal.candidates
