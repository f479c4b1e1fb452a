"""The engine's attention calls: fused-kernel formulations equal the reference SDPA path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _engine_helpers import build_tiny_target, tiny_draft

from dspine_train.engine import Engine, load_target
from dspine_train.modeling.sdpa_attention import (
    causal_attention,
    fused_sdpa_only,
    masked_attention,
    record_sdpa_backends,
)


def _ragged_mask(lengths: torch.Tensor, steps: int, keys: int) -> torch.Tensor:
    positions = lengths[:, None] + torch.arange(steps)[None, :]  # (B, T)
    return (torch.arange(keys)[None, None, :] <= positions[:, :, None]).unsqueeze(1)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_masked_attention_equals_sdpa_with_enable_gqa(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    batch, steps, keys, dim = 3, 5, 37, 16
    q = torch.randn(batch, heads, steps, dim, generator=gen)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    v = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    mask = _ragged_mask(torch.tensor([0, 11, 31]), steps, keys)
    for scale in (None, 0.3):
        reference = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True, scale=scale
        )
        out = masked_attention(q, k, v, mask, scale=scale)
        torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


def test_causal_attention_equals_the_masked_prefill():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 9, 16, generator=gen)
    k = torch.randn(2, 3, 9, 16, generator=gen)
    v = torch.randn(2, 3, 9, 16, generator=gen)
    mask = _ragged_mask(torch.zeros(2, dtype=torch.long), 9, 9)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(causal_attention(q, k, v), reference, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention")
    hf = build_tiny_target(root / "target", "qwen3", head_scale=4.0, eos_token_id=None)
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    return root, hf


def test_target_prefill_and_verify_equal_the_masked_path(tiny):
    root, _ = tiny
    target = load_target(root / "target", dtype=torch.float32)
    target.set_feature_layers([1, 3])
    target.setup(3, 64)
    prompts = torch.randint(1, 200, (3, 7), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([7, 3, 5])
    outs = {}
    for prefill in (True, False):
        target.cache.reset(3)
        first = target(prompts, kv_len=7, prefill=prefill)
        target.cache.crop(lengths)
        block = prompts[:, :4]
        second = target(block, kv_len=40)
        outs[prefill] = (first, second, target.cache.keys.clone())
    (a1, a2, ka), (b1, b2, kb) = outs[True], outs[False]
    for x, y in ((a1.hidden, b1.hidden), (a1.features, b1.features), (a2.hidden, b2.hidden)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)


def test_draft_block_over_a_kv_bucket_equals_the_whole_cache(tiny):
    root, hf = tiny
    from dspine_train.modeling import DSpineDraftModel

    draft = DSpineDraftModel.from_pretrained(str(root / "draft")).eval()
    draft.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    cache = draft.new_context_cache(3, 120, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(3, 20, draft.config.num_context_layers * 64, generator=gen)
    draft.append_context(cache, features, torch.tensor([20, 4, 13]))
    anchors = torch.tensor([5, 6, 7])
    full = draft.draft_forward(cache, anchors)
    bucket = draft.draft_forward(cache, anchors, kv_len=32)  # >= 20 + block_size 8
    for x, y in zip(full, bucket, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_every_attention_call_selects_a_fused_backend(tiny):
    root, _ = tiny
    engine = Engine.from_pretrained(
        root / "target", root / "draft", max_batch_size=2, max_seq_len=64, eos_token_ids=[]
    )
    with record_sdpa_backends() as calls, fused_sdpa_only():
        out = engine.generate([[5, 6, 7], [9]], max_new_tokens=4, chat=False)
    assert all(len(t) == 4 for t in out.token_ids)
    labels = {label for label, _ in calls}
    assert labels == {"prefill", "verify", "draft"}
    assert all(backend != "MATH" for _, backend in calls), calls
