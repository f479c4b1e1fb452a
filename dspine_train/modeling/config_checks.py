"""The checks of `DSpineConfig`'s training and method settings, beyond its shapes.

`DSpineConfig.check_consistency` checks the network's shapes and ids, then calls
`check_settings`: the curriculum, alignment and refinement settings, and each method's own
(DSpark's heads, Domino's GRU correction, DFlash2's convolutions and selector). Each raises
`ValueError` naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .method_presets import DOMINO_METHOD

if TYPE_CHECKING:
    from .configuration_dspine import DSpineConfig


def check_settings(config: DSpineConfig) -> None:
    """The curriculum, alignment and refinement settings (METHOD 2.2, 2.3), then each
    method's own."""
    if config.replacement_layers < 0:
        raise ValueError(f"replacement_layers must be >= 0, got {config.replacement_layers}")
    if not 0.0 <= config.replacement_probability <= 1.0:
        raise ValueError("replacement_probability must be in [0, 1], got "
                         f"{config.replacement_probability}")
    if not 0.0 <= config.replacement_hold_ratio < config.replacement_end_ratio <= 1.0:
        raise ValueError(
            "replacement_hold_ratio and replacement_end_ratio must satisfy 0 <= hold < end "
            f"<= 1, got {config.replacement_hold_ratio} and {config.replacement_end_ratio}")
    if config.alignment_warmup_steps < 0:
        raise ValueError(
            f"alignment_warmup_steps must be >= 0, got {config.alignment_warmup_steps}")
    choices = {"readout_init": ("whitened", "directions"),
               "alignment_layer_reduction": ("sum", "mean"),
               "refine_normalization": ("covered", "supervised")}
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, "
                             f"got {getattr(config, name)!r}")
    if config.sliding_window is not None and config.sliding_window < config.block_size:
        raise ValueError(f"sliding_window ({config.sliding_window}) must be >= block_size "
                         f"({config.block_size}): a window narrower than the block would hide "
                         "the block's own slots")
    check_dspark(config)
    check_domino(config)
    check_dflash2(config)

def check_dflash2(config: DSpineConfig) -> None:
    """DFlash2's settings: every one >= 1, the hidden size split into whole groups, the
    kernel inside a block, the candidates inside the vocabulary, the whole vocabulary."""
    if config.selector_weight < 0:
        raise ValueError(f"selector_weight must be >= 0, got {config.selector_weight}")
    if config.method != "dflash2":
        return
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1 for method: dflash2, got "
                             f"{getattr(config, name)}")
    if config.hidden_size % config.conv_group_size:
        raise ValueError(f"conv_group_size ({config.conv_group_size}) must divide hidden_size "
                         f"({config.hidden_size})")
    if config.conv_kernel_size > config.block_size:
        raise ValueError(f"conv_kernel_size ({config.conv_kernel_size}) cannot exceed "
                         f"block_size ({config.block_size})")
    if config.selector_top_k > config.vocab_size:
        raise ValueError(f"selector_top_k ({config.selector_top_k}) cannot exceed vocab_size "
                         f"({config.vocab_size})")
    if config.draft_vocab_size is not None:
        raise ValueError(f"draft_vocab_size={config.draft_vocab_size}: method: dflash2 scores "
                         "the target's whole vocabulary (as speculators' DFlash2 requires)")

def check_dspark(config: DSpineConfig) -> None:
    """DSpark's head settings: a rank >= 0, the implemented head variant, a
    confidence head that reads the Markov embedding only where there is one."""
    if config.confidence_weight < 0:
        raise ValueError(f"confidence_weight must be >= 0, got {config.confidence_weight}")
    if config.markov_rank < 0:
        raise ValueError(f"markov_rank must be >= 0 (0: no Markov head), got {config.markov_rank}")
    if config.markov_head_type != "vanilla":
        raise ValueError(
            f"markov_head_type must be 'vanilla', got {config.markov_head_type!r}: the "
            "first-order head is the one implemented here and the one vLLM serves "
            "('gated' and 'rnn' are speculators' training variants)")
    if config.confidence_head_with_markov and not config.enable_confidence_head:
        raise ValueError("confidence_head_with_markov=True needs enable_confidence_head=True")
    if config.confidence_head_with_markov and config.markov_rank == 0:
        raise ValueError("confidence_head_with_markov=True needs markov_rank > 0 (the head "
                         "reads the Markov embedding of the previous token)")
    if config.method == "dspark" and config.draft_vocab_size is not None:
        raise ValueError(f"draft_vocab_size={config.draft_vocab_size}: method: dspark scores "
                         "the target's whole vocabulary (a pruned DSpark is not implemented)")

def check_domino(config: DSpineConfig) -> None:
    """Domino's settings: positive widths, a pure-draft prefix inside the block, a schedule
    in [0, 1], the whole vocabulary."""
    if config.method != DOMINO_METHOD:
        return
    for name in ("domino_emb_dim", "domino_gru_hidden_dim"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1 for method: domino, got {getattr(config, name)}")
    if not 0 <= config.domino_prefix_len < config.num_predictions:
        raise ValueError(f"domino_prefix_len must be in 0..{config.num_predictions - 1} (the "
                         f"block's drafted tokens), got {config.domino_prefix_len}")
    if not 0.0 <= config.domino_lambda_start <= 1.0:
        raise ValueError(f"domino_lambda_start must be in [0, 1], got {config.domino_lambda_start}")
    if not 0.0 < config.domino_lambda_decay_ratio <= 1.0:
        raise ValueError("domino_lambda_decay_ratio must be in (0, 1], got "
                         f"{config.domino_lambda_decay_ratio}")
    if config.draft_vocab_size is not None:
        raise ValueError(f"draft_vocab_size={config.draft_vocab_size}: method: domino scores "
                         "the target's whole vocabulary (its embed_proj outputs V logits)")
