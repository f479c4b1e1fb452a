"""Training logs a user watches: s/step beside tokens/s, and the demo's logs written as the
stage runs."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from dspine_train.training.tracking import progress_line
from scripts.tools.child_runs import offline_env, run_logged


def test_progress_line_shows_seconds_per_step_beside_tokens_per_second() -> None:
    row = {"loss": 3.14159, "backbone_ce": 2.5, "tokens_per_s": 812.4, "s_per_step": 3.4012,
           "lr": 1e-3, "top1_acc": 0.25}
    line = progress_line(5, 150, row)
    assert line.startswith("step 5/150 | loss 3.1416")
    assert "812 tokens/s | 3.40 s/step" in line


def test_a_stage_log_is_written_as_the_stage_runs(tmp_path: Path) -> None:
    """The child prints a line, then waits for a file: its line must be in the log by then."""
    log, release = tmp_path / "logs" / "train.log", tmp_path / "release"
    child = ("import pathlib, time\n"
             "print('step 1/2 | loss 1.0')\n"
             f"p = pathlib.Path({str(release)!r})\n"
             "for _ in range(600):\n"
             "    if p.exists(): break\n"
             "    time.sleep(0.05)\n"
             "print('step 2/2 | loss 0.5')\n")
    runner = threading.Thread(target=run_logged,
                              args=([sys.executable, "-c", child], log, "the child"))
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


def test_a_failed_stage_names_itself_its_exit_code_and_its_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "features.log"
    child = "import sys; print('cannot read the target'); sys.exit(3)"

    class StageError(RuntimeError):
        pass

    with pytest.raises(StageError) as err:
        run_logged([sys.executable, "-c", child], log, "caching the target features",
                   echo=False, error=StageError)
    message = str(err.value)
    assert message.startswith("caching the target features failed (exit 3)")
    assert str(log) in message and "cannot read the target" in message  # the log's last lines
    assert "cannot read the target" in log.read_text()


def test_child_runs_are_offline_and_outside_a_launchers_world(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("RANK", "3")
    env = offline_env(threads=2, drop_launcher=True)
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["OMP_NUM_THREADS"] == "2" and "RANK" not in env
    assert offline_env()["RANK"] == "3"  # kept unless asked: a launched study stays launched
