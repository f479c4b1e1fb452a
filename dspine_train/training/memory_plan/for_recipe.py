"""`plan_only=true`: the per-GPU memory plan of a recipe, from configs alone (no weights).

The target's config and the draft the trainer would build for it, handed to
`estimate.estimate_memory`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import PretrainedConfig

from ...modeling import DSpineConfig
from ...modeling.attention_masks import default_use_flex
from ...recipe_files import resolve_recipe_path
from ..config import Precision, TrainConfig
from ..draft_builder import draft_config_for
from ..errors import TrainingError
from ..initialisation import from_dflash
from ..target import load_target_config, used_vocab_size
from ..tiny_assets import tiny_target_config
from .estimate import estimate_memory
from .parameters import method_fields_of
from .plan import MemoryPlan


def plan_target_config(config: TrainConfig) -> PretrainedConfig:
    """The target's config as `plan_only` reads it: `model.target_config_path` (shipped for
    the published targets under `recipes/targets/`) or `model.target_path`; for the `tiny`
    recipe before its target is written, the architecture it will be written with."""
    m = config.model
    if m.tiny_random_target and not Path(m.target_path).exists():
        return tiny_target_config()  # what check_inputs would write there
    if m.target_config_path:
        return load_target_config(str(resolve_recipe_path(m.target_config_path)),
                                  m.trust_remote_code)
    return load_target_config(m.target_path, m.trust_remote_code)


def plan_draft_config(config: TrainConfig, target: PretrainedConfig | None = None) -> DSpineConfig:
    """The draft `plan_only` sizes: `draft_config_for` (`DSpineConfig.from_target` with the
    recipe's draft fields), as the trainer builds it.

    The tokenizer is read when `model.target_path` is a local directory, as the trainer does.
    When it is not at hand (a Hub id: plan_only reads configs only) and the recipe names no
    `mask_token_id` (or the tokenizer uses every row), the plan takes the last vocabulary row as the mask token: the mask id
    changes no memory, and the run itself requires the tokenizer.
    """
    target = plan_target_config(config) if target is None else target
    m = config.model
    used = m.used_vocab_size
    if Path(m.target_path).is_dir():
        try:
            used = used_vocab_size(m.target_path, target.vocab_size, m.used_vocab_size)
        except TrainingError:
            pass  # the run names what is wrong with the tokenizer; the plan needs no mask id
    # (a DFlash checkpoint in `init_from` brings its own mask id: `from_dflash`)
    if ((used is None or used >= target.vocab_size) and m.mask_token_id is None
            and from_dflash.dflash_checkpoint(m.init_from) is None):
        m = dataclasses.replace(m, mask_token_id=target.vocab_size - 1)
    return draft_config_for(m, target, used)


def memory_plan_for(config: TrainConfig) -> MemoryPlan:
    """`estimate_memory` for the recipe's draft (`plan_draft_config`) at `config.world_size`
    GPUs of `config.gpu_memory_gib`.

    The draft attention counted is the one the forward runs on `config.plan_device`.
    """
    target = plan_target_config(config)
    draft = plan_draft_config(config, target)
    return estimate_memory(
        target_config=target,
        draft_num_layers=draft.num_layers,
        block_size=draft.block_size,
        num_anchors=config.data.num_anchors,
        max_length=config.data.max_length,
        micro_batch_size=config.data.batch_size,
        transfer_dim=draft.transfer_dim,
        message_size=draft.message_size,
        candidate_k=draft.candidate_k,
        zero_stage=config.deepspeed.stage,
        world_size=config.world_size,
        param_dtype="bf16" if config.precision == Precision.bf16 else "fp32",
        grad_accum_steps=config.optim.grad_accum_steps,
        offline_features=config.data.offline_features_dir is not None,
        logits_chunk_size=config.logits_chunk_size,
        gpu_memory_gib=config.gpu_memory_gib,
        num_context_layers=draft.num_context_layers,
        attention_bias=draft.attention_bias,
        method_fields=method_fields_of(draft),
        # the path the draft's forward takes on that device
        attention_path="flex" if default_use_flex(torch.device(config.plan_device)) else "dense",
    )
