"""`method: dspark` and its speculators export, proven against `speculators`' DSpark class.

The reference is `speculators==0.9.0`'s `DSparkDraftModel` (`speculators/models/dspark`): the
DFlash backbone with the anchor slot predicting, a first-order Markov head and a confidence
head. Its forward computes only a loss, so its logits and confidence logits are read where it
hands them to its loss (`compute_metrics`, swapped for a recorder): the very tensors its
trainer sees, with the Markov term teacher-forced from the block's true tokens. A tiny random
Qwen3 target, CPU, fp32, `eager` attention (see `test_speculators_format.py`).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from _engine_helpers import build_tiny_target, edited_export, hf_features, tiny_draft
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

from dspine_train.engine import Engine
from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.training.config import compose_train_config

VOCAB = 200  # ids the tokenizer would use; the mask token is 200
LAYERS = 6  # target depth
BLOCK = 8
RANK = 16


def _nontrivial(draft: DSpineDraftModel) -> DSpineDraftModel:
    """Norm weights off one and heads large enough to move the logits, so a misplaced norm, a
    shifted previous token or a dropped head shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
        draft.markov_head.markov_w1.weight.normal_(std=1.0)
        draft.markov_head.markov_w2.weight.normal_(std=0.5)
        draft.confidence_head.proj.bias.fill_(0.3)
    return draft


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target loaded from its directory (so drafts know its path) and a `method:
    dspark` draft saved in our format and exported in the speculators format."""
    root = tmp_path_factory.mktemp("dspark")
    build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=LAYERS,
                      eos_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    draft = _nontrivial(tiny_draft(hf, VOCAB, method="dspark", markov_rank=RANK))
    draft.save_pretrained(root / "ours")
    assert export_main([str(root / "ours"), str(root / "spec"), "--format", "speculators"]) == 0
    prompts = [[5, 17, 3], [9, 140, 33, 61, 2, 77, 18]]
    return {"root": root, "hf": hf, "prompts": prompts}


def _their_config(path) -> DSparkSpeculatorConfig:
    config = DSparkSpeculatorConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"  # not the compiled flex mask
    return config


def _theirs(path) -> DSparkDraftModel:
    """Their model with the verifier's embedding and head (as `SpeculatorModel` loads it)."""
    return SpeculatorModel.from_pretrained(str(path), config=_their_config(path)).eval()


def _ours(world) -> DSpineDraftModel:
    hf = world["hf"]
    ours = load_draft(world["root"] / "ours")
    ours.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    return ours.eval()


@torch.no_grad()
def speculators_block(model: DSparkDraftModel, feats: torch.Tensor, block: list[int],
                      monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Their slot logits (B, V) and confidence logits (B,) for the block anchored at position T
    = len(feats) after context features `feats` (T, n*H): `block` is [anchor, x_1..x_{B-1}],
    the tokens at T..T+B-1, whose x_k is slot k's teacher-forced previous token. One anchor
    (their loss mask picks the anchors, never in the last B positions, hence B+1 padding rows,
    which their mask hides from the block)."""
    seen = {}

    def record(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return torch.zeros(()), {}

    monkeypatch.setattr("speculators.models.dspark.core.compute_metrics", record)
    size, (length, width) = model.block_size, feats.shape
    total = length + size + 1
    hidden = torch.cat([feats, torch.zeros(size + 1, width)])[None]
    ids = torch.zeros(1, total, dtype=torch.long)
    ids[0, length:length + size] = torch.tensor(block)
    loss_mask = torch.zeros(1, total)
    loss_mask[0, length] = 1
    model(hidden, ids, loss_mask, torch.zeros(1, total, model.hidden_size),
          torch.zeros(1, total, dtype=torch.long), max_anchors=1)
    return seen["logits"][0], seen["confidence"][0]


@torch.no_grad()
def our_training_block(draft: DSpineDraftModel, feats: torch.Tensor, block: list[int]):
    """Ours for the same block through the training forward (teacher-forced `prev_ids`)."""
    size, (length, width) = draft.config.block_size, feats.shape
    ids = torch.zeros(1, length + size + 1, dtype=torch.long)
    ids[0, length:length + size] = torch.tensor(block)
    context = torch.cat([feats, torch.zeros(size + 1, width)])[None]
    out = draft(ids, context, torch.tensor([[length]]), use_flex=False)
    assert out.prev_ids[0, 0].tolist() == block  # anchor, then the true tokens
    assert out.labels[0, 0].tolist() == [*block[1:], 0]  # slot k targets a+k+1
    result = draft.dspark_block(out.hidden, out.prev_ids)
    return result.logits[0, 0], result.confidence[0, 0]


@torch.no_grad()
def our_cached_block(draft: DSpineDraftModel, feats: torch.Tensor, block: list[int]):
    """Ours for the same block through the inference path (context cache, one block), the
    Markov term from the given previous tokens."""
    cache = draft.new_context_cache(1, feats.shape[0] + draft.config.block_size)
    draft.append_context(cache, feats[None], torch.tensor([feats.shape[0]]))
    base, pre, _ = draft.draft_forward(cache, torch.tensor([block[0]]))
    result = draft.dspark_block(pre, torch.tensor([block]))
    # draft_forward's base logits are the slots' logits before the Markov term
    markov = draft.markov_head.bias(draft.markov_head.embed(torch.tensor([block])))
    torch.testing.assert_close(result.logits, base + markov, rtol=1e-5, atol=1e-5)
    return result.logits[0], result.confidence[0]


# ----------------------------------------------------------------------------- the client
def test_speculators_loads_our_export_with_every_weight(world):
    root = world["root"]
    _, info = DSparkDraftModel.from_pretrained(str(root / "spec"), config=_their_config(
        root / "spec"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # its generic entry point picks its DSpark class from `speculators_model_type`
    theirs = SpeculatorModel.from_pretrained(str(root / "spec"))
    assert type(theirs) is DSparkDraftModel
    ours = load_draft(root / "ours")
    assert theirs.target_layer_ids == [i + 1 for i in ours.config.target_layer_ids]
    assert (theirs.block_size, theirs.mask_token_id) == (BLOCK, VOCAB)
    assert theirs.config.sample_from_anchor and theirs.markov_head.markov_rank == RANK
    assert theirs.confidence_head.proj.in_features == ours.config.hidden_size + RANK
    mine = ours.state_dict()
    for name, tensor in theirs.state_dict().items():
        if name.startswith(("markov_head.", "confidence_head.")):
            assert tensor.equal(mine[name]), name


def test_speculators_computes_our_logits_and_confidence(world, monkeypatch):
    """Their DSpark forward and ours agree on every slot's logits (Markov term included) and
    confidence logits, through our training forward and our inference path alike."""
    theirs, ours, hf = _theirs(world["root"] / "spec"), _ours(world), world["hf"]
    for prompt in world["prompts"]:
        _, feats = hf_features(hf, prompt, ours.config.target_layer_ids)
        for block in ([prompt[-1], 7, 7, 150, 3, 42, 0, 199], [42, *range(60, 67)]):
            ref_logits, ref_conf = speculators_block(theirs, feats, block, monkeypatch)
            assert ref_logits.shape == (BLOCK, hf.config.vocab_size)
            for logits, conf in (our_training_block(ours, feats, block),
                                 our_cached_block(ours, feats, block)):
                torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(conf, ref_conf, rtol=1e-5, atol=1e-5)
    # the comparison sees the previous tokens: another x_k moves slot k only
    _, feats = hf_features(hf, world["prompts"][1], ours.config.target_layer_ids)
    a, _ = speculators_block(theirs, feats, [42, *range(60, 67)], monkeypatch)
    b, _ = speculators_block(theirs, feats, [42, 60, 61, 99, 63, 64, 65, 66], monkeypatch)
    moved = [k for k in range(BLOCK) if not torch.allclose(a[k], b[k])]
    assert moved == [3]


def test_the_keys_vllm_reads_are_the_ones_speculators_writes(world, tmp_path):
    """vLLM's speculators reader takes `speculators_model_type: dspark` and the heads' keys;
    speculators' own config class and `save_pretrained` write our config.json back unchanged
    (but for their remote-code hook), and the same tensors."""
    root = world["root"]
    fields = json.loads((root / "spec" / "config.json").read_text())
    ours = load_draft(root / "ours").config
    assert fields["speculators_model_type"] == "dspark"
    assert fields["architectures"] == ["DSparkDraftModel"]
    assert fields["aux_hidden_state_layer_ids"] == [i + 1 for i in ours.target_layer_ids]
    assert (fields["block_size"], fields["mask_token_id"]) == (BLOCK, VOCAB)
    assert fields["sample_from_anchor"] is True
    assert {k: fields[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov")} == {
        "markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True}
    spec = fields["speculators_config"]
    assert spec["algorithm"] == "dspark"
    assert spec["proposal_methods"][0]["speculative_tokens"] == BLOCK  # the anchor drafts too
    assert spec["verifier"] == {"name_or_path": str(root / "target"),
                                "architectures": ["Qwen3ForCausalLM"]}
    DSparkSpeculatorConfig.from_pretrained(str(root / "spec")).save_pretrained(tmp_path / "cfg")
    written = json.loads((tmp_path / "cfg" / "config.json").read_text())
    assert written.pop("auto_map") == {"": "config.DSparkSpeculatorConfig"}
    assert written == fields
    theirs = DSparkDraftModel.from_pretrained(str(root / "spec"))
    theirs.save_pretrained(tmp_path / "resaved")
    again = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert again.pop("auto_map") == {"": "config.DSparkSpeculatorConfig"}
    assert again == fields
    _same_tensors(root / "spec", tmp_path / "resaved")
    # and what they wrote reads back here as our draft
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
    assert (cfg.method, cfg.markov_rank, cfg.enable_confidence_head,
            cfg.confidence_head_with_markov) == ("dspark", RANK, True, True)
    for name in ("target_layer_ids", "target_num_layers", "block_size", "mask_token_id",
                 "hidden_size", "num_layers", "rope_parameters", "target_name_or_path"):
        assert getattr(cfg, name) == getattr(original.config, name), name
    mine = original.state_dict()
    for name, tensor in load_file(root / "spec" / "model.safetensors").items():
        assert tensor.equal(mine[name]), name
        assert imported.state_dict()[name].equal(tensor), name
    assert export_dir(root / "spec", tmp_path / "again", "speculators") == tmp_path / "again"
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads(
        (root / "spec" / "config.json").read_text())
    _same_tensors(root / "spec", tmp_path / "again")
    # our own format keeps the heads and every DSpark field
    export_dir(root / "spec", tmp_path / "dspine", "dspine")
    back = DSpineDraftModel.from_pretrained(str(tmp_path / "dspine"))
    assert back.config.method == "dspark" and back.config.markov_rank == RANK
    assert back.markov_head.markov_w2.weight.equal(mine["markov_head.markov_w2.weight"])


def test_config_round_trips(tmp_path):
    config = DSpineConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_layers=2, target_num_layers=6, block_size=7, mask_token_id=63,
                          transfer_dim=8, message_size=8, candidate_k=4, method="dspark",
                          markov_rank=12, enable_confidence_head=True,
                          confidence_head_with_markov=False)
    config.save_pretrained(tmp_path)
    again = DSpineConfig.from_pretrained(tmp_path)
    assert again.to_dict() == config.to_dict()
    assert (again.injection, again.block_attention, again.transition_cache) == (
        False, "bidirectional", False)
    assert again.num_predictions == 7 and again.anchor_predicts
    # the method's values fill the fields left unset
    fields = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, transfer_dim=8, message_size=8, candidate_k=4)
    preset = DSpineConfig(method="dspark", **fields)
    assert (preset.markov_rank, preset.markov_head_type, preset.enable_confidence_head,
            preset.confidence_head_with_markov) == (256, "vanilla", True, True)
    assert DSpineConfig(method="dspark", markov_rank=0, **fields).confidence_head_with_markov \
        is False
    plain = DSpineConfig(**fields)
    assert (plain.markov_rank, plain.enable_confidence_head, plain.num_predictions) == (
        0, False, 15)
    draft = DSpineDraftModel(DSpineConfig(method="dspark", markov_rank=0,
                                          enable_confidence_head=False, **fields))
    assert draft.markov_head is None and draft.confidence_head is None


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("settings", "message"), [
    ({"method": "dspark", "injection": True}, r"method: dspark .* injection=True \(dspark: False\)"),
    ({"method": "dspark", "block_attention": "causal"}, r"block_attention='causal'"),
    ({"markov_rank": 8}, r"method: dspine .* markov_rank=8 \(dspine: 0\)"),
    ({"method": "dflash", "enable_confidence_head": True}, r"enable_confidence_head=True"),
    ({"method": "dspark", "markov_rank": -1}, r"markov_rank must be >= 0"),
    ({"method": "dspark", "markov_head_type": "rnn"}, r"markov_head_type must be 'vanilla'"),
    ({"method": "dspark", "markov_head_type": "other"}, r"markov_head_type must be 'vanilla'"),
    ({"method": "dspark", "markov_rank": 0, "confidence_head_with_markov": True},
     r"confidence_head_with_markov=True needs markov_rank > 0"),
    ({"method": "dspark", "enable_confidence_head": False, "confidence_head_with_markov": True},
     r"confidence_head_with_markov=True needs enable_confidence_head=True"),
    ({"method": "dspark", "markov_rank": 8.0}, r"markov_rank must be an integer or null"),
    ({"method": "dspark", "enable_confidence_head": "yes"}, r"enable_confidence_head must be"),
    ({"method": "dspark", "draft_vocab_size": 32}, r"draft_vocab_size=32: method: dspark"),
    ({"method": "spark"}, r"method must be one of \['dflash', 'dflash2', 'domino', 'dspark', 'dspine'\]"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    fields = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, transfer_dim=8, message_size=8, candidate_k=4)
    with pytest.raises(ValueError, match=message):
        DSpineConfig(**fields, **settings)


def test_formats_that_cannot_hold_a_dspark_draft_refuse_it(world, capsys):
    root = world["root"]
    for fmt, words in (("dflash", "drop its Markov and confidence heads"),
                       ("specforge", "method='dspark' (use --format speculators)")):
        out = root / f"refused_{fmt}"
        assert export_main([str(root / "ours"), str(out), "--format", fmt]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
        assert not out.exists()


def test_the_engine_serves_a_dspark_draft_and_its_speculators_import_alike(world):
    """A block of block_size drafts, our export and its speculators import alike
    (`test_engine_dspark.py` proves it lossless; the trainer trains DSpark:
    tests/test_train_run.py)."""
    ours = _ours(world)
    cache = ours.new_context_cache(1, 16)
    assert ours.propose(cache, torch.tensor([3])).tokens.shape == (1, BLOCK)
    served = [Engine.from_pretrained(world["root"] / "target", world["root"] / name,
                                     max_seq_len=64, eos_token_ids=[]).generate(
        world["prompts"], max_new_tokens=12, chat=False).token_ids for name in ("ours", "spec")]
    assert served[0] == served[1]
    # the schema knows the head settings (a Literal becomes an Enum)
    with pytest.raises(ConfigCompositionException, match="markov_head_type"):
        compose_train_config("recipe=tiny", "model.markov_head_type=cubic")


def _edited(world, tmp_path, edit):
    """A copy of the speculators export with `edit(fields, tensors)` applied."""
    return edited_export(world["root"] / "spec", tmp_path / "edited", edit)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f, t: f.update(sample_from_anchor=False), r"sample_from_anchor=False"),
    (lambda f, t: f.update(markov_head_type="gated"), r"markov_head_type must be 'vanilla'"),
    (lambda f, t: f.update(draft_vocab_size=100), r"draft_vocab_size=100 \(a pruned"),
    (lambda f, t: f["transformer_layer_config"].update(
        layer_types=["sliding_attention", "full_attention"]), r"layer_types"),
    (lambda f, t: t.pop("markov_head.markov_w1.weight"), r"missing: markov_head\.markov_w1"),
    (lambda f, t: t.pop("confidence_head.proj.bias"), r"missing: confidence_head\.proj\.bias"),
    (lambda f, t: f.update(markov_rank=8),
     r"mismatched: .*markov_head\.markov_w1\.weight \(256, 16\) \(expected \(256, 8\)\)"),
    (lambda f, t: f.update(enable_confidence_head=False),
     r"unexpected: confidence_head\.proj\.bias"),
    (lambda f, t: t.update(extra=torch.zeros(1)), r"unexpected: extra"),
])
def test_a_speculators_dspark_checkpoint_we_cannot_run_is_refused(world, tmp_path, edit, message):
    with pytest.raises(FormatError, match=message):
        load_draft(_edited(world, tmp_path, edit))
