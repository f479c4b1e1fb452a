"""DFlash2's training objective: speculators' re-implementation (`models/dflash2`), chunked.

z-lab published DFlash2's network but no training objective; this is the one `speculators`
trains it with (`DFlash2DraftModel.forward` with its default `kl_div` loss and
`selector_loss_alpha`), in this project's terms. Per supervised drafted slot k (k = 1..B-1 of
a block anchored at a; slot k predicts token a+k; weight `w_k = exp(-(k-1)/gamma)` while the
targets a+1..a+k are all supervised and inside the sequence, so supervision stops at the first
unsupervised one, as for DFlash here):

* unary term: KL(p_t || p_d), p_d the draft's own ("unary") distribution at the slot, p_t the
  target's at position a+k-1 (its final normed state through its head, no gradient);
* selector term: the K-way cross-entropy of the candidate selector's scores over the slot's
  top-K unary candidates (detached top-k), with the true predecessor token a+k-1 (teacher
  forcing). The hard target is the target's own greedy token argmax p_t; where it is not among
  the top K it replaces the K-th candidate, so every slot has a label (speculators'
  `selector_training_candidates`). The scores add the unary logits of the candidates, so this
  term trains the backbone too.

loss = sum_k w_k KL / n + alpha * sum_k w_k CE_sel / n, with n the number of supervised slots
(speculators divides by the mask's count, not by the sum of the weights) and alpha =
`selector_weight` (1.0). Without `distill` there is no p_t: the unary term is the label's CE
and the label is the selector's hard target.

Full-vocabulary logits exist for one chunk of slots at a time, recomputed in backward
(activation checkpointing), so B x S x V is never materialised (METHOD 4). The trainer calls it
for a `method: dflash2` draft (`training.draft_step.DraftStep`); metrics carry the trainer's
names for the shared terms (`backbone_ce`, `top1_acc`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .modeling import DSpineDraftModel, DSpineTrainOutput
from .modeling.transition_cache import top_candidates
from .objective import slot_weights


def selector_training_candidates(
    cand: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cand (n, K) the unary top-K, target (n,) the hard targets -> (the candidates with a
    missing target in the K-th place (n, K), the target's place (n,), whether the unary top-K
    held it (n,))."""
    k = cand.shape[-1]
    matches = cand.eq(target[:, None])
    contains = matches.any(-1)
    place = torch.where(contains, matches.long().argmax(-1), k - 1)
    training = cand.clone()
    training[:, -1] = torch.where(contains, cand[:, -1], target)
    return training, place, contains


def _slot_terms(draft: DSpineDraftModel, hidden: torch.Tensor, prev: torch.Tensor,
                labels: torch.Tensor,
                target_hidden: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(unary loss, label CE, selector CE, correct, covered, selector correct) of n slots:
    hidden (n, H) last-layer states before the final norm, prev (n,) the true predecessors,
    labels (n,), target_hidden (n, H) the target's final normed states or None. The (n, V)
    logits live only in here."""
    normed = draft.norm(hidden)
    unary = draft.logits(hidden)  # (n, V)
    logp = torch.log_softmax(unary.float(), dim=-1)
    ce = F.nll_loss(logp, labels, reduction="none")
    correct = (unary.detach().argmax(-1) == labels).float()
    if target_hidden is None:
        unary_loss, hard = ce, labels
    else:
        with torch.no_grad():
            target_logits = draft.target_logits(target_hidden).float()
            p_target = torch.softmax(target_logits, dim=-1)
            hard = target_logits.argmax(-1)
        unary_loss = F.kl_div(logp, p_target, reduction="none").sum(-1)
    selector = draft.candidate_selector
    cand = top_candidates(unary.detach(), selector.top_k)  # (n, K): the walk's candidates
    cand, place, covered = selector_training_candidates(cand, hard)
    scores = selector.score_candidates(unary, normed, prev, cand).float()  # (n, K)
    selector_ce = F.cross_entropy(scores, place, reduction="none")
    picked = cand.gather(-1, scores.detach().argmax(-1, keepdim=True)).squeeze(-1)
    selector_correct = (picked.eq(hard) & covered).float()
    return unary_loss, ce, selector_ce, correct, covered.float(), selector_correct


def dflash2_loss(
    draft: DSpineDraftModel,
    out: DSpineTrainOutput,
    target_final_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFlash2 objective for one training forward (`draft(...)` of a `method: dflash2`
    draft); returns (loss, detached metrics: loss, backbone_kl, backbone_ce, selector_ce,
    top1_acc, candidate_coverage (the hard target among the unary top-K), selector_acc,
    supervised_slots). target_final_hidden (B, S, H): the target's final normed states; slot k
    of anchor a reads its distribution at position a + k - 1."""
    cfg = draft.config
    if draft.candidate_selector is None or out.prev_ids is None:
        raise ValueError(f"dflash2_loss: a method: {cfg.method} draft has no candidate selector")
    bsz, seq_len = loss_mask.shape
    bk = cfg.block_size
    weights = slot_weights(loss_mask, anchors, anchor_mask, bk, cfg.loss_gamma)  # (B, A, Bk-1)
    # Deliberate host sync (as in `objective.supervised_slots`): the supervised slots' indices,
    # read once, so padding costs no vocabulary work.
    rows = torch.nonzero(weights.reshape(-1) > 0).squeeze(1)  # (n,)
    w = weights.reshape(-1)[rows]
    hidden = out.hidden[..., 1:, :].reshape(-1, cfg.hidden_size)[rows]  # (n, H)
    prev = out.prev_ids.reshape(-1)[rows]
    labels = out.labels.reshape(-1)[rows]
    # the target state predicting token a+k sits at position a+k-1
    pos = (anchors[..., None] + torch.arange(bk - 1, device=anchors.device)).clamp_max(seq_len - 1)
    batch = torch.arange(bsz, device=anchors.device)[:, None, None].expand_as(pos)
    pos, batch = pos.reshape(-1)[rows], batch.reshape(-1)[rows]
    terms = []
    for start in range(0, rows.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        target = target_final_hidden[batch[part], pos[part]] if cfg.distill else None
        args = (draft, hidden[part], prev[part], labels[part], target)
        if torch.is_grad_enabled():
            terms.append(checkpoint(_slot_terms, *args, use_reentrant=False))
        else:
            terms.append(_slot_terms(*args))
    if terms:
        unary, ce, selector_ce, correct, covered, selector_correct = (
            torch.cat(t) for t in zip(*terms, strict=True))
    else:  # no supervised slot: a zero loss that still reaches the parameters
        unary = ce = selector_ce = correct = covered = selector_correct = (
            hidden.sum() * 0.0 + torch.zeros(0, device=hidden.device))
    count = torch.tensor(float(rows.numel()), device=w.device).clamp_min(1.0)

    def per_slot(x: torch.Tensor) -> torch.Tensor:
        return (w * x).sum() / count  # speculators' reduction: weighted sum / supervised slots

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (w * x).sum() / w.sum().clamp_min(1e-6)

    loss = per_slot(unary) + cfg.selector_weight * per_slot(selector_ce)
    metrics = {"loss": loss.detach(), "backbone_ce": mean(ce).detach(),
               "backbone_kl": mean(unary).detach() if cfg.distill else mean(ce).detach() * 0.0,
               "selector_ce": mean(selector_ce).detach(), "top1_acc": mean(correct).detach(),
               "candidate_coverage": mean(covered).detach(),
               "selector_acc": mean(selector_correct).detach(),
               "supervised_slots": torch.tensor(float(rows.numel()), device=loss.device)}
    return loss, metrics
