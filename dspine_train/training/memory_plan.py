"""Per-GPU memory plan of a DSpine training run, computed from configs alone (no weights loaded).

`python train.py recipe=qwen3_8b plan_only=true` calls `estimate_memory` and prints
`MemoryPlan.table()`: one row per resident item at the recipe's ZeRO stage and world size, the
total, and whether it fits a given GPU.

Notation used in every formula below (all sizes are element counts unless said otherwise):

    H  target hidden size        V  vocabulary size           L  target depth
    q  heads * head_dim          kv key/value heads * head_dim
    I  MLP intermediate size     N  draft layers              n  context layers (default N)
    r  transfer_dim              m  message_size              K  candidate_k
    b  micro-batch size          S  max_length                A  anchors per sequence
    B  block size                W  world size (GPUs)         c  logits chunk (slots)
    h  attention heads           Q  queries A*B               KV keys S + A*B
    nq ceil(Q/128)               nk ceil(KV/128)  (flex attention's 128 x 128 mask tiles)
    P  trainable draft parameters
    p  bytes per element of `param_dtype` (2 for bf16/fp16, 4 for fp32)
    f  4 / p, an fp32 copy's size in p-byte elements (the norms compute in fp32)

Assumptions (each one is a choice a real run can break; the headroom covers small ones):
    * The frozen target is not wrapped by DeepSpeed: its weights are replicated on every GPU in
      `param_dtype`, at every ZeRO stage. With offline features only its embedding and lm_head
      stay on the GPU (the draft's frozen input embedding and output head).
    * Mixed precision (bf16/fp16): p-byte parameters, p-byte gradients, fp32 master weights and
      fp32 Adam m and v (4 + 4 + 4 = 12 bytes per parameter). Pure fp32: 4-byte parameters and
      gradients and 8 bytes of Adam state, no master copy.
    * ZeRO-2 partitions gradients and optimizer states over W; parameters stay replicated.
      ZeRO-3 partitions parameters too and gathers them module by module; we count two gathered
      modules (the one running and the one prefetched). DeepSpeed may keep more parameters live
      (up to `stage3_max_live_parameters`); lower that setting if the plan is tight.
    * Gradient accumulation adds no memory: micro-batches accumulate into the same gradient
      partition. It only changes the tokens per optimizer step.
    * The draft's attention is planned for the path the run takes (`attention_path`), counted
      from what each kernel keeps (see `attention_items`). "flex" (CUDA): compiled flex
      attention, which materialises no score matrix; it keeps per layer an fp32 logsumexp and
      shares one block-sparse mask (index tensors of full and partial 128 x 128 tiles, and their
      transposes for backward). "dense" (CPU): SDPA's flash kernel with the boolean
      (b, 1, Q, KV) mask, which it turns into an additive p-byte mask of the same shape in
      every layer and keeps for backward, plus the logsumexp. Neither keeps scores; the
      attention output and its q/k/v are in the block and context items.
    * The target runs without its lm_head (the objective applies the head per chunk) and
      without a KV cache, under `no_grad`.
    * The loss is computed in chunks of c block slots; only one chunk of full-vocabulary fp32
      tensors exists at a time (METHOD 4).
    * Activations are what autograd keeps for backward in the real `DraftStep` forward and
      objective (`draft_activation_elements`); `tests/test_memory_plan.py` measures them.
    * Not counted, left to the headroom: CUDA context and NCCL buffers, DeepSpeed communication
      buckets, allocator fragmentation, gradients of activations during backward (at most about
      one layer's activations at a time).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

GIB = 1024**3

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Full-vocabulary fp32 tensors alive at once for one loss chunk: the draft logits, the draft
# probabilities (softmax, needed for the L1 distillation term), the target's probabilities
# (p_target) and the gradient of the logits during the chunk's backward.
LOGIT_BUFFERS_PER_CHUNK = 4

# Share of the GPU left free by `fits`: CUDA context, NCCL and DeepSpeed buffers, allocator
# fragmentation and the activation gradients the plan does not itemise.
DEFAULT_HEADROOM_FRACTION = 0.10

# The draft attention kernels a plan can describe (`estimate_memory(attention_path=...)`).
ATTENTION_PATHS = {
    "flex": "compiled flex attention (CUDA): block-sparse mask, no score matrix",
    "dense": "dense SDPA with a boolean (b, 1, Q, KV) mask (CPU)",
}

# Flex attention's mask tile: the BlockMask indexes 128 x 128 (query x key) tiles.
FLEX_TILE = 128


@dataclass(frozen=True)
class MemoryItem:
    """One resident item of the plan.

    Attributes:
        name: what the memory holds.
        bytes: bytes per GPU.
        formula: how `bytes` was computed, in the notation of the module docstring.
        partitioned: True when the item is divided over the world size (ZeRO).
    """

    name: str
    bytes: int
    formula: str
    partitioned: bool = False

    @property
    def gib(self) -> float:
        """Size in GiB."""
        return self.bytes / GIB


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory breakdown of a training setup; see the module docstring for the formulas.

    Attributes:
        items: resident items, in the order they are printed.
        draft_parameters: P, trainable parameters of the draft.
        target_parameters: parameters of the frozen target (all of them, even when offline
            features keep only the embedding and head on the GPU).
        zero_stage: 2 or 3.
        world_size: W.
        tokens_per_step: b * S * W * grad_accum_steps, padded tokens per optimizer step.
        gpu_memory_gib: the GPU size the verdict of `table()` refers to (None: no verdict).
        headroom_fraction: share of the GPU `fits` keeps free.
        attention_path: the draft attention the plan counts, "flex" or "dense" (see
            `attention_items`).
    """

    items: tuple[MemoryItem, ...]
    draft_parameters: int
    target_parameters: int
    zero_stage: int
    world_size: int
    tokens_per_step: int
    gpu_memory_gib: float | None = None
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    attention_path: str = "flex"

    @property
    def total_bytes(self) -> int:
        """Sum of all items, bytes per GPU."""
        return sum(item.bytes for item in self.items)

    @property
    def total_gib(self) -> float:
        """Sum of all items, GiB per GPU."""
        return self.total_bytes / GIB

    @property
    def required_gpu_gib(self) -> float:
        """Smallest GPU (GiB) on which `fits` is True: total / (1 - headroom)."""
        return self.total_gib / (1.0 - self.headroom_fraction)

    def item(self, name: str) -> MemoryItem:
        """The item called `name`; `KeyError` lists the names when there is none."""
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(f"no memory item {name!r}; items are {[i.name for i in self.items]}")

    def fits(self, gpu_gib: float | None = None) -> bool:
        """Whether the total stays within `(1 - headroom_fraction)` of a `gpu_gib` GPU.

        `gpu_gib` defaults to the plan's `gpu_memory_gib`; `ValueError` when neither is set.
        """
        gpu_gib = self.gpu_memory_gib if gpu_gib is None else gpu_gib
        if gpu_gib is None:
            raise ValueError("fits: pass gpu_gib or build the plan with gpu_memory_gib")
        return self.total_gib <= gpu_gib * (1.0 - self.headroom_fraction)

    def table(self, gpu_gib: float | None = None) -> str:
        """A readable table: one row per item (GiB and formula), the total and the verdict."""
        gpu_gib = self.gpu_memory_gib if gpu_gib is None else gpu_gib
        name_width = max(len(item.name) for item in self.items)
        header = (
            f"Per-GPU memory plan: ZeRO-{self.zero_stage}, world size {self.world_size}, "
            f"draft {self.draft_parameters / 1e6:,.1f} M trainable parameters, "
            f"target {self.target_parameters / 1e9:,.2f} B parameters, "
            f"{self.tokens_per_step:,} tokens per optimizer step"
        )
        lines_attention = f"draft attention: {ATTENTION_PATHS[self.attention_path]}"
        lines = [header, lines_attention, f"{'item':<{name_width}}  {'GiB':>8}  formula"]
        lines.append("-" * len(lines[-1]))
        for item in self.items:
            note = f"{item.formula}  [partitioned over W]" if item.partitioned else item.formula
            lines.append(f"{item.name:<{name_width}}  {item.gib:>8.2f}  {note}")
        lines.append("-" * len(lines[2]))
        lines.append(f"{'total':<{name_width}}  {self.total_gib:>8.2f}")
        headroom = f"{self.headroom_fraction:.0%} headroom"
        if gpu_gib is None:
            lines.append(f"needs a GPU of at least {self.required_gpu_gib:.1f} GiB ({headroom})")
        else:
            verdict = "FITS" if self.fits(gpu_gib) else "DOES NOT FIT"
            lines.append(
                f"verdict: {verdict} on a {gpu_gib:g} GiB GPU "
                f"(needs {self.required_gpu_gib:.1f} GiB with {headroom})"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------- parameter counts
def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) config."""
    return getattr(config, "text_config", None) or config


def _attention_dims(config: PretrainedConfig) -> tuple[int, int]:
    """(q, kv): widths of the query and of the key (= value) projections."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads * head_dim, kv_heads * head_dim


def draft_parameter_counts(
    target_config: PretrainedConfig,
    *,
    draft_num_layers: int,
    transfer_dim: int,
    message_size: int,
    num_context_layers: int | None = None,
    attention_bias: bool = False,
) -> dict[str, int]:
    """Trainable parameters of a DSpine draft for `target_config`, by component.

    The draft's layers have the target's width and head layout (METHOD 1):

        fc             n*H*H                          Linear(n*H -> H), no bias
        hidden_norm    H                              RMSNorm after fc
        layers         N * (H*q + 2*H*kv + q*H        q/k/v/o projections (GQA)
                            [+ q + 2*kv + H]          their biases when `attention_bias`
                                                      (the draft config's own field, False
                                                      by default, not the target's)
                            + 2*head_dim              q_norm, k_norm
                            + 3*H*I                   SwiGLU gate/up/down
                            + 2*H)                    input and post-attention RMSNorms
        final_norm     H
        injection      N*H*r                          readouts R_l: H -> r, no bias
                       + r*m                          message M: r -> m, no bias
                       + r*m + m                      gate_recv: r -> m with the gate bias b
                       + r*m                          gate_pred: r -> m, no bias
                       + N*m*H                        writes W_l: m -> H, no bias

    The frozen embedding and lm_head belong to the target and the token codes are a buffer,
    so neither is counted here. The injection modules exist (and are trained) even when the
    draft runs as plain DFlash (`injection: false`): the readouts still feed the alignment term.
    """
    cfg = _text_config(target_config)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = _attention_dims(cfg)
    head_dim = q_dim // cfg.num_attention_heads
    n = draft_num_layers if num_context_layers is None else num_context_layers
    r, m = transfer_dim, message_size
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if attention_bias:
        attention += q_dim + 2 * kv_dim + hidden
    per_layer = attention + 2 * head_dim + 3 * hidden * inter + 2 * hidden
    counts = {
        "fc": n * hidden * hidden,
        "hidden_norm": hidden,
        "layers": draft_num_layers * per_layer,
        "final_norm": hidden,
        "injection": (
            draft_num_layers * hidden * r  # readouts
            + r * m  # message
            + (r * m + m)  # gate_recv with the gate bias
            + r * m  # gate_pred
            + draft_num_layers * m * hidden  # writes
        ),
    }
    return counts


def _draft_layer_parameters(cfg: PretrainedConfig, attention_bias: bool = False) -> int:
    """Parameters of one draft decoder layer (the `layers` formula above with N = 1)."""
    counts = draft_parameter_counts(cfg, draft_num_layers=1, transfer_dim=1, message_size=1,
                                    attention_bias=attention_bias)
    return counts["layers"]


def _dense_decoder_parameters(cfg: PretrainedConfig) -> int:
    """Parameter count of a dense Llama/Qwen-style decoder, from its config alone.

    `V*H` embedding + L layers (q/k/v/o [+ biases], q/k norms when the model type is qwen3,
    SwiGLU, two RMSNorms) + final norm + `V*H` lm_head unless tied.
    """
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = _attention_dims(cfg)
    per_layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * inter
    per_layer += 2 * hidden
    if getattr(cfg, "attention_bias", False):
        per_layer += q_dim + 2 * kv_dim + hidden
    if str(getattr(cfg, "model_type", "")).startswith("qwen3"):
        per_layer += 2 * (q_dim // cfg.num_attention_heads)
    head = 0 if getattr(cfg, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + cfg.num_hidden_layers * per_layer + hidden + head


def target_parameter_count(target_config: PretrainedConfig) -> int:
    """Exact parameter count of the target (tied weights counted once).

    Builds the model on the `meta` device (no memory, no weights read) with
    `AutoModelForCausalLM.from_config`, so any architecture transformers knows is counted
    exactly. For one it does not know (remote code), falls back to the dense-decoder formula
    of `_dense_decoder_parameters` with a warning.
    """
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target_config)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as err:
        warnings.warn(
            f"memory plan: cannot build {type(target_config).__name__} on the meta device ({err}); "
            "counting the target's parameters with the dense-decoder formula",
            stacklevel=2,
        )
        return _dense_decoder_parameters(_text_config(target_config))
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- activations
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
        supervised: per supervised slot (at most b*A*(B-1)): the objective outside its chunks.
    """

    layer: int
    injection: int
    rope: int
    context: int
    context_layer: int
    supervised: int


def draft_activation_elements(
    target_config: PretrainedConfig,
    *,
    draft_num_layers: int,
    transfer_dim: int,
    message_size: int,
    candidate_k: int,
    param_dtype_bytes: int,
) -> ActivationElements:
    """What autograd keeps per slot / position in the draft's training forward and objective.

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
    """
    cfg = _text_config(target_config)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = _attention_dims(cfg)
    head_dim = q_dim // cfg.num_attention_heads
    r, m, k, p = transfer_dim, message_size, candidate_k, param_dtype_bytes
    f = 4 // p
    norm = f * hidden + 2 * hidden
    return ActivationElements(
        layer=2 * norm + (f + 4) * q_dim + (f + 3) * kv_dim + 4 * inter,
        injection=2 * hidden + 2 * r + 2 * r + 3 * m + (f + 1) * hidden,
        rope=2 * head_dim,
        context=norm,
        context_layer=(f + 3) * kv_dim,
        supervised=(
            2 * hidden
            + (f + 1) * hidden + 2 * r + 3 * m
            + (f + 1) * hidden + k * hidden
            + 2 * draft_num_layers * f * r
            + 2 * 8 // p + 8 * f
        ),
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
    cfg = _text_config(target_config)
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
) -> MemoryPlan:
    """Per-GPU memory of DSpine training; the items and their formulas (module docstring notation):

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
        loss activations           b*A*(B-1) * supervised * p: what the objective keeps per
                                   supervised slot outside its chunks (selected rows, the
                                   refinement's write, norm and K gathered head rows, the
                                   alignment's fp32 features)
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

    cfg = _text_config(target_config)
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = _attention_dims(cfg)
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
        largest_module = max(_draft_layer_parameters(cfg, attention_bias), counts["fc"])
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
    )
    drafted = micro_batch_size * num_anchors * (block_size - 1)  # b*A*(B-1), slots 1..B-1
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
            drafted * act.supervised * p,
            f"b*A*(B-1) * {act.supervised / hidden:.2f} H * {p} B (K = {candidate_k} head rows "
            "per slot for the refinement term among them)",
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
