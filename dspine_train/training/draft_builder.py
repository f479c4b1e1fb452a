"""Build the draft for a target: its `DSpineConfig`, the token table and the initial weights.

Every mismatch between the recipe, the target and an existing token table or draft is caught
here, before any training step, as a `TrainingError` naming the recipe field.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..formats import load_draft
from ..modeling import DSpineConfig, DSpineDraftModel
from ..token_table import TokenTable, build_token_table
from .config import ModelConfig
from .errors import TrainingError
from .initialisation import from_dflash, from_export, from_target_layers


def _check_one_init_source(model_cfg: ModelConfig) -> None:
    """`model.warm_start_layers` and `model.init_from` both initialise the draft: one only."""
    if model_cfg.warm_start_layers is not None and model_cfg.init_from:
        raise TrainingError("model.warm_start_layers and model.init_from are two init sources "
                            "for the draft: set one of them")


def draft_config_for(
    model_cfg: ModelConfig, target_config: PretrainedConfig, used_vocab_size: int | None,
    tokenizer: Any = None,
) -> DSpineConfig:
    """The draft config: the target's architecture plus the recipe's draft fields. `tokenizer`
    (needed when it uses every vocabulary row) picks and checks the mask id among its
    reserved tokens.

    With `model.init_from` a DFlash checkpoint, its structure fills the fields the recipe leaves
    unset and must agree with the ones it sets, and it must have been made for this target
    (`from_dflash`). A DSpine export likewise, and its other fields (objective, curriculum,
    decode) are the recipe's where the recipe sets them (`from_export`)."""
    _check_one_init_source(model_cfg)
    overrides = model_cfg.draft_overrides()
    checkpoint = from_dflash.dflash_checkpoint(model_cfg.init_from)
    if checkpoint is not None:
        overrides = from_dflash.structure_overrides(overrides, checkpoint, model_cfg.init_from)
    else:
        checkpoint = from_export.export_config(model_cfg.init_from)
        if checkpoint is not None:
            overrides = from_export.continued_overrides(overrides, checkpoint,
                                                        model_cfg.init_from)
    try:
        config = DSpineConfig.from_target(
            target_config, tokenizer, used_vocab_size=used_vocab_size, **overrides
        )
    except ValueError as err:
        raise TrainingError(f"model: the draft does not fit the target {model_cfg.target_path!r}: "
                            f"{err}") from err
    if checkpoint is not None:
        from_dflash.check_target_fields(config, checkpoint, model_cfg.init_from)
    if model_cfg.warm_start_layers is not None:
        from_target_layers.check_layer_choice(list(model_cfg.warm_start_layers), config)
    config.target_name_or_path = model_cfg.target_path
    return config


def load_or_build_token_table(
    path: Path,
    head_weight: torch.Tensor,
    transfer_dim: int,
    is_main: bool,
    wait_for_everyone: Callable[[], None],
) -> TokenTable:
    """The token table at `path`; built from `head_weight` (V, H) by the main process if missing.

    A table that exists but was built for another head shape is an error, never rebuilt
    silently (it may belong to another target).
    """
    if is_main and not path.exists():
        print(f"building the token table (r={transfer_dim}) from the target's lm_head -> {path}")
        table = build_token_table(head_weight.float(), transfer_dim, source=str(path))
        table.save(path)
    wait_for_everyone()
    try:
        table = TokenTable.load(path)
    except (ValueError, FileNotFoundError) as err:
        raise TrainingError(f"model.token_table_path: {err}") from err
    vocab, hidden = head_weight.shape
    if (table.vocab_size, table.hidden_size, table.transfer_dim) != (vocab, hidden, transfer_dim):
        raise TrainingError(
            f"model.token_table_path: {path} was built for V={table.vocab_size}, "
            f"H={table.hidden_size}, r={table.transfer_dim}; this target and recipe need "
            f"V={vocab}, H={hidden}, r={transfer_dim} (delete it or point to another file)"
        )
    return table


def build_draft(
    model_cfg: ModelConfig,
    config: DSpineConfig,
    table: TokenTable,
    target_config: PretrainedConfig,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> DSpineDraftModel:
    """A fresh draft (seeded, token codes and readouts from `table`), or `model.init_from`.

    `init_from` a DSpine export: a draft of `config` (built by `draft_config_for`: the export's
    structure, the recipe's objective) holding the export's weights, every one of them. A DFlash
    checkpoint: the fresh draft of `config` with the checkpoint's backbone (`from_dflash`).
    `model.warm_start_layers`: the fresh draft with its decoder layers copied from those target
    layers (`from_target_layers`); `log` receives the line saying what was copied.
    """
    _check_one_init_source(model_cfg)
    dflash_init = from_dflash.dflash_checkpoint(model_cfg.init_from) is not None
    if model_cfg.init_from and not dflash_init:
        try:
            exported = load_draft(model_cfg.init_from)  # ours or SpecForge's
            config.validate_for_target(target_config)
        except (OSError, ValueError) as err:
            raise TrainingError(f"model.init_from: {err}") from err
        draft = DSpineDraftModel(config)
        draft.load_state_dict(exported.state_dict())  # strict: the same structure
        return draft
    torch.manual_seed(seed)  # the same initial draft on every process and every rerun
    draft = DSpineDraftModel(config)
    draft.init_token_table(table)
    if dflash_init:
        from_dflash.load_backbone(draft, model_cfg.init_from)
    if model_cfg.warm_start_layers is not None:
        line = from_target_layers.copy_target_layers(draft, model_cfg.target_path,
                                                   list(model_cfg.warm_start_layers))
        if log is not None:
            log(line)
    return draft
