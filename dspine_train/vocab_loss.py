"""The backbone's vocabulary terms of the DSpine objective, with their gradient made in forward.

Per supervised slot the backbone loss is `c * CE(label) + (1 - c) * L1(p_draft, p_target)`
(SPEC 2.3). Both terms depend on the slot's full-vocabulary logits, which are too large to
keep for backward (SPEC 4). Recomputing them in backward (activation checkpointing) costs a
second V x H projection per slot, and a third one for the target's distribution when it is
projected from the target's final state. `BackboneVocabTerms` instead computes, in the forward
of each chunk, the value *and* its gradient with respect to the normed draft state
(an (n, H) tensor, as small as the state itself), then frees the logits: backward is one
multiply. The arithmetic is the same as autograd's (see `tests/test_fast_step.py`).

The target's distribution comes in one of two forms (`TargetDistribution`):

* dense: the exact softmax of the target's logits, (n, V) (online target, or a feature cache
  without a stored distribution);
* top-k: the k most likely ids and their probabilities, stored once per token by the feature
  cache pass (`offline_features`) with the logits' logsumexp. The mass outside the stored ids
  (`1 - sum(probs)`) is a single remainder bucket: L1 over it is `|P_draft(outside) -
  remainder|`, the triangle inequality's lower bound of the exact term, off by at most
  `2 * remainder`. The refinement's p_target on the draft's K candidates stays exact: K head
  rows against the cached final state, normalised by the stored logsumexp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TargetDistribution:
    """The target's next-token distribution of n slots.

    probs: (n, V) dense probabilities, or (n, k) the top-k probabilities when `ids` is set.
    ids: (n, k) long token ids of the top-k probabilities; None for a dense distribution.
    states, logsumexp, head: with a top-k, the target's final states (n, H), the log-normaliser
        of its logits (n,) and its head (V, H), which give the exact probability of any id
        from one head row (`at`); without them `at` is 0 outside the top-k.
    """

    probs: torch.Tensor
    ids: torch.Tensor | None = None
    states: torch.Tensor | None = None
    logsumexp: torch.Tensor | None = None
    head: torch.Tensor | None = None

    def at(self, token_ids: torch.Tensor) -> torch.Tensor:
        """p_target of `token_ids` (n, K), exact (dense, or rows of the head), else 0 outside
        the top-k. The refinement restricts p_target to the draft's K candidates, which may lie
        outside the target's top-k; renormalised there, small masses matter."""
        if self.ids is None:
            return self.probs.gather(-1, token_ids)
        if self.states is not None:
            rows = self.head[token_ids].float()  # (n, K, H)
            logits = torch.einsum("nh,nkh->nk", self.states.float(), rows)
            return torch.exp(logits - self.logsumexp.float()[:, None])
        hit = token_ids[:, :, None] == self.ids[:, None, :]  # (n, K, k)
        return (hit * self.probs[:, None, :]).sum(-1)


@torch.no_grad()
def target_topk(
    states: torch.Tensor, head: torch.Tensor, k: int, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of softmax(states @ head^T): ids (T, k) int32, probabilities (T, k) float32 and
    the logits' logsumexp (T, 1) float32.

    states (T, H) the target's final normed hidden states; head (V, H) its lm_head. Computed
    in float32 `chunk_size` rows at a time (the feature cache pass and the bench call this).
    """
    k = min(k, head.shape[0])
    ids, probs, lses = [], [], []
    for start in range(0, states.shape[0], chunk_size):
        logits = F.linear(states[start : start + chunk_size].float(), head.float())
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        top = torch.topk(logits, k, dim=-1)
        ids.append(top.indices.to(torch.int32))
        probs.append(torch.exp(top.values - lse))
        lses.append(lse)
    if not ids:
        return (torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k), torch.zeros(0, 1))
    return torch.cat(ids), torch.cat(probs), torch.cat(lses)


class BackboneVocabTerms(torch.autograd.Function):
    """(normed (n, H), head (V, H), labels (n,), c, target, K) ->
    mix (n,) = c * CE + (1 - c) * L1 (differentiable in `normed`), and detached: CE (n,),
    L1 (n,), argmax correctness (n,), the top-K candidates (n, K) and p_target on them (n, K).

    Without a target (`target` None) mix is the CE and L1 is zero. The head is frozen: it
    gets no gradient.
    """

    @staticmethod
    def forward(ctx, normed, head, labels, c, target, k):  # noqa: ANN001, ANN205 - autograd API
        logits = F.linear(normed, head.to(normed.dtype)).float()  # (n, V)
        correct = (logits.argmax(-1) == labels).float()
        cand = torch.topk(logits, k, dim=-1).indices  # (n, K)
        lse = torch.logsumexp(logits, dim=-1)
        ce = lse - logits.gather(-1, labels[:, None]).squeeze(-1)
        p = logits.sub_(lse[:, None]).exp_()  # the logits' storage, now p_draft
        del logits
        if target is None:
            l1 = torch.zeros_like(ce)
            p_cand = torch.zeros(cand.shape, device=cand.device)
            grad = p
        else:
            p_cand = target.at(cand)
            if target.ids is None:
                diff = p - target.probs
                l1 = diff.abs().sum(-1)
                sign = diff.sign_()
            else:
                ids = target.ids.long()
                p_in = p.gather(-1, ids)
                outside = (1 - p_in.sum(-1)) - (1 - target.probs.sum(-1)).clamp_min(0)
                l1 = (p_in - target.probs).abs().sum(-1) + outside.abs()
                sign = outside.sign()[:, None].expand_as(p).clone()
                sign.scatter_(-1, ids, (p_in - target.probs).sign())
            # dL1/dz = p * (s - <p, s>), s = sign(p - p_target) per vocabulary entry
            sign.sub_((p * sign).sum(-1, keepdim=True)).mul_(p)
            grad = p.mul_(c).add_(sign, alpha=1 - c)
            del sign
        # dCE/dz = p - onehot(label)
        grad.scatter_add_(-1, labels[:, None], torch.full_like(ce[:, None], -c))
        ctx.save_for_backward(grad.to(normed.dtype) @ head.to(normed.dtype))
        mix = c * ce + (1 - c) * l1
        ctx.mark_non_differentiable(ce, l1, correct, cand, p_cand)
        return mix, ce, l1, correct, cand, p_cand

    @staticmethod
    def backward(ctx, grad_mix, *unused):  # noqa: ANN001, ANN205 - autograd API
        (grad_normed,) = ctx.saved_tensors
        return grad_mix[:, None].to(grad_normed.dtype) * grad_normed, None, None, None, None, None


def backbone_vocab_terms(
    normed: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    c: float,
    target: TargetDistribution | None,
    k: int,
) -> tuple[torch.Tensor, ...]:
    """`BackboneVocabTerms.apply`: (mix, ce, l1, correct, cand, p_cand) of one chunk."""
    return BackboneVocabTerms.apply(normed, head, labels, c, target, k)
