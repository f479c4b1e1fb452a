"""Domino's logit correction on the DFlash backbone (SpecForge `DominoDraftModel`).

A Domino block drafts P tokens (P = B-1: slot k predicts token a+k; with `domino_shift_label`
P = B: the anchor slot predicts too, slot k predicts a+k+1). Drafted token i (i = 1..P) is
read from its slot's final normed state z_i and corrected by what precedes it in the block:

* `prefix_gru`: GRU(H -> G, one layer, no bias) over the target's embeddings of the tokens
  before token i, x_a, x_{a+1}, ..., x_{a+i-1} (the anchor first); s_i is its state after
  those i tokens. `PrefixGRU` holds torch's `nn.GRU` parameters under its names and runs its
  cell itself: torch.compile does not trace `nn.GRU` (the engine's steps are compiled whole),
  and training and decoding then run the very same cell.
* `embed_proj`: Linear(H + G, E), SiLU, Linear(E, V), no biases: a logit delta.

logits_i = lm_head(z_i) + embed_proj([z_i ; s_i]) for i > p (p = `domino_prefix_len`, the
"pure draft prefix"), and the backbone's logits alone for i <= p. This indexing covers both of
SpecForge's label layouts: its slot k >= `suffix_start` with `shift_label` false (s = its GRU
output k-1, fed the first B-1 block tokens) or true (s = GRU output k, fed all B) is our token
i = k or k+1, corrected iff i > p in both.

In training the previous tokens are the true ones (teacher forcing, `domino_states`); in
decoding they are the tokens just drafted (`domino_walk`), so a block is decoded left to
right: one GRU cell step and one E x V product per token. Parameter names are SpecForge's
(`prefix_gru.weight_{ih,hh}_l0`, `embed_proj.{0,2}.weight`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .configuration_dspine import DSpineConfig
from .transition_cache import WalkResult, draw_in_top_k, stacked_walk


class PrefixGRU(nn.Module):
    """A one-layer GRU without biases, torch's equations and parameter names: `weight_ih_l0`
    (3G, H) and `weight_hh_l0` (3G, G), each the [reset; update; new] gates stacked."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.weight_ih_l0 = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh_l0 = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))

    def step(self, gi: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One step from the input's projection gi = W_ih x (..., 3G) and the state h (..., G)."""
        gh = F.linear(h, self.weight_hh_l0)  # (..., 3G)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1.0 - z) * n + z * h

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """W_ih x: (..., H) inputs -> (..., 3G), in the weights' dtype."""
        return F.linear(x.to(self.weight_ih_l0.dtype), self.weight_ih_l0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """States after each step from a zero state: x (N, P, H) -> (N, P, G)."""
        gi = self.project(x)  # (N, P, 3G): every step's input projection at once
        h = gi.new_zeros(x.shape[0], self.hidden_size)
        states = []
        for t in range(x.shape[1]):
            h = self.step(gi[:, t], h)
            states.append(h)
        return torch.stack(states, dim=1)


def build_domino_head(config: DSpineConfig) -> tuple[PrefixGRU | None, nn.Sequential | None]:
    """Domino's GRU and logit-delta MLP for `config` (both None unless `method: domino`)."""
    if config.method != "domino":
        return None, None
    hidden, g = config.hidden_size, config.domino_gru_hidden_dim
    gru = PrefixGRU(hidden, g)
    proj = nn.Sequential(
        nn.Linear(hidden + g, config.domino_emb_dim, bias=False),
        nn.SiLU(),
        nn.Linear(config.domino_emb_dim, config.vocab_size, bias=False),
    )
    return gru, proj


@torch.no_grad()
def init_domino_head(gru: PrefixGRU | None) -> None:
    """The GRU starts as torch's `nn.GRU` does, U(-1/sqrt(G), 1/sqrt(G)) (SpecForge leaves it
    so; the MLP's Linears get the draft's normal init). Loaded weights are left alone."""
    if gru is None:
        return
    bound = gru.hidden_size ** -0.5
    for weight in (gru.weight_ih_l0, gru.weight_hh_l0):
        init.uniform_(weight, -bound, bound)


def domino_states(gru: PrefixGRU, prev_embedded: torch.Tensor) -> torch.Tensor:
    """s_i for every drafted token of every block, teacher-forced: prev_embedded (..., P, H) the
    embeddings of the tokens before each drafted token (anchor first) -> (..., P, G)."""
    lead, (p, h) = prev_embedded.shape[:-2], prev_embedded.shape[-2:]
    states = gru(prev_embedded.reshape(-1, p, h))  # (N, P, G)
    return states.reshape(*lead, p, gru.hidden_size)


def logit_delta(proj: nn.Sequential, normed: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """embed_proj([z ; s]): normed (..., H) final normed states, states (..., G) -> (..., V)."""
    dtype = proj[0].weight.dtype
    return proj(torch.cat((normed.to(dtype), states.to(dtype)), dim=-1))


def domino_walk(
    base_logits: torch.Tensor,
    normed: torch.Tensor,
    anchor_ids: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    gru: PrefixGRU,
    proj: nn.Sequential,
    prefix_len: int,
    k: int,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> WalkResult:
    """Decode a Domino block left to right, exactly as trained with the true tokens: token i's
    logits are its base logits plus, for i > `prefix_len`, the delta of its state and the GRU
    state after the anchor and the tokens drafted before it.

    base_logits (..., P, V) and normed (..., P, H) of the drafting slots (`draft_forward`);
    anchor_ids (...,); `embed` the target's input embedding. Greedy takes each token's argmax;
    sampling (`temperature > 0`, or `noise` (..., P, K) Exp(1) draws) draws with the
    exponential race from the token's softmax restricted to its top-`k` (as `markov_walk`), so q
    is (..., P, K) over `candidates` (..., P, K). Returns the drafted tokens (..., P).
    """
    greedy = noise is None and not (isinstance(temperature, torch.Tensor) or temperature > 0.0)
    weight = gru.weight_hh_l0
    state = torch.zeros(*anchor_ids.shape, gru.hidden_size, dtype=weight.dtype,
                        device=anchor_ids.device)  # (..., G)
    prev = anchor_ids
    tokens, qs, cands = [], [], []
    for i in range(base_logits.shape[-2]):
        state = gru.step(gru.project(embed(prev)), state)  # after the anchor and drafts 1..i
        logits = base_logits[..., i, :]  # (..., V)
        if i >= prefix_len:  # token i + 1 > p
            logits = logits + logit_delta(proj, normed[..., i, :], state).to(logits.dtype)
        if greedy:
            prev = logits.argmax(-1)
        else:
            slot_noise = None if noise is None else noise[..., i, :]
            prev, probs, cand = draw_in_top_k(logits, k, temperature, generator, slot_noise)
            qs.append(probs)
            cands.append(cand)
        tokens.append(prev)
    return stacked_walk(tokens, qs, cands)  # tokens (..., P)
