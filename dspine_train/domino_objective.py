"""Domino's training objective (SpecForge `OnlineDominoModel`, `DominoTrainStrategy`).

Per supervised drafted token i of a block (i = 1..P, token a+i; weight `w_i = exp(-(i-1)/gamma)`
while the targets a+1..a+i are all supervised and inside the sequence):

* CE_final: the label's CE under the final logits, the backbone's plus the GRU correction
  teacher-forced with the true previous tokens (`DSpineDraftModel.domino_logits`);
* CE_base: the label's CE under the backbone's logits alone.

loss = (1 - l) sum_i w_i CE_final / sum_i w_i + l sum_i w_i CE_base / sum_i w_i, with the base
weight l = `domino_lambda_start` falling linearly to 0 at `domino_lambda_decay_ratio` of the
run's steps (`lambda_base`; SpecForge's `linear_lambda_base`). Label CE only: Domino distils
nothing from the target's distribution (`distill` and `ce_weight` are not read).

One difference from SpecForge, kept for the project's one rule across methods: its weight is the
loss mask of each target alone, here supervision stops at a block's first unsupervised target
(`objective.slot_weights`, as DFlash, DSpine and DSpark train here) - the evaluation and the
engine never accept a token past it either.

Full-vocabulary logits exist for one chunk of tokens at a time, so B x S x V is never
materialised (METHOD 4). In training both CEs are computed with their gradient in forward
(`DominoVocabTerms`, as DSpine's `vocab_loss.BackboneVocabTerms`): with respect to the normed
states, the delta MLP's hidden layer and its (V, E) output weight (one sum over the chunks), then
the (n, V) logits are freed; recomputing them in backward (activation checkpointing) cost one
more V x H and one more V x E projection per token. Without gradients (`_token_terms`) they are
computed once; under ZeRO-3, where the output weight is only gathered inside its module's
forward, the chunks stay checkpointed. The GRU runs once over every block's previous tokens (a
(blocks, P, G) tensor), outside the chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .modeling import DSpineDraftModel, DSpineTrainOutput
from .modeling.layers import vocab_projection
from .objective import slot_weights
from .vocab_loss import label_terms_in_place


def lambda_base(step: int, total_steps: int, start: float, decay_ratio: float) -> float:
    """The base-CE weight at `step` of `total_steps`: `start` falling linearly to 0 over the
    first `int(total_steps * decay_ratio)` steps (at least one), clamped to [0, 1]."""
    decay_steps = max(1, int(total_steps * decay_ratio))
    return max(0.0, min(1.0, start * (1.0 - min(step / decay_steps, 1.0))))


def _token_terms(draft: DSpineDraftModel, hidden: torch.Tensor, states: torch.Tensor,
                 corrected: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(final CE, base CE, final correct, base correct) of n drafted tokens: hidden (n, H) their
    slots' last-layer states, states (n, G) their GRU states, corrected (n,), labels (n,). The
    (n, V) logits live only in here."""
    final, base = draft.domino_logits(hidden, states, corrected)
    final, base = final.float(), base.float()
    final_ce = F.cross_entropy(final, labels, reduction="none")
    base_ce = F.cross_entropy(base, labels, reduction="none")
    correct = (final.detach().argmax(-1) == labels).float()
    base_correct = (base.detach().argmax(-1) == labels).float()
    return final_ce, base_ce, correct, base_correct


def _label_ce_gradient(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(CE (n,), correct (n,), dCE/dz = p - onehot(label) (n, V)) of float32 logits (n, V),
    computed in their storage."""
    ce, correct, grad = label_terms_in_place(logits, labels)
    grad.scatter_add_(-1, labels[:, None], torch.full_like(ce[:, None], -1.0))
    return ce, correct, grad


class DominoVocabTerms(torch.autograd.Function):
    """(normed (n, H), head (V, H), mid (n, E), w_out (V, E), corrected (n,) bool, labels (n,),
    coef_final (n,), coef_base (n,), chunk) -> (sum_i coef_final_i CE_final_i + coef_base_i
    CE_base_i, and detached: CE_final, CE_base, correct final, correct base, each (n,)).

    base = normed @ head^T, final = base + (mid @ w_out^T) on corrected tokens (the delta MLP's
    output layer on its hidden layer `mid`), both in the draft's dtype, then float32. `chunk`
    tokens at a time, the gradients with respect to normed, mid and w_out (summed over the
    chunks) are made in forward and the (n, V) tensors freed; the head is frozen.
    """

    @staticmethod
    def forward(ctx, normed, head, mid, w_out, corrected, labels, coef_final, coef_base,  # noqa: ANN001, ANN205 - autograd API
                chunk):
        head = head.to(normed.dtype)
        grad_normed, grad_mid, grad_w = torch.empty_like(normed), torch.empty_like(mid), None
        out = [torch.zeros(labels.shape, device=normed.device) for _ in range(4)]
        final_ce, base_ce, correct, base_correct = out
        for start in range(0, labels.numel(), chunk):
            part = slice(start, start + chunk)
            base = vocab_projection(normed[part], head)  # (n, V)
            on = corrected[part, None].to(base.dtype)
            final = base + F.linear(mid[part], w_out).to(base.dtype) * on
            final_ce[part], correct[part], grad_final = _label_ce_gradient(final.float(), labels[part])
            del final
            base_ce[part], base_correct[part], grad_base = _label_ce_gradient(base.float(), labels[part])
            del base
            grad_final.mul_(coef_final[part, None])
            grad_base.mul_(coef_base[part, None]).add_(grad_final)  # base feeds final too
            grad_normed[part] = grad_base.to(normed.dtype) @ head
            del grad_base
            grad_delta = grad_final.mul_(corrected[part, None]).to(w_out.dtype)
            grad_mid[part] = (grad_delta @ w_out).to(mid.dtype)
            m = mid[part].to(w_out.dtype)
            grad_w = grad_delta.T @ m if grad_w is None else grad_w.addmm_(grad_delta.T, m)
            del grad_final, grad_delta
        ctx.save_for_backward(grad_normed, grad_mid, grad_w)
        ctx.mark_non_differentiable(*out)
        return (coef_final * final_ce + coef_base * base_ce).sum(), *out

    @staticmethod
    def backward(ctx, grad_total, *unused):  # noqa: ANN001, ANN205 - autograd API
        grad_normed, grad_mid, grad_w = (grad_total.to(g.dtype) * g for g in ctx.saved_tensors)
        return grad_normed, None, grad_mid, grad_w, *[None] * 5


def _fused_terms(draft: DSpineDraftModel, hidden: torch.Tensor, states: torch.Tensor,
                 corrected: torch.Tensor, labels: torch.Tensor, coef_final: torch.Tensor,
                 coef_base: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """(the loss, then `_token_terms`' four terms) of n drafted tokens (its arguments, and the
    tokens' weights in the loss of each CE)."""
    normed = draft.norm(hidden)
    proj = draft.embed_proj  # Linear(H + G, E), SiLU, Linear(E, V)
    mid = proj[1](proj[0](torch.cat((normed.to(proj[0].weight.dtype),
                                     states.to(proj[0].weight.dtype)), dim=-1)))
    return DominoVocabTerms.apply(normed, draft.output_head(), mid, proj[2].weight, corrected,
                                  labels, coef_final, coef_base, chunk)


def _zero3_partitioned(draft: DSpineDraftModel) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the delta MLP (its parameters carry `ds_id`)."""
    return hasattr(draft.embed_proj[2].weight, "ds_id")


def domino_loss(
    draft: DSpineDraftModel,
    out: DSpineTrainOutput,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    step: int = 0,
    total_steps: int = 1,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Domino objective for one training forward (`draft(...)` of a `method: domino` draft)
    at `step` of `total_steps`; returns (loss, detached metrics: loss, backbone_ce (base CE),
    domino_ce (final CE), top1_acc (final), base_top1_acc, lambda_base, supervised_slots)."""
    cfg = draft.config
    if cfg.method != "domino" or out.prev_ids is None:
        raise ValueError(f"domino_loss: a method: {cfg.method} draft (use objective.dspine_loss)")
    p = cfg.num_predictions
    first = cfg.block_size - p  # the first drafting slot: 1, or 0 when the anchor predicts
    # drafted token i predicts a+i with weight exp(-(i-1)/gamma): the weights of a block of P + 1
    weights = slot_weights(loss_mask, anchors, anchor_mask, p + 1, cfg.loss_gamma)  # (B, A, P)
    states = draft.domino_prev_states(out.prev_ids)  # (B, A, P, G), teacher-forced
    # Deliberate host sync (as in `objective.supervised_slots`): the supervised tokens' indices,
    # read once, so padding costs no vocabulary work.
    rows = torch.nonzero(weights.reshape(-1) > 0).squeeze(1)  # (n,)
    w = weights.reshape(-1)[rows]
    hidden = out.hidden[:, :, first:].reshape(-1, cfg.hidden_size)[rows]  # (n, H)
    states = states.reshape(-1, states.shape[-1])[rows]  # (n, G)
    token = torch.arange(1, p + 1, device=anchors.device).expand_as(weights).reshape(-1)[rows]
    corrected = token > cfg.domino_prefix_len
    labels = out.labels.reshape(-1)[rows]
    total = w.sum().clamp_min(1e-6)
    lam = lambda_base(step, total_steps, cfg.domino_lambda_start, cfg.domino_lambda_decay_ratio)
    fused = torch.is_grad_enabled() and not _zero3_partitioned(draft)
    terms, loss = [], None
    if fused and rows.numel():
        loss, *fused_terms = _fused_terms(draft, hidden, states, corrected, labels,
                                          (1.0 - lam) * w / total, lam * w / total, chunk_size)
        terms.append(fused_terms)
    for start in range(0, 0 if fused else rows.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        args = (draft, hidden[part], states[part], corrected[part], labels[part])
        if torch.is_grad_enabled():
            terms.append(checkpoint(_token_terms, *args, use_reentrant=False))
        else:
            terms.append(_token_terms(*args))
    if terms:
        final_ce, base_ce, correct, base_correct = (torch.cat(t) for t in zip(*terms, strict=True))
    else:  # no supervised token: a zero loss that still reaches the parameters
        final_ce = base_ce = correct = base_correct = (
            hidden.sum() * 0.0 + states.sum() * 0.0 + torch.zeros(0, device=hidden.device))

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (w * x).sum() / total

    if loss is None:
        loss = (1.0 - lam) * mean(final_ce) + lam * mean(base_ce)
    metrics = {"loss": loss.detach(), "backbone_ce": mean(base_ce).detach(),
               "domino_ce": mean(final_ce).detach(), "top1_acc": mean(correct).detach(),
               "base_top1_acc": mean(base_correct).detach(),
               "lambda_base": torch.tensor(lam, device=loss.device),
               "supervised_slots": torch.tensor(float(rows.numel()), device=loss.device)}
    return loss, metrics
