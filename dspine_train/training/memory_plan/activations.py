"""What the draft's training forward keeps for backward, and what its attention kernel adds.

Counted per slot and per position (`draft_activation_elements`) and per micro-batch for the
attention (`attention_items`), in the notation of the package docstring
(`training.memory_plan`); `tests/test_memory_plan.py` measures both against the real forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from ...modeling.method_presets import METHOD_PRESETS
from .parameters import attention_dims, text_config
from .plan import ATTENTION_PATHS, MemoryItem

# Flex attention's mask tile: the BlockMask indexes 128 x 128 (query x key) tiles.
FLEX_TILE = 128


@dataclass(frozen=True)
class ActivationElements:
    """Elements the draft's training forward keeps for backward, counted in p-byte units (an
    fp32 tensor of n elements counts 4/p * n). `tests/test_memory_plan.py` checks their sum
    against what autograd saves in the real `DraftStep` forward.

    Attributes:
        layer: per block slot per draft layer (attention + MLP).
        injection: per drafted slot (slots 1..B-1) per draft layer.
        rope: per position, once: the RoPE cos and sin (block slots and context positions).
        context: per context position, once: the fused context features.
        context_layer: per context position per draft layer: the context keys and values.
        supervised: per supervised slot (at most b*A*(B-1), b*A*B when the anchor slot
            predicts): the objective outside its chunks, the method's heads included.
        per_step: once per training forward: DSpark's `markov_w2` gradient (V x r), which its
            objective makes in forward over all the chunks (`dspark_objective`).
    """

    layer: int
    injection: int
    rope: int
    context: int
    context_layer: int
    supervised: int
    per_step: int = 0


def method_settings(method_fields: Mapping[str, Any] | None) -> dict[str, Any]:
    """Every preset field of the draft's method (`METHOD_PRESETS`), overridden by
    `method_fields` (`parameters.method_fields_of`; None: DSpine's)."""
    method = dict(METHOD_PRESETS[(method_fields or {}).get("method", "dspine")])
    method.update(method_fields or {})
    return method


def counts_dspine_terms(method_fields: Mapping[str, Any] | None) -> bool:
    """Whether the objective keeps DSpine's refinement and alignment rows (and so the plan
    counts them among the supervised slots' activations)."""
    method = method_settings(method_fields)
    return bool(method["refine_weight"] or method["alignment_weight"])


def draft_activation_elements(
    target_config: PretrainedConfig,
    *,
    draft_num_layers: int,
    transfer_dim: int,
    message_size: int,
    candidate_k: int,
    param_dtype_bytes: int,
    method_fields: Mapping[str, Any] | None = None,
) -> ActivationElements:
    """What autograd keeps per slot / position in the draft's training forward and objective,
    for a draft of `method_fields` (`parameters.method_fields_of`; None: DSpine).

    f = 4 / p: the draft's RMSNorms (and the injection's rms) compute in fp32, so with 2-byte
    parameters every norm keeps an fp32 copy of its input (f = 2 units per element); in fp32
    that copy is the input itself (f = 1). A norm keeps that copy, its normalised input and,
    for the linear layers that read it, its weighted output: `fH + 2H`.

        layer          2 * (fH + 2H)            input and post-attention norms
                       + fq + 4q                q_norm copy and normalised q, the rotated q
                                                and the attention output (SDPA / flex keep
                                                both), and the (b, Q, q) copy o_proj reads
                                                when the kernel returns (b, h, Q, D) (a view
                                                on the CPU kernel: planned anyway)
                       + fkv + 3kv              k_norm copy and normalised k, block keys and
                                                values in the [context ; block] K/V
                       + 4I                     SwiGLU gate, act(gate), up and their product
        injection      2H + 2r                  the two readouts (injection, alignment
                                                features): their input copies and outputs
                       + 2r + 3m                f_recv, f_pred, gate, message, gated message
                       + fH + H                 rms's fp32 copy and the write's update
        rope           2 * head_dim             cos and sin (RoPE's products save nothing
                                                else: cos/sin carry no gradient)
        context        fH + 2H                  hidden_norm of fc's output
        context_layer  fkv + 3kv                k_norm copy and normalised k, context keys
                                                and values in the K/V
        supervised     2H                       the selected draft and target hidden rows
                       + (f + 1)H + 2r + 3m     the refinement's last-layer write again
                       + (f + 1)H + K*H         its final norm and the K gathered head rows
                       + 2N*f*r                 fp32 features and label codes (alignment)
                       + 2*8/p + 8f             int64 labels, fp32 per-slot scores and terms

    The other methods run no injection and neither refinement nor alignment (supervised: the
    hidden rows, labels and per-slot terms only); the training forward still reads each
    layer's features out (`layer_stack`: r + 1, the readout and its norm, per drafted slot per
    layer, and once more for the last layer's), and they add their own:

        layer          + 8k H                   DFlash2: per sublayer (attention, MLP) the
                                                input-side and output-side convolutions keep
                                                k taps' coefficients and k-1 shifted copies
                                                each, and the convolved input and sublayer
                                                output that the next products read: 4k H
        supervised     + 9G                     Domino: the GRU's states gathered for the loss
                                                and, per step, its input and hidden gates and
                                                states
                       + (f + 1)H + f           DSpark, DFlash2 and Domino, whose objectives
                       + H                      make the vocabulary terms' gradient in
                                                forward: the final norm's fp32 copy, rms and
                                                normalised rows, and the gradient with
                                                respect to them
                       + 2E                     Domino (delta MLP width E): its hidden layer
                                                before SiLU, and the gradient of its output
                       + (H + s) + s + 8/p + 2f DSpark (Markov rank s): the confidence head's
                                                input [normed ; W1[x]], the gradient of W1[x],
                                                the previous ids, the BCE's fp32 terms
                       + (K + 2)s + K(8/p + f)  DFlash2 (selector rank s, top K): the
                                                hidden projection, the predecessor's and the
                                                K candidates' codebook rows, the candidates
                                                and their fp32 scores
        per_step       V s                      DSpark: the summed `markov_w2` gradient
                       V E                      Domino: the summed `embed_proj.2` gradient
    """
    cfg = text_config(target_config)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = attention_dims(cfg)
    head_dim = q_dim // cfg.num_attention_heads
    r, m, k, p = transfer_dim, message_size, candidate_k, param_dtype_bytes
    f = 4 // p
    norm = f * hidden + 2 * hidden
    method = method_settings(method_fields)
    layer = 2 * norm + (f + 4) * q_dim + (f + 3) * kv_dim + 4 * inter
    supervised = 2 * hidden + 2 * 8 // p + 8 * f
    if counts_dspine_terms(method_fields):  # DSpine's own terms
        supervised += ((f + 1) * hidden + 2 * r + 3 * m + (f + 1) * hidden + k * hidden
                       + 2 * draft_num_layers * f * r)
    layer += 8 * method["conv_kernel_size"] * hidden  # DFlash2's convolutions
    supervised += 9 * method["domino_gru_hidden_dim"]  # Domino's GRU
    markov, selector, top_k = method["markov_rank"], method["selector_rank"], method["selector_top_k"]
    delta = method["domino_emb_dim"]
    if markov or selector or delta:  # the final norm and the gradient made in forward
        supervised += (f + 1) * hidden + f + hidden
    supervised += 2 * delta  # Domino's delta MLP hidden layer and its gradient
    if markov:  # DSpark's confidence input, Markov embedding gradient, ids, BCE terms
        supervised += hidden + markov + markov + 8 // p + 2 * f
    if selector:  # DFlash2's selector rows, candidates and scores
        supervised += (top_k + 2) * selector + top_k * (8 // p + f)
    if method["injection"]:
        injection = 2 * hidden + 2 * r + 2 * r + 3 * m + (f + 1) * hidden
    else:  # the features read out after each layer, and the last layer's again
        injection = r + 1
        supervised += r + 1
    return ActivationElements(
        layer=layer,
        injection=injection,
        rope=2 * head_dim,
        context=norm,
        context_layer=(f + 3) * kv_dim,
        supervised=supervised,
        per_step=cfg.vocab_size * (markov + delta),
    )


def attention_items(
    target_config: PretrainedConfig,
    *,
    draft_num_layers: int,
    block_size: int,
    num_anchors: int,
    max_length: int,
    micro_batch_size: int,
    param_dtype_bytes: int,
    path: str,
    activation_checkpointing: bool,
) -> list[MemoryItem]:
    """What the draft's attention keeps beyond q, k, v and its output, for one micro-batch.

        flex   mask        b * (4 * nq*nk + 2*nq + 2*nk) * 4 B: the BlockMask's int32 tile
                           indices (partial and full tiles, and the transposed pair for
                           backward) and per-row counts; built once, shared by the N layers
               logsumexp   N * b*h*Q * 4 B: fp32, saved per layer for backward
        dense  mask        b*Q*KV * 1 B (the boolean mask) + N * b*Q*KV * p: the additive mask
                           SDPA derives from it in every layer and keeps for backward
               logsumexp   N * b*h*Q * 4 B, as for flex

    With activation checkpointing one layer's share is live instead of N. `tests/
    test_memory_plan.py` checks these against what the CPU forward really keeps.
    """
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention_path must be one of {sorted(ATTENTION_PATHS)}, got {path!r}")
    cfg = text_config(target_config)
    b, p = micro_batch_size, param_dtype_bytes
    q_len = num_anchors * block_size
    kv_len = max_length + q_len
    layers, layers_sym = (1, "1") if activation_checkpointing else (draft_num_layers, "N")
    lse = MemoryItem(
        "attention logsumexp (fp32)",
        layers * b * cfg.num_attention_heads * q_len * 4,
        f"{layers_sym} * b*h*Q * 4 B",
    )
    if path == "flex":
        nq, nk = math.ceil(q_len / FLEX_TILE), math.ceil(kv_len / FLEX_TILE)
        mask = MemoryItem(
            "attention block mask (flex)",
            b * (4 * nq * nk + 2 * nq + 2 * nk) * 4,
            "b * (4*nq*nk + 2*nq + 2*nk) * 4 B, int32 tile indices",
        )
    else:
        mask = MemoryItem(
            "attention masks (dense)",
            b * q_len * kv_len * (1 + layers * p),
            f"b*Q*KV * (1 + {layers_sym} * {p}) B, boolean + additive per layer",
        )
    return [mask, lse]
