"""The frozen target: loading it and reading the features the draft trains on.

Any Hugging Face causal LM works. It is loaded with `from_pretrained` (safetensors only,
remote code only when the recipe asks), frozen and kept in eval mode; it is never handed to
DeepSpeed. One forward of its *base model* (no lm_head, so no (B, S, V) logits) yields:

* context features: the outputs of the configured layers, `hidden_states[l + 1]`,
  concatenated on the last dim (B, S, n*H);
* the final normed hidden state `hidden_states[-1]` (B, S, H), from which the target's own
  next-token distribution is computed: its top-k once per position (`TargetFeatures.with_topk`,
  `data.target_topk` > 0, as the feature cache stores it), or exactly per block slot by the
  objective (`data.target_topk: 0`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from ..checkpoint_io import SafetensorsWeights, WeightsError
from ..target_config import read_target_config
from ..vocab_loss import target_topk
from .errors import TrainingError

# Files of which a tokenizer has at least one; without them transformers makes a placeholder.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TargetFeatures:
    """What one target forward gives the draft.

    context: (B, S, n*H) hidden states at `target_layer_ids`, concatenated.
    final_hidden: (B, S, H) the target's final normed hidden state.
    topk_ids, topk_probs: (B, S, k) the top-k of the target's next-token distribution at each
        position, target_lse (B, S, 1) its logits' logsumexp, when a feature cache stored them
        (`offline_features`); None otherwise.
    """

    context: torch.Tensor
    final_hidden: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_probs: torch.Tensor | None = None
    target_lse: torch.Tensor | None = None

    def to(self, device: torch.device) -> TargetFeatures:
        """The same features on `device`."""
        return TargetFeatures(*[None if t is None else t.to(device) for t in (
            self.context, self.final_hidden, self.topk_ids, self.topk_probs, self.target_lse)])

    def with_topk(self, head: torch.Tensor, k: int) -> TargetFeatures:
        """These features with the top-k of the target's next-token distribution at every
        position, projected once per position through the target's `head` (V, H), as the
        feature cache stores it (`vocab_loss.target_topk`): the online objective then reads
        the distribution of each block slot from its position instead of projecting the slot."""
        bsz, seq, hidden = self.final_hidden.shape
        ids, probs, lse = target_topk(self.final_hidden.reshape(-1, hidden), head, k)
        return dataclasses.replace(  # (B*S, k) -> (B, S, k)
            self, topk_ids=ids.view(bsz, seq, -1), topk_probs=probs.view(bsz, seq, -1),
            target_lse=lse.view(bsz, seq, 1))

    @property
    def topk(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(topk_ids, topk_probs, target_lse), or None when not stored."""
        if self.topk_ids is None:
            return None
        return self.topk_ids, self.topk_probs, self.target_lse


def load_target_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's HF config (a directory, a config.json, or a Hub id); no weights are read."""
    try:
        config = read_target_config(path, trust_remote_code=trust_remote_code)
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


def used_vocab_size(path: str, vocab_size: int, explicit: int | None = None) -> int:
    """The ids the target's tokenizer uses: `len(tokenizer)`, or `model.used_vocab_size`.

    Without tokenizer files transformers builds a placeholder tokenizer of a single token
    (a real token would then become the mask id), so a local target without them, or with a
    tokenizer shorter than half its `vocab_size` (`vocab_size` rows; real tokenizers fill
    nearly all of them), counts as having none: `explicit` must then say it.
    """
    source = Path(path)
    where = f"model.target_path {path!r}"
    found = None
    if not source.is_dir() or any((source / name).is_file() for name in _TOKENIZER_FILES):
        try:
            found = len(AutoTokenizer.from_pretrained(path))
        except (OSError, ValueError, TypeError):
            found = None
    if found is not None and found < vocab_size // 2:
        if explicit is None:
            raise TrainingError(
                f"{where}: its tokenizer has {found} tokens for {vocab_size} vocabulary rows, "
                "not a real tokenizer; save the target's tokenizer there or set "
                "model.used_vocab_size"
            )
        found = None
    if explicit is not None:
        if not 1 <= explicit <= vocab_size:
            raise TrainingError(
                f"model.used_vocab_size must be in 1..{vocab_size} (the target's vocab_size), "
                f"got {explicit}"
            )
        if found is not None and found != explicit:
            raise TrainingError(
                f"model.used_vocab_size is {explicit} but the tokenizer of {where} has {found} "
                "tokens; set model.used_vocab_size=null to use the tokenizer"
            )
        return explicit
    if found is None:
        raise TrainingError(
            f"{where} has no tokenizer ({', '.join(_TOKENIZER_FILES)}), so the ids it uses "
            "are unknown; save the target's tokenizer there or set model.used_vocab_size"
        )
    return found


def load_target_tokenizer(path: str):  # noqa: ANN201 - a transformers tokenizer
    """The target's tokenizer (to pick and check a mask id among its reserved tokens)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise TrainingError(f"model.target_path: cannot load the tokenizer of {path!r}: {err}") from err


def embedding_scale(target: nn.Module) -> float:
    """The factor the target multiplies its input embeddings by (`embed_scale` of transformers'
    scaled embeddings, e.g. Gemma's sqrt(hidden_size)); 1.0 for a plain `nn.Embedding`."""
    scale = getattr(target.get_input_embeddings(), "embed_scale", None)
    return 1.0 if scale is None else float(scale)


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
    try:
        with SafetensorsWeights(path) as weights:

            def read(suffix: str) -> torch.Tensor | None:
                names = [k for k in weights.keys() if k.endswith(suffix)]
                return weights.get_tensor(names[0]) if names else None

            embed = read("embed_tokens.weight")
            if embed is None:
                raise TrainingError(
                    f"model.target_path: {path!r} has no *embed_tokens.weight tensor")
            head = read("lm_head.weight")
    except WeightsError as err:
        raise TrainingError(f"model.target_path: {err}") from None
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
    def __call__(self, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> TargetFeatures:
        """input_ids, attention_mask (B, S) -> `TargetFeatures` (right padding only; None: no
        padding)."""
        out = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
        states = out.hidden_states  # L + 1 tensors (B, S, H): embeddings, then each layer
        context = torch.cat([states[i + 1] for i in self.layer_ids], dim=-1)  # (B, S, n*H)
        return TargetFeatures(context=context, final_hidden=states[-1])
