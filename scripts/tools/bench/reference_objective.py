"""The DSpine objective with its backbone terms through autograd and activation checkpointing.

The code before `vocab_loss`: each chunk's full-vocabulary terms (`objective.full_vocab_terms`) are
recomputed in backward by `torch.utils.checkpoint`, two more V x H projections per slot than
the product's gradient-in-forward terms, with the same values. Kept as the reference the fast
path is checked against (`tests/test_fast_step.py`) and timed against (`step_bench`'s "old").

    loss, metrics = reference_dspine_loss(draft, out, final_hidden, loss_mask, anchors, mask, 30)
    step = ReferenceDraftStep(draft, chunk)  # a `DraftStep` whose loss is this one
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dspine_train import objective
from dspine_train.modeling import DSpineDraftModel, DSpineTrainOutput
from dspine_train.training.draft_step import DraftStep


def reference_backbone_terms(draft: DSpineDraftModel, slots: objective.SupervisedSlots,
                             chunk_size: int) -> tuple[torch.Tensor, ...]:
    """`objective.backbone_terms` through autograd + checkpointing, over the full vocabulary
    and the exact target distribution (a cached top-k is not read)."""
    c = objective.ce_share(draft.config)
    chunks = []
    for chunk in slots.chunks(chunk_size):
        target_hidden = slots.target_hidden(chunk)
        # looked up on the module each call, so `step_profile` can time it
        ce, l1, correct, cand, p_cand = checkpoint(
            objective.full_vocab_terms, draft, slots.hidden[chunk], target_hidden,
            slots.labels[chunk], draft.config.candidate_k, use_reentrant=False,
        )
        mix = c * ce + (1 - c) * l1 if target_hidden is not None else ce
        chunks.append((mix, ce, l1, correct, cand, p_cand))
    return objective.concat_chunks(chunks)


def reference_dspine_loss(
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
    """`objective.dspine_loss` with `reference_backbone_terms`; same arguments and results.
    A pruned draft vocabulary is refused (`ValueError`): this path scores the full one."""
    del total_steps, target_topk  # the reference projects the exact target distribution
    if draft.config.draft_vocab_size is not None:
        raise ValueError("reference_dspine_loss scores the full vocabulary; this draft has "
                         f"draft_vocab_size={draft.config.draft_vocab_size}")
    slots = objective.supervised_slots(draft, out, target_final_hidden, loss_mask, anchors,
                                       anchor_mask)
    return objective.slot_loss(draft, out, slots,
                               reference_backbone_terms(draft, slots, chunk_size), step,
                               chunk_size)


class ReferenceDraftStep(DraftStep):
    """A `DraftStep` whose training loss is `reference_dspine_loss` (evaluation unchanged)."""

    def forward(self, input_ids: torch.Tensor, context: torch.Tensor,
                final_hidden: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                anchor_mask: torch.Tensor, replace_mask: torch.Tensor | None = None,
                step: int = 0, total_steps: int = 1, evaluate: bool | str = False,
                eval_chunks: int = 0, target_topk: tuple[torch.Tensor, ...] | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | torch.Tensor:
        """`DraftStep.forward`, the training loss made by `reference_dspine_loss`."""
        if evaluate:
            return super().forward(input_ids, context, final_hidden, loss_mask, anchors,
                                   anchor_mask, replace_mask, step, total_steps, evaluate,
                                   eval_chunks, target_topk)
        out = self.draft(input_ids, context, anchors, anchor_mask, replace_mask)
        return reference_dspine_loss(self.draft, out, final_hidden, loss_mask, anchors,
                                     anchor_mask, step, total_steps,
                                     chunk_size=self.logits_chunk_size, target_topk=target_topk)
