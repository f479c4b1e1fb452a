"""`method: dflash` is the reference DFlash draft, proven against z-lab's own client.

The `dflash` package (`dflash==0.1.0`, installed without its dependencies by `make install`:
its pins conflict with ours, and it imports only torch and transformers) runs here with our
pinned transformers 5.24.0 as is, no shim. A tiny random Qwen3 target; everything on CPU, fp32.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from _engine_helpers import (
    build_tiny_target,
    build_tokenizer,
    hf_features,
    hf_greedy,
    tiny_draft,
    train_draft_briefly,
    zlab_draft_config,
)
from dflash.model import DFlashDraftModel
from safetensors.torch import load_file

from dspine_train.engine import Engine
from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.training.config import (
    ConfigError,
    compose_train_config,
)
from dspine_train.training.errors import TrainingError
from dspine_train.training.memory_plan.for_recipe import plan_draft_config
from scripts.tools.bench.reference_parity import (
    compare_rounds,
    our_block_logits,
    record_engine_rounds,
    record_reference_rounds,
    reference_block_logits,
)
from tests._train_helpers import REPO, check_ok, run_train, tiny_overrides, train_env

NEW = 24  # new tokens per prompt
VOCAB = 200  # ids the tokenizer uses; the mask token is 200


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target (6 layers), a briefly trained `method: dflash` draft exported in
    both formats, a DSpine draft, and prompts with the target's greedy continuations."""
    root = tmp_path_factory.mktemp("dflash")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6, eos_token_id=None
    )
    build_tokenizer(root / "target", vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 7, 10, 5)]
    reference = [hf_greedy(hf, p, NEW) for p in prompts]
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts])
    draft = train_draft_briefly(tiny_draft(hf, VOCAB, method="dflash"), hf, sequences,
                                steps=150, lr=1e-2)
    draft.save_pretrained(root / "ours")  # the trainer's (dspine) export
    tiny_draft(hf, VOCAB).save_pretrained(root / "dspine")  # a DSpine draft
    assert export_main([str(root / "ours"), str(root / "ours_dflash"), "--format", "dflash"]) == 0
    return {"root": root, "hf": hf, "prompts": prompts, "reference": reference}


def _bound(draft: DSpineDraftModel, hf) -> DSpineDraftModel:
    draft.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    return draft.eval()


# ----------------------------------------------------------------------------- the preset
def test_method_dflash_fixes_the_network_decode_and_terms(world):
    config = load_draft(world["root"] / "ours").config
    assert config.method == "dflash"
    assert (config.injection, config.block_attention, config.transition_cache) == (
        False, "bidirectional", False)
    assert (config.refine_weight, config.alignment_weight, config.token_ce_intermediate) == (
        0.0, 0.0, False)
    # the default method is DSpine's, with its parts on
    dspine = DSpineConfig.from_target(world["hf"].config, used_vocab_size=VOCAB)
    assert (dspine.method, dspine.injection, dspine.block_attention) == ("dspine", True, "causal")
    # a DSpine switch set against the preset is refused, naming every such key
    with pytest.raises(ValueError, match=r"injection=True.*refine_weight=0\.5"):
        DSpineConfig.from_target(world["hf"].config, used_vocab_size=VOCAB, method="dflash",
                                 injection=True, refine_weight=0.5)
    # restating the preset's own value is fine
    DSpineConfig.from_target(world["hf"].config, used_vocab_size=VOCAB, method="dflash",
                             block_attention="bidirectional")


def test_recipe_method_is_one_setting():
    config = plan_draft_config(compose_train_config("recipe=tiny", "model.method=dflash"))
    assert (config.method, config.injection, config.transition_cache) == ("dflash", False, False)
    with pytest.raises(TrainingError, match="alignment_weight=0.3"):
        plan_draft_config(compose_train_config("recipe=tiny", "model.method=dflash",
                                               "model.alignment_weight=0.3"))
    # the trainer's export in DFlash's format needs a DFlash draft, refused before any work
    with pytest.raises(ConfigError, match=r"export.format: dflash needs model.method: dflash"):
        compose_train_config("recipe=tiny", "export.format=dflash")
    config = compose_train_config("recipe=tiny", "export.format=dflash", "model.method=dflash")
    assert config.export.format == "dflash"
    with pytest.raises(ConfigError, match=r"DSpark draft's anchor slot .* --format speculators"):
        compose_train_config("recipe=tiny", "export.format=dflash", "model.method=dspark")
    with pytest.raises(ConfigError, match=r"DFlash2 draft's convolutions .* --format speculators"):
        compose_train_config("recipe=tiny", "export.format=dflash", "model.method=dflash2")


# ----------------------------------------------------------------------------- export
def test_dflash_export_holds_the_backbone_only(world):
    root = world["root"]
    fields = json.loads((root / "ours_dflash" / "config.json").read_text())
    ours = load_draft(root / "ours").config
    assert fields["architectures"] == ["DFlashDraftModel"] and fields["model_type"] == "qwen3"
    assert fields["dflash_config"] == {"target_layer_ids": ours.target_layer_ids,
                                       "mask_token_id": VOCAB, "block_size": 8,
                                       "num_target_layers": 6}
    assert fields["num_hidden_layers"] == 2 and fields["head_dim"] == 16
    keys = set(load_file(root / "ours_dflash" / "model.safetensors"))
    assert keys and all(k.split(".")[0] in ("fc", "hidden_norm", "layers", "norm") for k in keys)
    full = set(load_file(root / "ours" / "model.safetensors"))
    assert full - keys == {k for k in full if k.startswith(("injection.", "token_codes"))}
    # plus the export's marker (a dot file: neither loaded nor uploaded)
    assert sorted(p.name for p in (root / "ours_dflash").iterdir()) == [
        ".dspine_train.export", "config.json", "model.safetensors"]


def test_dspine_draft_is_refused_for_the_dflash_format(world, capsys):
    root = world["root"]
    out = root / "refused"
    assert export_main([str(root / "dspine"), str(out), "--format", "dflash"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "drop its injection weights" in err and "--format dspine" in err and "injection=True" in err
    assert not out.exists() and not list(root.glob(".refused*"))  # nothing half-written


def test_dspine_format_carries_the_dflash_keys_under_its_own_name(world):
    root = world["root"]
    out = export_dir(root / "dspine", root / "dspine_fmt", "dspine")
    fields = json.loads((out / "config.json").read_text())
    assert fields["architectures"] == ["DSpineDraftModel"] and fields["model_type"] == "dspine"
    assert fields["dflash_config"]["target_layer_ids"] == fields["target_layer_ids"]
    assert fields["dspine_config"]["injection"] is True
    assert fields["dspine_config"]["transfer_dim"] == fields["transfer_dim"]
    again = DSpineDraftModel.from_pretrained(out)  # the derived blocks are not fields
    assert not hasattr(again.config, "dflash_config")
    original = load_file(root / "dspine" / "model.safetensors")
    assert all(original[k].equal(v) for k, v in load_file(out / "model.safetensors").items())
    # DFlash's class does not run it as a DFlash draft: every DSpine tensor is reported
    # unexpected and the layers it expects are missing (no silent success)
    _, info = DFlashDraftModel.from_pretrained(str(out), output_loading_info=True)
    assert {k for k in info["unexpected_keys"]} >= {"token_codes", "injection.gate_pred.weight"}
    assert info["missing_keys"]


def test_export_cli_runs_as_a_module(world):
    root = world["root"]
    done = subprocess.run(
        [sys.executable, "-m", "dspine_train.export", str(root / "nowhere"), str(root / "x"),
         "--format", "dflash"], capture_output=True, text=True, env=train_env(), cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {root / 'nowhere'}: no config.json (expected an " \
                                  "exported draft directory)"


# ----------------------------------------------------------------------------- the client
def test_reference_client_loads_our_export_and_computes_our_logits(world):
    root, hf = world["root"], world["hf"]
    theirs, info = DFlashDraftModel.from_pretrained(str(root / "ours_dflash"),
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    ours = _bound(load_draft(root / "ours"), hf)
    assert theirs.target_layer_ids == ours.config.target_layer_ids
    for prompt in world["prompts"]:
        _, feats = hf_features(hf, prompt, ours.config.target_layer_ids)
        for anchor in (prompt[-1], 42):
            mine = our_block_logits(ours, feats, anchor)
            ref = reference_block_logits(theirs.eval(), hf, feats, anchor)
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def test_reference_spec_generate_with_our_draft_is_lossless_and_accepts_as_our_engine(world):
    root, hf = world["root"], world["hf"]
    engine = Engine.from_pretrained(root / "target", root / "ours", max_seq_len=96,
                                    eos_token_ids=[], max_batch_size=1)
    compared = accepted = 0
    for prompt, reference in zip(world["prompts"], world["reference"]):
        theirs = DFlashDraftModel.from_pretrained(str(root / "ours_dflash")).eval()
        ref_rounds = record_reference_rounds(theirs)
        out = theirs.spec_generate(hf, torch.tensor([prompt]), max_new_tokens=NEW,
                                   stop_token_ids=None)
        assert out[0, len(prompt):].tolist() == reference  # the target's greedy output
        our_rounds = record_engine_rounds(engine)
        assert engine.generate([prompt], max_new_tokens=NEW, chat=False).token_ids == [reference]
        # Every full block the reference drafted, our engine drafted at the same position with
        # the same tokens, and both committed as many tokens after it: the same acceptance.
        # (At the length limit the reference drafts a shorter block, which bidirectional
        # attention sees differently; the engine drafts whole blocks. Those are left out.)
        rounds = compare_rounds(ref_rounds, our_rounds, theirs.block_size, prompt + reference)
        assert rounds.same and rounds.compared >= 2
        compared += rounds.compared
        accepted += rounds.accepted
    print(f"{compared} rounds compared, {accepted} drafted tokens accepted")
    assert accepted > compared  # a trained draft: more than one accepted token per round


def test_draft_made_by_the_reference_class_imports_here(world, tmp_path):
    root, hf = world["root"], world["hf"]
    config = zlab_draft_config(
        hf.config, 3, num_target_layers=6,
        dflash_config={"target_layer_ids": [0, 2, 4], "mask_token_id": VOCAB, "block_size": 4})
    torch.manual_seed(3)
    theirs = DFlashDraftModel(config).eval()
    with torch.no_grad():  # non-trivial norms, so a misplaced norm shows
        for name, param in theirs.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    theirs.save_pretrained(tmp_path / "ref")

    ours = _bound(load_draft(tmp_path / "ref"), hf)
    assert ours.config.method == "dflash" and ours.config.block_size == 4
    assert ours.config.target_layer_ids == [0, 2, 4] and ours.config.num_layers == 3
    for prompt in world["prompts"][:2]:
        _, feats = hf_features(hf, prompt, [0, 2, 4])
        torch.testing.assert_close(our_block_logits(ours, feats, 42),
                                   reference_block_logits(theirs, hf, feats, 42),
                                   rtol=1e-5, atol=1e-5)
    # our engine serves it (a random draft: lossless, whatever it proposes) ...
    engine = Engine.from_pretrained(root / "target", tmp_path / "ref", max_seq_len=96,
                                    eos_token_ids=[])
    result = engine.generate(world["prompts"], max_new_tokens=NEW, chat=False)
    assert result.token_ids == world["reference"]
    # ... and it converts to our format and back to DFlash's with the same tensors
    export_dir(tmp_path / "ref", tmp_path / "as_dspine", "dspine")
    export_dir(tmp_path / "as_dspine", tmp_path / "back", "dflash")
    before, after = load_file(tmp_path / "ref" / "model.safetensors"), load_file(
        tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)


def test_embedding_scale_round_trips_as_input_embedding_scale(world, tmp_path):
    """A target that scales its input embeddings (Gemma: sqrt(H)): our `embed_scale` is the
    reference's `dflash_config.input_embedding_scale`, both ways."""
    hf = world["hf"]
    draft = tiny_draft(hf, VOCAB, method="dflash", embed_scale=8.0)
    draft.save_pretrained(tmp_path / "ours")
    export_dir(tmp_path / "ours", tmp_path / "dfl", "dflash")
    fields = json.loads((tmp_path / "dfl" / "config.json").read_text())
    assert fields["dflash_config"]["input_embedding_scale"] == 8.0
    theirs = DFlashDraftModel.from_pretrained(str(tmp_path / "dfl")).eval()
    back = _bound(load_draft(tmp_path / "dfl"), hf)
    assert back.config.embed_scale == 8.0
    _, feats = hf_features(hf, world["prompts"][1], draft.config.target_layer_ids)
    torch.testing.assert_close(our_block_logits(back, feats, 42),
                               reference_block_logits(theirs, hf, feats, 42),
                               rtol=1e-5, atol=1e-5)
    unscaled = our_block_logits(_bound(load_draft(world["root"] / "ours"), hf), feats, 42)
    assert not torch.allclose(our_block_logits(back, feats, 42), unscaled)


def test_a_dflash_checkpoint_with_foreign_tensors_is_refused(world, tmp_path):
    root = world["root"]
    export_dir(root / "ours", tmp_path / "d", "dflash")
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    tensors["extra.weight"] = torch.zeros(2)
    del tensors["norm.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(FormatError, match=r"missing: norm\.weight; unexpected: extra\.weight"):
        load_draft(tmp_path / "d")


@pytest.mark.slow  # one DeepSpeed run of the tiny recipe
def test_trainer_exports_a_dflash_run_in_dflash_format(tiny_assets, tmp_path):
    out = tmp_path / "run"
    check_ok(run_train(tiny_overrides(tiny_assets, out, "model.method=dflash",
                                      "export.format=dflash", "optim.max_steps=4",
                                      "eval.every=0")))
    final = out / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"]
    assert not (final / "token_table.safetensors").exists()
    theirs, info = DFlashDraftModel.from_pretrained(str(final), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # and it is the draft the run trained: the same logits as its import here
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_assets["target"]).eval()
    ours = _bound(load_draft(final), hf)
    _, feats = hf_features(hf, [5, 6, 7, 8, 9], ours.config.target_layer_ids)
    torch.testing.assert_close(our_block_logits(ours, feats, 11),
                               reference_block_logits(theirs.eval(), hf, feats, 11),
                               rtol=1e-5, atol=1e-5)
