"""The DSpine draft network: HF round-trip, DFlash equivalence, causality, masks, gradients."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel

from dspine_train import DSpineConfig, DSpineDraftModel
from tests._model_helpers import (
    USED_VOCAB,
    context_features,
    randomise_injection,
    tiny_draft,
    tiny_target,
)
from tests._train_helpers import REPO, train_env


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def batch(target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, USED_VOCAB, (2, 40), generator=g)
    anchors = torch.tensor([[3, 10, 20, 30], [0, 7, 25, 38]])
    return ids, anchors


def test_a_saved_draft_loads_through_automodel_after_importing_only_its_config(target, tmp_path):
    """The package's names load lazily (the engine imports its light modules alone); any of them
    still registers the `dspine` type, so `AutoModel` reads a saved draft in a fresh process."""
    tiny_draft(target).save_pretrained(tmp_path)
    code = ("import sys\n"
            "from dspine_train.modeling import DSpineConfig\n"
            "from transformers import AutoModel\n"
            f"print(type(AutoModel.from_pretrained({str(tmp_path)!r})).__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "DSpineDraftModel"


def test_save_pretrained_roundtrip_is_bit_identical_without_target_weights(target, tmp_path):
    draft = tiny_draft(target)
    randomise_injection(draft)
    draft.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DSpineDraftModel)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "dspine"
    before, after = draft.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        shapes = {k: f.get_slice(k).get_shape() for k in keys}
    assert "token_codes" in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    # nothing target-sized except the token codes (V x r, not V x H)
    vocab, hidden = draft.config.vocab_size, draft.config.hidden_size
    assert [k for k, s in shapes.items() if s == [vocab, hidden]] == []


def test_loaded_draft_needs_bound_target(target, tmp_path, batch):
    tiny_draft(target).save_pretrained(tmp_path)
    loaded = DSpineDraftModel.from_pretrained(tmp_path)
    ids, anchors = batch
    feats, _ = context_features(target, loaded, ids)
    with pytest.raises(RuntimeError, match="bind_target"):
        loaded(ids, feats, anchors)


def test_untrained_dspine_is_exactly_its_dflash_backbone(target, batch):
    ids, anchors = batch
    dspine = tiny_draft(target, seed=3)
    dflash = tiny_draft(target, seed=3, injection=False)
    dflash.load_state_dict(dspine.state_dict())
    feats, _ = context_features(target, dspine, ids)
    with torch.no_grad():
        a, b = dspine(ids, feats, anchors), dflash(ids, feats, anchors)
    assert torch.equal(a.hidden, b.hidden)
    assert torch.equal(dspine.logits(a.hidden), dflash.logits(b.hidden))


def test_writes_and_predecessor_gate_start_at_zero(target, batch):
    """METHOD 2.2: W_l and G_pred start at zero, the other injection weights do not.

    Zero writes alone already make the forward equal DFlash's (above), whatever G_pred holds;
    a non-zero G_pred shows in the gate and in the refined scores (METHOD 2.4) as soon as the
    writes move, so the init is checked directly and through what it implies: at init the gate
    does not depend on the predecessor, and every predecessor row of the transition table is
    the same (the refinement starts as the plain per-slot scores).
    """
    ids, anchors = batch
    draft = tiny_draft(target, seed=3)
    inj = draft.injection
    for layer, write in enumerate(inj.writes):
        assert torch.count_nonzero(write.weight) == 0, f"injection.writes.{layer}"
    assert torch.count_nonzero(inj.gate_pred.weight) == 0, "injection.gate_pred"
    # the shared message and the receiver gate are initialised normally (init really ran)
    assert inj.message.weight.std() > 0 and inj.gate_recv.weight.std() > 0

    g = torch.Generator().manual_seed(0)
    f_recv, f_pred = (torch.randn(5, draft.config.transfer_dim, generator=g) for _ in range(2))
    with torch.no_grad():
        gate = torch.sigmoid(inj.gate_recv(f_recv) + inj.gate_pred(f_pred))
        other = torch.sigmoid(inj.gate_recv(f_recv) + inj.gate_pred(-3 * f_pred))
    assert torch.equal(gate, other)  # the gate ignores the predecessor until trained

    feats, _ = context_features(target, draft, ids)
    with torch.no_grad():
        out = draft(ids, feats, anchors)
        pre, recv = out.pre_injection[0, 0, 1:], out.recv_features[0, 0]  # (Bk-1, H), (Bk-1, r)
        preds = torch.tensor([1, 2, 3, 4])[None].expand(pre.shape[0], -1)  # 4 predecessors
        cands = torch.tensor([5, 6, 7])[None].expand(pre.shape[0], -1)
        scores = draft.refined_scores(pre, recv, preds, cands)  # (Bk-1, 4, 3)
        plain = draft.logits(pre)[:, [5, 6, 7]]  # the per-slot scores of the same candidates
    # equal up to float rounding: some CPUs' matmul kernels round rows differently (3e-8 on
    # an AMX machine, on scores of ~1e-3); a live G_pred moves them far more
    torch.testing.assert_close(scores, scores[:, :1].expand_as(scores), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(scores[:, 0], plain)


def test_injection_off_ignores_injection_weights(target, batch):
    ids, anchors = batch
    dflash = tiny_draft(target, injection=False)
    feats, _ = context_features(target, dflash, ids)
    with torch.no_grad():
        before = dflash(ids, feats, anchors).hidden
        randomise_injection(dflash, std=1.0)
        after = dflash(ids, feats, anchors).hidden
    assert torch.equal(before, after)


def test_injection_changes_outputs_once_trained(target, batch):
    ids, anchors = batch
    draft = tiny_draft(target)
    feats, _ = context_features(target, draft, ids)
    with torch.no_grad():
        base = draft(ids, feats, anchors).hidden
        randomise_injection(draft)
        assert not torch.allclose(base, draft(ids, feats, anchors).hidden)


def test_context_at_or_after_anchor_changes_nothing(target, batch):
    ids, _ = batch
    draft = tiny_draft(target)
    randomise_injection(draft)
    anchor = 15
    feats, _ = context_features(target, draft, ids)
    feats2 = feats.clone()
    feats2[:, anchor:] = torch.randn_like(feats2[:, anchor:])
    anchors = torch.tensor([[anchor]] * 2)
    with torch.no_grad():
        a, b = draft(ids, feats, anchors), draft(ids, feats2, anchors)
    assert torch.equal(a.hidden, b.hidden)
    # the block's own future tokens are labels only: changing them changes nothing either
    ids2 = ids.clone()
    ids2[:, anchor + 1 :] = (ids2[:, anchor + 1 :] + 1) % USED_VOCAB
    with torch.no_grad():
        c = draft(ids2, feats, anchors)
    assert torch.equal(a.hidden, c.hidden)
    # ... while context before the anchor does matter
    feats3 = feats.clone()
    feats3[:, anchor - 1] += 1.0
    with torch.no_grad():
        assert not torch.allclose(a.hidden, draft(ids, feats3, anchors).hidden)


def test_blocks_of_one_sequence_never_see_each_other(target, batch):
    ids, _ = batch
    draft = tiny_draft(target)
    randomise_injection(draft)
    feats, _ = context_features(target, draft, ids)
    anchors = torch.tensor([[5, 20]] * 2)
    ids2 = ids.clone()
    ids2[:, 20] = (ids2[:, 20] + 7) % USED_VOCAB  # the second block's anchor token
    with torch.no_grad():
        a, b = draft(ids, feats, anchors), draft(ids2, feats, anchors)
    assert torch.equal(a.hidden[:, 0], b.hidden[:, 0])
    assert not torch.allclose(a.hidden[:, 1], b.hidden[:, 1])


@pytest.mark.parametrize("block_attention", ["causal", "bidirectional"])
def test_true_predecessor_reaches_only_its_successors(target, batch, block_attention):
    """Replacement feeds slot t the code of token x_{a+t-1}; with a causal block nothing before
    slot t can hear it, and it reaches slot t right at the first layer's injection."""
    ids, _ = batch
    draft = tiny_draft(target, block_attention=block_attention, replacement_layers=1)
    randomise_injection(draft)
    feats, _ = context_features(target, draft, ids)
    anchor, t = 12, 3  # perturb x_{a+t-1}, the true predecessor of slot t
    anchors = torch.tensor([[anchor]] * 2)
    replace = torch.ones(2, 1, dtype=torch.bool)
    ids2 = ids.clone()
    ids2[:, anchor + t - 1] = (ids2[:, anchor + t - 1] + 11) % USED_VOCAB
    with torch.no_grad():
        a = draft(ids, feats, anchors, replace_mask=replace)
        b = draft(ids2, feats, anchors, replace_mask=replace)
        c = draft(ids2, feats, anchors)  # no replacement: the true token is only a label
    first_a, first_b = a.layer_features[0][:, 0], b.layer_features[0][:, 0]  # (B, Bk-1, r)
    slot = t - 1  # index of slot t among slots 1..Bk-1
    assert not torch.allclose(first_a[:, slot], first_b[:, slot])
    assert torch.equal(first_a[:, :slot], first_b[:, :slot])  # same-layer: only slot t moved
    assert torch.equal(first_a[:, slot + 1 :], first_b[:, slot + 1 :])
    if block_attention == "causal":
        assert torch.equal(a.hidden[:, 0, : t], b.hidden[:, 0, : t])
        assert not torch.allclose(a.hidden[:, 0, t + 1 :], b.hidden[:, 0, t + 1 :])
    else:
        assert not torch.allclose(a.hidden[:, 0, 1:t], b.hidden[:, 0, 1:t])
    with torch.no_grad():
        d = draft(ids, feats, anchors)
    assert torch.equal(c.hidden, d.hidden)


def test_adjacent_chain_unrolls_along_depth(target, batch):
    """Without attention between slots the predecessor's message reaches slot t+d after d+1
    layers: perturbing slot 1's predecessor (the anchor code) moves slot 1 at layer 1, slot 2
    at layer 2, slot 3 at layer 3, and no further slot earlier than that."""
    ids, _ = batch
    draft = tiny_draft(target, num_layers=3)
    randomise_injection(draft)
    anchor = 12
    anchors = torch.tensor([[anchor]] * 2)
    feats, _ = context_features(target, draft, ids)
    # cut every intra-block attention path except a slot's own, to isolate the injection chain
    from dspine_train.modeling import attention_masks as am

    def no_block_mixing(anchors_, seq_len, bk, causal, window=None):
        mask = am.dense_training_mask(anchors_, seq_len, bk, causal, window)
        q = mask.shape[-2]
        blk = mask[..., seq_len:]
        mask[..., seq_len:] = blk & torch.eye(q, dtype=torch.bool)
        return mask

    original = am.dense_training_mask
    import dspine_train.modeling.modeling_dspine as md

    md.dense_training_mask = no_block_mixing
    try:
        codes = draft.token_codes.clone()
        with torch.no_grad():
            a = draft(ids, feats, anchors)
            draft.token_codes[ids[:, anchor]] += 0.5  # only the anchor's code changes
            b = draft(ids, feats, anchors)
            draft.token_codes.copy_(codes)
    finally:
        md.dense_training_mask = original
    for layer in range(3):
        fa, fb = a.layer_features[layer][:, 0], b.layer_features[layer][:, 0]  # (B, Bk-1, r)
        reached = layer + 1  # slots 1..layer+1 have heard the anchor by now
        assert not torch.allclose(fa[:, reached - 1], fb[:, reached - 1]), layer
        assert torch.equal(fa[:, reached:], fb[:, reached:]), layer


# Dense vs (compiled) flex attention: tests/test_flex_attention.py.


def test_gradients_reach_every_trainable_parameter_and_not_the_target(target, batch):
    ids, anchors = batch
    draft = tiny_draft(target)
    randomise_injection(draft)
    for p in target.parameters():
        p.requires_grad_(True)
        p.grad = None
    feats, _ = context_features(target, draft, ids)
    replace = torch.tensor([[True, False, True, False]] * 2)
    out = draft(ids, feats, anchors, replace_mask=replace)
    loss = draft.logits(out.hidden).logsumexp(-1).mean()
    loss = loss + sum(f.pow(2).mean() for f in out.layer_features)
    cand = torch.topk(draft.logits(out.hidden[..., 1:, :]).detach(), 4, dim=-1).indices
    loss = loss + draft.refined_scores(out.pre_injection[..., 1:, :], out.recv_features,
                                       cand[..., :1], cand).mean()
    loss.backward()
    missing = [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert all(p.grad is None for p in target.parameters())
    assert not draft.token_codes.requires_grad
    for p in target.parameters():
        p.requires_grad_(False)


@pytest.mark.parametrize("causal", [True, False])
def test_inference_forward_matches_training_forward(target, batch, causal):
    ids, _ = batch
    attention = "causal" if causal else "bidirectional"
    draft = tiny_draft(target, block_attention=attention)
    randomise_injection(draft)
    feats, _ = context_features(target, draft, ids)
    anchor = torch.tensor([17, 9])  # ragged: each sequence has its own committed length
    cache = draft.new_context_cache(2, 48)
    # commit the context in two uneven pieces, with padding rows beyond each count
    draft.append_context(cache, feats[:, :8], torch.tensor([5, 8]))
    rest = torch.stack([feats[0, 5:25], feats[1, 8:28]])
    draft.append_context(cache, rest, anchor - torch.tensor([5, 8]))
    assert cache.lengths.tolist() == anchor.tolist()
    anchor_ids = ids[torch.arange(2), anchor]
    logits, pre, recv = draft.draft_forward(cache, anchor_ids)
    with torch.no_grad():
        train = draft(ids, feats, anchor[:, None])
    torch.testing.assert_close(pre, train.pre_injection[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recv, train.recv_features[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, draft.logits(train.hidden[:, 0, 1:]), rtol=1e-5, atol=1e-5)
    # crop back and re-append: the same block again
    draft.crop_context(cache, torch.tensor([4, 4]))
    draft.append_context(cache, torch.stack([feats[0, 4:17], feats[1, 4:17]]), anchor - 4)
    logits2, _, _ = draft.draft_forward(cache, anchor_ids)
    torch.testing.assert_close(logits2, logits, rtol=1e-5, atol=1e-5)


def test_bind_target_rejects_wrong_shapes(target):
    draft = tiny_draft(target)
    with pytest.raises(ValueError, match="lm_head_weight"):
        draft.bind_target(target.model.embed_tokens.weight, torch.zeros(10, 64))


def test_token_table_shape_is_checked(target):
    from dspine_train.token_table import build_token_table

    draft = tiny_draft(target)
    with pytest.raises(ValueError, match="transfer_dim"):
        draft.init_token_table(build_token_table(target.lm_head.weight.detach(), 16))


class TestConfig:
    def test_from_target_derives_the_spec_layers(self):
        from transformers import Qwen3Config

        target = Qwen3Config(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936)
        cfg = DSpineConfig.from_target(target, used_vocab_size=151669, num_layers=5)
        assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
        assert cfg.mask_token_id == 151669
        assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (4096, 8, 128)
        assert cfg.transfer_dim == 1024 and cfg.message_size == 512

    def test_from_target_uses_the_tokenizer_length(self, target):
        class Tok:
            def __len__(self):
                return 200

        cfg = DSpineConfig.from_target(target.config, Tok(), num_layers=2)
        assert cfg.mask_token_id == 200 and cfg.target_vocab_size == 200

    @pytest.mark.parametrize(
        ("override", "field"),
        [
            ({"hidden_size": 32}, "hidden_size"),
            ({"vocab_size": 300}, "vocab_size"),
            ({"target_layer_ids": [1, 9]}, "target_layer_ids"),
            ({"mask_token_id": 10}, "mask_token_id"),
            ({"candidate_k": 10_000}, "candidate_k"),
            ({"transfer_dim": 65}, "transfer_dim"),
            ({"block_attention": "sideways"}, "block_attention"),
        ],
    )
    def test_inconsistent_config_names_the_field(self, target, override, field):
        with pytest.raises(ValueError, match=field):
            DSpineConfig.from_target(target.config, used_vocab_size=USED_VOCAB, **override)

    def test_missing_mask_id_source_is_an_error(self, target):
        with pytest.raises(ValueError, match="mask_token_id"):
            DSpineConfig.from_target(target.config)


@pytest.mark.parametrize("shape", [(7, 64), (1, 3, 64), (2, 5, 64), (4, 9, 64)])
def test_vocab_projection_equals_the_linear_head(shape):
    """The few-row CPU path ((head @ x^T)^T) and F.linear give the same logits and gradients."""
    from dspine_train.modeling.layers import vocab_projection

    g = torch.Generator().manual_seed(0)
    head = torch.randn(300, 64, generator=g)
    x = torch.randn(shape, generator=g, requires_grad=True)
    out = vocab_projection(x, head)
    ref = torch.nn.functional.linear(x, head)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-3)  # grads are O(100)
