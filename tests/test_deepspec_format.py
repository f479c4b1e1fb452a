"""`--format deepspec`: DeepSpec's own DSpark checkpoint (`Qwen3DSparkModel`), read and written.

DeepSpec is not a package to install, so the format is checked against the keys and tensor
names its class and vLLM's `qwen3_dspark.py` loader read (`dspine_train/formats/deepspec.py`),
and against the speculators format, which `test_speculators_dspark.py` proves against the
reference class: the two exports hold the same network, and either converts to the other.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from _engine_helpers import build_tiny_target, edited_export, hf_features, tiny_draft
from safetensors.torch import load_file

from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft

VOCAB = 200  # ids the tokenizer would use; the mask token is 200
LAYERS = 6
RANK = 16


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target, a `method: dspark` draft with non-trivial heads, its deepspec and
    speculators exports."""
    root = tmp_path_factory.mktemp("deepspec")
    build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=LAYERS,
                      eos_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    draft = tiny_draft(hf, VOCAB, method="dspark", markov_rank=RANK)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    draft.save_pretrained(root / "ours")
    assert export_main([str(root / "ours"), str(root / "ds"), "--format", "deepspec"]) == 0
    assert export_main([str(root / "ours"), str(root / "spec"), "--format", "speculators"]) == 0
    return {"root": root, "hf": hf}


def test_the_config_holds_what_deepspec_and_vllm_read(world):
    root = world["root"]
    fields = json.loads((root / "ds" / "config.json").read_text())
    ours = load_draft(root / "ours").config
    assert fields["architectures"] == ["Qwen3DSparkModel"] and fields["model_type"] == "qwen3"
    # what DeepSpec's Qwen3DSparkModel.__init__ asserts present, and vLLM's reader takes
    assert {k: fields[k] for k in ("target_layer_ids", "mask_token_id", "block_size",
                                   "num_target_layers", "markov_rank", "markov_head_type",
                                   "enable_confidence_head", "confidence_head_with_markov")} == {
        "target_layer_ids": ours.target_layer_ids, "mask_token_id": VOCAB, "block_size": 8,
        "num_target_layers": LAYERS, "markov_rank": RANK, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True}
    assert isinstance(fields["num_anchors"], int)
    assert fields["num_hidden_layers"] == 2 and fields["layer_types"] == ["full_attention"] * 2
    assert fields["tie_word_embeddings"] is False
    # transformers reads it as the Qwen3 config DeepSpec's class is built from
    config = transformers.AutoConfig.from_pretrained(root / "ds")
    assert type(config) is transformers.Qwen3Config and config.markov_rank == RANK
    tensors = load_file(root / "ds" / "model.safetensors")
    hidden = world["hf"].config.hidden_size
    vocab = world["hf"].config.vocab_size
    assert tensors["markov_head.markov_w1.weight"].shape == (vocab, RANK)
    assert tensors["markov_head.markov_w2.weight"].shape == (vocab, RANK)
    assert tensors["confidence_head.proj.weight"].shape == (1, hidden + RANK)
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    assert not any(k.startswith(("injection.", "token_codes", "embed_tokens", "lm_head"))
                   for k in tensors)


def test_deepspec_and_speculators_exports_hold_the_same_draft(world, tmp_path):
    root, hf = world["root"], world["hf"]
    assert load_file(root / "ds" / "model.safetensors").keys() == load_file(
        root / "spec" / "model.safetensors").keys()
    original, from_ds, from_spec = (load_draft(root / name) for name in ("ours", "ds", "spec"))
    for name in ("method", "target_layer_ids", "target_num_layers", "block_size",
                 "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
                 "confidence_head_with_markov", "hidden_size", "num_layers", "rope_parameters"):
        assert getattr(from_ds.config, name) == getattr(original.config, name), name
        assert getattr(from_spec.config, name) == getattr(original.config, name), name
    # the same outputs, bit for bit, with the Markov term teacher-forced
    _, feats = hf_features(hf, [9, 140, 33, 61, 2, 77, 18], original.config.target_layer_ids)
    ids = torch.tensor([[9, 140, 33, 61, 2, 77, 18, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
    context = torch.cat([feats, torch.zeros(ids.shape[1] - feats.shape[0], feats.shape[1])])
    results = []
    for draft in (original, from_ds, from_spec):
        draft.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
        with torch.no_grad():
            out = draft(ids, context[None], torch.tensor([[6, 2]]), use_flex=False)
            results.append(draft.dspark_block(out.hidden, out.prev_ids))
    for other in results[1:]:
        assert other.logits.equal(results[0].logits)
        assert other.confidence.equal(results[0].confidence)
    # deepspec -> speculators is the speculators export; speculators -> deepspec the deepspec one
    export_dir(root / "ds", tmp_path / "spec", "speculators", verifier=str(root / "target"))
    export_dir(root / "spec", tmp_path / "ds", "deepspec")
    for ours, again in ((root / "spec", tmp_path / "spec"), (root / "ds", tmp_path / "ds")):
        assert json.loads((again / "config.json").read_text()) == json.loads(
            (ours / "config.json").read_text())
        left, right = load_file(ours / "model.safetensors"), load_file(again / "model.safetensors")
        assert left.keys() == right.keys() and all(left[k].equal(right[k]) for k in left)


def _edited(world, tmp_path, edit):
    """A copy of the deepspec export with `edit(fields, tensors)` applied."""
    return edited_export(world["root"] / "ds", tmp_path / "edited", edit)


def test_a_published_checkpoint_with_the_targets_copies_loads(world, tmp_path):
    """DeepSpec's checkpoints carry the target's embedding and head: accepted, then dropped."""
    hf = world["hf"]

    def add_copies(fields, tensors):
        tensors["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
        tensors["lm_head.weight"] = hf.lm_head.weight.detach().clone()

    draft = load_draft(_edited(world, tmp_path, add_copies))
    assert "embed_tokens.weight" not in draft.state_dict()
    saved = load_file(world["root"] / "ds" / "model.safetensors")
    assert all(draft.state_dict()[k].equal(v) for k, v in saved.items())


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f, t: f.update(target_layer_ids=[-1, 2]), r"target_layer_ids with -1"),
    (lambda f, t: f.update(model_type="gemma4"), r"only DeepSpec's Qwen3DSparkModel \(qwen3\)"),
    (lambda f, t: f.pop("markov_rank"), r"lacks markov_rank"),
    (lambda f, t: f.pop("confidence_head_with_markov"), r"lacks confidence_head_with_markov"),
    (lambda f, t: f.update(markov_head_type="rnn"), r"markov_head_type must be 'vanilla'"),
    (lambda f, t: f.update(layer_types=["sliding_attention", "full_attention"]), r"layer_types"),
    (lambda f, t: t.pop("markov_head.markov_w2.weight"), r"missing: markov_head\.markov_w2"),
    (lambda f, t: t.update({"lm_head.weight": torch.zeros(3, 3)}),
     r"mismatched: lm_head\.weight \(3, 3\)"),
    (lambda f, t: t.update({"mask_embedding": torch.zeros(3)}), r"unexpected: mask_embedding"),
])
def test_a_deepspec_checkpoint_we_cannot_run_is_refused(world, tmp_path, edit, message):
    with pytest.raises(FormatError, match=message):
        load_draft(_edited(world, tmp_path, edit))


def test_only_a_dspark_draft_is_written_in_it(world, tmp_path, capsys):
    tiny_draft(world["hf"], VOCAB, method="dflash").save_pretrained(tmp_path / "dflash")
    assert export_main([str(tmp_path / "dflash"), str(tmp_path / "out"),
                        "--format", "deepspec"]) == 2
    err = capsys.readouterr().err
    assert "method: dflash cannot be exported with --format deepspec" in err
    assert not (tmp_path / "out").exists()
