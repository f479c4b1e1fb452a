"""The transition cache and the left-to-right conditional decode (SPEC 2.4).

Every drafted slot t keeps its top-K candidates C_t. The refined score of candidate c' at slot t
given that its predecessor is token c is `S_t[c, c']`. All pairs (c in C_{t-1}, c' in C_t) are
scored in one parallel pass - a (B-1) x K x K table, where slot 1's single predecessor (the
anchor) makes its rows coincide - and the decode only walks the table:

    x_t = argmax_{c'} S_t[x_{t-1}, c']       (greedy)
    x_t ~ softmax(S_t[x_{t-1}, :] / T)       (sampling; that row is the draft's q for slot t)

`naive_serial_walk` recomputes each slot's scores after committing its predecessor; the walk
must choose exactly the same tokens (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# score(pre (..., T, H), recv (..., T, r), pred_ids (..., T, P), cand_ids (..., T, K)) -> (..., T, P, K)
ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class WalkResult:
    """Drafted tokens and, when sampling, the distribution each was drawn from.

    tokens: (..., T) long.
    q: (..., T, V) float32 restricted distributions scattered into the vocabulary, or None (greedy).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None


def top_candidates(slot_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-K candidate ids per slot, best first: (..., T, V) -> (..., T, K)."""
    return torch.topk(slot_logits, k, dim=-1, sorted=True).indices


def transition_table(
    score: ScoreFn,
    pre: torch.Tensor,
    recv: torch.Tensor,
    anchor_ids: torch.Tensor,
    cand: torch.Tensor,
) -> torch.Tensor:
    """The (..., T, K, K) table S_t[i, j] = score of cand[t, j] after predecessor cand[t-1, i].

    pre (..., T, H) / recv (..., T, r): the last layer's pre-injection states and features of the
    drafted slots; anchor_ids (...,); cand (..., T, K). Slot 1's predecessor is the anchor for
    every row, so its row is computed once and broadcast.
    """
    k = cand.shape[-1]
    first = score(pre[..., :1, :], recv[..., :1, :], anchor_ids[..., None, None], cand[..., :1, :])
    first = first.expand(*first.shape[:-2], k, k)  # (..., 1, K, K): identical rows
    if cand.shape[-2] == 1:
        return first
    rest = score(pre[..., 1:, :], recv[..., 1:, :], cand[..., :-1, :], cand[..., 1:, :])
    return torch.cat((first, rest), dim=-3)


def _choose(
    row: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick an index from scores row (..., K): argmax, or a sample from softmax(row / T)."""
    if temperature <= 0.0:
        return row.argmax(dim=-1), None
    probs = torch.softmax(row.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])  # (N, K) for multinomial
    idx = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    return idx, probs


def _scatter_q(q_cand: list[torch.Tensor], cand: torch.Tensor, vocab_size: int) -> torch.Tensor:
    q = torch.stack(q_cand, dim=-2)  # (..., T, K)
    out = torch.zeros(*cand.shape[:-1], vocab_size, dtype=torch.float32, device=cand.device)
    return out.scatter_(-1, cand, q.float())


def walk_table(
    table: torch.Tensor,
    cand: torch.Tensor,
    vocab_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> WalkResult:
    """Left-to-right walk over the transition table; only look-ups are serial.

    table (..., T, K, K), cand (..., T, K). Returns tokens (..., T) and, when sampling, q.
    """
    num_slots = cand.shape[-2]
    prev = torch.zeros(cand.shape[:-2], dtype=torch.long, device=cand.device)  # row of slot 1
    tokens, q_cand = [], []
    for t in range(num_slots):
        rows = table[..., t, :, :]  # (..., K, K)
        row = torch.gather(rows, -2, prev[..., None, None].expand(*prev.shape, 1, rows.shape[-1]))
        idx, probs = _choose(row.squeeze(-2), temperature, generator)
        tokens.append(torch.gather(cand[..., t, :], -1, idx[..., None]).squeeze(-1))
        if probs is not None:
            q_cand.append(probs)
        prev = idx
    out = torch.stack(tokens, dim=-1)
    return WalkResult(out, _scatter_q(q_cand, cand, vocab_size) if q_cand else None)


def naive_serial_walk(
    score: ScoreFn,
    pre: torch.Tensor,
    recv: torch.Tensor,
    anchor_ids: torch.Tensor,
    cand: torch.Tensor,
    vocab_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> WalkResult:
    """Reference decode: after committing x_{t-1}, score slot t's candidates given it.

    One scoring call per slot, serial; the transition-cache walk must equal it.
    """
    prev_token = anchor_ids
    tokens, q_cand = [], []
    for t in range(cand.shape[-2]):
        row = score(
            pre[..., t : t + 1, :], recv[..., t : t + 1, :],
            prev_token[..., None, None], cand[..., t : t + 1, :],
        )  # (..., 1, 1, K)
        idx, probs = _choose(row[..., 0, 0, :], temperature, generator)
        prev_token = torch.gather(cand[..., t, :], -1, idx[..., None]).squeeze(-1)
        tokens.append(prev_token)
        if probs is not None:
            q_cand.append(probs)
    out = torch.stack(tokens, dim=-1)
    return WalkResult(out, _scatter_q(q_cand, cand, vocab_size) if q_cand else None)


def per_slot_decode(
    slot_logits: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> WalkResult:
    """Decode each slot by its own distribution (`transition_cache: false`, and plain DFlash)."""
    if temperature <= 0.0:
        return WalkResult(slot_logits.argmax(dim=-1))
    probs = torch.softmax(slot_logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    tokens = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    return WalkResult(tokens, probs)
