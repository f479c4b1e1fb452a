"""Speculative acceptance as pure tensor functions (METHOD 1, 2.4).

Given `g` draft tokens `d_1..d_g` and the target's distributions at the `g + 1` verified
positions (`p_0` predicts d_1's position, ..., `p_g` the position after d_g):

* greedy: accept the longest prefix with `d_i == argmax p_{i-1}`, then one bonus token
  `argmax p_a` at the first mismatch (or after the last draft token);
* sampling: accept `d_i` with probability `min(1, p(d_i) / q(d_i))`; at the first rejection draw
  from `norm(max(0, p - q))`; when all are accepted draw the bonus from `p_g`.

Both return the committed tokens of every row in one `(B, g + 1)` tensor; nothing reads back to
the host, so the engine's single read of `Acceptance` per round is the only sync of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine_train.engine.sampling import sample


@dataclass
class Acceptance:
    """Outcome of verifying one block per sequence."""

    num_accepted: torch.Tensor  # (B,) long in [0, g]: draft tokens accepted
    tokens: torch.Tensor  # (B, g + 1) long: accepted drafts, then the bonus at index num_accepted
    accepted: torch.Tensor  # (B, g) bool: position i accepted (a prefix of True)


def _prefix_acceptance(accept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn per-position accept flags `(B, g)` into the accepted prefix and its length."""
    prefix = accept.long().cumprod(dim=-1).bool()  # (B, g): True up to the first reject
    num_accepted = prefix.sum(-1)
    return prefix, num_accepted


def _commit(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor
) -> torch.Tensor:
    """`(B, g + 1)`: draft tokens with the bonus written at index `num_accepted`."""
    tokens = torch.cat([draft_tokens, bonus[:, None]], dim=1)
    return tokens.scatter(1, num_accepted[:, None], bonus[:, None])


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Greedy verification: `draft_tokens (B, g)`, `target_logits (B, g + 1, V)`."""
    target_argmax = target_logits.argmax(-1)  # (B, g + 1)
    prefix, num_accepted = _prefix_acceptance(draft_tokens == target_argmax[:, :-1])
    bonus = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return Acceptance(num_accepted, _commit(draft_tokens, num_accepted, bonus), prefix)


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    candidates: torch.Tensor | None = None,
) -> Acceptance:
    """Rejection sampling: `draft_tokens (B, g)`; `draft_probs q (B, g, K)` the distribution
    each draft token was drawn from, over `candidates (B, g, K)` (distinct token ids per slot;
    None: q is dense over the vocabulary, K = V); `target_probs p (B, g + 1, V)` (after
    temperature / top-p).

    q stays sparse: p(d)/q(d) reads one q value per slot, and the residual max(0, p - q) at the
    first rejection is p's row there with its K q-values subtracted in place (one (B, V) row
    per sequence).
    """
    batch, steps = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if candidates is None:
        candidates = torch.arange(vocab, device=draft_probs.device).expand(draft_probs.shape)
    p_draft = target_probs[:, :steps].gather(2, draft_tokens[..., None]).squeeze(2)  # (B, g)
    # q(d): the draft token's entry among its slot's candidates (0 where it is none of them).
    drawn = candidates == draft_tokens[..., None]  # (B, g, K)
    q_draft = torch.where(drawn, draft_probs, 0.0).sum(-1)  # (B, g)
    uniform = torch.rand(
        (batch, steps), generator=generator, device=draft_tokens.device, dtype=p_draft.dtype
    )
    # u < p/q written without the division, so q == 0 (a token q could not draw) never accepts.
    accept = uniform * q_draft < p_draft
    prefix, num_accepted = _prefix_acceptance(accept)

    # The distribution the bonus is drawn from: the residual at the first rejected position,
    # or p_g when every draft token was accepted. q is padded with a zero row at slot g so that
    # max(0, p_g - 0) = p_g covers the all-accepted case in the same expression.
    width = draft_probs.shape[-1]
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, width)], 1)
    cand_padded = torch.cat([candidates, candidates.new_zeros(batch, 1, width)], 1)
    at = num_accepted[:, None, None]
    p_at = target_probs.gather(1, at.expand(-1, 1, vocab)).squeeze(1)  # (B, V)
    q_at = q_padded.gather(1, at.expand(-1, 1, width)).squeeze(1)  # (B, K)
    cand_at = cand_padded.gather(1, at.expand(-1, 1, width)).squeeze(1)  # (B, K)
    residual = p_at.scatter_add(1, cand_at, -q_at.to(p_at.dtype)).clamp_min(0.0)  # p - q
    mass = residual.sum(-1, keepdim=True)
    # A zero residual only arises where p == q, where rejection has probability 0; fall back to
    # p so the expression stays finite without a data-dependent branch.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    bonus = sample(residual, generator)
    return Acceptance(num_accepted, _commit(draft_tokens, num_accepted, bonus), prefix)


def clip_at_eos(
    tokens: torch.Tensor, counts: torch.Tensor, eos_token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row's `counts` new `tokens (B, n)` just after its first EOS.

    Returns `(counts, hit_eos)`: the number of tokens to keep (the EOS itself included) and
    whether an EOS was among them.
    """
    steps = tokens.shape[1]
    within = torch.arange(steps, device=tokens.device)[None, :] < counts[:, None]
    is_eos = torch.isin(tokens, eos_token_ids) & within  # (B, n)
    hit = is_eos.any(-1)
    first = torch.where(is_eos, torch.arange(steps, device=tokens.device), steps).amin(-1)
    return torch.where(hit, first + 1, counts), hit
