"""Tiny random targets and drafts shared by the model tests (CPU, fixed seeds)."""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM

from dspine_train import DSpineConfig, DSpineDraftModel
from dspine_train.training.tiny_assets import tiny_target_config

USED_VOCAB = 250


def tiny_target(seed: int = 0, *, layers: int = 6, vocab: int = 256) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_target_config(num_hidden_layers=layers, vocab_size=vocab, initializer_range=0.02)
    return Qwen3ForCausalLM(cfg).eval()


def random_token_table(draft: DSpineDraftModel, seed: int = 0):
    """A token table from the bound head, so features and codes are consistent."""
    from dspine_train.token_table import build_token_table

    head = draft._target_head
    return build_token_table(head.float(), draft.config.transfer_dim)


def tiny_draft(
    target: Qwen3ForCausalLM, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> DSpineDraftModel:
    fields = dict(num_layers=3, transfer_dim=32, message_size=16, candidate_k=6, block_size=6)
    fields.update(overrides)
    cfg = DSpineConfig.from_target(target.config, used_vocab_size=USED_VOCAB, **fields)
    torch.manual_seed(seed)
    draft = DSpineDraftModel(cfg).to(dtype)
    draft.bind_target(
        target.model.embed_tokens.weight.to(dtype), target.lm_head.weight.to(dtype)
    )
    table = random_token_table(draft, seed)
    draft.init_token_table(table)
    return draft


def randomise_injection(draft: DSpineDraftModel, seed: int = 1, std: float = 0.05) -> None:
    """Give the zero-initialised writes/gates values, as after some training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.injection.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p) * std)
        for ro in draft.injection.readouts:
            ro.weight.add_(torch.randn(ro.weight.shape, generator=g).to(ro.weight) * 0.1)


def context_features(target: Qwen3ForCausalLM, draft: DSpineDraftModel, ids: torch.Tensor):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in draft.config.target_layer_ids], dim=-1)
    return feats.to(draft.fc.weight.dtype), out.hidden_states[-1]
