"""Models the GPU check (`scripts/gpu_check.py`) builds locally: no network, no checkpoint.

* `tiny_qwen3_config` / `save_tiny_target`: a tiny random Qwen3 saved as an HF directory (fp32
  exactness runs load it through `Engine.from_pretrained`, the user's path).
* `margin_target`: a random Qwen3 of any config (Qwen3-8B's in the real run) built on the device,
  with weights scaled so that greedy tokens win by clear margins in bf16 (see its docstring).
* `train_draft_briefly`: a few steps of the DSpine objective, enough to lift acceptance above an
  untrained draft's.
* `hf_greedy`: transformers' own greedy `generate`, the reference of every lossless check.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

from dspine_train.training.tiny_assets import tiny_target_config

if TYPE_CHECKING:
    from dspine_train.modeling import DSpineDraftModel


def tiny_qwen3_config(**overrides) -> transformers.Qwen3Config:
    """A tiny Qwen3 (6 layers, H 64, V 256, head_dim 16), no EOS so runs go to their budget."""
    fields = dict(num_hidden_layers=6, vocab_size=256, initializer_range=0.02, eos_token_id=None)
    return tiny_target_config(**{**fields, **overrides})


def save_tiny_target(path: Path, seed: int = 0, head_scale: float = 4.0) -> transformers.PreTrainedModel:
    """Save a tiny random fp32 Qwen3 causal LM to `path` and return it (eval mode, CPU).

    Norm weights and the head get a spread so the next-token distributions are peaked.
    """
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(tiny_qwen3_config()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return model


@torch.no_grad()
def margin_target(
    config: transformers.PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    context_ratio: float = 0.7,
    top_logit: float = 30.0,
) -> tuple[transformers.PreTrainedModel, float]:
    """A random HF causal LM on `device` whose greedy tokens have clear top-2 margins.

    A random network's next-token logits are near-ties (a bf16 rounding flips the argmax every
    few tokens), which would make a bf16 lossless check fail for reasons that are not bugs. So:

    * the token embedding gets unit-variance entries, and `lm_head` row `v` is the embedding of
      token `perm[v]` scaled so the top logit is about `top_logit`: the final state then points
      at one token by a wide margin;
    * every layer's output projections (`o_proj`, `down_proj`) are scaled so the layers' summed
      contribution to the residual stream is `context_ratio` of the embedding's size, measured on
      a random input (the scale applied is returned with the model): attention and MLPs still move every logit (a wrong cache or mask shows in
      the logit difference against transformers) without erasing the margin.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    hidden = config.hidden_size
    embed = model.model.embed_tokens.weight
    embed.normal_(0.0, 1.0, generator=gen)
    scale = 1.0
    probe = torch.randint(0, config.vocab_size, (1, 32), device=device, generator=gen)
    for _ in range(3):  # the contribution is close to linear in the scale: a few fixed-point steps
        out = model.model(probe, output_hidden_states=True)
        # hidden_states[0] is the embedding, [-1] the normed final state; [-2] is the residual
        # stream entering the last layer (close enough to size the layers' contribution).
        first, last = out.hidden_states[0].float(), out.hidden_states[-2].float()
        ratio = float((last - first).pow(2).mean().sqrt() / first.pow(2).mean().sqrt())
        factor = context_ratio / max(ratio, 1e-6)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)
        scale *= factor
    perm = torch.randperm(config.vocab_size, device=device, generator=gen)
    # A normed state h ~ e_t / |e_t| * sqrt(H) gives <h, e_t> ~ H / sqrt(1 + ratio^2).
    head_scale = top_logit * (1.0 + context_ratio**2) ** 0.5 / hidden
    model.lm_head.weight.copy_(embed[perm] * head_scale)
    return model, scale


@torch.no_grad()
def hf_greedy(model: transformers.PreTrainedModel, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by transformers' own forward: the argmax of the full sequence each step.

    No KV cache and no `generate` machinery, so nothing but the model's forward is trusted (and
    a tiny model runs it in milliseconds).
    """
    seq = torch.tensor([ids], device=model.device)
    for _ in range(max_new_tokens):
        logits = model(seq).logits[0, -1]
        seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
    return seq[0, len(ids) :].tolist()


def train_draft_briefly(
    draft: DSpineDraftModel,
    hf_model: transformers.PreTrainedModel,
    sequences: torch.Tensor,
    steps: int,
    lr: float = 3e-3,
) -> DSpineDraftModel:
    """`steps` AdamW steps of the DSpine objective on target sequences `(B, S)` (CPU, fp32)."""
    from dspine_train.objective import dspine_loss, sample_anchors
    from dspine_train.token_table import build_token_table

    cfg = draft.config
    draft.init_token_table(build_token_table(hf_model.lm_head.weight.detach().float(),
                                             cfg.transfer_dim))
    draft.bind_target(hf_model.model.embed_tokens.weight.detach(), hf_model.lm_head.weight.detach())
    with torch.no_grad():
        out = hf_model(sequences, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in cfg.target_layer_ids], dim=-1)
    final = out.hidden_states[-1]
    mask = torch.ones_like(sequences)
    gen = torch.Generator().manual_seed(0)
    optim = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
    draft.train()
    for step in range(steps):
        anchors, anchor_mask = sample_anchors(mask, 16, cfg.block_size, gen)
        train_out = draft(sequences, feats, anchors, anchor_mask)
        loss, _ = dspine_loss(draft, train_out, final, mask, anchors, anchor_mask, step, steps)
        optim.zero_grad()
        loss.backward()
        optim.step()
    return draft.eval()
