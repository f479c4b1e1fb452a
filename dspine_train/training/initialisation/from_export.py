"""`model.init_from` = a DSpine draft export (ours, or SpecForge's): training continues from it.

The export's weights fix its structure (`STRUCTURE_FIELDS`: what the weights' shapes or meaning
depend on). The recipe leaves such a field unset (the export's value is taken) or sets the
export's value; any other value is an error naming the field, so a run never trains a draft other
than the one its recipe describes. The other draft fields set the objective, the replacement
curriculum and the decode: the recipe's values apply to the continued run and to its export, the
export's where the recipe leaves one unset. (`from_dflash` is the same for a DFlash checkpoint.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...formats import readable_format, specforge, specforge_domino
from ...formats.dflash import read_config
from ...modeling import DSpineConfig
from ..errors import TrainingError
from .from_dflash import dflash_checkpoint, structure_overrides

# The draft fields an export's weights depend on: the layers and their inputs, the block, the
# attention and injection, the transfer space's sizes, the pruned vocabulary.
STRUCTURE_FIELDS = ("num_layers", "target_layer_ids", "block_size", "mask_token_id",
                    "attention_bias", "method", "block_attention", "injection", "transfer_dim",
                    "message_size", "draft_vocab_size")


def export_config(init_from: str | None) -> DSpineConfig | None:
    """The config of the DSpine export (or SpecForge checkpoint) `init_from`, read from its
    config.json alone; None when there is no `init_from` or it is a DFlash checkpoint
    (`from_dflash`). A Hub id is read as transformers reads one. `TrainingError` naming
    `model.init_from` when it cannot be read."""
    if not init_from or dflash_checkpoint(init_from) is not None:
        return None
    try:
        if Path(init_from).is_dir():
            fields = read_config(init_from)
            fmt = readable_format(fields, init_from)
            if fmt == "specforge":
                return specforge.config_from_dict(fields, init_from)
            if fmt == "specforge-domino":
                return specforge_domino.config_from_dict(fields, init_from)
        return DSpineConfig.from_pretrained(init_from)
    except (OSError, ValueError) as err:  # a FormatError is a ValueError
        raise TrainingError(f"model.init_from: {err}") from err


def continued_overrides(overrides: dict[str, Any], exported: DSpineConfig,
                        source: str) -> dict[str, Any]:
    """The draft fields of a run continuing from the export: the recipe's `overrides` (the
    fields it sets) over the export's values. `TrainingError` naming every `model.<field>` of
    `STRUCTURE_FIELDS` the recipe sets to another value than the export's."""
    merged = structure_overrides(overrides, exported, source, STRUCTURE_FIELDS,
                                 kind="DSpine export")
    unset = {name: getattr(exported, name) for name in DSpineConfig.draft_fields()
             if name not in merged}
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in unset.items()}, **merged}
