"""DSpark's training objective (DeepSpec `deepspec/modeling/dspark/loss.py`).

Per supervised slot j (j = 0..B-1 of a block anchored at a; slot j predicts token a+j+1, its
logits with the Markov term teacher-forced from the true token a+j; weight
`w_j = exp(-j / gamma)` while the targets a+1..a+j+1 are all supervised and inside the
sequence, so supervision stops at the first unsupervised one):

* CE(label), the draft's distribution p_d against the label;
* L1 = ||p_d - p_t||_1, p_t the target's own distribution at position a+j (its final normed
  state through its head, no gradient);
* BCE(confidence logit, 1 - L1 / 2) with the acceptance target clamped to [0, 1] and detached.

loss = sum_j w_j (c CE + (1 - c) L1 + lambda BCE) / sum_j w_j with c = `ce_weight` (DeepSpec: 0.1,
the rest 0.9 on L1), lambda = `confidence_weight` (1.0), gamma = `loss_gamma` (DSpark: 4).
DeepSpec divides all three by the same sum of weights, as here. Without `distill` the L1 and
the confidence terms are dropped (there is no p_t to measure acceptance against).

Full-vocabulary logits exist for one chunk of slots at a time, so B x S x V is never
materialised (METHOD 4). As DSpine's backbone terms (`vocab_loss.BackboneVocabTerms`), each
chunk's CE and L1 terms are computed with their gradient in forward (`DSparkVocabTerms`): with
respect to the normed states, the Markov embeddings and `markov_w2` (one (V, r) sum over the
chunks), then the (n, V) logits are freed and backward is one multiply. Recomputing them in
backward (activation checkpointing) cost two more V x H projections per slot (the draft's and
the target's) and one more V x r.
The confidence head's BCE stays in autograd (it reads no vocabulary). Under ZeRO-3, where
`markov_w2` is only gathered inside its module's forward, the chunks are checkpointed instead.

The trainer calls it for a `method: dspark` draft (`training.draft_step.DraftStep`); its
metrics carry the trainer's names for the shared terms (`backbone_ce`, `backbone_l1`,
`top1_acc`) so logs and plots read the same for every method.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .modeling import DSpineDraftModel, DSpineTrainOutput
from .modeling.layers import vocab_projection
from .modeling.markov_head import confidence_scores
from .objective import slot_weights
from .vocab_loss import label_terms_in_place


class DSparkVocabTerms(torch.autograd.Function):
    """(normed (n, H), head (V, H), embedded (n, r) or None, w2 (V, r) or None, labels (n,),
    coef (n,), c, target_hidden (n, H) or None, target_logits, chunk) ->
    (sum_i coef_i (c CE_i + (1 - c) L1_i), and detached: CE (n,), L1 (n,), correct (n,)).

    A slot's logits are `normed @ head^T + w2 @ embedded` (the Markov bias of its previous
    token; none without a Markov head), in the draft's dtype, then float32; p_target is the
    softmax of `target_logits(target_hidden)` (the target's own head). `chunk` slots at a time,
    each chunk's gradients (with respect to normed, embedded and w2; the head is frozen) are
    made in forward and its (n, V) tensors freed; w2's is summed over the chunks into one
    (V, r) buffer. Without a target L1 is zero (c is then 1).
    """

    @staticmethod
    def forward(ctx, normed, head, embedded, w2, labels, coef, c, target_hidden,  # noqa: ANN001, ANN205 - autograd API
                target_logits, chunk):
        head = head.to(normed.dtype)
        grad_normed = torch.empty_like(normed)
        grad_embedded = None if w2 is None else torch.empty_like(embedded)
        grad_w2 = None
        ce, l1, correct = (torch.zeros(labels.shape, device=normed.device) for _ in range(3))
        for start in range(0, labels.numel(), chunk):
            part = slice(start, start + chunk)
            logits = vocab_projection(normed[part], head)
            if w2 is not None:
                e = embedded[part].to(w2.dtype)
                logits = logits + F.linear(e, w2).to(logits.dtype)
            ce[part], correct[part], p = label_terms_in_place(logits.float(), labels[part])
            del logits
            if target_hidden is None:
                grad = p
            else:
                sign = p - torch.softmax(target_logits(target_hidden[part]).float(), dim=-1)
                l1[part] = sign.abs().sum(-1)
                sign.sign_()
                # dL1/dz = p * (s - <p, s>), s = sign(p - p_target) per vocabulary entry
                sign.sub_((p * sign).sum(-1, keepdim=True)).mul_(p)
                grad = p.mul_(c).add_(sign, alpha=1 - c)
                del sign
            # dCE/dz = p - onehot(label)
            grad.scatter_add_(-1, labels[part, None], torch.full_like(ce[part, None], -c))
            grad = grad.mul_(coef[part, None]).to(normed.dtype)  # the weighted dLoss/dz
            grad_normed[part] = grad @ head
            if w2 is not None:
                grad = grad.to(w2.dtype)
                grad_embedded[part] = (grad @ w2).to(embedded.dtype)
                grad_w2 = grad.T @ e if grad_w2 is None else grad_w2.addmm_(grad.T, e)
            del grad
        ctx.save_for_backward(*(g for g in (grad_normed, grad_embedded, grad_w2) if g is not None))
        ctx.mark_non_differentiable(ce, l1, correct)
        return (coef * (c * ce + (1 - c) * l1)).sum(), ce, l1, correct

    @staticmethod
    def backward(ctx, grad_total, *unused):  # noqa: ANN001, ANN205 - autograd API
        grads = [grad_total.to(g.dtype) * g for g in ctx.saved_tensors]
        grad_normed, grad_embedded, grad_w2 = grads + [None] * (3 - len(grads))
        return grad_normed, None, grad_embedded, grad_w2, *[None] * 6


def _fused_terms(draft: DSpineDraftModel, hidden: torch.Tensor, prev: torch.Tensor,
                 labels: torch.Tensor, coef: torch.Tensor, c: float,
                 target_hidden: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, ...]:
    """(the CE + L1 part of the loss, ce, l1, bce, correct, acceptance) of n slots
    (`_slot_terms`' arguments, coef (n,) the slots' weights in the loss, chunk the slots whose
    logits exist at once)."""
    normed = draft.norm(hidden)
    markov = draft.markov_head
    embedded = markov.embed(prev) if markov is not None else None
    w2 = markov.markov_w2.weight if markov is not None else None
    total, ce, l1, correct = DSparkVocabTerms.apply(
        normed, draft.output_head(), embedded, w2, labels, coef, c, target_hidden,
        draft.target_logits, chunk)
    acceptance = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    scores = confidence_scores(normed, embedded, draft.confidence_head,
                               draft.config.confidence_head_with_markov)
    bce = torch.zeros_like(ce)
    if scores is not None and target_hidden is not None:
        bce = F.binary_cross_entropy_with_logits(scores.float(), acceptance, reduction="none")
    return total, ce, l1, bce, correct, acceptance


def _zero3_partitioned(draft: DSpineDraftModel) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the Markov head (its parameters carry `ds_id`)."""
    return draft.markov_head is not None and hasattr(draft.markov_head.markov_w2.weight, "ds_id")


def _slot_terms(draft: DSpineDraftModel, hidden: torch.Tensor, prev: torch.Tensor,
                labels: torch.Tensor,
                target_hidden: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(ce, l1, bce, correct, acceptance) of n slots: hidden (n, H) last-layer states before
    the final norm, prev (n,) the true previous tokens, labels (n,), target_hidden (n, H) the
    target's final normed states or None. The (n, V) logits live only in here."""
    result = draft.dspark_block(hidden, prev)
    logits = result.logits.float()  # (n, V)
    logp = torch.log_softmax(logits, dim=-1)
    ce = F.nll_loss(logp, labels, reduction="none")
    correct = (logits.detach().argmax(-1) == labels).float()
    zeros = torch.zeros_like(ce)
    if target_hidden is None:
        return ce, zeros, zeros, correct, zeros
    with torch.no_grad():
        p_target = torch.softmax(draft.target_logits(target_hidden).float(), dim=-1)
    l1 = (logp.exp() - p_target).abs().sum(-1)
    acceptance = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    bce = zeros
    if result.confidence is not None:
        bce = F.binary_cross_entropy_with_logits(result.confidence.float(), acceptance,
                                                 reduction="none")
    return ce, l1, bce, correct, acceptance


def dspark_loss(
    draft: DSpineDraftModel,
    out: DSpineTrainOutput,
    target_final_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DSpark objective for one training forward (`draft(...)` of a `method: dspark` draft);
    returns (loss, detached metrics: loss, backbone_ce, backbone_l1, confidence_bce, top1_acc,
    acceptance (mean 1 - L1/2), supervised_slots). target_final_hidden (B, S, H): the target's
    final normed hidden states; slot j of anchor a reads its distribution at position a + j."""
    cfg = draft.config
    if not cfg.anchor_predicts or out.prev_ids is None:
        raise ValueError(f"dspark_loss: a method: {cfg.method} draft (use objective.dspine_loss)")
    bsz, seq_len = loss_mask.shape
    bk = cfg.block_size
    # slot j predicts a+j+1 with weight exp(-j/gamma): DSpine's per-slot weights of a block one
    # longer (its slots k = 1..Bk predict a+k, weighted exp(-(k-1)/gamma))
    weights = slot_weights(loss_mask, anchors, anchor_mask, bk + 1, cfg.loss_gamma)
    # Deliberate host sync (as in `objective.supervised_slots`): the supervised slots' indices,
    # read once, so padding costs no vocabulary work.
    rows = torch.nonzero(weights.reshape(-1) > 0).squeeze(1)  # (n,)
    w = weights.reshape(-1)[rows]
    hidden = out.hidden.reshape(-1, cfg.hidden_size)[rows]  # (n, H)
    prev = out.prev_ids.reshape(-1)[rows]
    labels = out.labels.reshape(-1)[rows]
    # the target state predicting token a+j+1 sits at position a+j
    pos = (anchors[..., None] + torch.arange(bk, device=anchors.device)).clamp_max(seq_len - 1)
    batch = torch.arange(bsz, device=anchors.device)[:, None, None].expand_as(pos)
    pos, batch = pos.reshape(-1)[rows], batch.reshape(-1)[rows]
    distill = cfg.distill
    total = w.sum().clamp_min(1e-6)
    c = cfg.ce_weight if distill else 1.0
    fused = torch.is_grad_enabled() and not _zero3_partitioned(draft)
    terms, share = [], None
    if fused and rows.numel():
        target = target_final_hidden[batch, pos] if distill else None
        share, *fused_terms = _fused_terms(draft, hidden, prev, labels, w / total, c, target,
                                           chunk_size)
        terms.append(fused_terms)
    for start in range(0, 0 if fused else rows.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        target = target_final_hidden[batch[part], pos[part]] if distill else None
        args = (draft, hidden[part], prev[part], labels[part], target)
        if torch.is_grad_enabled():
            terms.append(checkpoint(_slot_terms, *args, use_reentrant=False))
        else:
            terms.append(_slot_terms(*args))
    if terms:
        ce, l1, bce, correct, acceptance = (torch.cat(t) for t in zip(*terms, strict=True))
    else:  # no supervised slot: a zero loss that still reaches the parameters
        ce = l1 = bce = correct = acceptance = hidden.sum() * 0.0 + torch.zeros(0, device=hidden.device)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (w * x).sum() / total

    loss = share if share is not None else c * mean(ce) + (1.0 - c) * mean(l1)
    if distill and draft.confidence_head is not None:
        loss = loss + cfg.confidence_weight * mean(bce)
    metrics = {"loss": loss.detach(), "backbone_ce": mean(ce).detach(),
               "backbone_l1": mean(l1).detach(), "confidence_bce": mean(bce).detach(),
               "top1_acc": mean(correct).detach(), "acceptance": mean(acceptance).detach(),
               "supervised_slots": torch.tensor(float(rows.numel()), device=loss.device)}
    return loss, metrics
