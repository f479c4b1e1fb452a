"""Training logs a user watches: s/step beside tokens/s, and the demo's logs written as the
stage runs."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from dspine_train.training.tracking import progress_line
from tests._train_helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import demo  # noqa: E402  (scripts/demo.py)


def test_progress_line_shows_seconds_per_step_beside_tokens_per_second() -> None:
    row = {"loss": 3.14159, "backbone_ce": 2.5, "tokens_per_s": 812.4, "s_per_step": 3.4012,
           "lr": 1e-3, "top1_acc": 0.25}
    line = progress_line(5, 150, row)
    assert line.startswith("step 5/150 | loss 3.1416")
    assert "812 tokens/s | 3.40 s/step" in line


def test_demo_stage_log_is_written_as_the_stage_runs(tmp_path: Path) -> None:
    """The child prints a line, then waits for a file: its line must be in the log by then."""
    log, release = tmp_path / "logs" / "train.log", tmp_path / "release"
    child = ("import pathlib, time\n"
             "print('step 1/2 | loss 1.0')\n"
             f"p = pathlib.Path({str(release)!r})\n"
             "for _ in range(600):\n"
             "    if p.exists(): break\n"
             "    time.sleep(0.05)\n"
             "print('step 2/2 | loss 0.5')\n")
    env = demo.subprocess_env(argparse.Namespace(threads=None))
    runner = threading.Thread(target=demo.run_logged,
                              args=([sys.executable, "-c", child], log, env))
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if log.is_file() and "step 1/2" in log.read_text():
                break
            time.sleep(0.05)
        seen_while_running = log.is_file() and "step 1/2" in log.read_text()
    finally:
        release.touch()
        runner.join(timeout=30)
    assert seen_while_running, "the stage's log stayed empty while the stage ran"
    assert "step 2/2" in log.read_text()
