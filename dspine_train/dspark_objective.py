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

Full-vocabulary logits exist for one chunk of slots at a time, recomputed in backward
(activation checkpointing), so B x S x V is never materialised (METHOD 4).

The trainer calls it for a `method: dspark` draft (`training.draft_step.DraftStep`); its
metrics carry the trainer's names for the shared terms (`backbone_ce`, `backbone_l1`,
`top1_acc`) so logs and plots read the same for every method.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .modeling import DSpineDraftModel, DSpineTrainOutput
from .objective import slot_weights


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
    terms = []
    for start in range(0, rows.numel(), chunk_size):
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
    total = w.sum().clamp_min(1e-6)
    c = cfg.ce_weight if distill else 1.0

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (w * x).sum() / total

    loss = c * mean(ce) + (1.0 - c) * mean(l1)
    if distill and draft.confidence_head is not None:
        loss = loss + cfg.confidence_weight * mean(bce)
    metrics = {"loss": loss.detach(), "backbone_ce": mean(ce).detach(),
               "backbone_l1": mean(l1).detach(), "confidence_bce": mean(bce).detach(),
               "top1_acc": mean(correct).detach(), "acceptance": mean(acceptance).detach(),
               "supervised_slots": torch.tensor(float(rows.numel()), device=loss.device)}
    return loss, metrics
