"""`plan_only=true`: the per-GPU memory plan of a recipe, from configs alone (no weights)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..modeling import DSpineConfig, default_target_layer_ids
from ..modeling.attention_masks import default_use_flex
from .config import Precision, TrainConfig
from .memory_plan import MemoryPlan, estimate_memory
from .target import load_target_config
from .tiny_assets import tiny_target_config


def memory_plan_for(config: TrainConfig) -> MemoryPlan:
    """`estimate_memory` for the recipe at `config.world_size` GPUs of `config.gpu_memory_gib`.

    The target's config comes from `model.target_config_path` (shipped for the published
    targets under `recipes/targets/`) or `model.target_path`; draft fields left unset take the
    `DSpineConfig` defaults, capped by the target's size as `DSpineConfig.from_target` does.
    The draft attention counted is the one the forward runs on `config.plan_device`.
    """
    m = config.model
    if m.tiny_random_target and not Path(m.target_path).exists():
        target = tiny_target_config()  # what check_inputs would write there
    else:
        target = load_target_config(m.target_config_path or m.target_path, m.trust_remote_code)
    layers = m.num_layers or DSpineConfig.num_layers
    layer_ids = m.target_layer_ids or default_target_layer_ids(target.num_hidden_layers, layers)
    return estimate_memory(
        target_config=target,
        draft_num_layers=layers,
        block_size=m.block_size or DSpineConfig.block_size,
        num_anchors=config.data.num_anchors,
        max_length=config.data.max_length,
        micro_batch_size=config.data.batch_size,
        transfer_dim=m.transfer_dim or min(DSpineConfig.transfer_dim, target.hidden_size),
        message_size=m.message_size or min(DSpineConfig.message_size, target.hidden_size),
        candidate_k=m.candidate_k or DSpineConfig.candidate_k,
        zero_stage=config.deepspeed.stage,
        world_size=config.world_size,
        param_dtype="bf16" if config.precision == Precision.bf16 else "fp32",
        grad_accum_steps=config.optim.grad_accum_steps,
        offline_features=config.data.offline_features_dir is not None,
        logits_chunk_size=config.logits_chunk_size,
        gpu_memory_gib=config.gpu_memory_gib,
        num_context_layers=len(layer_ids),
        # the path the draft's forward takes on that device
        attention_path="flex" if default_use_flex(torch.device(config.plan_device)) else "dense",
    )
