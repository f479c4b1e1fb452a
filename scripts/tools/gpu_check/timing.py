"""Section 5 of the GPU check: step timings, the speed-up they imply, syncs and kernels per round."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from dspine_train.engine import Engine
from scripts.tools.bench.engine_profiling import time_engine_steps
from scripts.tools.gpu_check.context import Check, Figures


def section_timings(ck: Check, fig: Figures) -> None:
    timing = ck.timing_engine()
    engine = timing["engine"]
    fig["iters"] = ck.iters
    fig["timer"] = "cuda events (median)" if ck.cuda else "perf_counter (median)"
    ms, fig["timed_by"] = step_times(ck, engine)
    fig["ms"] = ms
    t_ar = ms["plain_step"] + ms["commit"]
    speedup = {}
    for g in (3, 7, 15):
        t_round = ms["draft_step"] + ms[f"verify_{g + 1}"] + ms["commit"]
        speedup[f"g{g}"] = {f"tau{tau}": round(tau * t_ar / t_round, 3)
                            for tau in range(3, 7) if tau <= g + 1}
    fig["speedup_estimate"] = speedup
    if ck.cuda:
        fig["per_round"] = round_counters(ck, engine)
        fig.expect(fig["per_round"]["host_syncs"] <= 1.0,
                   f"{fig['per_round']['host_syncs']:.2f} host syncs per round (expected <= 1: "
                   "one read of the acceptance result)")
    else:
        fig["per_round"] = "CUDA only (sync debug mode, CUDA kernels)"
    for name, value in ms.items():
        fig.expect(value > 0 and math.isfinite(value), f"timing {name} is {value}")


def step_times(ck: Check, engine: Engine) -> tuple[dict[str, float], str]:
    """Median ms of a plain step, verify at g + 1 in {4, 8, 16}, a draft step and a commit (batch
    1), by `time_engine_steps` (the engine benchmark's own step timer)."""
    ms: dict[str, float] = {}
    for g in (3, 7, 15):
        steps = time_engine_steps(engine, batch=1, g=g, iters=ck.iters)
        ms[f"verify_{g + 1}"] = round(steps["verify_ms"], 4)
        if g == 15:
            ms.update(plain_step=round(steps["plain_ms"], 4), draft_step=round(steps["draft_ms"], 4),
                      commit=round(steps["commit_ms"], 4))
    return ms, "scripts.tools.bench.engine_profiling.time_engine_steps"


def round_counters(ck: Check, engine: Engine) -> dict[str, Any]:
    """Host syncs (sync debug mode warnings) and CUDA kernels per speculative round.

    A run that stops after the prefill is measured the same way and subtracted, so the figures
    are the rounds' own.
    """
    from torch.profiler import ProfilerActivity, profile

    prompt = [list(range(5, 69))]

    def syncs_of(new_tokens: int) -> tuple[int, int, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = engine.generate(prompt, max_new_tokens=new_tokens, num_draft_tokens=15)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        return len(found), out.stats.steps, found

    def device_ops_of(new_tokens: int) -> tuple[int, int]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompt, max_new_tokens=new_tokens, num_draft_tokens=15)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copies = sum(n.lower().startswith(("memcpy", "memset")) for n in names)
        return len(names) - copies, copies

    base_syncs, _, _ = syncs_of(1)
    full_syncs, rounds, messages = syncs_of(64)
    base_kernels, base_copies = device_ops_of(1)
    full_kernels, full_copies = device_ops_of(64)
    rounds = max(rounds, 1)
    return dict(
        rounds=rounds, host_syncs=(full_syncs - base_syncs) / rounds,
        prefill_host_syncs=base_syncs,
        kernels=(full_kernels - base_kernels) / rounds,
        copies_and_memsets=(full_copies - base_copies) / rounds,
        sync_messages=sorted({m.splitlines()[0][:120] for m in messages})[:5],
    )
