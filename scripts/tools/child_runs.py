"""Child processes of the demo, the studies and the tests: one offline environment and one
logged run (output saved to a log as it comes, echoed live)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from scripts.tools import REPO

# What a launcher (accelerate, torchrun, Slurm) sets for its world: a child that inherits it
# would join that world instead of running on its own.
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


def offline_env(threads: int | None = None, *, drop_launcher: bool = False) -> dict[str, str]:
    """`os.environ` for a child run: nothing downloaded (Hub, datasets, transformers), wandb
    offline unless set, the shared DeepSpeed op build, the repository importable, output
    unbuffered (a child's prints reach its log as they happen), `threads` OpenMP threads when
    given, and without a launcher's world when `drop_launcher`."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.setdefault("WANDB_MODE", "offline")
    # DeepSpeed JIT-builds a CPU comm op once; kept where the Makefile and the tests keep it.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if drop_launcher:
        for key in LAUNCHER_KEYS:
            env.pop(key, None)
    return env


def run_logged(command: Sequence[str], log: Path, what: str, *,
               env: dict[str, str] | None = None, echo: bool = True,
               error: Callable[[str], Exception] = RuntimeError) -> None:
    """Run `command` from the repository root, its output appended to `log` as it comes (each
    chunk flushed: the log can be followed while it runs; a resumed run keeps the log of its
    interrupted session) and echoed live unless `echo` is False.

    Raises `error(message)`, naming `what`, the exit code, the log and its last lines, when
    the command exits non-zero.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    env = offline_env() if env is None else env
    with log.open("ab") as saved:
        saved.write(f"$ {subprocess.list2cmdline(list(command))}\n".encode())
        saved.flush()
        if echo:
            print("$ " + " ".join(command), flush=True)
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        assert proc.stdout is not None  # PIPE above
        # Raw chunks, not lines: tqdm redraws its bar with carriage returns.
        while chunk := proc.stdout.read1(4096):
            saved.write(chunk)
            saved.flush()
            if echo:
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
        code = proc.wait()
    if code != 0:
        tail = log.read_bytes()[-2000:].decode("utf-8", "replace")
        raise error(f"{what} failed (exit {code}); its output is in {log}\n{tail}")
