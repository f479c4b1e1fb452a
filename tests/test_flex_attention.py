"""The training forward's flex path: compiled flex attention equals dense SDPA, compiles once per
shape class, and refuses (RuntimeError) anything that would run the unfused score-matrix path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dspine_train.modeling.compiled_flex as cf
from dspine_train.modeling.attention_masks import (
    dense_training_mask,
    flex_training_mask,
    training_mask_mod,
)
from dspine_train.modeling.compiled_flex import FlexAttentionUnavailable
from tests._model_helpers import (
    USED_VOCAB,
    context_features,
    randomise_injection,
    tiny_draft,
    tiny_target,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _inputs(target, draft, bsz: int, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, USED_VOCAB, (bsz, seq_len), generator=g)
    anchors = torch.randint(0, seq_len, (bsz, 4), generator=g)
    anchor_mask = torch.ones_like(anchors, dtype=torch.bool)
    anchor_mask[0, -1] = False  # one padding block
    feats, _ = context_features(target, draft, ids)
    return ids, feats, anchors, anchor_mask


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("causal", [True, False])
def test_flex_mask_predicate_is_the_dense_mask(causal):
    """The mask_mod the block mask and the kernel evaluate, on every (b, q, kv), vs the dense mask."""
    bsz, seq_len, block, num_blocks = 3, 23, 4, 5
    anchors = torch.randint(0, seq_len, (bsz, num_blocks), generator=torch.Generator().manual_seed(0))
    q_len, kv_len = num_blocks * block, seq_len + num_blocks * block
    mask_mod = training_mask_mod(anchors, seq_len, block, causal)
    got = mask_mod(torch.arange(bsz)[:, None, None], torch.zeros((), dtype=torch.long),
                   torch.arange(q_len)[None, :, None], torch.arange(kv_len)[None, None, :])
    assert torch.equal(got, dense_training_mask(anchors, seq_len, block, causal)[:, 0])


@pytest.mark.slow  # compiles flex attention with inductor on CPU, a slow compile
def test_compiled_flex_forward_equals_dense_sdpa_and_a_new_length_does_not_recompile(target):
    draft = tiny_draft(target)  # causal blocks; the bidirectional predicate is checked above
    randomise_injection(draft)
    with torch.no_grad():
        for i, seq_len in enumerate([40, 52]):
            ids, feats, anchors, anchor_mask = _inputs(target, draft, 2, seq_len, seed=i)
            dense = draft(ids, feats, anchors, anchor_mask, use_flex=False)
            before = _graphs()
            flex = draft(ids, feats, anchors, anchor_mask, use_flex=True)
            torch.testing.assert_close(flex.hidden, dense.hidden, rtol=1e-5, atol=1e-5)
            for a, b in zip(flex.layer_features, dense.layer_features):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            if i == 1:  # a new sequence length (and anchor positions): the same compiled graphs
                assert _graphs() == before
        # a short last batch is a new shape class (flex specialises the batch size), once
        graphs = _graphs()
        for seq_len in (44, 60):
            ids, feats, anchors, anchor_mask = _inputs(target, draft, 1, seq_len, seed=seq_len)
            draft(ids, feats, anchors, anchor_mask, use_flex=True)
        assert _graphs() - graphs <= 2  # the mask builder and the attention, for batch size 1
    # A long run meets: training and evaluation batch sizes and their short last batches, each
    # with and without grad, per compiled function: dynamo's default limit of 8 is too close.
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    assert (limit or torch._dynamo.config.cache_size_limit) >= cf.RECOMPILE_LIMIT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_long_cuda_run_compiles_each_shape_class_once(target):
    """Train (grad) and evaluation (no grad) forwards over new lengths and a short last batch
    compile once per (mode, batch size), far from the recompile limit."""
    draft = tiny_draft(target)
    randomise_injection(draft)
    shapes = [(bsz, seq_len) for bsz in (2, 1) for seq_len in (40, 52, 64)]
    inputs = {shape: [t.cuda() for t in _inputs(target, draft, *shape)] for shape in shapes}
    draft.cuda()
    counts = []
    for grad in (True, False):
        for bsz in (2, 1):
            before = _graphs()
            for seq_len in (40, 52, 64):
                ids, feats, anchors, anchor_mask = inputs[(bsz, seq_len)]
                with torch.set_grad_enabled(grad):
                    out = draft(ids, feats, anchors, anchor_mask, use_flex=True)
                    if grad:
                        out.hidden.float().pow(2).mean().backward()
            counts.append(_graphs() - before)
    assert sum(counts) < cf.RECOMPILE_LIMIT and all(c <= 4 for c in counts), counts


def test_flex_path_refuses_to_run_eagerly(target):
    """A stance that makes torch.compile run eagerly must not silently run eager flex attention."""
    draft = tiny_draft(target)
    ids, feats, anchors, anchor_mask = _inputs(target, draft, 2, 40)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        with pytest.raises(FlexAttentionUnavailable, match="materialise the full score matrix"):
            draft(ids, feats, anchors, anchor_mask, use_flex=True)


def test_flex_path_refuses_when_torch_compile_is_unsupported(target, monkeypatch):
    draft = tiny_draft(target)
    ids, feats, anchors, anchor_mask = _inputs(target, draft, 2, 40)
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="dynamo"):
        draft(ids, feats, anchors, anchor_mask, use_flex=True)


def test_flex_with_gradients_on_cpu_is_refused_with_the_alternative(target):
    draft = tiny_draft(target)
    ids, feats, anchors, anchor_mask = _inputs(target, draft, 2, 40)
    with pytest.raises(RuntimeError, match="use_flex=False"):
        draft(ids, feats, anchors, anchor_mask, use_flex=True)


def test_flex_on_cuda_without_triton_is_refused(monkeypatch):
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    with pytest.raises(FlexAttentionUnavailable, match="Triton"):
        cf.check_flex_usable(torch.device("cuda"), needs_grad=True)


def test_a_failed_compile_is_an_error_not_a_fallback(monkeypatch):
    def hit_limit(*args):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    monkeypatch.setitem(cf._compiled, "flex_attention", hit_limit)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(FlexAttentionUnavailable, match="FailOnRecompileLimitHit"):
        cf.compiled_flex_attention(q, q, q, None, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_compiled_flex_gradients_equal_dense_sdpa_on_cuda(causal):
    """Forward and gradients of the compiled kernel against dense SDPA, fp32, GQA."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bsz, heads, kv_heads, dim, seq_len, block, num_blocks = 2, 4, 2, 64, 200, 16, 12
    q_len = num_blocks * block
    anchors = torch.randint(0, seq_len, (bsz, num_blocks), device=dev)
    q = torch.randn(bsz, heads, q_len, dim, device=dev, requires_grad=True)
    k = torch.randn(bsz, kv_heads, seq_len + q_len, dim, device=dev, requires_grad=True)
    v = torch.randn(bsz, kv_heads, seq_len + q_len, dim, device=dev, requires_grad=True)
    grad = torch.randn(bsz, heads, q_len, dim, device=dev)
    out = cf.compiled_flex_attention(q, k, v, flex_training_mask(anchors, seq_len, block, causal),
                                     dim**-0.5)
    got = torch.autograd.grad(out, (q, k, v), grad)
    mask = dense_training_mask(anchors, seq_len, block, causal)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5,
                                         enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
def test_compiled_flex_at_the_8b_recipe_shape_keeps_no_score_matrix():
    """One layer at qwen3_8b's 8192 queries x 11264 keys, bf16: the forward's peak and what it
    keeps for backward are the output plus the plan's attention terms, not a 5.6 GiB score matrix."""
    from transformers import Qwen3Config

    from dspine_train.training.memory_plan.activations import attention_items

    dev = torch.device("cuda")
    heads, kv_heads, dim, seq_len, block, num_blocks = 32, 8, 128, 3072, 16, 512
    q_len = num_blocks * block
    anchors = torch.sort(torch.randint(0, seq_len, (1, num_blocks), device=dev)).values
    kw = dict(device=dev, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, heads, q_len, dim, **kw)
    k = torch.randn(1, kv_heads, seq_len + q_len, dim, **kw)
    v = torch.randn(1, kv_heads, seq_len + q_len, dim, **kw)
    cfg = Qwen3Config(hidden_size=4096, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=dim)
    plan = {i.name: i.bytes for i in attention_items(
        cfg, draft_num_layers=1, block_size=block, num_anchors=num_blocks, max_length=seq_len,
        micro_batch_size=1, param_dtype_bytes=2, path="flex", activation_checkpointing=False)}
    # warm up (compile) outside the measurement
    mask = flex_training_mask(anchors, seq_len, block, True)
    cf.compiled_flex_attention(q, k, v, mask, dim**-0.5).sum().backward()
    q.grad = k.grad = v.grad = None
    del mask
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    mask = flex_training_mask(anchors, seq_len, block, True)
    out = cf.compiled_flex_attention(q, k, v, mask, dim**-0.5)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    out_bytes = out.numel() * out.element_size()
    expected = out_bytes + sum(plan.values())
    assert abs(kept - expected) <= 2 * 1024**2, (kept, expected, plan)
    scores = heads * q_len * (seq_len + q_len) * 2
    assert peak < scores / 8, (peak, scores)
