"""`--format speculators` is vLLM's own format, proven against the `speculators` package.

`speculators==0.9.0` is installed without its dependencies by `make install` (it pins
transformers <= 5.19 and datasets <= 5.1.0 against ours); `import speculators` also imports its
training stack, hence `loguru`, `openai` and `hs-connectors`, installed the same way. It runs
here with our pinned torch 2.13 / transformers 5.24.0 as is. A tiny random Qwen3 target, CPU,
fp32. Its DFlash model attends through `eager` here (its training default, flex attention with
a compiled block mask, is what the attention implementation switch replaces; the network is
the same).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from _engine_helpers import build_tiny_target, hf_features, tiny_draft
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators.convert.dflash import DFlashConverter
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from dspine_train.modeling import DSpineDraftModel
from scripts.tools.bench.reference_parity import our_block_logits

VOCAB = 200  # ids the tokenizer would use; the mask token is 200
LAYERS = 6  # target depth


def _perturb_norms(draft: DSpineDraftModel) -> DSpineDraftModel:
    """Non-trivial norm weights, so a misplaced or missing norm shows in the logits."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return draft


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target loaded from its directory (so drafts know its path), a `method:
    dflash` draft exported in the speculators and dflash formats, and a DSpine draft."""
    root = tmp_path_factory.mktemp("speculators")
    build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=LAYERS,
                      eos_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    _perturb_norms(tiny_draft(hf, VOCAB, method="dflash")).save_pretrained(root / "ours")
    tiny_draft(hf, VOCAB).save_pretrained(root / "dspine")
    assert export_main([str(root / "ours"), str(root / "spec"), "--format", "speculators"]) == 0
    assert export_main([str(root / "ours"), str(root / "dfl"), "--format", "dflash"]) == 0
    prompts = [[5, 17, 3], [9, 140, 33, 61, 2, 77, 18]]
    return {"root": root, "hf": hf, "prompts": prompts}


def _their_config(path) -> DFlashSpeculatorConfig:
    config = DFlashSpeculatorConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"  # not the compiled flex mask
    return config


@torch.no_grad()
def speculators_block_logits(model: DFlashDraftModel, feats: torch.Tensor,
                             anchor: int) -> torch.Tensor:
    """speculators' slot logits (B-1, V) for the block anchored at position T = len(feats)
    after context features `feats` (T, n*H) at positions 0..T-1, through its own anchored-block
    forward: one anchor at T (its loss mask picks the anchors, never in the last B positions,
    hence B+1 padding rows, which its mask hides from the block), slot 0 the anchor token."""
    size, (length, width) = model.block_size, feats.shape
    total = length + size + 1
    hidden = torch.cat([feats, torch.zeros(size + 1, width)])[None]
    ids = torch.zeros(1, total, dtype=torch.long)
    ids[0, length] = anchor
    loss_mask = torch.zeros(1, total)
    loss_mask[0, length] = 1
    _, logits, _, _, _ = model._backbone_forward(
        hidden, ids, loss_mask, torch.zeros(1, total, model.hidden_size),
        torch.zeros(1, total, dtype=torch.long), max_anchors=1)
    return logits[0, 1:size]


# ----------------------------------------------------------------------------- the client
def test_speculators_loads_our_export_with_every_weight(world):
    root = world["root"]
    _, info = DFlashDraftModel.from_pretrained(str(root / "spec"), config=_their_config(
        root / "spec"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # its generic entry point picks its DFlash class from `speculators_model_type`, and fills
    # the target's embedding and head from the verifier our config names
    theirs = SpeculatorModel.from_pretrained(str(root / "spec"))
    assert type(theirs) is DFlashDraftModel
    hf = world["hf"]
    assert theirs.embed_tokens.weight.equal(hf.model.embed_tokens.weight)
    assert theirs.lm_head.weight.equal(hf.lm_head.weight)
    ours = load_draft(root / "ours")
    assert theirs.target_layer_ids == [i + 1 for i in ours.config.target_layer_ids]
    assert (theirs.block_size, theirs.mask_token_id) == (8, VOCAB)


def test_speculators_computes_our_block_logits(world):
    root, hf = world["root"], world["hf"]
    theirs = DFlashDraftModel.from_pretrained(str(root / "spec"),
                                              config=_their_config(root / "spec")).eval()
    ours = load_draft(root / "ours")
    ours.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    ours.eval()
    for prompt in world["prompts"]:
        _, feats = hf_features(hf, prompt, ours.config.target_layer_ids)
        for anchor in (prompt[-1], 42):
            mine = our_block_logits(ours, feats, anchor)
            ref = speculators_block_logits(theirs, feats, anchor)
            assert mine.shape == ref.shape == (7, hf.config.vocab_size)
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    # the comparison sees the context: other features, other logits
    _, feats = hf_features(hf, world["prompts"][1], ours.config.target_layer_ids)
    assert not torch.allclose(speculators_block_logits(theirs, feats, 42),
                              speculators_block_logits(theirs, feats.flip(0), 42))


def test_the_keys_vllm_detects_are_the_ones_speculators_writes(world, tmp_path):
    """`vllm serve` dispatches on `speculators_model_type` and reads the draft from
    `transformer_layer_config`, `aux_hidden_state_layer_ids`, `mask_token_id` and
    `speculators_config` (verifier, drafted tokens): speculators' own `save_pretrained` of the
    loaded draft writes our config.json back unchanged (but for its remote-code hook)."""
    root = world["root"]
    fields = json.loads((root / "spec" / "config.json").read_text())
    ours = load_draft(root / "ours").config
    assert fields["speculators_model_type"] == "dflash"
    assert fields["architectures"] == ["DFlashDraftModel"]
    assert fields["aux_hidden_state_layer_ids"] == [i + 1 for i in ours.target_layer_ids]
    assert fields["speculators_config"]["verifier"] == {
        "name_or_path": str(root / "target"), "architectures": ["Qwen3ForCausalLM"]}
    assert fields["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert fields["transformer_layer_config"]["num_hidden_layers"] == 2
    assert sorted(p.name for p in (root / "spec").iterdir()) == [
        ".dspine_train.export", "config.json", "model.safetensors"]  # the marker: a dot file
    # its config class parses ours and writes it back as it was
    DFlashSpeculatorConfig.from_pretrained(str(root / "spec")).save_pretrained(tmp_path / "cfg")
    written = json.loads((tmp_path / "cfg" / "config.json").read_text())
    assert written.pop("auto_map") == {"": "config.DFlashSpeculatorConfig"}
    assert written == fields
    theirs = DFlashDraftModel.from_pretrained(str(root / "spec"))
    theirs.save_pretrained(tmp_path / "resaved")
    again = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert again.pop("auto_map") == {"": "config.DFlashSpeculatorConfig"}
    assert again == fields
    _same_tensors(root / "spec", tmp_path / "resaved")


def _same_tensors(a, b) -> None:
    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert left.keys() == right.keys()
    assert all(left[k].dtype == right[k].dtype and left[k].equal(right[k]) for k in left)


def test_speculators_converter_on_our_dflash_export_gives_our_speculators_export(world):
    """The package's `convert/dflash` on our `--format dflash` export writes the same
    config.json, key by key, and the same tensors as our `--format speculators`. The one
    difference: it adds `auto_map` and a copy of its config module (`config.py`), the
    remote-code hook of its config class, which neither vLLM nor speculators reads to load
    the draft."""
    root = world["root"]
    converted = root / "converted"
    DFlashConverter().convert(root / "dfl", converted, base_model=str(root / "target"),
                              validate=True)
    theirs = json.loads((converted / "config.json").read_text())
    ours = json.loads((root / "spec" / "config.json").read_text())
    assert theirs.pop("auto_map") == {"": "config.DFlashSpeculatorConfig"}
    assert theirs.keys() == ours.keys()
    for key in ours:
        assert theirs[key] == ours[key], key
    assert sorted(p.name for p in converted.iterdir()) == ["config.json", "config.py",
                                                           "model.safetensors"]
    _same_tensors(root / "spec", converted)
    # and they are the dflash export's tensors, nothing added or dropped
    _same_tensors(root / "dfl", converted)


# ----------------------------------------------------------------------------- refusals
def test_dspine_draft_is_refused_for_the_speculators_format(world, capsys):
    root = world["root"]
    out = root / "refused"
    assert export_main([str(root / "dspine"), str(out), "--format", "speculators"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--format speculators" in err and "drop its injection weights" in err
    assert "--format dspine" in err and "injection=True" in err
    assert not out.exists() and not list(root.glob(".refused*"))  # nothing half-written


def test_drafts_speculators_cannot_run_as_ours_are_refused(world, tmp_path):
    hf = world["hf"]
    # a context feature from the target's last layer (speculators' converter drops that id)
    tiny_draft(hf, VOCAB, method="dflash", target_layer_ids=[1, LAYERS - 1]).save_pretrained(
        tmp_path / "last")
    with pytest.raises(FormatError, match=r"include the target's last layer \(5\)"):
        export_dir(tmp_path / "last", tmp_path / "out", "speculators")
    # a target that scales its embeddings: speculators' DFlash has no such scale
    tiny_draft(hf, VOCAB, method="dflash", embed_scale=8.0).save_pretrained(tmp_path / "scaled")
    with pytest.raises(FormatError, match=r"embed_scale=8\.0.*--format dflash"):
        export_dir(tmp_path / "scaled", tmp_path / "out", "speculators")
    assert not (tmp_path / "out").exists()


def test_the_verifier_is_named_and_checked(world, tmp_path, capsys):
    root = world["root"]
    # a DFlash checkpoint does not know its target: --verifier names it
    out = tmp_path / "from_dflash"
    assert export_main([str(root / "dfl"), str(out), "--format", "speculators"]) == 2
    assert "no target_name_or_path; pass --verifier" in capsys.readouterr().err
    assert not out.exists()
    assert export_main([str(root / "dfl"), str(out), "--format", "speculators",
                        "--verifier", str(root / "target")]) == 0
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (root / "spec" / "config.json").read_text())
    assert export_main([str(root / "ours"), str(tmp_path / "d"), "--format", "dflash",
                        "--verifier", str(root / "target")]) == 2
    assert "--verifier names the target in the speculators format only" in \
        capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    # a verifier that is not the draft's target is refused by key
    other = tmp_path / "other"
    build_tiny_target(other, "qwen3", num_hidden_layers=4)
    with pytest.raises(FormatError, match=r"num_hidden_layers=4 \(the draft's target has 6\)"):
        export_dir(root / "ours", tmp_path / "x", "speculators", verifier=str(other))
    with pytest.raises(FormatError, match=r"verifier .*nowhere: no readable config.json"):
        export_dir(root / "ours", tmp_path / "x", "speculators",
                   verifier=str(tmp_path / "nowhere"))
    assert not (tmp_path / "x").exists()


def test_a_speculators_export_is_not_read_as_a_dflash_checkpoint(world, tmp_path):
    """Its `architectures` name is DFlash's: it must not be imported as a DFlash checkpoint."""
    shutil.copytree(world["root"] / "spec", tmp_path / "spec")
    with pytest.raises(FormatError, match="a speculators-format draft"):
        load_draft(tmp_path / "spec")
