"""`method: dflash2` and its speculators export, proven against `speculators`' DFlash2 class.

The reference is `speculators==0.9.0`'s `DFlash2DraftModel` (`speculators/models/dflash2`):
the DFlash backbone (anchor given, B-1 drafted slots) with a grouped dynamic causal convolution
around every layer's attention and MLP, and a rank-r candidate selector over each slot's top-k.
Its forward computes only a loss, so its unary logits and candidate scores are read where it
hands them to its loss (`compute_metrics`, swapped for a recorder): the very tensors its
trainer sees, the selector's predecessor teacher-forced from the block's true tokens. A tiny
random Qwen3 target, CPU, fp32, `eager` attention (see `test_speculators_dspark.py`).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from _engine_helpers import (
    build_tiny_target,
    edited_export,
    hf_features,
    nontrivial_dflash2,
    tiny_draft,
)
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from dspine_train.modeling import DSpineConfig, DSpineDraftModel

VOCAB = 200  # ids the tokenizer would use; the mask token is 200
LAYERS = 6  # target depth
BLOCK = 8
RANK = 12
TOP_K = 5
GROUP = 8


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target loaded from its directory (so drafts know its path) and a `method:
    dflash2` draft saved in our format and exported in the speculators format."""
    root = tmp_path_factory.mktemp("dflash2")
    build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=LAYERS,
                      eos_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    draft = nontrivial_dflash2(tiny_draft(hf, VOCAB, method="dflash2", selector_rank=RANK,
                                   selector_top_k=TOP_K, conv_group_size=GROUP))
    draft.save_pretrained(root / "ours")
    assert export_main([str(root / "ours"), str(root / "spec"), "--format", "speculators"]) == 0
    prompts = [[5, 17, 3], [9, 140, 33, 61, 2, 77, 18]]
    return {"root": root, "hf": hf, "prompts": prompts}


def _their_config(path) -> DFlash2SpeculatorConfig:
    config = DFlash2SpeculatorConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"  # not the compiled flex mask
    return config


def _theirs(path) -> DFlash2DraftModel:
    """Their model with the verifier's embedding and head (as `SpeculatorModel` loads it)."""
    return SpeculatorModel.from_pretrained(str(path), config=_their_config(path)).eval()


def _ours(world) -> DSpineDraftModel:
    hf = world["hf"]
    ours = load_draft(world["root"] / "ours")
    ours.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    return ours.eval()


@torch.no_grad()
def speculators_block(model: DFlash2DraftModel, feats: torch.Tensor, block: list[int],
                      monkeypatch) -> dict[str, torch.Tensor]:
    """Their unary logits (B, V), candidate ids (B, K) and candidate scores (B, K) for the block
    anchored at position T = len(feats) after context features `feats` (T, n*H): `block` is
    [anchor, x_1..x_{B-1}], the tokens at T..T+B-1; slot k's predecessor is x_{k-1}. One
    anchor (their loss mask picks it; B+1 padding rows, which their mask hides)."""
    seen = {}

    def record(**kwargs):
        seen.update(kwargs)
        return torch.zeros(()), {}

    monkeypatch.setattr("speculators.models.dflash2.core.compute_metrics", record)
    size, (length, width) = model.block_size, feats.shape
    total = length + size + 1
    hidden = torch.cat([feats, torch.zeros(size + 1, width)])[None]
    ids = torch.zeros(1, total, dtype=torch.long)
    ids[0, length:length + size] = torch.tensor(block)
    loss_mask = torch.zeros(1, total)
    loss_mask[0, length] = 1
    model(hidden, ids, loss_mask, torch.zeros(1, total, model.hidden_size),
          torch.zeros(1, total, dtype=torch.long), max_anchors=1)
    return {"unary": seen["unary_logits"][0], "cand": seen["training_candidate_ids"][0],
            "scores": seen["candidate_logits"][0]}


@torch.no_grad()
def our_training_block(draft: DSpineDraftModel, feats: torch.Tensor, block: list[int],
                       cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours for the same block through the training forward: unary logits (B, V) and the
    scores of `cand` (B-1, K) at slots 1..B-1 with the teacher-forced predecessors."""
    size, (length, width) = draft.config.block_size, feats.shape
    ids = torch.zeros(1, length + size + 1, dtype=torch.long)
    ids[0, length:length + size] = torch.tensor(block)
    context = torch.cat([feats, torch.zeros(size + 1, width)])[None]
    out = draft(ids, context, torch.tensor([[length]]), use_flex=False)
    assert out.prev_ids[0, 0].tolist() == block[:-1]  # anchor, then the true tokens
    assert out.labels[0, 0].tolist() == block[1:]  # slot k targets a+k
    normed = draft.norm(out.hidden[0, 0])
    unary = draft.logits(out.hidden[0, 0])
    scores = draft.candidate_selector.score_candidates(unary[1:], normed[1:],
                                                       out.prev_ids[0, 0], cand)
    return unary, scores


@torch.no_grad()
def our_cached_block(draft: DSpineDraftModel, feats: torch.Tensor, block: list[int],
                     cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours through the inference path (context cache, one block): slots 1..B-1's unary logits
    (B-1, V) and the scores of `cand` (B-1, K) given predecessors `block[:-1]`."""
    cache = draft.new_context_cache(1, feats.shape[0] + draft.config.block_size)
    draft.append_context(cache, feats[None], torch.tensor([feats.shape[0]]))
    unary, pre, _ = draft.draft_forward(cache, torch.tensor([block[0]]))
    normed = draft.norm(pre[0, 1:])
    scores = draft.candidate_selector.score_candidates(unary[0], normed,
                                                       torch.tensor(block[:-1]), cand)
    return unary[0], scores


# ----------------------------------------------------------------------------- the client
def test_speculators_loads_our_export_with_every_weight(world):
    root = world["root"]
    _, info = DFlash2DraftModel.from_pretrained(str(root / "spec"), config=_their_config(
        root / "spec"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    theirs = SpeculatorModel.from_pretrained(str(root / "spec"))
    assert type(theirs) is DFlash2DraftModel  # picked by `speculators_model_type`
    ours = load_draft(root / "ours")
    assert theirs.target_layer_ids == [i + 1 for i in ours.config.target_layer_ids]
    assert (theirs.block_size, theirs.mask_token_id) == (BLOCK, VOCAB)
    assert not theirs.config.sample_from_anchor
    assert theirs.candidate_selector.top_k == TOP_K
    assert theirs.candidate_selector.predecessor_codebook.shape == (256, RANK)
    assert theirs.layers[0].attention_conv.num_groups == ours.config.hidden_size // GROUP
    mine = ours.state_dict()
    for name, tensor in theirs.state_dict().items():
        if name.startswith("candidate_selector.") or "_conv." in name:
            assert tensor.equal(mine[name]), name


def test_speculators_computes_our_logits_and_selector_scores(world, monkeypatch):
    """Their DFlash2 forward and ours agree on every slot's unary logits (through the
    convolutions) and every candidate's selector score, through our training forward and our
    inference path alike."""
    theirs, ours, hf = _theirs(world["root"] / "spec"), _ours(world), world["hf"]
    for prompt in world["prompts"]:
        _, feats = hf_features(hf, prompt, ours.config.target_layer_ids)
        for block in ([prompt[-1], 7, 7, 150, 3, 42, 0, 199], [42, *range(60, 67)]):
            ref = speculators_block(theirs, feats, block, monkeypatch)
            assert ref["unary"].shape == (BLOCK, hf.config.vocab_size)
            cand = ref["cand"][1:]
            unary, scores = our_training_block(ours, feats, block, cand)
            torch.testing.assert_close(unary, ref["unary"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(scores, ref["scores"][1:], rtol=1e-5, atol=1e-5)
            unary, scores = our_cached_block(ours, feats, block, cand)
            torch.testing.assert_close(unary, ref["unary"][1:], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(scores, ref["scores"][1:], rtol=1e-5, atol=1e-5)
    # the comparison sees the predecessors: another x_k moves slot k+1's scores only
    _, feats = hf_features(hf, world["prompts"][1], ours.config.target_layer_ids)
    a = speculators_block(theirs, feats, [42, *range(60, 67)], monkeypatch)
    b = speculators_block(theirs, feats, [42, 60, 61, 99, 63, 64, 65, 66], monkeypatch)
    assert torch.equal(a["unary"], b["unary"])  # the block input is the anchor and masks only
    moved = [k for k in range(BLOCK) if not torch.allclose(a["scores"][k], b["scores"][k])]
    assert moved == [4]


def test_the_convolution_and_selector_matter(world):
    """With the convolutions at the identity our draft is its DFlash backbone (same unary
    logits as the same weights under method: dflash); with them trained it is not."""
    ours = _ours(world)
    hf = world["hf"]
    fields = {k: v for k, v in ours.config.to_dict().items()
              if k in DSpineConfig.own_fields() and k not in (
                  "method", "conv_kernel_size", "conv_group_size", "selector_rank",
                  "selector_top_k")}
    plain = DSpineDraftModel(DSpineConfig(method="dflash", **fields)).eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items()
                           if k in plain.state_dict()})
    plain.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    _, feats = hf_features(hf, world["prompts"][1], ours.config.target_layer_ids)

    def unary(draft):
        cache = draft.new_context_cache(1, feats.shape[0] + BLOCK)
        draft.append_context(cache, feats[None], torch.tensor([feats.shape[0]]))
        return draft.draft_forward(cache, torch.tensor([42]))[0]

    assert not torch.allclose(unary(ours), unary(plain), atol=1e-3)
    for layer in ours.layers:
        layer.reset_convolutions()
    torch.testing.assert_close(unary(ours), unary(plain), rtol=1e-5, atol=1e-5)


def test_the_walk_is_the_reference_selector_decoded_left_to_right(world):
    """Greedy: each slot takes the candidate the reference selector scores best given the token
    drafted before it (slot 1: the anchor); our walk returns exactly those tokens."""
    theirs, ours, hf = _theirs(world["root"] / "spec"), _ours(world), world["hf"]
    for prompt in world["prompts"]:
        _, feats = hf_features(hf, prompt, ours.config.target_layer_ids)
        cache = ours.new_context_cache(1, feats.shape[0] + BLOCK)
        ours.append_context(cache, feats[None], torch.tensor([feats.shape[0]]))
        unary, pre, _ = ours.draft_forward(cache, torch.tensor([prompt[-1]]))
        normed = ours.norm(pre[0, 1:])
        prev, naive = torch.tensor(prompt[-1]), []
        for j in range(BLOCK - 1):
            cand, scores = theirs.candidate_selector.select(unary[0, j], normed[j], prev)
            prev = cand[scores.argmax()]
            naive.append(int(prev))
        cache.crop(torch.tensor([feats.shape[0]]))
        drafted = ours.propose(cache, torch.tensor([prompt[-1]])).tokens[0].tolist()
        assert drafted == naive
        # the selector changes the draft here: plain per-slot argmax differs somewhere
        assert naive != unary[0].argmax(-1).tolist()


def test_the_keys_vllm_reads_are_the_ones_speculators_writes(world, tmp_path):
    """Our config.json carries DFlash2's keys; speculators' own config class and
    `save_pretrained` write it back unchanged (but for their remote-code hook), and the same
    tensors."""
    root = world["root"]
    fields = json.loads((root / "spec" / "config.json").read_text())
    ours = load_draft(root / "ours").config
    assert fields["speculators_model_type"] == "dflash2"
    assert fields["architectures"] == ["DFlash2DraftModel"]
    assert fields["aux_hidden_state_layer_ids"] == [i + 1 for i in ours.target_layer_ids]
    assert (fields["block_size"], fields["mask_token_id"]) == (BLOCK, VOCAB)
    assert fields["sample_from_anchor"] is False
    assert {k: fields[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                   "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": GROUP, "selector_rank": RANK,
        "selector_top_k": TOP_K}
    spec = fields["speculators_config"]
    assert spec["algorithm"] == "dflash2"
    assert spec["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    DFlash2SpeculatorConfig.from_pretrained(str(root / "spec")).save_pretrained(tmp_path / "cfg")
    written = json.loads((tmp_path / "cfg" / "config.json").read_text())
    written.pop("auto_map", None)
    assert written == fields
    theirs = DFlash2DraftModel.from_pretrained(str(root / "spec"))
    theirs.save_pretrained(tmp_path / "resaved")
    again = json.loads((tmp_path / "resaved" / "config.json").read_text())
    again.pop("auto_map", None)
    assert again == fields
    _same_tensors(root / "spec", tmp_path / "resaved")
    (tmp_path / "resaved" / "config.py").unlink(missing_ok=True)
    assert load_draft(tmp_path / "resaved").config.to_dict() == load_draft(
        root / "spec").config.to_dict() | {"_name_or_path": str(tmp_path / "resaved")}


def _same_tensors(a, b) -> None:
    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert left.keys() == right.keys()
    assert all(left[k].dtype == right[k].dtype and left[k].equal(right[k]) for k in left)


# ----------------------------------------------------------------------------- round trips
def test_export_reloads_bit_identically(world, tmp_path):
    """speculators export -> import -> export: the same files; the imported draft is ours."""
    root = world["root"]
    original, imported = load_draft(root / "ours"), load_draft(root / "spec")
    cfg = imported.config
    assert (cfg.method, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank,
            cfg.selector_top_k) == ("dflash2", 2, GROUP, RANK, TOP_K)
    for name in ("target_layer_ids", "target_num_layers", "block_size", "mask_token_id",
                 "hidden_size", "num_layers", "rope_parameters", "target_name_or_path"):
        assert getattr(cfg, name) == getattr(original.config, name), name
    mine = original.state_dict()
    saved = load_file(root / "spec" / "model.safetensors")
    assert any("attention_conv" in k for k in saved) and any("mlp_conv" in k for k in saved)
    for name, tensor in saved.items():
        assert tensor.equal(mine[name]), name
        assert imported.state_dict()[name].equal(tensor), name
    export_dir(root / "spec", tmp_path / "again", "speculators")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads(
        (root / "spec" / "config.json").read_text())
    _same_tensors(root / "spec", tmp_path / "again")
    export_dir(root / "spec", tmp_path / "dspine", "dspine")
    back = DSpineDraftModel.from_pretrained(str(tmp_path / "dspine"))
    assert back.config.method == "dflash2" and back.config.selector_rank == RANK
    for name, tensor in mine.items():
        if name.startswith("candidate_selector.") or "_conv." in name:
            assert back.state_dict()[name].equal(tensor), name


def test_an_untrained_dflash2_is_its_dflash_backbone_and_config_round_trips(tmp_path):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_layers=2, target_num_layers=6,
                  block_size=7, mask_token_id=63, transfer_dim=8, message_size=8, candidate_k=4)
    config = DSpineConfig(method="dflash2", conv_group_size=8, selector_rank=6, **fields)
    config.save_pretrained(tmp_path)
    again = DSpineConfig.from_pretrained(tmp_path)
    assert again.to_dict() == config.to_dict()
    assert (again.injection, again.block_attention, again.transition_cache) == (
        False, "bidirectional", False)
    assert (again.conv_kernel_size, again.selector_top_k, again.num_predictions) == (2, 16, 6)
    draft = DSpineDraftModel(config)
    conv = draft.layers[0].attention_conv
    assert conv.base_kernel[:, 0].eq(1).all() and conv.base_kernel[:, 1:].eq(0).all()
    assert conv.kernel_projection.weight.eq(0).all()
    assert draft.candidate_selector.predecessor_codebook.std() > 0
    plain = DSpineConfig(**fields)
    assert (plain.conv_kernel_size, plain.selector_rank) == (0, 0)
    assert DSpineDraftModel(plain).candidate_selector is None


@pytest.mark.parametrize(("settings", "message"), [
    ({"method": "dflash2", "injection": True}, r"method: dflash2 .* injection=True"),
    ({"selector_rank": 8}, r"method: dspine .* selector_rank=8 \(dspine: 0\)"),
    ({"method": "dflash", "conv_kernel_size": 2}, r"conv_kernel_size=2 \(dflash: 0\)"),
    ({"method": "dflash2", "conv_group_size": 5}, r"conv_group_size \(5\) must divide"),
    ({"method": "dflash2", "conv_kernel_size": 9}, r"conv_kernel_size \(9\) cannot exceed"),
    ({"method": "dflash2", "selector_rank": 0}, r"selector_rank must be >= 1"),
    ({"method": "dflash2", "selector_top_k": 65}, r"selector_top_k \(65\) cannot exceed"),
    ({"method": "dflash2", "draft_vocab_size": 32}, r"draft_vocab_size=32: method: dflash2"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    fields = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, transfer_dim=8, message_size=8, candidate_k=4, block_size=8,
                  conv_group_size=None if settings.get("method") != "dflash2" else 8)
    fields.update(settings)
    with pytest.raises(ValueError, match=message):
        DSpineConfig(**fields)


def test_formats_that_cannot_hold_a_dflash2_draft_refuse_it(world, capsys):
    root = world["root"]
    for fmt, words in (("specforge", "method='dflash2' (use --format speculators)"),
                       ("deepspec", "method: dflash2 cannot be exported with --format deepspec")):
        out = root / f"refused_{fmt}"
        assert export_main([str(root / "ours"), str(out), "--format", fmt]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
        assert not out.exists()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f, t: f.update(sample_from_anchor=True), r"sample_from_anchor=True"),
    (lambda f, t: f.update(draft_vocab_size=100), r"draft_vocab_size=100 \(a pruned"),
    (lambda f, t: f["transformer_layer_config"].update(
        layer_types=["sliding_attention", "full_attention"]), r"layer_types"),
    (lambda f, t: t.pop("candidate_selector.successor_codebook"),
     r"missing: candidate_selector\.successor_codebook"),
    (lambda f, t: t.pop("layers.1.mlp_conv.base_kernel"), r"missing: layers\.1\.mlp_conv"),
    (lambda f, t: f.update(selector_rank=8),
     r"mismatched: .*predecessor_codebook \(256, 12\) \(expected \(256, 8\)\)"),
    (lambda f, t: f.update(conv_group_size=16), r"mismatched: .*kernel_projection"),
    (lambda f, t: t.update(extra=torch.zeros(1)), r"unexpected: extra"),
])
def test_a_speculators_dflash2_checkpoint_we_cannot_run_is_refused(world, tmp_path, edit,
                                                                    message):
    with pytest.raises(FormatError, match=message):
        load_draft(edited_export(world["root"] / "spec", tmp_path / "edited", edit))


def test_the_convolution_is_the_references_over_many_blocks():
    """Blocks laid end to end (the training forward's layout): each block convolved on its own,
    no tap reaching into the block before, as speculators' `grouped_dynamic_conv` computes it
    over the flattened sequence; kernels of 1 to 3 taps."""
    from speculators.models.dflash2.model_definitions import grouped_dynamic_conv as theirs

    from dspine_train.modeling.dflash2_layers import grouped_dynamic_conv as ours

    torch.manual_seed(0)
    blocks, size, width, group = 3, 5, 32, 8
    x = torch.randn(1, blocks * size, width)
    for taps in (1, 2, 3):
        delta = torch.randn(1, blocks * size, taps, width // group)
        base = torch.randn(taps, width)
        expected = theirs(x, delta, base, block_size=size, group_size=group)
        torch.testing.assert_close(ours(x, delta, base, size, group), expected)
        # a change in one block leaves the others alone
        moved = x.clone()
        moved[0, size - 1] += 1.0  # the last slot of block 0
        out = ours(moved, delta, base, size, group)
        torch.testing.assert_close(out[0, size:], expected[0, size:])
