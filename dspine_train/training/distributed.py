"""accelerate + DeepSpeed setup: the DeepSpeed JSON of the recipe and the `Accelerator`.

Facts this module encodes (all observed with accelerate 1.15 / DeepSpeed 0.19.8):

* Without a GPU the process group must use gloo (`InitProcessGroupKwargs(backend="gloo")`),
  or a DeepSpeed run silently misreports its world.
* A plain `python train.py` has no launcher environment; accelerate's DeepSpeed path then finds
  no process group. We fill in a one-process world (RANK=0, WORLD_SIZE=1, a free local port)
  so the same DeepSpeed code path runs with or without `accelerate launch`.
* DeepSpeed JIT-builds a CPU communication op on first use (about a minute); set
  TORCH_EXTENSIONS_DIR to keep the build between runs (the Makefile does).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from ..recipe_files import resolve_recipe_path
from .config import Precision, TrainConfig
from .errors import TrainingError


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_process_group_env() -> None:
    """Describe a one-process world in the environment when no launcher did."""
    if "LOCAL_RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()),
    )


def deepspeed_config(config: TrainConfig) -> dict[str, Any]:
    """The recipe's DeepSpeed JSON with every "auto" field filled in from the schema."""
    path = resolve_recipe_path(config.deepspeed.config_file)
    try:
        ds = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise TrainingError(f"deepspeed.config_file: cannot read {path}: {err}") from err
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage", config.deepspeed.stage) != config.deepspeed.stage:
        raise TrainingError(
            f"deepspeed.stage is {config.deepspeed.stage} but {path} sets "
            f"zero_optimization.stage {zero['stage']}"
        )
    zero["stage"] = config.deepspeed.stage
    if config.deepspeed.stage == 3:
        # Without it ZeRO-3 cannot hand back full weights for the export.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds["train_micro_batch_size_per_gpu"] = config.data.batch_size
    ds["gradient_accumulation_steps"] = config.optim.grad_accum_steps
    ds["gradient_clipping"] = config.optim.max_grad_norm
    ds["bf16"] = {"enabled": config.precision == Precision.bf16}
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world
    ds.pop("optimizer", None)  # the trainer's AdamW and schedule are the ones used
    ds.pop("scheduler", None)
    return ds


def build_accelerator(config: TrainConfig) -> Accelerator:
    """An `Accelerator` driving DeepSpeed with the recipe's settings (see the module docstring)."""
    ensure_process_group_env()
    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(config), zero3_init_flag=False)
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(
        deepspeed_plugin=plugin,
        mixed_precision="bf16" if config.precision == Precision.bf16 else "no",
        kwargs_handlers=handlers,
        # The trainer steps the schedule once per optimizer step itself; accelerate's default
        # would step it once per process (its per-process batch convention).
        step_scheduler_with_optimizer=False,
    )


@contextmanager
def without_zero3_init(accelerator: Accelerator) -> Iterator[None]:
    """Build models whole, even under ZeRO-3.

    accelerate registers its DeepSpeed config with transformers, which then partitions every
    `from_pretrained` model at load time under ZeRO-3. The frozen target is never trained and
    stays outside DeepSpeed, and the draft is partitioned later by `accelerator.prepare`, so
    both are built with the registration lifted and restored afterwards.
    """
    plugin = accelerator.state.deepspeed_plugin
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if plugin is not None:
            plugin.set_deepspeed_weakref()
