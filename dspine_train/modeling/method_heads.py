"""The other methods' heads on the draft: DSpark's Markov and confidence heads, Domino's GRU
logit correction and DFlash2's candidate selector, as methods of `DSpineDraftModel`.

`MethodHeads` is a mixin of the draft model: the heads themselves are built in its `__init__`
(`markov_head.build_dspark_heads`, `domino_head.build_domino_head`, `CandidateSelector`) and are
None for the methods without them; these methods run them on the backbone's outputs, teacher-
forced in training and left to right when decoding, and are what the objectives, the held-out
evaluation and the engine's chain draft call.
"""

from __future__ import annotations

import torch

from .candidate_selector import selector_walk
from .domino_head import domino_states, domino_walk, logit_delta
from .layers import vocab_projection
from .markov_head import DSparkOutput, dspark_outputs, markov_walk
from .transition_cache import WalkResult


class MethodHeads:
    """DSpark's, Domino's and DFlash2's block heads (mixed into `DSpineDraftModel`, whose
    `config`, `norm`, `output_head`, `embed_tokens`, `num_candidates` and head modules they
    read)."""

    def dspark_block(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> DSparkOutput:
        """DSpark's per-slot logits and confidence logits (`markov_head.dspark_outputs`).

        hidden (..., Bk, H) the last layer's output before the final norm (`forward`'s `hidden`,
        or `draft_forward`'s second output); prev_ids (..., Bk) the token before each slot's
        target: the anchor, then the true tokens (teacher forcing, `forward`'s `prev_ids`) or
        the drafted ones. Returns logits (..., Bk, V) with the Markov term added and confidence
        (..., Bk). Full-vocabulary logits for every slot: the objective chunks its calls.
        """
        cfg = self.config
        if not cfg.anchor_predicts:
            raise ValueError(f"dspark_block: a method: {cfg.method} draft has no DSpark heads")
        normed = self.norm(hidden)
        base = vocab_projection(normed, self.output_head().to(hidden.dtype))
        return dspark_outputs(normed, base, prev_ids, self.markov_head, self.confidence_head,
                              cfg.confidence_head_with_markov)

    def domino_prev_states(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Domino's GRU states s_i, teacher-forced: prev_ids (..., P) the tokens before each
        drafted token (`forward`'s `prev_ids`) -> (..., P, G) (`domino_head.domino_states`)."""
        if self.prefix_gru is None:
            raise ValueError(f"domino_prev_states: a method: {self.config.method} draft has no GRU")
        return domino_states(self.prefix_gru, self.embed_tokens(prev_ids))

    def domino_logits(self, hidden: torch.Tensor, states: torch.Tensor,
                      corrected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final, base) vocabulary logits (..., V) of drafted tokens: hidden (..., H) their
        slots' last-layer states before the final norm, states (..., G) their GRU states,
        corrected (...,) bool, whether each token is past the pure-draft prefix (gets the
        delta). Full-vocabulary logits: the objective chunks its calls."""
        normed = self.norm(hidden)
        base = vocab_projection(normed, self.output_head().to(hidden.dtype))
        delta = logit_delta(self.embed_proj, normed, states).to(base.dtype)
        return base + delta * corrected[..., None].to(base.dtype), base

    def domino_walk(
        self,
        base_logits: torch.Tensor,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float | torch.Tensor = 0.0,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> WalkResult:
        """Decode a Domino block from its drafting slots' base logits (..., P, V) and
        last-layer states before the final norm (..., P, H): the GRU's left-to-right walk
        (`domino_head.domino_walk`), K = `candidate_k` when sampling. The tokens (..., P) are
        the drafts for positions anchor+1 .. anchor+P."""
        return domino_walk(base_logits, self.norm(hidden), anchor_ids, self.embed_tokens,
                           self.prefix_gru, self.embed_proj, self.config.domino_prefix_len,
                           self.num_candidates, temperature, generator, noise)

    def dspark_walk(
        self,
        base_logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float | torch.Tensor = 0.0,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> WalkResult:
        """Decode a DSpark block from `draft_forward`'s base logits (..., Bk, V): the Markov
        head's left-to-right walk (`markov_head.markov_walk`), K = `candidate_k` when sampling.
        The tokens (..., Bk) are the drafts for positions anchor+1 .. anchor+Bk."""
        return markov_walk(base_logits, anchor_ids, self.markov_head, self.num_candidates,
                           temperature, generator, noise)

    def dflash2_walk(
        self,
        unary_logits: torch.Tensor,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float | torch.Tensor = 0.0,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> WalkResult:
        """Decode a DFlash2 block: its candidate selector's left-to-right walk over each drafted
        slot's top `selector_top_k` (`candidate_selector.selector_walk`). unary_logits (..., Bk-1,
        V) `draft_forward`'s slot logits, hidden (..., Bk-1, H) the last layer's output of
        slots 1..Bk-1 (before the final norm, as `forward`'s `hidden`); the tokens (..., Bk-1)
        are the drafts for positions anchor+1 .. anchor+Bk-1."""
        if self.candidate_selector is None:
            raise ValueError(f"dflash2_walk: a method: {self.config.method} draft has no "
                             "candidate selector")
        return selector_walk(self.candidate_selector, unary_logits, self.norm(hidden),
                             anchor_ids, temperature, generator, noise)
