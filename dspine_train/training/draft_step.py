"""The module DeepSpeed wraps: the draft plus its objective and its evaluation decode.

Everything that touches draft parameters runs inside this module's `forward`, so ZeRO-3 can
gather each submodule's partitioned parameters as it is called (the loss applies the final
norm and the injection writes outside the draft's own forward).

A `method: dspark` draft trains on `dspark_objective.dspark_loss` and is evaluated with its
served decode, the Markov head's left-to-right walk (`dspark_walk`): B drafts a block, slot j
predicting token a+j+1. A `method: domino` draft trains on `domino_objective.domino_loss` and
is evaluated with its served decode, the GRU's left-to-right walk (`domino_walk`). A `method:
dflash2` draft trains on `dflash2_objective.dflash2_loss` and is evaluated with its candidate
selector's left-to-right walk (`dflash2_walk`; B-1 drafts, slot k predicting a+k). The other
methods train on `objective.dspine_loss` and decode with
`walk` (B-1 drafts, slot k predicting a+k). Both count acceptance with the same rule
(`block_metrics.accepted_prefix`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..dflash2_objective import dflash2_loss
from ..domino_objective import domino_loss
from ..dspark_objective import dspark_loss
from ..evaluation.block_metrics import accepted_prefix, block_counts
from ..modeling import DSpineDraftModel, DSpineTrainOutput
from ..objective import dspine_loss, slot_weights


class DraftStep(nn.Module):
    """`forward(...)` -> (loss, metrics) for training, or acceptance counts with `evaluate=True`.

    The draft must be bound to the target (its head also gives the target's greedy tokens
    during evaluation).
    """

    def __init__(self, draft: DSpineDraftModel, logits_chunk_size: int = 1024) -> None:
        super().__init__()
        self.draft = draft
        self.logits_chunk_size = logits_chunk_size

    def forward(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor,
        final_hidden: torch.Tensor,
        loss_mask: torch.Tensor,
        anchors: torch.Tensor,
        anchor_mask: torch.Tensor,
        replace_mask: torch.Tensor | None = None,
        step: int = 0,
        total_steps: int = 1,
        evaluate: bool | str = False,
        eval_chunks: int = 0,
        target_topk: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | torch.Tensor:
        """input_ids, loss_mask (B, S); context (B, S, n*H); final_hidden (B, S, H);
        anchors, anchor_mask, replace_mask (B, A). `eval_chunks`: decode chunks every process
        runs in evaluation (see `_acceptance_counts`). `evaluate="blocks"` returns the
        per-block flags of `accepted_prefixes` instead of their sums. target_topk: the target's
        distribution as a feature cache stored it (`TargetFeatures.topk`; then it is not
        projected again)."""
        if evaluate == "blocks":  # through forward, so ZeRO-3 gathers the parameters
            return self.accepted_prefixes(input_ids, context, final_hidden, loss_mask, anchors,
                                          anchor_mask, eval_chunks)
        if evaluate:
            return self._acceptance_counts(input_ids, context, final_hidden, loss_mask,
                                           anchors, anchor_mask, eval_chunks)
        out = self.draft(input_ids, context, anchors, anchor_mask, replace_mask)
        if self.draft.config.method == "domino":  # label CE only: no target distribution
            return domino_loss(self.draft, out, loss_mask, anchors, anchor_mask, step,
                               total_steps, chunk_size=self.logits_chunk_size)
        if self.draft.config.anchor_predicts:
            # DSpark's objective reads the target's exact distribution from `final_hidden`
            # (the trainer asks for no top-k for it).
            return dspark_loss(self.draft, out, final_hidden, loss_mask, anchors, anchor_mask,
                               chunk_size=self.logits_chunk_size)
        if self.draft.config.method == "dflash2":  # the exact distribution too, as speculators
            return dflash2_loss(self.draft, out, final_hidden, loss_mask, anchors, anchor_mask,
                                chunk_size=self.logits_chunk_size)
        return dspine_loss(
            self.draft, out, final_hidden, loss_mask, anchors, anchor_mask, step, total_steps,
            chunk_size=self.logits_chunk_size, target_topk=target_topk,
        )

    @torch.no_grad()
    def _acceptance_counts(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor,
        final_hidden: torch.Tensor,
        loss_mask: torch.Tensor,
        anchors: torch.Tensor,
        anchor_mask: torch.Tensor,
        eval_chunks: int,
    ) -> torch.Tensor:
        """Acceptance sums of `evaluation.block_counts` for this batch's blocks."""
        prefix = self.accepted_prefixes(input_ids, context, final_hidden, loss_mask, anchors,
                                        anchor_mask, eval_chunks)
        return block_counts(prefix, anchor_mask.reshape(-1))

    @torch.no_grad()
    def accepted_prefixes(
        self,
        input_ids: torch.Tensor,
        context: torch.Tensor,
        final_hidden: torch.Tensor,
        loss_mask: torch.Tensor,
        anchors: torch.Tensor,
        anchor_mask: torch.Tensor,
        eval_chunks: int = 0,
    ) -> torch.Tensor:
        """The simulated evaluation of every block: `block_metrics.accepted_prefix` flags
        (B*A, P), block (b, i) at row b * A + i (padding blocks included; mask them with
        `anchor_mask`); P = `num_predictions` (Bk-1, or Bk for DSpark). The parity check
        (`evaluation.parity`) reads them per block."""
        draft = self.draft
        cfg = draft.config
        p = cfg.num_predictions
        bsz, seq_len = input_ids.shape
        out = draft(input_ids, context, anchors, anchor_mask)
        # P drafts predict a+1..a+P: the per-slot weights of a block of P + 1 (= Bk but for DSpark)
        supervised = slot_weights(loss_mask, anchors, anchor_mask, p + 1, cfg.loss_gamma) > 0
        anchor_ids = torch.gather(input_ids, 1, anchors)  # (B, A)
        # the target state predicting drafted token i (i = 0..P-1: token a+i+1) sits at a+i
        pred_pos = (anchors[..., None] + torch.arange(p, device=anchors.device))
        pred_pos = pred_pos.clamp_max(seq_len - 1)  # (B, A, P); clamped slots are unsupervised
        batch_idx = torch.arange(bsz, device=anchors.device)[:, None, None].expand_as(pred_pos)

        # Every real or padding block is decoded, in a fixed number of chunks: under ZeRO-3
        # each submodule call gathers parameters collectively, so every process must make the
        # same calls whatever its batch holds. One chunk's (n, P, V) logits is the peak.
        flat_b = batch_idx[..., 0].reshape(-1)
        flat_a = torch.arange(anchors.shape[1], device=anchors.device).expand(bsz, -1).reshape(-1)
        chunk = max(1, self.logits_chunk_size // p)
        num_chunks = max(-(-flat_b.numel() // chunk), eval_chunks)
        draft_tokens, target_tokens = [], []
        for i in range(num_chunks):
            b, a = flat_b[i * chunk : (i + 1) * chunk], flat_a[i * chunk : (i + 1) * chunk]
            padding = b.numel() == 0
            if padding:  # a throw-away chunk that keeps the calls in step across processes
                b, a = flat_b[:1], flat_a[:1]
            tokens = self._decode(out, b, a, anchor_ids[b, a])
            if padding:
                continue
            draft_tokens.append(tokens)
            states = final_hidden[batch_idx[b, a], pred_pos[b, a]]  # (n, P, H)
            target_tokens.append(draft.target_logits(states).argmax(-1))
        return accepted_prefix(
            torch.cat(draft_tokens), torch.cat(target_tokens),
            out.labels.reshape(-1, p), supervised.reshape(-1, p),
        )  # (B*A, P)

    def _decode(self, out: DSpineTrainOutput, b: torch.Tensor, a: torch.Tensor,
                anchor_ids: torch.Tensor) -> torch.Tensor:
        """The greedy drafts (n, P) of blocks (b, a) of a training forward, decoded as they
        are served: DSpark's Markov walk over all Bk slots' base logits (`dspark_walk`),
        DFlash2's selector walk over slots 1..Bk-1 (`dflash2_walk`), otherwise `walk` over
        slots 1..Bk-1 (the transition cache or each slot's argmax)."""
        draft = self.draft
        if draft.config.method == "domino":  # the drafting slots: 1..Bk-1, or 0..Bk-1
            hidden = out.hidden[b, a, draft.config.block_size - draft.config.num_predictions:]
            return draft.domino_walk(draft.logits(hidden), hidden, anchor_ids).tokens
        if draft.config.anchor_predicts:
            base_logits = draft.logits(out.hidden[b, a])  # (n, Bk, V), no Markov term yet
            return draft.dspark_walk(base_logits, anchor_ids).tokens
        slot_logits = draft.logits(out.hidden[b, a, 1:])  # (n, Bk-1, V)
        if draft.config.method == "dflash2":
            return draft.dflash2_walk(slot_logits, out.hidden[b, a, 1:], anchor_ids).tokens
        return draft.walk(out.pre_injection[b, a], out.recv_features[b, a], slot_logits,
                          anchor_ids).tokens
