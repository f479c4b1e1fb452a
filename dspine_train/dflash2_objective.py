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

Full-vocabulary logits exist for one chunk of slots at a time, so B x S x V is never
materialised (METHOD 4). In training each chunk's unary term is computed with its gradient in
forward (`UnaryVocabTerms`, as DSpine's `vocab_loss.BackboneVocabTerms`), and the selector reads
only the K candidates' unary logits, whose gradient backward sends through those K head rows:
the (n, V) logits are freed at once, where recomputing them in backward (activation
checkpointing) cost two more V x H projections per slot, the draft's and the target's. Without
gradients (`_slot_terms`) the terms are computed once and nothing is kept. The trainer calls it
for a `method: dflash2` draft (`training.draft_step.DraftStep`); metrics carry the trainer's
names for the shared terms (`backbone_ce`, `top1_acc`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .modeling import DSpineDraftModel, DSpineTrainOutput
from .modeling.layers import vocab_projection
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


class UnaryVocabTerms(torch.autograd.Function):
    """(normed (n, H), head (V, H), labels (n,), coef (n,), p_target (n, V) or None, hard (n,),
    k) -> (sum_i coef_i unary_i, the unary logits of the selector's training candidates (n, k),
    and detached: the candidates (n, k), the hard target's place among them (n,), whether the
    unary top-k held it (n,), the label's CE (n,), the unary term (n,), correct (n,)).

    The unary logits are `normed @ head^T` in the draft's dtype; the unary term is KL(p_target
    || p_draft), or the label's CE without a target. Its gradient with respect to normed is made
    in forward; the candidates' logits get theirs in backward, through their k head rows.
    """

    @staticmethod
    def forward(ctx, normed, head, labels, coef, p_target, hard, k):  # noqa: ANN001, ANN205 - autograd API
        head = head.to(normed.dtype)
        unary = vocab_projection(normed, head)  # (n, V)
        cand, place, covered = selector_training_candidates(top_candidates(unary, k), hard)
        cand_logits = unary.gather(-1, cand)
        correct = (unary.argmax(-1) == labels).float()
        logits = unary.float()
        del unary
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        ce = (lse - logits.gather(-1, labels[:, None])).squeeze(-1)
        logp = logits.sub_(lse)  # the logits' storage
        del logits
        if p_target is None:
            term = ce
            grad = logp.exp_()  # dCE/dz = p - onehot(label)
            grad.scatter_add_(-1, labels[:, None], torch.full_like(ce[:, None], -1.0))
        else:
            term = (torch.xlogy(p_target, p_target) - p_target * logp).sum(-1)
            # dKL/dz = p_draft * sum(p_target) - p_target (autograd's, through log_softmax)
            grad = logp.exp_().mul_(p_target.sum(-1, keepdim=True)).sub_(p_target)
        del logp
        ctx.save_for_backward(grad.mul_(coef[:, None]).to(normed.dtype) @ head, head, cand)
        ctx.mark_non_differentiable(cand, place, covered, ce, term, correct)
        return (coef * term).sum(), cand_logits, cand, place, covered, ce, term, correct

    @staticmethod
    def backward(ctx, grad_total, grad_cand_logits, *unused):  # noqa: ANN001, ANN205 - autograd API
        grad_normed, head, cand = ctx.saved_tensors
        grad = grad_total.to(grad_normed.dtype) * grad_normed
        if grad_cand_logits is not None:  # d(cand_logits)/d(normed) = the candidates' head rows
            grad = grad + torch.einsum("nk,nkh->nh", grad_cand_logits.to(head.dtype), head[cand])
        return grad, None, None, None, None, None, None


def _fused_terms(draft: DSpineDraftModel, hidden: torch.Tensor, prev: torch.Tensor,
                 labels: torch.Tensor, coef: torch.Tensor,
                 target_hidden: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(the chunk's share of the unary loss, then `_slot_terms`' six terms) of n slots; coef
    (n,) the slots' weights in the loss."""
    normed = draft.norm(hidden)
    p_target, hard = None, labels
    if target_hidden is not None:
        with torch.no_grad():
            target_logits = draft.target_logits(target_hidden).float()
            hard = target_logits.argmax(-1)
            p_target = torch.softmax(target_logits, dim=-1)
            del target_logits
    selector = draft.candidate_selector
    share, cand_logits, cand, place, covered, ce, unary_loss, correct = UnaryVocabTerms.apply(
        normed, draft.output_head(), labels, coef, p_target, hard, selector.top_k)
    del p_target
    scores = (cand_logits + selector.transition_scores(normed, prev, cand).to(cand_logits.dtype)
              ).float()  # `score_candidates` on the gathered logits
    selector_ce = F.cross_entropy(scores, place, reduction="none")
    picked = cand.gather(-1, scores.detach().argmax(-1, keepdim=True)).squeeze(-1)
    selector_correct = (picked.eq(hard) & covered).float()
    return share, unary_loss, ce, selector_ce, correct, covered.float(), selector_correct


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
    count = torch.tensor(float(rows.numel()), device=w.device).clamp_min(1.0)
    coef = w / count  # speculators' reduction: weighted sum / supervised slots
    terms, shares = [], []
    for start in range(0, rows.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        target = target_final_hidden[batch[part], pos[part]] if cfg.distill else None
        args = (draft, hidden[part], prev[part], labels[part], target)
        if torch.is_grad_enabled():
            share, *chunk_terms = _fused_terms(*args[:4], coef[part], target)
            shares.append(share)
            terms.append(chunk_terms)
        else:
            terms.append(_slot_terms(*args))
    if terms:
        unary, ce, selector_ce, correct, covered, selector_correct = (
            torch.cat(t) for t in zip(*terms, strict=True))
    else:  # no supervised slot: a zero loss that still reaches the parameters
        unary = ce = selector_ce = correct = covered = selector_correct = (
            hidden.sum() * 0.0 + torch.zeros(0, device=hidden.device))

    def per_slot(x: torch.Tensor) -> torch.Tensor:
        return (coef * x).sum()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (w * x).sum() / w.sum().clamp_min(1e-6)

    unary_share = torch.stack(shares).sum() if shares else per_slot(unary)
    loss = unary_share + cfg.selector_weight * per_slot(selector_ce)
    metrics = {"loss": loss.detach(), "backbone_ce": mean(ce).detach(),
               "backbone_kl": mean(unary).detach() if cfg.distill else mean(ce).detach() * 0.0,
               "selector_ce": mean(selector_ce).detach(), "top1_acc": mean(correct).detach(),
               "candidate_coverage": mean(covered).detach(),
               "selector_acc": mean(selector_correct).detach(),
               "supervised_slots": torch.tensor(float(rows.numel()), device=loss.device)}
    return loss, metrics
