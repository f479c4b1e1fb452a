"""The frozen target: loading it and reading the features the draft trains on.

Any Hugging Face causal LM works. It is loaded with `from_pretrained` (safetensors only,
remote code only when the recipe asks), frozen and kept in eval mode; it is never handed to
DeepSpeed. One forward of its *base model* (no lm_head, so no (B, S, V) logits) yields:

* context features: the outputs of the configured layers, `hidden_states[l + 1]`,
  concatenated on the last dim (B, S, n*H);
* the final normed hidden state `hidden_states[-1]` (B, S, H), from which the objective
  computes the target's own next-token distribution chunk by chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from .errors import TrainingError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TargetFeatures:
    """What one target forward gives the draft.

    context: (B, S, n*H) hidden states at `target_layer_ids`, concatenated.
    final_hidden: (B, S, H) the target's final normed hidden state.
    """

    context: torch.Tensor
    final_hidden: torch.Tensor


def load_target_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's HF config (a directory, a config.json, or a Hub id); no weights are read."""
    source = Path(path)
    if source.is_file():
        source = source.parent
    try:
        config = AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise TrainingError(f"model.target_path: cannot read a model config at {path!r}: {err}") from err
    return getattr(config, "text_config", None) or config


def load_target(
    path: str, dtype: str, device: torch.device, trust_remote_code: bool = False
) -> nn.Module:
    """Load a frozen causal LM in eval mode on `device` (safetensors weights only)."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=_DTYPES[dtype],
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError) as err:
        raise TrainingError(f"model.target_path: cannot load a causal LM from {path!r}: {err}") from err
    model.requires_grad_(False)
    return model.eval().to(device)


def used_vocab_size(path: str) -> int | None:
    """`len(tokenizer)` of the target when it ships a tokenizer, else None."""
    try:
        return len(AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError, TypeError):
        return None


def target_head_weights(target: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's frozen input embedding and output head weights, both (V, H)."""
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    if head is None:
        raise TrainingError(
            f"model.target_path: {type(target).__name__} has no output embeddings (lm_head); "
            "the target must be a causal LM"
        )
    return embed.detach(), head.weight.detach()


def read_embedding_and_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's `embed_tokens` and `lm_head` weights (V, H) read straight from its
    safetensors files, without building the model (offline-feature training needs only these).
    A tied head returns the embedding twice."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = {k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            files = dict.fromkeys(f.keys(), root / "model.safetensors")
    else:
        raise TrainingError(f"model.target_path: no safetensors checkpoint in {path!r}")

    def read(suffix: str) -> torch.Tensor | None:
        names = [k for k in files if k.endswith(suffix)]
        if not names:
            return None
        with safe_open(str(files[names[0]]), framework="pt") as f:
            return f.get_tensor(names[0])

    embed = read("embed_tokens.weight")
    if embed is None:
        raise TrainingError(f"model.target_path: {path!r} has no *embed_tokens.weight tensor")
    head = read("lm_head.weight")
    return embed, embed if head is None else head


class TargetFeatureExtractor:
    """Runs the frozen target's base model and gathers the draft's training features."""

    def __init__(self, target: nn.Module, target_layer_ids: list[int]) -> None:
        depth = target.config.get_text_config().num_hidden_layers
        bad = [i for i in target_layer_ids if not 0 <= i < depth - 1]
        if bad:
            # hidden_states[depth] is the *normed* final state in transformers, not the raw
            # output of the last layer, so the last layer cannot be a context layer.
            raise TrainingError(
                f"model.target_layer_ids {bad} are outside 0..{depth - 2} for this target "
                f"({depth} layers; the last layer's output is only available normed)"
            )
        self.target = target
        self.base = target.base_model
        self.layer_ids = list(target_layer_ids)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetFeatures:
        """input_ids, attention_mask (B, S) -> `TargetFeatures` (right padding only)."""
        out = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
        states = out.hidden_states  # L + 1 tensors (B, S, H): embeddings, then each layer
        context = torch.cat([states[i + 1] for i in self.layer_ids], dim=-1)  # (B, S, n*H)
        return TargetFeatures(context=context, final_hidden=states[-1])
