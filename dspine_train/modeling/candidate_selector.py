"""DFlash2's candidate selector and its left-to-right decode (speculators `models/dflash2`).

Each drafted slot t keeps its top-k candidates C_t under the backbone's own ("unary") logits
u_t. The selector rescores them given the token before the slot:

    S_t[c] = u_t[c] + sum_r P[x_{t-1}, r] * (W h_t)[r] * Q[c, r]

with `predecessor_codebook` P (V, r), `successor_codebook` Q (V, r) and `hidden_projection` W
(H -> r) applied to the slot's final *normed* state h_t: a rank-r bilinear transition term that
depends on the slot's state. The predecessor of slot 1 is the anchor; in training it is the true
token (teacher forcing), in decoding the token just drafted at slot t-1, so the block is walked
left to right (`selector_walk`; only the k scores of a slot are serial work).

Parameter names are the reference ones (`candidate_selector.{predecessor_codebook,
successor_codebook,hidden_projection.weight}`), so speculators' checkpoints map one to one.
"""

from __future__ import annotations

import torch
from torch import nn

from .transition_cache import WalkResult, draw_among, top_candidates


class CandidateSelector(nn.Module):
    """The rank-r transition scorer over a slot's top-k candidates."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def transition_scores(self, normed: torch.Tensor, pred_ids: torch.Tensor,
                          cand_ids: torch.Tensor) -> torch.Tensor:
        """normed (..., H) slot states after the final norm, pred_ids (...,) the token before
        each slot, cand_ids (..., K) -> the transition term (..., K)."""
        pred = self.predecessor_codebook[pred_ids.long()]  # (..., r)
        context = pred * self.hidden_projection(normed).to(pred.dtype)  # (..., r)
        successors = self.successor_codebook[cand_ids.long()]  # (..., K, r)
        return (context.unsqueeze(-2) * successors).sum(-1)

    def score_candidates(self, unary_logits: torch.Tensor, normed: torch.Tensor,
                         pred_ids: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """S[c] = u[c] + the transition term: unary_logits (..., V), normed (..., H), pred_ids
        (...,), cand_ids (..., K) -> (..., K), in the unary logits' dtype."""
        unary = unary_logits.gather(-1, cand_ids)
        return unary + self.transition_scores(normed, pred_ids, cand_ids).to(unary.dtype)


def selector_walk(
    selector: CandidateSelector,
    unary_logits: torch.Tensor,
    normed: torch.Tensor,
    anchor_ids: torch.Tensor,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> WalkResult:
    """Decode a DFlash2 block left to right over each slot's top-k (`selector.top_k`).

    unary_logits (..., P, V) and normed (..., P, H) of the P drafted slots (slots 1..B-1);
    anchor_ids (...,). Slot j's scores are `score_candidates` with the token drafted at slot j-1
    as predecessor (slot 1: the anchor), exactly the function training scores with the true
    predecessor. Greedy takes the best score; sampling (`temperature > 0`, or `noise` (..., P, K)
    Exp(1) draws given) draws from the softmax of the scores / temperature over the candidates
    with the exponential race, and that distribution is q: (..., P, K) over `candidates`.
    """
    greedy = noise is None and not (isinstance(temperature, torch.Tensor) or temperature > 0.0)
    cand = top_candidates(unary_logits, selector.top_k)  # (..., P, K), best first
    prev = anchor_ids
    tokens, qs = [], []
    for j in range(unary_logits.shape[-2]):
        slot_cand = cand[..., j, :]
        scores = selector.score_candidates(unary_logits[..., j, :], normed[..., j, :], prev,
                                           slot_cand)  # (..., K)
        if greedy:
            prev = slot_cand.gather(-1, scores.argmax(-1)[..., None]).squeeze(-1)
        else:
            slot_noise = None if noise is None else noise[..., j, :]
            prev, probs = draw_among(scores, slot_cand, temperature, generator, slot_noise)
            qs.append(probs)
        tokens.append(prev)
    out = torch.stack(tokens, dim=-1)  # (..., P)
    if greedy:
        return WalkResult(out)
    return WalkResult(out, torch.stack(qs, dim=-2), cand)
