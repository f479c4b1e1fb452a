"""DSpark's two heads on the DFlash backbone (DeepSpec `deepspec/modeling/dspark/`).

In a DSpark block `[anchor, MASK x (B-1)]` every slot is a prediction: slot k (k = 0..B-1)
predicts token a+k+1 from the backbone's final state h_k. Two small heads sit on top:

* `MarkovHead`: a first-order, low-rank logit bias. `markov_w1` Embedding(V, r) embeds the
  token *before* slot k's target, x_{a+k} (slot 0: the anchor), and `markov_w2` Linear(r, V)
  maps it to a bias added to slot k's logits: logits_k = lm_head(norm(h_k)) + W2 W1[x_{a+k}].
  In training x_{a+k} is the true token (teacher forcing); in decoding it is the token just
  drafted at slot k-1, so the block is decoded left to right (only the bias is serial).
* `ConfidenceHead`: Linear(H + r, 1) (or Linear(H, 1)) over [norm(h_k) ; W1[x_{a+k}]], the
  logit of the probability that slot k's draft is accepted.

Parameter names are the reference ones (`markov_head.markov_w{1,2}.weight`,
`confidence_head.proj.{weight,bias}`), so the speculators and vLLM checkpoints map one to one.
`dspark_outputs` is the forward training uses; `markov_walk` the left-to-right decode of one
block from its base logits (serial only in the bias: B look-ups and rank-r products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init

from .configuration_dspine import DSpineConfig
from .transition_cache import WalkResult, draw_in_top_k, stacked_walk


@dataclass
class DSparkOutput:
    """Per-slot outputs of a DSpark block; `...` are the blocks' leading dims.

    logits: (..., B, V) base logits plus the Markov bias of each slot's previous token.
    confidence: (..., B) acceptance logits, or None without a confidence head.
    """

    logits: torch.Tensor
    confidence: torch.Tensor | None


class MarkovHead(nn.Module):
    """Low-rank first-order bias W2 W1[x]: (..., ) token ids -> (..., V) logit bias."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x]: (...,) previous-token ids -> (..., r)."""
        return self.markov_w1(prev_ids.long())

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        """W2 e: (..., r) Markov embeddings -> (..., V) logit bias."""
        return self.markov_w2(embedded.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """Linear(input_dim, 1): (..., input_dim) features -> (...,) acceptance logits."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


def build_dspark_heads(config: DSpineConfig) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    """The heads `config` asks for (none unless `method: dspark`)."""
    markov = MarkovHead(config.vocab_size, config.markov_rank) if config.markov_rank else None
    confidence = None
    if config.enable_confidence_head:
        extra = config.markov_rank if config.confidence_head_with_markov else 0
        confidence = ConfidenceHead(config.hidden_size + extra)
    return markov, confidence


@torch.no_grad()
def init_dspark_heads(markov: MarkovHead | None, confidence: ConfidenceHead | None,
                      std: float) -> None:
    """The reference initialisation: W1 ~ N(0, 0.01), W2 and the confidence weight ~ N(0, std)
    (`initializer_range`), the confidence bias at zero. Weights loaded from a checkpoint are
    left alone (transformers' `initialization` functions skip them)."""
    if markov is not None:
        init.normal_(markov.markov_w1.weight, std=0.01)
        init.normal_(markov.markov_w2.weight, std=std)
    if confidence is not None:
        init.normal_(confidence.proj.weight, std=std)
        init.zeros_(confidence.proj.bias)


def dspark_outputs(
    normed: torch.Tensor,
    base_logits: torch.Tensor,
    prev_ids: torch.Tensor,
    markov: MarkovHead | None,
    confidence: ConfidenceHead | None,
    with_markov: bool,
) -> DSparkOutput:
    """Add the Markov bias to `base_logits` and score each slot's confidence.

    normed (..., B, H) the backbone's final states after the final norm; base_logits (..., B, V)
    their vocabulary logits; prev_ids (..., B) the token before each slot's target (the anchor,
    then the true tokens in training or the drafted ones in decoding).
    """
    embedded = markov.embed(prev_ids) if markov is not None else None  # (..., B, r)
    logits = base_logits
    if markov is not None:
        logits = base_logits + markov.bias(embedded).to(base_logits.dtype)
    return DSparkOutput(logits=logits,
                        confidence=confidence_scores(normed, embedded, confidence, with_markov))


def confidence_scores(normed: torch.Tensor, embedded: torch.Tensor | None,
                      confidence: ConfidenceHead | None, with_markov: bool) -> torch.Tensor | None:
    """The confidence head's acceptance logits (...,) over normed (..., H), with the Markov
    embeddings W1[x] (..., r) appended when `with_markov`; None without a confidence head."""
    if confidence is None:
        return None
    features = normed
    if with_markov:
        features = torch.cat((normed, embedded.to(normed.dtype)), dim=-1)  # (..., H + r)
    return confidence(features.to(confidence.proj.weight.dtype))


def markov_walk(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov: MarkovHead | None,
    k: int,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> WalkResult:
    """Decode a DSpark block left to right: slot j's logits are `base_logits[..., j, :]` plus
    the Markov bias of the token drafted at slot j-1 (slot 0: the anchor), exactly as trained
    with the true tokens (`dspark_outputs`).

    base_logits (..., B, V) the slots' logits without the Markov term (`draft_forward`);
    anchor_ids (...,). Greedy takes each slot's argmax. Sampling (`temperature > 0`, or `noise`
    (..., B, K) Exp(1) draws given) draws each token with the exponential race from the slot's
    softmax restricted to its top-`k` (as `transition_cache.per_slot_decode`), so q is sparse:
    (..., B, K) over `candidates` (..., B, K). Returns the drafted tokens (..., B).
    """
    greedy = noise is None and not (isinstance(temperature, torch.Tensor) or temperature > 0.0)
    prev = anchor_ids
    tokens, qs, cands = [], [], []
    for j in range(base_logits.shape[-2]):
        logits = base_logits[..., j, :]  # (..., V)
        if markov is not None:
            logits = logits + markov.bias(markov.embed(prev)).to(logits.dtype)
        if greedy:
            prev = logits.argmax(-1)
        else:
            slot_noise = None if noise is None else noise[..., j, :]
            prev, probs, cand = draw_in_top_k(logits, k, temperature, generator, slot_noise)
            qs.append(probs)
            cands.append(cand)
        tokens.append(prev)
    return stacked_walk(tokens, qs, cands)  # tokens (..., B)
