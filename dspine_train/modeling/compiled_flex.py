"""Compiled flex attention for the training forward: a fused kernel that keeps no score matrix.

Called eagerly, `flex_attention` runs an unfused fallback that materialises the full
(B, heads, Q, K) score matrix (about 12 GB per layer per sequence at the `qwen3_8b` recipe's
8192 queries x 11264 keys), and an eager `create_block_mask` materialises the dense
(B, 1, Q, K) mask. Only under `torch.compile` do they become a fused attention kernel and a
block-sparse mask builder. This module holds the two compiled functions (lazy process-wide
singletons, compiled on first use) and refuses to run either eagerly: anything that would
fall back (no dynamo, no Triton on CUDA, a `force_eager` stance, dynamo disabled, the
recompile limit, a failed compile) raises a `RuntimeError` naming the reason.

What compiles. Both functions are compiled with `dynamic=True, fullgraph=True`: sequence
length and anchor count are symbolic, and so are the Python ints the mask predicate closes
over (sequence length, block size), so a batch of a new padded length reuses the kernels.
Dynamo compiles a new attention graph per: grad mode (training step vs evaluation), batch size
(the flex kernel specialises it; training keeps `data.batch_size`, evaluation its own), block
attention kind (causal or bidirectional), device and dtype. A run thus compiles on its first
training step and on its first evaluation (a noticeable wait each, on a GPU and on a CPU, even
for a tiny forward). Dynamo's default limit of 8 graphs per function is raised to
`RECOMPILE_LIMIT` (64) before the first compile; past it `fullgraph=True` makes dynamo raise,
which surfaces here as `FlexAttentionUnavailable`.

The mask itself is not cached across steps: it depends on the anchor positions, drawn anew for
every batch. One forward builds it once and every layer shares it.

On CPU torch compiles flex attention's forward only (it has no CPU backward), so a CPU run
with gradients uses the dense SDPA path; `check_flex_usable` says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - every supported torch has it
    BlockMask = create_block_mask = flex_attention = None  # type: ignore[assignment,misc]

_EAGER = (
    "ran eagerly instead of compiled (a torch.compiler.set_stance('force_eager') or "
    "torch._dynamo.config.disable / TORCHDYNAMO_DISABLE=1 is in effect): eager flex attention "
    "would materialise the full score matrix"
)

_compiled: dict[str, Callable] = {}


class FlexAttentionUnavailable(RuntimeError):
    """Compiled flex attention was asked for and cannot run; nothing falls back to a dense path."""


def check_flex_usable(device: torch.device, needs_grad: bool) -> None:
    """Raise `FlexAttentionUnavailable` when compiled flex attention cannot run on `device`.

    needs_grad: the forward will be differentiated (flex attention has no CPU backward).
    """
    if flex_attention is None:
        raise FlexAttentionUnavailable(
            f"this torch build ({torch.__version__}) has no torch.nn.attention.flex_attention"
        )
    if not torch._dynamo.is_dynamo_supported():
        raise FlexAttentionUnavailable(
            "torch.compile (dynamo) is not supported on this Python/platform, so flex attention "
            "cannot be compiled; uncompiled it would materialise the full score matrix"
        )
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise FlexAttentionUnavailable(
                "compiled flex attention on CUDA needs Triton, which this environment lacks "
                "(install the triton package matching torch)"
            )
    elif device.type == "cpu":
        if needs_grad:
            raise FlexAttentionUnavailable(
                f"torch {torch.__version__} compiles flex attention's forward only on CPU (no "
                "backward); train on CPU with use_flex=False (dense SDPA with a boolean mask)"
            )
    else:
        raise FlexAttentionUnavailable(
            f"compiled flex attention is only used on cuda and cpu devices, not {device.type!r}"
        )


def _build_block_mask(
    mask_mod: Callable, batch: int, q_len: int, kv_len: int, device: torch.device
) -> BlockMask:
    if not torch.compiler.is_compiling():  # constant True while dynamo traces this function
        raise FlexAttentionUnavailable(f"create_block_mask {_EAGER}")
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)


def _fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float
) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        raise FlexAttentionUnavailable(f"flex_attention {_EAGER}")
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep `limit` compiled graphs per function instead of its default 8.

    A long training run meets several shape classes per compiled function (grad and no-grad
    mode x the batch size and a short last batch, for training and for evaluation); the engine
    one per (shape, kv bucket) of each step. Past the limit `fullgraph=True` raises mid-run."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dynamo_config, name, limit) < limit:
            setattr(dynamo_config, name, limit)


def _compiled_fn(name: str, fn: Callable) -> Callable:
    """`torch.compile(fn)` once per process (dynamo's guards then cache one graph per shape class)."""
    if name not in _compiled:
        raise_recompile_limit()
        _compiled[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _compiled[name]


def _run_compiled(name: str, fn: Callable, *args) -> object:  # noqa: ANN002 - forwarded as is
    try:
        return _compiled_fn(name, fn)(*args)
    except FlexAttentionUnavailable:
        raise
    except (torch._dynamo.exc.TorchDynamoException,
            torch._dynamo.exc.FailOnRecompileLimitHit) as err:
        raise FlexAttentionUnavailable(
            f"compiling {name} failed ({type(err).__name__}); refusing to fall back to the "
            f"unfused path. Cause: {str(err).splitlines()[0] if str(err) else err!r}"
        ) from err


def compiled_block_mask(
    mask_mod: Callable, batch: int, q_len: int, kv_len: int, device: torch.device
) -> BlockMask:
    """`create_block_mask(mask_mod, batch, None, q_len, kv_len)` through the compiled builder.

    Never materialises the dense (batch, 1, q_len, kv_len) mask.
    """
    return _run_compiled("create_block_mask", _build_block_mask, mask_mod, batch, q_len, kv_len,
                         device)


def compiled_flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float
) -> torch.Tensor:
    """Fused flex attention with GQA: q (B, heads, Q, D), k/v (B, kv_heads, K, D) -> (B, heads, Q, D).

    Keeps the output and a per-query fp32 logsumexp (B, heads, Q) for backward, no scores.
    """
    return _run_compiled("flex_attention", _fused_attention, q, k, v, block_mask, scale)
