"""Shared builders for the engine tests: tiny random targets, a tokenizer, drafts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from dspine_train.training.tiny_assets import TINY_SHAPE
from scripts.tools.bench.oracle_draft import OracleContext, OracleDraft

# the tiny Qwen3 shape; head_dim is given per family below (Qwen2 derives it from H / heads)
TINY = dict({k: v for k, v in TINY_SHAPE.items() if k != "head_dim"}, num_hidden_layers=4,
            vocab_size=256, max_position_embeddings=512)


def tiny_hf_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A tiny random config of `family` ("qwen3", "qwen2" or "llama")."""
    fields = {**TINY, **overrides}
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **fields)
    if family == "qwen2":
        return transformers.Qwen2Config(**fields)
    if family == "llama":
        fields.setdefault("attention_bias", True)
        fields.setdefault("mlp_bias", True)
        return transformers.LlamaConfig(head_dim=16, **fields)
    raise ValueError(family)


def build_tiny_target(
    path: Path, family: str = "qwen3", seed: int = 0, head_scale: float = 1.0, **overrides
) -> transformers.PreTrainedModel:
    """Save a tiny random HF causal LM (fp32, eval) to `path` and return it.

    `head_scale` multiplies the lm_head so the next-token distribution is peaked rather than
    near-uniform (random tiny models are almost uniform otherwise).
    """
    torch.manual_seed(seed)
    config = tiny_hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # Random init of biases is zero; give them values so the parity tests see them.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return model


def build_tokenizer(path: Path, vocab_size: int = 200) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over `w0 .. w{n}` plus `<eos>`, saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1}
    vocab.update({f"w{i}": i + 2 for i in range(vocab_size - 2)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    return fast


def hf_features(model: transformers.PreTrainedModel, ids: list[int], layer_ids: list[int]):
    """HF logits `(T, V)` and concatenated `hidden_states[l + 1]` features `(T, n*H)`."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return out.logits[0], feats


def hf_greedy(model: transformers.PreTrainedModel, ids: list[int], max_new_tokens: int, eos=None):
    """Transformers' own greedy `generate`, new tokens only."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@dataclass
class RecordingOracleContext(OracleContext):
    """The oracle's committed lengths plus every feature row the engine committed."""

    features: torch.Tensor  # (B, max_length, n * H)


class FeatureRecordingOracle(OracleDraft):
    """The tools' oracle draft that also keeps the raw features the engine commits.

    Tests read `cache.features` to check exactly what the engine handed to the draft.
    """

    def new_context_cache(self, batch_size, max_length, *, device=None, dtype=None):  # noqa: ANN001
        width = self.config.hidden_size * len(self.config.target_layer_ids)
        features = torch.zeros(batch_size, max_length, width, device=device, dtype=dtype)
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        return RecordingOracleContext(lengths=lengths, features=features)

    def append_context(self, cache, features, counts) -> None:  # noqa: ANN001
        for b in range(features.shape[0]):
            start, n = int(cache.lengths[b]), int(counts[b])
            cache.features[b, start : start + n] = features[b, :n]
        super().append_context(cache, features, counts)


def tiny_draft(hf_model, used_vocab_size: int, seed: int = 0, **overrides):
    """An untrained `DSpineDraftModel` for `hf_model` (2 layers, block 8, small transfer space)."""
    from dspine_train.modeling import DSpineConfig, DSpineDraftModel

    fields = dict(num_layers=2, block_size=8, transfer_dim=16, message_size=16, candidate_k=4)
    fields.update(overrides)
    config = DSpineConfig.from_target(hf_model.config, used_vocab_size=used_vocab_size, **fields)
    torch.manual_seed(seed)
    return DSpineDraftModel(config).eval()


def train_draft_briefly(draft, hf_model, sequences: torch.Tensor, steps: int, lr: float = 3e-3):
    """A few optimizer steps of the DSpine objective on target sequences `(B, S)`.

    Enough to lift acceptance above an untrained draft's, which is all the lossless tests need
    from a "trained" draft (the trainer itself is tested elsewhere). The GPU check trains its
    exactness draft the same way, so both use the package's function.
    """
    from scripts.tools.gpu_check.models import train_draft_briefly as train

    return train(draft, hf_model, sequences, steps, lr)
