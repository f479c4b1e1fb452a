"""Getting an engine ready before anything is timed: capture its steps, measure its rounds.

`warm_up` compiles and captures every step at the shapes a run will meet (CUDA) or runs each
once (CPU); `calibrate` times one round of each shape the round planner chooses among
(`engine.round_planner`). Both leave the engine's committed state as they found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dspine_train.engine.decode_loop import round_of
from dspine_train.engine.request_checks import check_sampling, check_warmup
from dspine_train.engine.round_planner import RoundCosts
from dspine_train.engine.sampling import Sampler
from dspine_train.engine.stats import StepTimer, median_ms

if TYPE_CHECKING:
    from dspine_train.engine.engine import Engine


def warm_up(
    engine: Engine,
    batch_sizes: Sequence[int] = (1,),
    num_draft_tokens: Sequence[int] | int | None = None,
    kv_buckets: Sequence[int] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict[str, float | int]:
    """Compile and capture every step at these shapes before anything is timed.

    `batch_sizes` in 1..max_batch_size; `num_draft_tokens` the g values (0 is plain
    decoding; default: 0 and the draft's predictions per block, 0 without); `kv_buckets` values
    of `kv_buckets()` (default: all of them). On CPU, where nothing is captured, it checks
    the arguments and runs each step once eagerly at the smallest bucket. Returns the number
    of captured graphs and the seconds it took. The greedy steps always; with `temperature`
    > 0 the sampling draft and (trees) the sampling verify step at `top_p` too (one capture
    serves every temperature; the tree's serves one `top_p`). With `tree_paths` > 1 or
    `ngram`, the tree (and hybrid) draft and verify steps of every round shape are captured
    too, and with `adaptive` the round costs are measured (`calibrate`).
    """
    sizes, gs, buckets = check_warmup(
        batch_sizes, num_draft_tokens, kv_buckets, max_batch_size=engine.max_batch_size,
        max_draft_tokens=engine.num_predictions,
        valid_buckets=engine.kv_buckets(), kv_bucket_size=engine.kv_bucket_size,
        max_seq_len=engine.max_seq_len)
    check_sampling(temperature, top_p, "warmup ")
    sampling = temperature > 0.0
    if not engine._target_step.enabled:
        buckets = buckets[:1]  # nothing to capture: one eager pass per shape validates it
    before = engine._capture_seconds()
    with torch.inference_mode():
        for batch in sizes:
            engine.target.cache.reset(batch)
            engine._active[:batch].fill_(False)  # commits during capture leave lengths at 0
            engine._running[:batch].fill_(False)
            if engine.draft is not None:
                engine.draft_cache = engine._draft_cache_for(batch)
                engine.draft.crop_context(engine.draft_cache, engine.target.cache.lengths[:batch])
            # The chains verified: plain steps and the draft's chains (g in gs), and the n-gram
            # branch alone (its widths); a round commits the verified features where a draft
            # runs beside it (a speculative call with a draft), not in plain decoding.
            alone = engine.draft is None or engine.adaptive  # else n-gram rounds are hybrid
            chains = sorted(set(gs) | set((engine.ngram_widths() or []) if alone else []))
            for g in chains:
                block = torch.zeros(batch, g + 1, dtype=torch.long, device=engine.device)
                fits = [b for b in buckets if b >= g + 1] or [engine.max_seq_len]
                for kv in fits:
                    engine._target_step.prepare(block, kv_len=kv)
                features, _ = engine._target_forward(block, kv_len=fits[0])
                num_accepted = torch.zeros(batch, dtype=torch.long, device=engine.device)
                variants = []
                if engine.draft is None or (g == 0 and 0 in gs):
                    variants.append((num_accepted,))
                if engine.draft is not None and (g > 0 or engine.adaptive):
                    variants.append((num_accepted, features))
                for commit_inputs in variants:
                    engine._commit_step.prepare(*commit_inputs)
                    if not engine._commit_step.enabled:
                        engine._commit_step(*commit_inputs)
            if engine.draft is not None and any(g > 0 for g in gs):
                anchors = torch.zeros(batch, dtype=torch.long, device=engine.device)
                draft_steps = [(engine._draft_step, (anchors,))]
                if sampling:  # any Exp(1) values and temperature do for a capture
                    shape = (batch, engine.num_predictions, engine.draft.num_candidates)
                    noise = torch.ones(shape, device=engine.device)
                    scale = torch.ones((), device=engine.device)
                    draft_steps.append((engine._draft_sample_step, (anchors, noise, scale)))
                for kv in engine._draft_buckets(buckets):
                    for step, inputs in draft_steps:
                        step.prepare(*inputs, kv_len=kv)
                        if not step.enabled:
                            step(*inputs, kv_len=kv)
            for g in gs:
                for shape in engine.round_shapes(g):
                    if not shape.tree:
                        continue
                    fits = [b for b in buckets if b >= shape.nodes + 1] or [engine.max_seq_len]
                    budget = dict(
                        paths=engine.tree_paths, nodes=shape.nodes, depth=shape.draft_depth
                    )
                    width = engine.ngram.num_tokens if shape.ngram else 0
                    engine._tree.warmup(
                        batch, budget, engine._draft_buckets(buckets), fits, temperature,
                        top_p, ngram_width=width,
                    )
        engine.target.cache.reset(engine.max_batch_size)
    if engine.adaptive:
        for batch in sizes:
            for g in gs if engine.draft is None else [g for g in gs if g > 0]:
                calibrate(engine, batch, g)
    captured = sum(s.num_captured for s in engine._steps())
    return {"graphs": captured, "capture_s": engine._capture_seconds() - before}


def calibrate(engine: Engine, batch: int, num_draft_tokens: int, repeats: int = 3) -> RoundCosts:
    """Measure the seconds of one round of each shape (`round_shapes`) for `batch`
    sequences: the median of `repeats` greedy rounds on an empty context, after one
    untimed run (which compiles and captures on CUDA). Cached per (batch, g); what the
    rounds write lies past the committed lengths, where nothing reads it."""
    key = (batch, num_draft_tokens)
    if key in engine._costs:
        return engine._costs[key]
    shapes = engine.round_shapes(num_draft_tokens)
    width = engine.ngram.num_tokens if engine.ngram is not None else 0
    proposals = [(list(range(1, width + 1)), 1)] * batch  # full length: every width is timed
    sampler = Sampler(0.0, 1.0, torch.Generator(engine.device).manual_seed(0))
    timer = StepTimer(engine.device)  # the rounds' own sections; discarded
    seconds: dict[str, float] = {}
    with torch.inference_mode():
        engine.target.cache.reset(batch)
        if engine.draft is not None:
            engine.draft_cache = engine._draft_cache_for(batch)
            engine.draft.crop_context(engine.draft_cache, engine.target.cache.lengths[:batch])
        anchors = torch.zeros(batch, dtype=torch.long, device=engine.device)
        for shape in shapes:
            def one_round(shape=shape):
                round_of(engine, shape, anchors, 1, proposals, sampler, timer)

            one_round()  # untimed: compiles and captures on CUDA
            seconds[shape.key] = median_ms(one_round, engine.device, repeats) / 1e3
        engine.target.cache.reset(engine.max_batch_size)
    engine._costs[key] = RoundCosts(seconds, batch)
    return engine._costs[key]

