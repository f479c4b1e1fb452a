"""The transition cache and the left-to-right conditional decode (METHOD 2.4).

Every drafted slot t keeps its top-K candidates C_t. The refined score of candidate c' at slot t
given that its predecessor is token c is `S_t[c, c']`. All pairs (c in C_{t-1}, c' in C_t) are
scored in one parallel pass - a (B-1) x K x K table, where slot 1's single predecessor (the
anchor) makes its rows coincide - and the decode only walks the table:

    x_t = argmax_{c'} S_t[x_{t-1}, c']       (greedy)
    x_t ~ softmax(S_t[x_{t-1}, :] / T)       (sampling; that row is the draft's q for slot t)

Sampling uses the exponential race (`exponential_race.race`, the engine's draw too) over Exp(1)
draws that can be drawn ahead and passed in (`noise`), so a sampling walk is a pure function of
tensors; q stays sparse, one row of K probabilities over the slot's candidates.

`naive_serial_walk` recomputes each slot's scores after committing its predecessor; the walk
must choose exactly the same tokens (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .exponential_race import exponential_noise, race

# score(pre (..., T, H), recv (..., T, r), pred_ids (..., T, P), cand_ids (..., T, K)) -> (..., T, P, K)
ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class WalkResult:
    """Drafted tokens and, when sampling, the distribution each was drawn from.

    tokens: (..., T) long.
    q: (..., T, K) float32, or None (greedy): slot t's token was drawn from `q[..., t, :]` over
        that slot's K candidates `candidates[..., t, :]` (zero probability everywhere else).
    candidates: (..., T, K) long distinct token ids, or None (greedy).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


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
    row: torch.Tensor, temperature: float | torch.Tensor, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick an index from scores row (..., K): argmax without `noise`, else a draw from
    softmax(row / T) by the engine's exponential race with `noise (..., K)` Exp(1) draws."""
    if noise is None:
        return row.argmax(dim=-1), None
    probs = torch.softmax(row.float() / temperature, dim=-1)
    return race(probs, noise), probs


def draw_noise(
    cand: torch.Tensor,
    temperature: float | torch.Tensor,
    generator: torch.Generator | None,
    noise: torch.Tensor | None,
) -> torch.Tensor | None:
    """The walk's randomness: `noise` when given (sampling, its shape that of `cand`), else
    fresh Exp(1) draws from `generator` when `temperature > 0`, else None (greedy)."""
    if noise is not None or temperature <= 0.0:
        return noise
    return exponential_noise(cand.shape, generator, cand.device)


def draw_in_top_k(
    logits: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor,
    generator: torch.Generator | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One slot of a left-to-right walk, sampled: a token from softmax(logits / T) restricted to
    the slot's top-`k`, by the exponential race. logits (..., V); temperature a float or a tensor
    (...,); noise (..., K) Exp(1) draws, or None for fresh ones from `generator`. Returns the
    token (...,), q (..., K) and the candidates (..., K) it was drawn among (DSpark's Markov walk
    and Domino's GRU walk draw each slot so)."""
    cand = torch.topk(logits, k, dim=-1, sorted=True).indices  # (..., K)
    token, probs = draw_among(logits.gather(-1, cand), cand, temperature, generator, noise)
    return token, probs, cand


def draw_among(
    scores: torch.Tensor,
    cand: torch.Tensor,
    temperature: float | torch.Tensor,
    generator: torch.Generator | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token drawn from softmax(scores / T) over its candidates, by the exponential race:
    scores and cand (..., K); temperature a float or a tensor (...,); noise (..., K) or None
    (fresh draws from `generator`). Returns the token (...,) and q (..., K) (`draw_in_top_k`'s
    draw, and DFlash2's selector's over its scored candidates)."""
    noise = draw_noise(cand, temperature, generator, noise)
    scale = temperature[..., None] if isinstance(temperature, torch.Tensor) else temperature
    probs = torch.softmax(scores.float() / scale, dim=-1)
    return cand.gather(-1, race(probs, noise)[..., None]).squeeze(-1), probs


def stacked_walk(
    tokens: list[torch.Tensor], qs: list[torch.Tensor], cands: list[torch.Tensor]
) -> WalkResult:
    """A walk's per-slot tokens (...,) and, when it sampled, q and candidates (..., K), stacked
    along the slot axis into one `WalkResult`."""
    out = torch.stack(tokens, dim=-1)
    if not qs:
        return WalkResult(out)
    return WalkResult(out, torch.stack(qs, dim=-2), torch.stack(cands, dim=-2))


def walk_table(
    table: torch.Tensor,
    cand: torch.Tensor,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> WalkResult:
    """Left-to-right walk over the transition table; only look-ups are serial.

    table (..., T, K, K), cand (..., T, K). Returns tokens (..., T) and, when sampling, q over
    the candidates. Sampling draws slot t from row `x_{t-1}` of its table, with `noise
    (..., T, K)` (Exp(1) draws; drawn from `generator` when not given and `temperature > 0`).
    A given `noise` means sampling, and `temperature` may then be a tensor.
    """
    noise = draw_noise(cand, temperature, generator, noise)
    num_slots = cand.shape[-2]
    prev = torch.zeros(cand.shape[:-2], dtype=torch.long, device=cand.device)  # row of slot 1
    tokens, q_cand = [], []
    for t in range(num_slots):
        rows = table[..., t, :, :]  # (..., K, K)
        row = torch.gather(rows, -2, prev[..., None, None].expand(*prev.shape, 1, rows.shape[-1]))
        slot_noise = None if noise is None else noise[..., t, :]
        idx, probs = _choose(row.squeeze(-2), temperature, slot_noise)
        tokens.append(torch.gather(cand[..., t, :], -1, idx[..., None]).squeeze(-1))
        if probs is not None:
            q_cand.append(probs)
        prev = idx
    out = torch.stack(tokens, dim=-1)
    if not q_cand:
        return WalkResult(out)
    return WalkResult(out, torch.stack(q_cand, dim=-2), cand)


def naive_serial_walk(
    score: ScoreFn,
    pre: torch.Tensor,
    recv: torch.Tensor,
    anchor_ids: torch.Tensor,
    cand: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> WalkResult:
    """Reference decode: after committing x_{t-1}, score slot t's candidates given it.

    One scoring call per slot, serial; the transition-cache walk must equal it (given the same
    `noise`, or generators in the same state, when sampling).
    """
    noise = draw_noise(cand, temperature, generator, noise)
    prev_token = anchor_ids
    tokens, q_cand = [], []
    for t in range(cand.shape[-2]):
        row = score(
            pre[..., t : t + 1, :], recv[..., t : t + 1, :],
            prev_token[..., None, None], cand[..., t : t + 1, :],
        )  # (..., 1, 1, K)
        slot_noise = None if noise is None else noise[..., t, :]
        idx, probs = _choose(row[..., 0, 0, :], temperature, slot_noise)
        prev_token = torch.gather(cand[..., t, :], -1, idx[..., None]).squeeze(-1)
        tokens.append(prev_token)
        if probs is not None:
            q_cand.append(probs)
    out = torch.stack(tokens, dim=-1)
    if not q_cand:
        return WalkResult(out)
    return WalkResult(out, torch.stack(q_cand, dim=-2), cand)


def per_slot_decode(
    slot_logits: torch.Tensor,
    k: int,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> WalkResult:
    """Decode each slot by its own distribution (`transition_cache: false`, and plain DFlash).

    Greedy is the slot's argmax. Sampling draws from the slot's softmax restricted to its top-`k`
    (the candidates the token tree uses too), so that q stays sparse: `(..., T, K)` over
    `candidates` (ids of `slot_logits`' last axis). `noise` as in `walk_table`.
    """
    if noise is None and temperature <= 0.0:
        return WalkResult(slot_logits.argmax(dim=-1))
    cand = top_candidates(slot_logits, k)
    noise = draw_noise(cand, temperature, generator, noise)
    probs = torch.softmax(slot_logits.gather(-1, cand).float() / temperature, dim=-1)
    tokens = cand.gather(-1, race(probs, noise)[..., None]).squeeze(-1)
    return WalkResult(tokens, probs, cand)
