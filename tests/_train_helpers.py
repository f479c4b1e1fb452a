"""Shared pieces of the trainer tests: the tiny assets, CLI runs and metric readers.

DeepSpeed is slow to start, so the tests share runs: the tiny target and dataset are written
once per test module, and each module runs the trainer as few times as it can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dspine_train.training.tiny_assets import write_synthetic_dataset, write_tiny_target

REPO = Path(__file__).resolve().parents[1]


def train_env() -> dict[str, str]:
    """Environment of a trainer subprocess: offline, the shared DeepSpeed op build, no wandb."""
    env = dict(os.environ)
    env.update(
        # DeepSpeed JIT-builds a CPU comm op (slow); the Makefile keeps it here, built once.
        TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        # Tiny models: one thread each is fastest, and keeps a busy 2-core machine usable.
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a test must not inherit a launcher's world
    return env


def run_module(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python <args>` from the repo root; output captured as text."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=train_env(), capture_output=True, text=True,
        timeout=timeout,
    )


def run_train(overrides: list[str], launch: list[str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py <overrides>`, or under `accelerate launch <launch>` when given."""
    if launch is None:
        return run_module(["train.py", *overrides], timeout)
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", *launch]
    return subprocess.run(
        [*accelerate, str(REPO / "train.py"), *overrides], cwd=REPO, env=train_env(),
        capture_output=True, text=True, timeout=timeout,
    )


def check_ok(proc: subprocess.CompletedProcess) -> None:
    """Fail with the tail of the run's output when it did not exit 0."""
    assert proc.returncode == 0, (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:])


def tiny_overrides(assets: dict[str, Path], output_dir: Path, *extra: str) -> list[str]:
    """The tiny recipe on the session's assets, no progress bar, into `output_dir`."""
    return [
        "recipe=tiny",
        f"output_dir={output_dir}",
        f"model.target_path={assets['target']}",
        f"data.train_path={assets['data']}",
        f"model.token_table_path={assets['token_table']}",
        "logging.progress_bar=false",
        *extra,
    ]


def read_metrics(output_dir: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl."""
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(output_dir: Path) -> dict[int, float]:
    """step -> logged training loss."""
    return {row["step"]: row["loss"] for row in read_metrics(output_dir) if "loss" in row}


@contextmanager
def single_thread() -> Iterator[None]:
    """Tiny tensors: torch's thread pool costs more than it gives (and much more under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_tiny_assets(root: Path) -> dict[str, Path]:
    """The tiny random target and the dataset sampled from it (as the tiny recipe writes them),
    plus where the token table is cached; quick on one thread."""
    target, data = root / "target", root / "data"
    with single_thread():
        write_tiny_target(target, seed=0)
        write_synthetic_dataset(data, target, num_sequences=160, length=64, seed=0)
    return {"root": root, "target": target, "data": data,
            "token_table": root / "token_table.safetensors"}


# The embedded default target's architecture (Qwen2.5-Coder-0.5B-Instruct: 24 layers, H 896), for
# recipes whose target is not on this machine and ships no config under recipes/targets/.
DEFAULT_TARGET = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)


def compose_recipe(*overrides: str):
    """The typed `TrainConfig` that `train.py <overrides>` composes (nothing runs)."""
    from scripts.tools.ablation.study import compose_train_config

    return compose_train_config(overrides)
