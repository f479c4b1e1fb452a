"""`estimate_memory`: every resident item of one DSpine training setup, per GPU.

The items and their formulas are listed in `estimate_memory`'s docstring, in the notation of
the package docstring (`training.memory_plan`), which also states the assumptions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from transformers import PretrainedConfig

from ...modeling.method_presets import ANCHOR_PREDICTING_METHODS
from .activations import attention_items, counts_dspine_terms, draft_activation_elements
from .parameters import (
    attention_dims,
    draft_layer_parameters,
    draft_parameter_counts,
    target_parameter_count,
    text_config,
)
from .plan import ATTENTION_PATHS, DEFAULT_HEADROOM_FRACTION, MemoryItem, MemoryPlan

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Full-vocabulary fp32 tensors alive at once for one loss chunk: the draft logits, the draft
# probabilities (softmax, needed for the L1 distillation term), the target's probabilities
# (p_target) and the gradient of the logits during the chunk's backward.
LOGIT_BUFFERS_PER_CHUNK = 4


def estimate_memory(
    *,
    target_config: PretrainedConfig,
    draft_num_layers: int,
    block_size: int,
    num_anchors: int,
    max_length: int,
    micro_batch_size: int,
    transfer_dim: int,
    message_size: int,
    candidate_k: int,
    zero_stage: Literal[2, 3],
    world_size: int,
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16",
    grad_accum_steps: int = 1,
    offline_features: bool = False,
    logits_chunk_size: int = 1024,
    activation_checkpointing: bool = False,
    gpu_memory_gib: float | None = None,
    num_context_layers: int | None = None,
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION,
    target_parameters: int | None = None,
    attention_path: str = "flex",
    attention_bias: bool = False,
    method_fields: Mapping[str, Any] | None = None,
) -> MemoryPlan:
    """Per-GPU memory of draft training; the items and their formulas (package docstring notation):

        frozen target weights      online: P_target * p; offline: (1 or 2) * V*H * p
                                   (embedding and lm_head only, once when tied). Replicated.
        draft parameters           P * p; ZeRO-3: P * p / W
        draft gradients            P * p / W
        optimizer states           P * 12 / W (fp32 master + Adam m, v); fp32 runs: P * 8 / W
        ZeRO-3 gathered modules    ZeRO-3 only: 2 * max(draft layer, fc) parameters * p
        token codes buffer         V * r * p (replicated: ZeRO-3 does not partition buffers)
        target forward (no grad)   online only: b*S * (2H + 2q + 2kv + 3I) * p, one layer's
                                   transient tensors (residual, norm output, q/k/v, attention
                                   output, SwiGLU gate/up/product)
        context features           b*S * n*H * p (target hidden states at the n layers)
        target final hidden        b*S * H * p (for the target's own next-token distribution)
        draft context path         b*S * (context + rope + N * context_layer) * p with the
                                   per-position counts of `draft_activation_elements`: the
                                   fused features through hidden_norm, RoPE cos/sin, per layer
                                   the context keys (k_norm) and the K/V. Checkpointed: one
                                   layer's context_layer instead of N
        draft block activations    (b*A*B * N * layer + b*A*(B-1) * N * injection
                                   + b*A*B * rope) * p (`draft_activation_elements`).
                                   Checkpointed: b*A*B * (N*H + layer) and one layer's
                                   injection (layer inputs plus one layer recomputed)
        attention (2 items)        `attention_items` for `attention_path`: the mask (flex
                                   tile indices, or dense boolean + additive masks) and the
                                   fp32 logsumexp, N layers (one when checkpointed)
        loss activations           (b*A*D * supervised + per_step) * p: what the objective
                                   keeps per supervised slot outside its chunks (selected
                                   rows, the refinement's write, norm and K gathered head
                                   rows, the alignment's fp32 features); D = B-1 drafted
                                   slots per block, B where the anchor slot predicts too
                                   (DSpark); DSpark's Markov and Domino's delta heads add
                                   their output layer's gradient (V*s, V*E) once
        loss chunk                 c * 4 * V * 4: 4 fp32 full-vocabulary tensors
                                   (LOGIT_BUFFERS_PER_CHUNK), transient (checkpointed)

    Args:
        target_config: the target's HF config (no weights are read).
        draft_num_layers: N.
        block_size: B, slots per block including the anchor.
        num_anchors: A, blocks per sequence.
        max_length: S, padded sequence length.
        micro_batch_size: b, sequences per GPU per forward.
        transfer_dim: r.
        message_size: m.
        candidate_k: K.
        zero_stage: 2 or 3.
        world_size: W, GPUs over which ZeRO partitions.
        param_dtype: dtype of parameters and activations ("bf16", "fp16" or "fp32").
        grad_accum_steps: micro-batches per optimizer step (changes tokens per step only).
        offline_features: features read from disk; the target body is not on the GPU.
        logits_chunk_size: c, block slots whose full-vocabulary logits exist at once.
        activation_checkpointing: recompute each draft layer in backward.
        gpu_memory_gib: GPU size for the verdict of `MemoryPlan.table()` (None: no verdict).
        num_context_layers: n, target layers in a context feature (default N).
        headroom_fraction: share of the GPU `fits` keeps free.
        target_parameters: the target's parameter count when already known (skips building it
            on the meta device).
        attention_path: the draft attention the run uses: "flex" (compiled flex attention, the
            CUDA default) or "dense" (SDPA with a boolean mask, the CPU path).
        attention_bias: the draft's `attention_bias` (biases on its q/k/v/o projections).
        method_fields: the draft's `method` and the fields it leaves open
            (`parameters.method_fields_of`): its own heads are counted among the draft's
            parameters; None plans a DSpine draft.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage must be 2 or 3, got {zero_stage!r}")
    if param_dtype not in _DTYPE_BYTES:
        raise ValueError(f"param_dtype must be one of {sorted(_DTYPE_BYTES)}, got {param_dtype!r}")
    if attention_path not in ATTENTION_PATHS:
        raise ValueError(
            f"attention_path must be one of {sorted(ATTENTION_PATHS)}, got {attention_path!r}"
        )
    positive = {
        "draft_num_layers": draft_num_layers,
        "block_size": block_size,
        "num_anchors": num_anchors,
        "max_length": max_length,
        "micro_batch_size": micro_batch_size,
        "transfer_dim": transfer_dim,
        "message_size": message_size,
        "candidate_k": candidate_k,
        "world_size": world_size,
        "grad_accum_steps": grad_accum_steps,
        "logits_chunk_size": logits_chunk_size,
    }
    for field, value in positive.items():
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if not 0.0 <= headroom_fraction < 1.0:
        raise ValueError(f"headroom_fraction must be in [0, 1), got {headroom_fraction}")

    cfg = text_config(target_config)
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = attention_dims(cfg)
    n = draft_num_layers if num_context_layers is None else num_context_layers
    p = _DTYPE_BYTES[param_dtype]
    world = world_size
    tokens = micro_batch_size * max_length  # b*S, positions of one micro-batch
    slots = micro_batch_size * num_anchors * block_size  # b*A*B, block slots of one micro-batch

    counts = draft_parameter_counts(
        cfg,
        draft_num_layers=draft_num_layers,
        transfer_dim=transfer_dim,
        message_size=message_size,
        num_context_layers=n,
        attention_bias=attention_bias,
        method_fields=method_fields,
    )
    draft_params = sum(counts.values())
    if target_parameters is None:
        target_parameters = target_parameter_count(target_config)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))

    items: list[MemoryItem] = []
    if offline_features:
        head_copies = 1 if tied else 2
        items.append(
            MemoryItem(
                "frozen target embedding + lm_head",
                head_copies * vocab * hidden * p,
                f"{head_copies} * V*H * {p} B (offline features: target body not loaded)",
            )
        )
    else:
        items.append(
            MemoryItem(
                "frozen target weights",
                target_parameters * p,
                f"{target_parameters:,} params * {p} B, replicated",
            )
        )

    param_shard = world if zero_stage == 3 else 1
    optimizer_bytes = 8 if p == 4 else 12  # fp32 runs keep no separate master copy
    items += [
        MemoryItem(
            "draft parameters",
            math.ceil(draft_params * p / param_shard),
            f"P * {p} B" + (" / W" if zero_stage == 3 else ", replicated"),
            partitioned=zero_stage == 3,
        ),
        MemoryItem(
            "draft gradients",
            math.ceil(draft_params * p / world),
            f"P * {p} B / W",
            partitioned=True,
        ),
        MemoryItem(
            "optimizer states (master + Adam m, v)",
            math.ceil(draft_params * optimizer_bytes / world),
            f"P * {optimizer_bytes} B / W",
            partitioned=True,
        ),
    ]
    if zero_stage == 3:
        largest_module = max(draft_layer_parameters(cfg, attention_bias), counts["fc"])
        items.append(
            MemoryItem(
                "ZeRO-3 gathered modules",
                2 * largest_module * p,
                f"2 * {largest_module:,} params (running + prefetched) * {p} B",
            )
        )
    items.append(
        MemoryItem("token codes buffer", vocab * transfer_dim * p, f"V*r * {p} B, replicated")
    )

    if not offline_features:
        target_elements = 2 * hidden + 2 * q_dim + 2 * kv_dim + 3 * inter
        items.append(
            MemoryItem(
                "target forward working set (no grad)",
                tokens * target_elements * p,
                f"b*S * (2H + 2q + 2kv + 3I) * {p} B, one layer",
            )
        )
    items += [
        MemoryItem("context features", tokens * n * hidden * p, f"b*S * n*H * {p} B"),
        MemoryItem("target final hidden", tokens * hidden * p, f"b*S * H * {p} B"),
    ]

    act = draft_activation_elements(
        cfg, draft_num_layers=draft_num_layers, transfer_dim=transfer_dim,
        message_size=message_size, candidate_k=candidate_k, param_dtype_bytes=p,
        method_fields=method_fields,
    )
    drafted = micro_batch_size * num_anchors * (block_size - 1)  # b*A*(B-1), slots 1..B-1
    method = (method_fields or {}).get("method")
    anchor_predicts = method in ANCHOR_PREDICTING_METHODS or (  # Domino with shifted labels
        method == "domino" and bool((method_fields or {}).get("domino_shift_label")))
    predicted = micro_batch_size * num_anchors * block_size if anchor_predicts else drafted
    per_block = "B" if anchor_predicts else "(B-1)"
    layer_h, inject_h = act.layer / hidden, act.injection / hidden
    ctx_h, ctx_kv = act.context / hidden, act.context_layer / kv_dim
    if activation_checkpointing:
        # every layer's input (H per slot) plus one layer recomputed in backward
        block_bytes = (slots * (draft_num_layers * hidden + act.layer) + drafted * act.injection
                       + slots * act.rope) * p
        block_formula = (f"(b*A*B * (N*H + {layer_h:.2f} H) + b*A*(B-1) * {inject_h:.2f} H "
                         f"+ b*A*B * 2 head_dim) * {p} B (checkpointed)")
        context_bytes = tokens * (act.context + act.rope + act.context_layer) * p
        context_formula = f"b*S * ({ctx_h:.2f} H + 2 head_dim + {ctx_kv:.2f} kv) * {p} B"
    else:
        block_bytes = (slots * draft_num_layers * act.layer
                       + drafted * draft_num_layers * act.injection + slots * act.rope) * p
        block_formula = (f"(b*A*B * N * {layer_h:.2f} H + b*A*(B-1) * N * {inject_h:.2f} H "
                         f"+ b*A*B * 2 head_dim) * {p} B")
        context_bytes = tokens * (act.context + act.rope + draft_num_layers * act.context_layer) * p
        context_formula = f"b*S * ({ctx_h:.2f} H + 2 head_dim + N * {ctx_kv:.2f} kv) * {p} B"
    items += [
        MemoryItem("draft context path", context_bytes, context_formula),
        MemoryItem("draft block activations", block_bytes, block_formula),
    ]
    items += attention_items(
        cfg,
        draft_num_layers=draft_num_layers,
        block_size=block_size,
        num_anchors=num_anchors,
        max_length=max_length,
        micro_batch_size=micro_batch_size,
        param_dtype_bytes=p,
        path=attention_path,
        activation_checkpointing=activation_checkpointing,
    )
    items += [
        MemoryItem(
            "loss activations (supervised slots)",
            (predicted * act.supervised + act.per_step) * p,
            f"b*A*{per_block} * {act.supervised / hidden:.2f} H * {p} B"
            + (f" + V * {act.per_step // vocab} * {p} B (the vocabulary-sized head's gradient)"
               if act.per_step else "")
            + (f" (K = {candidate_k} head rows per slot for the refinement term among them)"
               if counts_dspine_terms(method_fields) else ""),
        ),
        MemoryItem(
            "loss chunk (full-vocabulary logits)",
            logits_chunk_size * LOGIT_BUFFERS_PER_CHUNK * vocab * 4,
            f"c * {LOGIT_BUFFERS_PER_CHUNK} * V * 4 B",
        ),
    ]
    return MemoryPlan(
        items=tuple(items),
        draft_parameters=draft_params,
        target_parameters=target_parameters,
        zero_stage=zero_stage,
        world_size=world,
        tokens_per_step=tokens * world * grad_accum_steps,
        gpu_memory_gib=gpu_memory_gib,
        headroom_fraction=headroom_fraction,
        attention_path=attention_path,
    )
