"""The backbone's vocabulary terms of the DSpine objective, with their gradient made in forward.

Per supervised slot the backbone loss is `c * CE(label) + (1 - c) * L1(p_draft, p_target)`
(METHOD 2.3). Both terms depend on the slot's full-vocabulary logits, which are too large to
keep for backward (METHOD 4). Recomputing them in backward (activation checkpointing) costs a
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

from collections.abc import Callable
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
    valid: torch.Tensor | None = None  # (n, k) bool: top-k entries kept by `restricted`

    def restricted(self, rows: torch.Tensor | None,
                   to_rows: Callable[[torch.Tensor], torch.Tensor]) -> TargetDistribution:
        """The distribution over a pruned draft vocabulary, renormalised: `rows` (N,) its target
        ids, `to_rows` maps target ids to row indices (-1 outside). Itself when `rows` is None.
        A top-k keeps its ids among the rows and assumes its remainder mass lies among them."""
        if rows is None:
            return self
        if self.ids is None:
            probs = self.probs[:, rows]
            return TargetDistribution(probs / probs.sum(-1, keepdim=True).clamp_min(1e-12))
        ids = to_rows(self.ids)
        valid = ids >= 0
        probs = self.probs * valid
        total = probs.sum(-1, keepdim=True) + (1 - self.probs.sum(-1, keepdim=True)).clamp_min(0)
        return TargetDistribution(probs / total.clamp_min(1e-12), ids.clamp_min(0), valid=valid)

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


def label_terms_in_place(logits: torch.Tensor, labels: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE (n,), correct (n,), p (n, V)) of float32 logits (n, V) and labels (n,): the label's
    cross-entropy, whether the argmax is the label, and the softmax, written into the logits'
    storage (the logits are gone after the call). The methods' objectives that make their
    gradient in forward build it from p (`dspark_objective`, `domino_objective`)."""
    correct = (logits.argmax(-1) == labels).float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    ce = (lse - logits.gather(-1, labels[:, None])).squeeze(-1)
    return ce, correct, logits.sub_(lse).exp_()


class BackboneVocabTerms(torch.autograd.Function):
    """(normed (n, H), head (V, H), labels (n,), c, target, K) ->
    mix (n,) = c * CE + (1 - c) * L1 (differentiable in `normed`), and detached: CE (n,),
    L1 (n,) and the top-K candidates (n, K), best first (`cand[:, 0]` is the argmax).

    `head` holds the rows scored (the target's lm_head, or a pruned draft vocabulary's rows),
    `labels` and `target` index those rows. Without a target (`target` None) mix is the CE and
    L1 is zero. The head is frozen: it gets no gradient.
    """

    @staticmethod
    def forward(ctx, normed, head, labels, c, target, k):  # noqa: ANN001, ANN205 - autograd API
        # Every pass over the (n, V) logits costs about as much as the projection itself on a
        # CPU, so they are few and in place: topk (also the max and the argmax), exp, sum, scale.
        logits = F.linear(normed, head.to(normed.dtype)).float()  # (n, V)
        top = torch.topk(logits, k, dim=-1)
        label_logit = logits.gather(-1, labels[:, None]).squeeze(-1)
        e = logits.sub_(top.values[:, :1]).exp_()  # the logits' storage: exp(z - max)
        del logits
        total = e.sum(-1)
        ce = top.values[:, 0] + total.log() - label_logit
        if target is None:
            l1 = torch.zeros_like(ce)
            grad = e.div_(total[:, None])  # p
        elif target.ids is None:
            p = e.div_(total[:, None])
            sign = p - target.probs
            l1 = sign.abs().sum(-1)
            sign.sign_()
            # dL1/dz = p * (s - <p, s>), s = sign(p - p_target) per vocabulary entry
            sign.sub_((p * sign).sum(-1, keepdim=True)).mul_(p)
            grad = p.mul_(c).add_(sign, alpha=1 - c)
            del sign
        else:
            ids, probs = target.ids.long(), target.probs
            p_in = e.gather(-1, ids) / total[:, None]  # (n, k)
            if target.valid is not None:
                p_in = p_in * target.valid
            outside = (1 - p_in.sum(-1)) - (1 - probs.sum(-1)).clamp_min(0)
            s_in, s_out = (p_in - probs).sign(), outside.sign()
            l1 = (p_in - probs).abs().sum(-1) + outside.abs()
            # s is s_out off the top-k ids, so <p, s> and dL1/dz there need no (n, V) pass:
            # grad = p * (c + (1 - c)(s - <p, s>)), corrected on the ids by p (1 - c)(s_in - s_out)
            p_dot_s = s_out * (1 - p_in.sum(-1)) + (p_in * s_in).sum(-1)
            grad = e.mul_(((c + (1 - c) * (s_out - p_dot_s)) / total)[:, None])
            grad.scatter_add_(-1, ids, p_in * (1 - c) * (s_in - s_out[:, None]))
        # dCE/dz = p - onehot(label)
        grad.scatter_add_(-1, labels[:, None], torch.full_like(ce[:, None], -c))
        ctx.save_for_backward(grad.to(normed.dtype) @ head.to(normed.dtype))
        mix = c * ce + (1 - c) * l1
        ctx.mark_non_differentiable(ce, l1, top.indices)
        return mix, ce, l1, top.indices

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
    """`BackboneVocabTerms.apply`: (mix, ce, l1, cand) of one chunk."""
    return BackboneVocabTerms.apply(normed, head, labels, c, target, k)
