"""Shared builders for the engine tests: tiny random targets, a tokenizer, drafts, and the
scaffolding of the sampling tests (samples against the target's exact marginals), edited
copies of exported checkpoints (the import tests' bad files), and the per-method engine tests'
training loop, engine and batching."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

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


def zlab_draft_config(target: transformers.PretrainedConfig, num_layers: int,
                      **fields: Any) -> transformers.Qwen3Config:
    """The Qwen3 config of a draft made by z-lab's own classes (`dflash` package) for the
    tiny `target`: its shapes, `num_layers` layers, and `fields` (`dflash_config`, ...)."""
    return transformers.Qwen3Config(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps, max_position_embeddings=target.max_position_embeddings,
        rope_parameters=dict(target.rope_parameters), **fields)


def nontrivial_dflash2(draft):
    """Norms off one, convolutions off the identity (static and dynamic taps on both sides) and
    a selector large enough to reorder candidates, so a misplaced norm or tap, a shifted
    predecessor or a dropped term shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("base_kernel"):
                param.add_(torch.randn_like(param) * 0.3)
            elif "kernel_projection" in name:
                param.normal_(std=0.05)
        draft.candidate_selector.predecessor_codebook.normal_(std=0.5)
        draft.candidate_selector.successor_codebook.normal_(std=0.5)
        draft.candidate_selector.hidden_projection.weight.normal_(std=0.3)
    return draft


def train_draft_briefly(draft, hf_model, sequences: torch.Tensor, steps: int, lr: float = 3e-3):
    """A few optimizer steps of the DSpine objective on target sequences `(B, S)`.

    Enough to lift acceptance above an untrained draft's, which is all the lossless tests need
    from a "trained" draft (the trainer itself is tested elsewhere). The GPU check trains its
    exactness draft the same way, so both use the package's function.
    """
    from scripts.tools.gpu_check.models import train_draft_briefly as train

    return train(draft, hf_model, sequences, steps, lr)


def train_method_briefly(draft, hf_model, sequences: torch.Tensor, steps: int, lr: float,
                         loss: Callable[..., tuple[torch.Tensor, Any]]):
    """`steps` AdamW steps of a method's objective on the target's sequences `(B, S)` (CPU,
    fp32, 16 anchors a row): enough for many accepted drafts. `loss(draft, out, final, mask,
    anchors, anchor_mask, step)` is the method's loss on one training forward `out` (`final`:
    the target's last hidden states), returning (loss, metrics)."""
    from dspine_train.objective import sample_anchors

    cfg = draft.config
    draft.bind_target(hf_model.model.embed_tokens.weight.detach(),
                      hf_model.lm_head.weight.detach())
    with torch.no_grad():
        out = hf_model(sequences, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in cfg.target_layer_ids], dim=-1)
    final, mask = out.hidden_states[-1], torch.ones_like(sequences)
    gen = torch.Generator().manual_seed(0)
    optim = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
    draft.train()
    for step in range(steps):
        anchors, anchor_mask = sample_anchors(mask, 16, cfg.block_size, gen)
        train_out = draft(sequences, feats, anchors, anchor_mask, use_flex=False)
        value, _ = loss(draft, train_out, final, mask, anchors, anchor_mask, step)
        optim.zero_grad()
        value.backward()
        optim.step()
    return draft.eval()


def world_engine(root: Path, draft: str, **kwargs):
    """An engine on `root`'s tiny target and its draft directory `draft` (batch 4 by default,
    96 positions, no EOS): what the per-method engine tests decode with."""
    from dspine_train.engine import Engine

    kwargs.setdefault("max_batch_size", 4)
    return Engine.from_pretrained(root / "target", root / draft, max_seq_len=96,
                                  eos_token_ids=[], **kwargs)


def generate_in_fours(engine, prompts: list[list[int]], new_tokens: int, **kwargs):
    """Speculative decoding of `prompts` four ragged prompts a call: the tokens of every
    prompt and each call's stats."""
    out, stats = [], []
    for i in range(0, len(prompts), 4):
        result = engine.generate(prompts[i : i + 4], max_new_tokens=new_tokens, chat=False,
                                 **kwargs)
        out += result.token_ids
        stats.append(result.stats)
    return out, stats


# ----------------------------------------------------------------------------- sampling tests
SAMPLED_TOKENS = 3  # new tokens per sampled row: their exact marginals sum over vocab**2 prefixes
SAMPLING_SEEDS = 4  # calls per check, each with its own seed


def exact_marginals(hf, prompt: list[int], vocab: int, steps: int) -> list[torch.Tensor]:
    """Exact marginal distributions of the first `steps` sampled tokens (temperature 1)."""
    with torch.no_grad():
        prefixes = torch.tensor([prompt])
        weights = torch.ones(1, dtype=torch.float64)
        marginals = []
        for _ in range(steps):
            probs = torch.softmax(hf(prefixes).logits[:, -1].double(), dim=-1)  # (N, V)
            joint = weights[:, None] * probs  # (N, V): P(prefix, next)
            marginals.append(joint.sum(0))
            # Every prefix extended by every token: (N, V) -> (N * V) prefixes.
            prefixes = torch.cat(
                [
                    prefixes.repeat_interleave(vocab, 0),
                    torch.arange(vocab).repeat(prefixes.shape[0])[:, None],
                ],
                dim=1,
            )
            weights = joint.reshape(-1)
        return marginals


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of token `samples` under the distribution `probs`."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    expected = probs * samples.numel()
    big = expected >= 5  # pool the rare tokens into one bin
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    return float(chisquare(observed[keep], expected[keep]).pvalue)


def sample_rows(
    engine, prompt: list[int], rows: int, method: str = "generate"
) -> tuple[torch.Tensor, list]:
    """`rows` copies of `prompt` sampled at temperature 1 by `engine.<method>`, once per seed:
    the new tokens `(SAMPLING_SEEDS * rows, SAMPLED_TOKENS)` and each call's result."""
    results = [
        getattr(engine, method)(
            [prompt] * rows, max_new_tokens=SAMPLED_TOKENS, temperature=1.0, seed=seed
        )
        for seed in range(SAMPLING_SEEDS)
    ]
    return torch.cat([torch.tensor(r.token_ids) for r in results]), results


def assert_sampled_like(tokens: torch.Tensor, exact: list[torch.Tensor], *label) -> None:
    """Each position of `tokens` (samples, positions) passes a chi-square test against its exact
    marginal (p > 1e-3); `label` names the case in the failure."""
    for position, probs in enumerate(exact):
        pvalue = chi_square_pvalue(tokens[:, position], probs)
        assert pvalue > 1e-3, (*label, position, pvalue)


def assert_trained_method_samples_the_target_law(root: Path, make_draft, train, label: str,
                                                  rows: int = 600) -> None:
    """The sampling check of a method's engine tests: a tiny 6-layer target of 32 tokens, a
    draft `make_draft(hf)` trained by `train(draft, hf, sequences, steps, lr)` on its greedy
    continuations (40 steps), `rows` seeded rows of `SAMPLED_TOKENS` sampled at T=1 against the
    target's exact marginals (chi-square); its drafts must have been both rejected and
    accepted, so they shaped the rounds."""
    from dspine_train.engine import Engine

    vocab, prompt = 32, [3, 17, 8, 25]
    build_tiny_target(root / "target", "qwen3", head_scale=6.0, vocab_size=vocab,
                      num_hidden_layers=6, eos_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    gen = torch.Generator().manual_seed(0)
    starts = [torch.randint(1, vocab, (4,), generator=gen).tolist() for _ in range(6)]
    sequences = torch.tensor([p + hf_greedy(hf, p, 20) for p in [prompt, *starts]])
    train(make_draft(hf), hf, sequences, steps=40, lr=1e-2).save_pretrained(root / "draft")
    exact = exact_marginals(hf, prompt, vocab, steps=SAMPLED_TOKENS)
    engine = Engine.from_pretrained(root / "target", root / "draft", max_batch_size=rows,
                                    max_seq_len=16, eos_token_ids=[])
    tokens, results = sample_rows(engine, prompt, rows, "generate")  # (seeds * rows, 3)
    assert_sampled_like(tokens, exact, label)
    accepted = {n for r in results for row in r.stats.round_accepted for n in row}
    assert 0 in accepted and max(accepted) >= 2, (label, sorted(accepted))


def sampling_engine(root: Path, prompt: list[int], rows: int, **engine_kwargs):
    """The tree and n-gram sampling tests' setup: a peaked 32-token target (4 layers, no EOS)
    and an untrained draft saved under `root`, the exact marginals of `prompt`'s first sampled
    tokens, and an `Engine` over both for `rows` sequences (`engine_kwargs`: its tree / n-gram
    settings). Returns (engine, marginals)."""
    from dspine_train.engine import Engine

    vocab = 32
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=6.0, vocab_size=vocab, num_hidden_layers=4,
        eos_token_id=None,
    )
    tiny_draft(hf, 30, transfer_dim=8, message_size=8).save_pretrained(root / "draft")
    exact = exact_marginals(hf, prompt, vocab, steps=SAMPLED_TOKENS)
    engine = Engine.from_pretrained(
        root / "target", root / "draft", max_batch_size=rows, max_seq_len=40, eos_token_ids=[],
        **engine_kwargs,
    )
    return engine, exact


def edited_export(source: Path, out: Path, edit: Callable[[dict, dict], None]) -> Path:
    """A copy of the export at `source` in `out` with `edit(fields, tensors)` applied to its
    config.json fields and model.safetensors tensors."""
    shutil.copytree(source, out)
    fields = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    edit(fields, tensors)
    (out / "config.json").write_text(json.dumps(fields))
    save_file(tensors, str(out / "model.safetensors"))
    return out
