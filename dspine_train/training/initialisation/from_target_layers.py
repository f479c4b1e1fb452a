"""Warm-start the draft's decoder layers from chosen target layers: `model.warm_start_layers`.

`model.warm_start_layers: [j_0, j_1, ...]` (one target layer index per draft layer, off by
default) copies target decoder layer `j_i` into draft layer `i`, tensor for tensor: the
attention projections (q/k/v/o, their biases when both have them), the q/k norms when the
target has them, the MLP and the two RMSNorms. Everything else keeps its fresh, seeded init
(the context projection `fc`, `hidden_norm`, the final `norm`, the injection, readouts and
token codes): the warm-started draft equals a cold one with the same seed outside the copied
tensors.

The target's weights are read lazily from its safetensors files
(`dspine_train.checkpoint_io.SafetensorsWeights`), only the chosen layers' tensors, so the
option works with offline features where the trainer never loads the target body. Every
shape is checked from the file headers before any tensor is copied: a draft layer that does
not have the target layer's shapes is refused with one error naming the layer and tensor.

A draft tensor the target layer lacks (q/k norms under a Qwen2 target) keeps its init, and a
target tensor the draft lacks (q/k/v biases of a Qwen2 target under `attention_bias: false`)
is not copied; `copy_target_layers` returns a log line that names both.
"""

from __future__ import annotations

import torch

from ...checkpoint_io import SafetensorsWeights, WeightsError
from ...modeling import DSpineConfig, DSpineDraftModel
from ..errors import TrainingError

FIELD = "model.warm_start_layers"


def check_layer_choice(layers: list[int], config: DSpineConfig) -> None:
    """`TrainingError` naming `model.warm_start_layers` unless it holds one target layer index
    (0..target depth - 1) per draft layer."""
    if len(layers) != config.num_layers:
        raise TrainingError(
            f"{FIELD}: {len(layers)} entries for a {config.num_layers}-layer draft (give one "
            f"target layer index per draft layer)")
    depth = config.target_num_layers
    bad = [j for j in layers if not 0 <= j < depth]
    if bad:
        raise TrainingError(f"{FIELD}: {bad} outside 0..{depth - 1} for the {depth}-layer target")


def _text_layers_prefix(weights: SafetensorsWeights, source: str) -> str:
    """The prefix of the target's decoder layers: that of its `embed_tokens` (`model.` for
    Qwen/Llama; a multimodal checkpoint's language model, not its vision tower)."""
    embeds = [k for k in weights.keys() if k.endswith("embed_tokens.weight")]
    if not embeds:
        raise TrainingError(f"{FIELD}: the target {source!r} has no *embed_tokens.weight tensor")
    return embeds[0][: -len("embed_tokens.weight")] + "layers."


def copy_target_layers(draft: DSpineDraftModel, target_path: str, layers: list[int]) -> str:
    """Copy target layer `layers[i]` into draft layer `i` (cast to the draft's dtype), reading
    only those layers from the target's safetensors at `target_path`. Every shape is checked
    before the first copy. Returns one line for the run's log."""
    check_layer_choice(layers, draft.config)
    state = draft.state_dict()
    try:
        with SafetensorsWeights(target_path) as weights:
            prefix = _text_layers_prefix(weights, target_path)
            keys = set(weights.keys())
            pairs: list[tuple[str, str]] = []  # (draft name, target name)
            kept, dropped = set(), set()
            for i, j in enumerate(layers):
                ours, theirs = f"layers.{i}.", f"{prefix}{j}."
                local = {k[len(theirs):] for k in keys if k.startswith(theirs)}
                if not local:
                    raise TrainingError(f"{FIELD}: the target {target_path!r} has no tensors "
                                        f"under {theirs!r} (draft layer {i})")
                mine = {k[len(ours):] for k in state if k.startswith(ours)}
                for name in sorted(mine):
                    if name not in local:
                        kept.add(name)
                        continue
                    want, have = list(state[ours + name].shape), weights.get_shape(theirs + name)
                    if want != list(have):
                        raise TrainingError(
                            f"{FIELD}: draft layer {i} cannot take target layer {j}: tensor "
                            f"{name} is {list(have)} in the target, {want} in the draft")
                    pairs.append((ours + name, theirs + name))
                dropped |= local - mine
            with torch.no_grad():
                for name, source in pairs:
                    param = state[name]
                    param.copy_(weights.get_tensor(source).to(param.dtype))
    except WeightsError as err:
        raise TrainingError(f"{FIELD}: {err}") from None
    line = (f"{FIELD}: draft layers <- target layers {list(layers)} ({len(pairs)} tensors "
            "copied); fc, norms outside the layers, injection and token codes start at their init")
    if kept:
        line += f"; the target has no {sorted(kept)}: kept at their init"
    if dropped:
        line += f"; the draft has no {sorted(dropped)}: not copied"
    return line
