"""What a GPU check measures about an engine: per-step latency and the SDPA backend of each call.

    report = time_engine_steps(engine, batch=1, g=7, iters=50)   # median ms per step
    backends = sdpa_backends(engine)                             # {"prefill": "FLASH_ATTENTION", ...}

Both run on CPU too (perf_counter instead of CUDA events), so the check script is tested in CI.
Steps are timed the way the loop runs them (compiled and graphed on CUDA), after `prepare` has
captured them: capture is never inside a timing. The engine's caches are left reset.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from dspine_train.engine.errors import GenerationInputError
from dspine_train.engine.stats import median_ms
from dspine_train.modeling.sdpa_attention import fused_sdpa_only, record_sdpa_backends

if TYPE_CHECKING:
    from dspine_train.engine import Engine


def time_engine_steps(
    engine: Engine,
    batch: int = 1,
    g: int | None = None,
    iters: int = 50,
    context_len: int = 128,
) -> dict[str, Any]:
    """Median milliseconds of one plain step, one verify of g + 1 tokens, one greedy draft step
    and one commit step, for `batch` sequences with `context_len` committed positions each.

    Without a draft only `plain_ms` is measured. CUDA events time each call on the device;
    on CPU it is `perf_counter`. The commit restores the lengths it advanced after each call
    (outside the timing), so every iteration commits the same round.
    """
    g = engine.num_predictions if g is None else int(g)
    need = context_len + max(g + 1, engine.block_size)
    if not 1 <= batch <= engine.max_batch_size or need > engine.max_seq_len or iters < 1:
        raise GenerationInputError(
            f"time_engine_steps: batch={batch} (max {engine.max_batch_size}), context_len="
            f"{context_len} + a block needs {need} <= max_seq_len={engine.max_seq_len}, iters >= 1"
        )
    report: dict[str, Any] = dict(
        device=str(engine.device), batch=batch, g=g, context_len=context_len, iters=iters,
        graphs=engine._target_step.enabled, compiled=engine._target_step.compiled,
    )
    with torch.inference_mode():
        _fill_context(engine, batch, context_len)
        plain = torch.zeros(batch, 1, dtype=torch.long, device=engine.device)
        kv = engine._bucket(context_len + 1, engine.max_seq_len)
        report["plain_ms"] = _median_ms(engine, lambda: engine._target_step(plain, kv_len=kv),
                                        iters, prepare=lambda: engine._target_step.prepare(
                                            plain, kv_len=kv))
        if engine.draft is not None and g > 0:
            block = torch.zeros(batch, g + 1, dtype=torch.long, device=engine.device)
            kv = engine._bucket(context_len + g + 1, engine.max_seq_len)
            report["kv_len_verify"] = kv
            report["verify_ms"] = _median_ms(
                engine, lambda: engine._target_step(block, kv_len=kv), iters,
                prepare=lambda: engine._target_step.prepare(block, kv_len=kv),
            )
            anchors = torch.zeros(batch, dtype=torch.long, device=engine.device)
            draft_kv = engine._bucket(context_len + engine.block_size, engine._draft_capacity())
            report["kv_len_draft"] = draft_kv
            report["draft_ms"] = _median_ms(
                engine, lambda: engine._draft_step(anchors, kv_len=draft_kv), iters,
                prepare=lambda: engine._draft_step.prepare(anchors, kv_len=draft_kv),
            )
            features, _ = engine._target_forward(block, kv_len=kv)
            accepted = torch.full((batch,), g, dtype=torch.long, device=engine.device)
            engine._active[:batch].fill_(True)
            engine._running[:batch].fill_(True)
            saved = [t.clone() for t in engine._commit_state()]

            def restore() -> None:
                for tensor, value in zip(engine._commit_state(), saved, strict=True):
                    tensor.copy_(value)

            report["commit_ms"] = _median_ms(
                engine, lambda: engine._commit_step(accepted, features), iters,
                prepare=lambda: engine._commit_step.prepare(accepted, features), after=restore,
            )
        engine.target.cache.reset(engine.max_batch_size)
    return report


def sdpa_backends(
    engine: Engine, batch: int = 2, g: int | None = None, context_len: int = 16, strict: bool = True
) -> dict[str, str]:
    """The SDPA backend each engine attention call selects: `{"prefill", "verify"[, "draft"]}`
    -> backend name ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", ...; several joined by ",").

    The calls run eagerly at the engine's dtype and device. With `strict` they run under
    `fused_sdpa_only()`, so a call that would need the math kernel raises instead.
    """
    g = engine.num_predictions if g is None else int(g)
    calls: list[tuple[str, str]]
    with torch.inference_mode(), record_sdpa_backends() as calls:
        context = fused_sdpa_only() if strict else nullcontext()
        with context:
            _fill_context(engine, batch, context_len)
            block = torch.zeros(batch, g + 1, dtype=torch.long, device=engine.device)
            engine.target(block, kv_len=engine._bucket(context_len + g + 1, engine.max_seq_len))
            if engine.draft is not None:
                anchors = torch.zeros(batch, dtype=torch.long, device=engine.device)
                kv = engine._bucket(context_len + engine.block_size, engine._draft_capacity())
                engine.draft.draft_forward(engine.draft_cache, anchors, kv)
        engine.target.cache.reset(engine.max_batch_size)
    found: dict[str, list[str]] = {}
    for label, backend in calls:
        if backend not in found.setdefault(label, []):
            found[label].append(backend)
    return {label: ",".join(names) for label, names in found.items()}


def _fill_context(engine: Engine, batch: int, context_len: int) -> None:
    """Prefill `batch` rows of `context_len` tokens (target cache and draft context)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.target.config.vocab_size, (batch, context_len), generator=gen)
    ids = ids.to(engine.device)
    lengths = torch.full((batch,), context_len, dtype=torch.long, device=engine.device)
    engine.target.cache.reset(batch)
    out = engine.target(ids, kv_len=context_len, prefill=True)
    engine.target.cache.crop(lengths)
    if engine.draft is not None:
        engine.draft_cache = engine._draft_cache_for(batch)
        engine.draft.crop_context(engine.draft_cache, torch.zeros_like(lengths))
        engine.draft.append_context(engine.draft_cache, out.features, lengths)


def _median_ms(
    engine: Engine,
    call: Callable[[], object],
    iters: int,
    prepare: Callable[[], None],
    after: Callable[[], None] | None = None,
) -> float:
    prepare()  # compile / capture outside the timing
    call()  # one untimed run (caches, allocator)
    if after is not None:
        after()
    return median_ms(call, engine.device, iters, after)
