"""Teacher-forced agreement of a multi-row verify with one-row plain steps (bf16 losslessness).

Greedy speculative decoding is token-identical to plain decoding when the target computes the
same logits for a position whether it is one row of a `g + 1`-token verify or a one-token step.
In float32 it does (to rounding far below any argmax margin; the exactness tests assert token
identity). In bf16 the two forwards round differently (different GEMM shapes, different
attention kernels), so a near-tie can flip: identity is not guaranteed, and the property to
check is that the argmax agrees almost everywhere and flips only where the top-2 margin is tiny.

    report = teacher_forced_agreement(engine, tokens, prefix_len=16, g=7)
    report.rate, report.margins_at_disagreement

Both passes feed the same fixed sequence (teacher forcing, so one flip never changes what follows)
through the engine's own step (compiled and graphed on CUDA), at the same kv buckets as decoding.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from dspine_train.engine.errors import GenerationInputError

if TYPE_CHECKING:
    from dspine_train.engine import Engine


@dataclass
class AgreementReport:
    """Argmax agreement over `positions` teacher-forced positions.

    margins_at_disagreement: top-1 minus top-2 logit of the one-row step where the argmaxes
    differ; median_margin: the same margin's median over every position (the scale to compare
    with); max_abs_logit_diff: largest |verify - one-row| logit difference seen.
    """

    positions: int
    agreements: int
    rate: float
    margins_at_disagreement: list[float]
    median_margin: float
    max_abs_logit_diff: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def teacher_forced_agreement(
    engine: Engine, tokens: Sequence[int] | torch.Tensor, prefix_len: int, g: int
) -> AgreementReport:
    """Run `tokens` through the engine's target after a prefill of the first `prefix_len`:
    once as verifies of `g + 1` rows, once one token per step; compare the argmaxes."""
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten().tolist()
    width = g + 1
    usable = (len(ids) - prefix_len) // width * width
    if g < 0 or prefix_len < 1 or usable < width or len(ids) > engine.max_seq_len:
        raise GenerationInputError(
            f"teacher_forced_agreement: {len(ids)} tokens (<= max_seq_len={engine.max_seq_len}) "
            f"must hold a prefix of {prefix_len} >= 1 and at least one block of g + 1 = {width}"
        )
    ids = ids[: prefix_len + usable]
    with torch.inference_mode():
        verify = _teacher_forced_logits(engine, ids, prefix_len, width)
        single = _teacher_forced_logits(engine, ids, prefix_len, 1)
        engine.target.cache.reset(engine.max_batch_size)
    agree = verify.argmax(-1) == single.argmax(-1)  # (N,)
    top2 = single.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    return AgreementReport(
        positions=int(agree.numel()),
        agreements=int(agree.sum()),
        rate=float(agree.float().mean()),
        margins_at_disagreement=margins[~agree].tolist(),
        median_margin=statistics.median(margins.tolist()),
        max_abs_logit_diff=float((verify - single).abs().max()),
    )


def _teacher_forced_logits(engine: Engine, ids: list[int], prefix_len: int, width: int) -> torch.Tensor:
    """Float32 logits `(N, V)` of positions prefix_len .. len(ids) - 1, `width` tokens a step."""
    device = engine.device
    sequence = torch.tensor([ids], device=device)  # (1, S)
    cache = engine.target.cache
    cache.reset(1)
    engine.target(sequence[:, :prefix_len], kv_len=prefix_len, prefill=True)
    out = []
    for start in range(prefix_len, len(ids), width):
        cache.lengths[:1].fill_(start)  # commit everything before this block
        block = sequence[:, start : start + width]
        kv = engine._bucket(start + width, engine.max_seq_len)
        engine._target_step.prepare(block, kv_len=kv)
        _, logits = engine._target_step(block, kv_len=kv)
        out.append(logits[0].clone())  # graph outputs are overwritten by the next replay
    return torch.cat(out, dim=0).float()
