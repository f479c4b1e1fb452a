"""What the GPU check script calls, at tiny shapes on CPU: step timings, SDPA backends, and the
teacher-forced agreement of verify vs one-row steps (exact in fp32, near-exact in bf16)."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import build_tiny_target, hf_greedy, tiny_draft

from dspine_train.engine import Engine, GenerationInputError
from scripts.tools.bench.agreement import teacher_forced_agreement
from scripts.tools.bench.engine_profiling import sdpa_backends, time_engine_steps


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiling")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=4, eos_token_id=None
    )
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    return root, hf


def _engine(world, **kwargs) -> Engine:
    root, _ = world
    return Engine.from_pretrained(
        root / "target", root / "draft", max_batch_size=2, max_seq_len=96, eos_token_ids=[],
        **kwargs,
    )


def test_step_timings_cover_every_step_and_leave_the_engine_clean(world):
    _, hf = world
    engine = _engine(world, kv_bucket_size=32)
    report = time_engine_steps(engine, batch=2, g=3, iters=3, context_len=40)
    for key in ("plain_ms", "verify_ms", "draft_ms", "commit_ms"):
        assert report[key] > 0, key
    assert report["kv_len_verify"] == 64 and report["kv_len_draft"] == 64
    with pytest.raises(GenerationInputError):
        time_engine_steps(engine, batch=3)
    prompt = [5, 6, 7]
    assert engine.generate([prompt], max_new_tokens=6, chat=False).token_ids == [
        hf_greedy(hf, prompt, 6)
    ]


def test_sdpa_backends_name_every_call_and_none_is_math(world):
    backends = sdpa_backends(_engine(world), batch=2, g=3)
    assert set(backends) == {"prefill", "verify", "draft"}
    assert all("MATH" not in name for name in backends.values()), backends


def _sequence(length: int) -> list[int]:
    return torch.randint(1, 200, (length,), generator=torch.Generator().manual_seed(4)).tolist()


def test_verify_rows_equal_one_row_steps_in_float32(world):
    report = teacher_forced_agreement(_engine(world), _sequence(64), prefix_len=8, g=7)
    assert report.positions == 56
    assert report.rate == 1.0 and report.margins_at_disagreement == []
    assert report.max_abs_logit_diff < 1e-4


def test_bf16_verify_agrees_with_one_row_steps_except_at_near_ties(world):
    engine = _engine(world, dtype=torch.bfloat16)
    report = teacher_forced_agreement(engine, _sequence(88), prefix_len=8, g=7)
    assert report.positions == 80
    assert report.rate >= 0.95, report
    # Where the argmax flips (on a CPU the two paths usually round alike), the one-row step's
    # top-2 margin is a small fraction of the typical one.
    assert all(m < 0.25 * report.median_margin for m in report.margins_at_disagreement), report
