"""The DSpine training objective (METHOD 2.3), computed in chunks over supervised slots.

Per supervised slot k of a block (weight `w_k = exp(-(k-1)/gamma)`, supervision cut at the first
unsupervised slot):

* backbone:   c * CE(label) + (1 - c) * L1(p_draft, p_target)        (label CE only without distill)
* refinement: over the backbone's top-K candidates (detached), the last-write refined scores given
  the *true* predecessor: c * CE(label | label in C) + (1 - c) * L1 against p_target restricted to
  C and renormalised (only where p_target puts > 1e-4 of its mass on C); averaged over the
  slots where each applies, or over every supervised slot (`refine_normalization`)
* alignment:  sum (or mean, `alignment_layer_reduction`) over layers of 1 - cos(f^l_t, T[label]),
  scaled by beta * CE(detached), beta rising linearly to `alignment_weight` over
  `alignment_warmup_steps`
* ablation:   full-vocabulary CE after every intermediate layer when `token_ce_intermediate`

Full-vocabulary logits exist for one chunk of slots at a time, their gradient made in the same
pass (`vocab_loss`), so B x S x V is never materialised (METHOD 4).

`dspine_loss` is three stages: `supervised_slots` (the slots every term reads),
`backbone_terms` (the vocabulary terms, chunk by chunk) and `slot_loss` (the weighted sums,
refinement, alignment). A benchmark or test can compute the backbone terms another way and
reuse the other two (`scripts/tools/bench/reference_objective.py`: autograd + checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .modeling import DSpineConfig, DSpineDraftModel, DSpineTrainOutput
from .vocab_loss import TargetDistribution, backbone_vocab_terms

IGNORE = -100
# What the backbone's vocabulary terms are, per supervised slot, in the order they come in.
BACKBONE_TERMS = ("mix", "ce", "l1", "correct", "cand", "p_cand")


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchor positions per sequence (METHOD 1 "Training").

    An anchor a is valid where `loss_mask[a]` and `loss_mask[a+1]` are both 1. Up to
    `num_anchors` distinct valid anchors are drawn per sequence, sorted; the result has a fixed
    width `min(num_anchors, S - 1)`, padded anchors marked False in the returned mask.
    loss_mask (B, S) -> anchors (B, A) long, anchor_mask (B, A) bool.
    """
    del block_size  # blocks may run past the sequence end; their slots there are unsupervised
    bsz, seq_len = loss_mask.shape
    width = max(1, min(num_anchors, seq_len - 1))
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    scores = torch.rand(lm.shape, generator=generator, device="cpu").to(lm.device)
    scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    top = torch.topk(scores, width, dim=1)
    anchor_mask = top.values >= 0
    anchors = torch.where(anchor_mask, top.indices, torch.full_like(top.indices, seq_len))
    anchors, order = torch.sort(anchors, dim=1)  # padding (seq_len) sorts last
    anchor_mask = torch.gather(anchor_mask, 1, order)
    anchors = torch.where(anchor_mask, anchors, torch.zeros_like(anchors))
    return anchors, anchor_mask


def batch_generator(seed: int, index: int) -> torch.Generator:
    """The RNG of global batch `index` (its anchor and replacement draws): the same draws on any
    world size and after any resume."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def replacement_probability(step: int, total_steps: int, start: float = 0.5,
                            hold: float = 1 / 6, end: float = 1 / 3) -> float:
    """Share of blocks whose first layers hear the true predecessor (METHOD 2.2 curriculum).

    `start` for the first `hold` of training, then linearly down to 0 at `end` (shares of
    `total_steps`; METHOD 2.2: 0.5, 1/6, 1/3).
    """
    if total_steps <= 0:
        return 0.0
    frac = step / total_steps
    if frac < hold:
        return start
    if frac >= end:
        return 0.0
    return start * (end - frac) / (end - hold)


def slot_weights(
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    block_size: int,
    gamma: float,
) -> torch.Tensor:
    """Per-slot loss weights (B, A, Bk-1): exp(-(k-1)/gamma) while loss_mask[a+1..a+k] are all 1."""
    bsz, seq_len = loss_mask.shape
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[..., None] + k  # (B, A, Bk-1)
    in_seq = pos < seq_len
    lm = torch.gather(loss_mask.float(), 1, pos.clamp_max(seq_len - 1).view(bsz, -1))
    lm = lm.view_as(pos) * in_seq * anchor_mask[..., None]
    supervised = torch.cumprod(lm, dim=-1)  # cut at the first unsupervised slot
    decay = torch.exp(-(k.float() - 1) / gamma)
    return supervised * decay


def alignment_scale(step: int, weight: float, warmup_steps: int) -> float:
    """beta at `step`: linear warm-up from 0 to `weight` over `warmup_steps`."""
    if warmup_steps <= 0:
        return weight
    return weight * min(1.0, step / warmup_steps)


def dspine_loss(
    draft: DSpineDraftModel,
    out: DSpineTrainOutput,
    target_final_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    step: int,
    total_steps: int | None = None,
    chunk_size: int = 1024,
    target_topk: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The METHOD 2.3 objective for one training forward; returns (loss, detached metrics).

    target_final_hidden (B, S, H): the target's final normed hidden states; the target's
    distribution for slot k of anchor a is softmax(lm_head(target_final_hidden[a + k - 1])).
    target_topk: (ids, probs, logsumexp), (B, S, k), (B, S, k), (B, S, 1): that distribution's
    top-k per position and its log-normaliser as the feature cache stores them (`vocab_loss`);
    when given, no V x H target projection is made.
    """
    del total_steps  # the alignment warm-up is in steps; kept for a uniform call signature
    slots = supervised_slots(draft, out, target_final_hidden, loss_mask, anchors, anchor_mask,
                             target_topk)
    return slot_loss(draft, out, slots, backbone_terms(draft, slots, chunk_size), step,
                     chunk_size)


def ce_share(config: DSpineConfig) -> float:
    """c: the label CE's share of each term against the L1 to the target (1 without distill)."""
    return config.ce_weight if config.distill else 1.0


@dataclass
class SupervisedSlots:
    """The supervised slots of one training forward, flattened (n of them, in one order): what
    every term of the objective reads. `supervised_slots` builds it."""

    rows: torch.Tensor  # (n,) their indices in the (B, A, Bk-1) slot grid
    weights: torch.Tensor  # (n,) w_k
    # (n,) w_k, zero where the label is outside a pruned draft vocabulary (the backbone's)
    backbone_weights: torch.Tensor
    labels: torch.Tensor  # (n,) target ids
    hidden: torch.Tensor  # (n, H) the draft's last-layer states
    pre_injection: torch.Tensor  # (n, H)
    recv_features: torch.Tensor  # (n, r)
    true_pred: torch.Tensor  # (n,) the true predecessor of each slot
    batch_index: torch.Tensor  # (n,) row of the target state predicting each slot's token
    position: torch.Tensor  # (n,) its position
    target_final_hidden: torch.Tensor | None  # (B, S, H); None without distillation
    target_topk: tuple[torch.Tensor, ...] | None  # (ids, probs, lse) per slot, (n, k) each

    def chunks(self, size: int) -> list[slice]:
        """The slices of at most `size` slots the vocabulary terms are computed in."""
        return [slice(start, start + size) for start in range(0, self.weights.numel(), size)]

    def target_hidden(self, chunk: slice) -> torch.Tensor | None:
        """The target's final states predicting the chunk's tokens (gathered per chunk, so the
        (n, H) copy never exists), or None without distillation."""
        if self.target_final_hidden is None:
            return None
        return self.target_final_hidden[self.batch_index[chunk], self.position[chunk]]


def supervised_slots(
    draft: DSpineDraftModel,
    out: DSpineTrainOutput,
    target_final_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    target_topk: tuple[torch.Tensor, ...] | None = None,
) -> SupervisedSlots:
    """The forward's supervised slots and what the objective reads of each (see `dspine_loss`
    for the arguments)."""
    cfg = draft.config
    bsz, seq_len = loss_mask.shape
    bk = cfg.block_size
    weights = slot_weights(loss_mask, anchors, anchor_mask, bk, cfg.loss_gamma)  # (B, A, Bk-1)
    # Deliberate host sync (the objective's only one): the indices of the supervised slots,
    # read once, so padding costs no vocab work; every selection below indexes with them.
    rows = torch.nonzero(weights.reshape(-1) > 0).squeeze(1)  # (n,)
    w = weights.reshape(-1)[rows]  # (n,)
    labels = out.labels.reshape(-1)[rows]
    hidden = out.hidden[..., 1:, :].reshape(-1, cfg.hidden_size)[rows]  # (n, H)
    pre = out.pre_injection[..., 1:, :].reshape(-1, cfg.hidden_size)[rows]
    recv = out.recv_features.reshape(-1, cfg.transfer_dim)[rows]
    # target state that predicts token a+k is at position a+k-1 (clamped rows are unsupervised)
    k_idx = torch.arange(bk - 1, device=anchors.device)
    pred_pos = (anchors[..., None] + k_idx).clamp_max(seq_len - 1)  # (B, A, Bk-1)
    batch_idx = torch.arange(bsz, device=anchors.device)[:, None, None].expand_as(pred_pos)
    flat_pos = pred_pos.reshape(-1)[rows]
    flat_b = batch_idx.reshape(-1)[rows]
    # the true predecessor of slot k is the token at a+k-1: the anchor for k=1, else label k-1
    true_pred = torch.cat((out.anchor_ids[..., None], out.labels[..., :-1]), dim=-1)
    true_pred = true_pred.clamp_min(0).reshape(-1)[rows]  # -100 only on unsupervised slots
    # a pruned draft vocabulary trains the backbone on the slots whose label is one of its rows
    w_backbone = w if cfg.draft_vocab_size is None else w * (draft.target_to_draft(labels) >= 0)
    if target_topk is not None:
        target_topk = tuple(t[flat_b, flat_pos] for t in target_topk)
    return SupervisedSlots(rows, w, w_backbone, labels, hidden, pre, recv, true_pred, flat_b,
                           flat_pos, target_final_hidden if cfg.distill else None, target_topk)


def backbone_terms(
    draft: DSpineDraftModel, slots: SupervisedSlots, chunk_size: int
) -> tuple[torch.Tensor, ...]:
    """The backbone's vocabulary terms of every slot, `chunk_size` slots at a time: (mix, ce,
    l1, correct, cand, p_cand), each (n,) or (n, K) (see `_chunk_terms`)."""
    chunks = [_chunk_terms(draft, slots, chunk) for chunk in slots.chunks(chunk_size)]
    return concat_chunks(chunks)


def concat_chunks(chunks: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Per-chunk term tuples joined into one tuple of (n, ...) tensors."""
    return tuple(torch.cat([terms[i] for terms in chunks]) for i in range(len(BACKBONE_TERMS)))


def _chunk_terms(
    draft: DSpineDraftModel, slots: SupervisedSlots, chunk: slice
) -> tuple[torch.Tensor, ...]:
    """`vocab_loss.backbone_vocab_terms` of one chunk of slots: (mix, ce, l1, correct, cand,
    p_cand), each (n,) or (n, K); the target's distribution from the cached top-k when given,
    else projected from its final state (None: no distillation).

    With a pruned draft vocabulary the backbone scores its rows only, against the target's
    distribution restricted to them and renormalised; labels outside it give garbage CE that
    the caller weighs by zero. Candidates come back as target ids, p_target on them exact.
    """
    _, head = draft._require_target()
    target_hidden = slots.target_hidden(chunk)
    labels = slots.labels[chunk]
    target = None
    if slots.target_topk is not None and target_hidden is not None:
        ids, probs, lse = (t[chunk] for t in slots.target_topk)
        target = TargetDistribution(probs.float(), ids.long(), target_hidden, lse[:, 0], head)
    elif target_hidden is not None:
        with torch.no_grad():  # the target's head on its own normed state (see full_vocab_terms)
            target = TargetDistribution(torch.softmax(draft.target_logits(target_hidden).float(), -1))
    rows = draft.draft_token_ids()
    restricted = None if target is None else target.restricted(rows, draft.target_to_draft)
    mix, ce, l1, cand = backbone_vocab_terms(
        draft.norm(slots.hidden[chunk]), draft.output_head(),
        draft.target_to_draft(labels).clamp_min(0), ce_share(draft.config), restricted,
        draft.config.candidate_k)
    cand = draft.draft_to_target(cand)
    correct = (cand[:, 0] == labels).float()
    p_cand = torch.zeros(cand.shape, device=cand.device) if target is None else target.at(cand)
    return mix, ce, l1, correct, cand, p_cand


def full_vocab_terms(
    draft: DSpineDraftModel,
    hidden: torch.Tensor,
    target_hidden: torch.Tensor | None,
    labels: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, ...]:
    """Per-row CE, L1, correctness, top-K candidates and p_target on them, for one chunk,
    through autograd (the intermediate-layer CE checkpoints it; so does the reference objective
    of `scripts/tools/bench/reference_objective.py`).

    hidden (n, H) draft states, target_hidden (n, H) target final states (or None without
    distillation), labels (n,). Full-vocabulary logits live only inside this function.
    """
    logits = draft.logits(hidden).float()  # (n, V)
    logp = torch.log_softmax(logits, dim=-1)
    ce = -logp.gather(-1, labels[:, None]).squeeze(-1)
    detached = logits.detach()
    correct = (detached.argmax(-1) == labels).float()
    cand = torch.topk(detached, k, dim=-1).indices  # (n, K)
    if target_hidden is None:
        zeros = torch.zeros_like(ce)
        return ce, zeros, correct, cand, torch.zeros(cand.shape, device=cand.device)
    with torch.no_grad():
        # Not `draft.logits`: the draft's norm on top of the target's would rescale the state
        # and, for a real target whose final norm is far from 1, flatten p_target.
        p_target = torch.softmax(draft.target_logits(target_hidden).float(), dim=-1)
    l1 = (logp.exp() - p_target).abs().sum(-1)
    return ce, l1, correct, cand, p_target.gather(-1, cand)


def slot_loss(
    draft: DSpineDraftModel,
    out: DSpineTrainOutput,
    slots: SupervisedSlots,
    backbone: tuple[torch.Tensor, ...],
    step: int,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, detached metrics) from the slots and their backbone terms over all n slots
    (`BACKBONE_TERMS`, as `backbone_terms` gives them): the weighted backbone terms plus
    refinement, alignment and the intermediate-layer CE."""
    cfg = draft.config
    rows, w, w_backbone, labels = slots.rows, slots.weights, slots.backbone_weights, slots.labels
    pre, recv, true_pred = slots.pre_injection, slots.recv_features, slots.true_pred
    distill = cfg.distill
    c = ce_share(cfg)
    mix, ce, l1, correct, cand, p_cand = backbone

    backbone_ce = _weighted_mean(ce, w_backbone)
    backbone_l1 = _weighted_mean(l1, w_backbone)
    loss = _weighted_mean(mix, w_backbone)  # c * backbone_ce + (1-c) * backbone_l1
    metrics: dict[str, torch.Tensor] = {
        "backbone_ce": backbone_ce.detach(),
        "backbone_l1": backbone_l1.detach(),
        "top1_acc": _weighted_mean(correct, (w > 0).float()),
    }
    if cfg.draft_vocab_size is not None:
        metrics["outside_draft_vocab"] = _weighted_mean((w_backbone == 0).float(), (w > 0).float())

    # --- refinement over the candidates, teacher-forced with the true predecessor
    in_cand = cand == labels[:, None]  # (n, K)
    covered = in_cand.any(-1).float()
    metrics["candidate_coverage"] = _weighted_mean(covered, (w > 0).float())
    if cfg.refine_weight > 0:
        scores = draft.refined_scores(pre, recv, true_pred[:, None], cand)[:, 0].float()  # (n, K)
        logq = torch.log_softmax(scores, dim=-1)
        label_idx = in_cand.float().argmax(-1)
        # "covered": over the slots whose label is a candidate; "supervised" (SpecForge): over
        # every supervised slot, the uncovered ones adding zero.
        every = cfg.refine_normalization == "supervised"
        refine_ce = _weighted_mean(-logq.gather(-1, label_idx[:, None]).squeeze(-1) * covered,
                                   w if every else w * covered)
        refine = refine_ce
        metrics["refine_ce"] = refine_ce.detach()
        if distill:
            mass = p_cand.sum(-1)
            ok = (mass > cfg.distill_mass_threshold).float()
            p_restricted = p_cand / mass.clamp_min(1e-12)[:, None]
            refine_l1 = _weighted_mean((logq.exp() - p_restricted).abs().sum(-1) * ok,
                                       w if every else w * ok)
            refine = c * refine_ce + (1 - c) * refine_l1
            metrics["refine_l1"] = refine_l1.detach()
        loss = loss + cfg.refine_weight * refine

    # --- layer-wise cosine alignment, at a fixed ratio to the (detached) backbone CE
    if cfg.alignment_weight > 0:
        target_codes = draft.token_codes[labels]  # (n, r)
        cos_terms = []
        for feats in out.layer_features:
            f = feats.reshape(-1, cfg.transfer_dim)[rows]
            cos_terms.append(1 - F.cosine_similarity(f.float(), target_codes.float(), dim=-1))
        per_slot = torch.stack(cos_terms)  # (N, n): one term per layer
        per_slot = per_slot.sum(0) if cfg.alignment_layer_reduction == "sum" else per_slot.mean(0)
        alignment = _weighted_mean(per_slot, w)
        beta = alignment_scale(step, cfg.alignment_weight, cfg.alignment_warmup_steps)
        loss = loss + beta * backbone_ce.detach() * alignment
        metrics["alignment"] = alignment.detach()
        # every metric on the loss's device: the trainer stacks them for one reduction
        metrics["alignment_beta"] = torch.full((), beta, device=loss.device)

    # --- ablation: full-vocabulary CE on intermediate layers (hurts acceptance, METHOD 2.3)
    if cfg.token_ce_intermediate and out.layer_hidden:
        inter = []
        for layer_out in out.layer_hidden[:-1]:
            h = layer_out[..., 1:, :].reshape(-1, cfg.hidden_size)[rows]
            layer_ce = []
            for sl in slots.chunks(chunk_size):
                ce_l, *_ = checkpoint(
                    full_vocab_terms, draft, h[sl], None,
                    draft.target_to_draft(labels[sl]).clamp_min(0), 1, use_reentrant=False
                )
                layer_ce.append(ce_l)
            inter.append(_weighted_mean(torch.cat(layer_ce), w_backbone))
        if inter:
            token_ce = torch.stack(inter).mean()
            loss = loss + token_ce
            metrics["token_ce_intermediate"] = token_ce.detach()

    metrics["loss"] = loss.detach()
    metrics["supervised_slots"] = torch.full((), float(w.numel()), device=loss.device)
    return loss, metrics


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1e-8)
