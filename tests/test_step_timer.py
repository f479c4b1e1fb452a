"""The one device timer (`dspine_train.engine.stats`) on CPU: what it times, and what it leaves out.

A fake `perf_counter` makes every duration known, so the figures are checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from dspine_train.engine import stats
from dspine_train.engine.stats import StepTimer, median_ms, time_calls

CPU = torch.device("cpu")


class _Clock:
    """A `perf_counter` stand-in that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(stats.time, "perf_counter", fake)
    return fake


def test_each_call_is_one_sample_and_after_is_outside_the_timing(clock: _Clock) -> None:
    durations = iter([1.0, 5.0, 2.0])
    calls = []

    def fn() -> None:
        calls.append("fn")
        clock.advance(next(durations))

    def restore() -> None:
        calls.append("after")
        clock.advance(100.0)  # must not show in any sample

    assert time_calls(fn, CPU, 3, after=restore) == [1.0, 5.0, 2.0]
    assert calls == ["fn", "after"] * 3


def test_median_ms_is_the_median_call_in_milliseconds(clock: _Clock) -> None:
    durations = iter([0.004, 0.001, 0.003, 0.010])
    assert median_ms(lambda: clock.advance(next(durations)), CPU, 4) == pytest.approx(3.5)


def test_sections_keep_every_sample_and_totals_sum_them(clock: _Clock) -> None:
    timer = StepTimer(CPU)
    for draft_s, verify_s in ((0.5, 2.0), (1.5, 3.0)):  # two rounds, interleaved sections
        with timer.section("draft"):
            clock.advance(draft_s)
        clock.advance(10.0)  # between sections: not timed
        with timer.section("verify"):
            clock.advance(verify_s)
    assert timer.samples() == {"draft": [0.5, 1.5], "verify": [2.0, 3.0]}
    assert timer.totals() == {"draft": 2.0, "verify": 5.0}


def test_real_clock_on_cpu_measures_the_body() -> None:
    import time

    samples = time_calls(lambda: time.sleep(0.02), CPU, 2)
    assert len(samples) == 2 and all(s >= 0.02 for s in samples)
