"""Where a training step's time goes: timed wrappers around the step's parts, and a FLOP plan.

`StepProfile` wraps, for one profiled step, the functions that make each part of the DSpine
step (the draft's layers, its vocabulary projection, the target's distribution, the
refinement scores, the alignment cosines) with timers that record *exclusive* wall time
(a part called inside another is subtracted from it), plus the backward and optimizer phases
the caller marks. Parts recomputed in backward (activation checkpointing of the reference
path) are counted under their own name, not under backward. Used by `scripts/bench_train.py`;
the wrappers cost microseconds, and the bench times its ratios on unwrapped steps.

`flop_plan` is the same split counted in multiply-adds from a config's shapes, for shapes too
large to run here (the `qwen3_8b` recipe on a CPU): what a GPU's time is close to.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dspine_train import objective, vocab_loss
from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.training import draft_step

from . import reference_objective

PARTS = ("draft layers (forward)", "draft vocabulary projection", "target distribution",
         "refinement", "alignment", "objective (rest)", "backward (rest)", "optimizer")


class StepProfile:
    """Exclusive wall time (s) per part of one or more profiled steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._stack: list[list[float]] = []  # [start, time spent in nested parts]

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as `name`, minus the parts timed inside it."""
        self._stack.append([time.perf_counter(), 0.0])
        try:
            yield
        finally:
            start, nested = self._stack.pop()
            elapsed = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - nested
            if self._stack:
                self._stack[-1][1] += elapsed

    def _wrap(self, fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - any signature
            with self.part(name):
                return fn(*args, **kwargs)
        return timed

    @contextmanager
    def patched(self, draft: DSpineDraftModel) -> Iterator[StepProfile]:
        """Within the block, the step's parts of `draft` and of the objective are timed."""
        patches = [
            (draft, "forward", "draft layers (forward)"),
            (draft, "target_logits", "target distribution"),
            (draft, "refined_scores", "refinement"),
            (objective, "full_vocab_terms", "draft vocabulary projection"),
            (objective, "backbone_vocab_terms", "draft vocabulary projection"),
            (draft_step, "dspine_loss", "objective (rest)"),
            (reference_objective, "reference_dspine_loss", "objective (rest)"),
            (vocab_loss.TargetDistribution, "at", "target distribution"),
            (objective.F, "cosine_similarity", "alignment"),
        ]
        saved = []
        for owner, attr, name in patches:
            saved.append((owner, attr, vars(owner).get(attr), attr in vars(owner)))
            setattr(owner, attr, self._wrap(getattr(owner, attr), name))
        try:
            yield self
        finally:
            for owner, attr, original, had in reversed(saved):
                if had:
                    setattr(owner, attr, original)
                else:
                    delattr(owner, attr)

    def milliseconds(self, steps: int = 1) -> dict[str, float]:
        """Per-step milliseconds of every part (averaged over `steps` profiled steps)."""
        return {name: 1e3 * s / steps for name, s in self.seconds.items()}


def flop_plan(config: DSpineConfig, seq_len: int, num_anchors: int, batch: int,
              vocab: int | None = None, target_distribution: bool = True,
              recompute: bool = True) -> dict[str, float]:
    """Multiply-adds (forward + backward) per part of one step, from the shapes alone.

    Forward x backward factor 3 for trained matmuls (1 forward, 2 backward), 2 for ones with
    only an input gradient (the frozen head: 1 + 1, plus 1 more when `recompute`, the
    checkpointed reference path). `vocab`: the draft's vocabulary rows (pruned or full).
    """
    h, r, m = config.hidden_size, config.transfer_dim, config.message_size
    inter, layers, bk = config.intermediate_size, config.num_layers, config.block_size
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    v = vocab or config.vocab_size
    slots = batch * num_anchors * (bk - 1)
    block_tokens = batch * num_anchors * bk
    ctx_tokens = batch * seq_len
    per_token_layer = h * (heads * hd) * 2 + h * (kv * hd) * 2 + 3 * h * inter  # q,o,k,v + MLP
    # scores + values against the whole context: the dense CPU mask's cost (an upper bound for
    # the sparse flex attention on a GPU, which skips the masked context)
    attention = block_tokens * heads * hd * 2 * (seq_len + bk)
    layers_macs = 3 * (layers * (block_tokens * per_token_layer + ctx_tokens * h * kv * hd * 2
                                 + attention)
                       + ctx_tokens * config.num_context_layers * h * h)  # + the fc fusion
    injection = 3 * layers * block_tokens * (2 * h * r + 2 * r * m + m * h)
    head_passes = 3 if recompute else 2
    plan = {
        "draft layers and injection": layers_macs + injection,
        "draft vocabulary projection": head_passes * slots * v * h,
        "target distribution": (2 if recompute else 1) * slots * v * h if target_distribution
        else slots * config.candidate_k * h,
        "refinement": 3 * slots * (config.candidate_k * h + h * r + r * m + m * h),
        "alignment": layers * slots * r,
    }
    return plan


def describe_plan(plan: dict[str, float]) -> str:
    """One line per part: GMACs and share of the step."""
    total = sum(plan.values())
    return "\n".join(f"  {name:<30} {macs / 1e9:>10.1f} GMAC {100 * macs / total:>6.1f}%"
                     for name, macs in plan.items())
