"""CUDA path of the engine: compiled, graphed steps on fused SDPA kernels, bf16. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import build_tiny_target, hf_greedy, tiny_draft

from dspine_train.engine import Engine
from dspine_train.modeling.sdpa_attention import fused_sdpa_only
from scripts.tools.bench.agreement import teacher_forced_agreement
from scripts.tools.bench.engine_profiling import sdpa_backends, time_engine_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6, eos_token_id=None
    )
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    return root, hf


def _engine(root, **kwargs) -> Engine:
    kwargs.setdefault("dtype", torch.float32)
    return Engine.from_pretrained(
        root / "target", root / "draft", device="cuda", max_batch_size=4, max_seq_len=128,
        eos_token_ids=[], kv_bucket_size=32, **kwargs,
    )


def test_cuda_graphs_greedy_matches_eager_and_transformers(files):
    root, hf = files
    reference = [hf_greedy(hf, p, 16) for p in PROMPTS]
    graphed = _engine(root, cuda_graphs=True, strict_graphs=True)
    eager = _engine(root, cuda_graphs=False, compile=False)
    for engine in (graphed, eager):
        assert engine.generate_ar(PROMPTS, max_new_tokens=16, chat=False).token_ids == reference
        assert engine.generate(PROMPTS, max_new_tokens=16, chat=False).token_ids == reference
        assert engine.generate(PROMPTS[:1], max_new_tokens=16, chat=False).token_ids == reference[:1]
    assert graphed._target_step.enabled and graphed._target_step.compiled
    assert graphed._commit_step.num_captured > 0
    # A second call replays the captured graphs with new inputs.
    out = graphed.generate(PROMPTS[::-1], max_new_tokens=16, chat=False)
    assert out.token_ids == reference[::-1]


def test_warmup_captures_every_shape_before_generation(files):
    root, hf = files
    engine = _engine(root, strict_graphs=True)
    report = engine.warmup(batch_sizes=[1, 4], num_draft_tokens=[0, 7])
    assert report["graphs"] > 0
    captured = engine._capture_seconds()
    out = engine.generate(PROMPTS, max_new_tokens=16, chat=False)
    assert out.token_ids == [hf_greedy(hf, p, 16) for p in PROMPTS]
    assert engine._capture_seconds() == captured, "generation captured a shape warmup missed"
    assert out.stats.capture_s == 0.0


@pytest.mark.parametrize("tree_paths", [1, 4])
def test_sampling_rounds_replay_captured_steps_only(files, tree_paths):
    """At T > 0 the sampling draft (chain) or the tree's sampling verify step (acceptance and
    compaction inside) is captured by `warmup(temperature=...)`; generation captures nothing
    more, and reproduces itself for a seed."""
    root, _ = files
    engine = _engine(root, strict_graphs=True, tree_paths=tree_paths)
    engine.warmup(batch_sizes=[4], num_draft_tokens=[7], temperature=0.8, top_p=0.9)
    if tree_paths == 1:
        assert engine._draft_sample_step.num_captured > 0
    captured = engine._capture_seconds()
    settings = dict(max_new_tokens=16, chat=False, temperature=0.8, top_p=0.9, seed=1)
    first = engine.generate(PROMPTS, **settings)
    assert engine._capture_seconds() == captured, "generation captured a shape warmup missed"
    assert first.stats.capture_s == 0.0
    assert engine.generate(PROMPTS, **settings).token_ids == first.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_call_runs_on_a_fused_kernel(files, dtype):
    root, _ = files
    engine = _engine(root, dtype=dtype, strict_graphs=True)
    backends = sdpa_backends(engine, batch=4, g=7, strict=True)
    assert set(backends) == {"prefill", "verify", "draft"}
    assert all(name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION") for name in backends.values())
    with fused_sdpa_only():  # the math kernel is excluded: an unsupported call would raise
        out = engine.generate(PROMPTS, max_new_tokens=8, chat=False)
    assert all(len(t) == 8 for t in out.token_ids)


def test_step_timings_run_on_cuda_events(files):
    root, _ = files
    engine = _engine(root, dtype=torch.bfloat16, strict_graphs=True)
    report = time_engine_steps(engine, batch=4, g=7, iters=5, context_len=64)
    assert report["graphs"] and report["compiled"]
    for key in ("plain_ms", "verify_ms", "draft_ms", "commit_ms"):
        assert report[key] > 0, key


def test_bf16_verify_agrees_with_one_row_steps_except_at_near_ties(files):
    """Token identity between a multi-row verify and a one-row step is not guaranteed in bf16
    (near-ties); the teacher-forced argmax agreement is, and flips sit at tiny margins."""
    root, _ = files
    engine = _engine(root, dtype=torch.bfloat16, strict_graphs=True)
    tokens = torch.randint(1, 200, (120,), generator=torch.Generator().manual_seed(0))
    report = teacher_forced_agreement(engine, tokens, prefix_len=8, g=7)
    assert report.rate >= 0.95, report
    assert all(m < 0.25 * report.median_margin for m in report.margins_at_disagreement), report
    sampled = engine.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=3, chat=False)
    assert all(len(t) == 8 for t in sampled.token_ids)
