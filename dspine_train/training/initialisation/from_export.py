"""`model.init_from` = a draft export (ours; SpecForge's DSpine or Domino; a DSpark or DFlash2
checkpoint in speculators', DeepSpec's or z-lab's format): training continues from it.

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

from ...formats import draft_config
from ...modeling import DSpineConfig
from ..errors import TrainingError
from .from_dflash import dflash_checkpoint, structure_overrides

# The draft fields an export's weights depend on: the layers and their inputs, the block, the
# attention and injection, the transfer space's sizes, the pruned vocabulary, and the other
# methods' heads (DSpark's, Domino's, DFlash2's: their sizes and what they read).
STRUCTURE_FIELDS = ("num_layers", "target_layer_ids", "block_size", "mask_token_id",
                    "attention_bias", "method", "block_attention", "injection", "transfer_dim",
                    "message_size", "draft_vocab_size", "markov_rank", "markov_head_type",
                    "enable_confidence_head", "confidence_head_with_markov", "domino_emb_dim",
                    "domino_gru_hidden_dim", "domino_prefix_len", "domino_shift_label",
                    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def export_config(init_from: str | None) -> DSpineConfig | None:
    """The config of the DSpine export (or SpecForge checkpoint) `init_from`, read from its
    config.json alone; None when there is no `init_from` or it is a DFlash checkpoint
    (`from_dflash`). A Hub id is read as transformers reads one. `TrainingError` naming
    `model.init_from` when it cannot be read."""
    if not init_from or dflash_checkpoint(init_from) is not None:
        return None
    try:
        if Path(init_from).is_dir():  # any format `load_draft` reads
            return draft_config(init_from)
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
