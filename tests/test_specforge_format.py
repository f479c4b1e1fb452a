"""SpecForge's DSpine checkpoints are served here, and ours are written in their format.

A tiny random Qwen3 target and a DSpine draft of ours whose injection is randomised (so the
injection and the transition cache change what it proposes). The SpecForge checkpoint is built
by hand here, with SpecForge's config layout (`configs/qwen3-8b-dspine.json`) and tensor names
(`specforge/modeling/draft/dspine.py`), independently of `dspine_train.formats.specforge`.
Everything on CPU, fp32.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from _engine_helpers import build_tiny_target, build_tokenizer, hf_greedy, tiny_draft
from safetensors.torch import load_file, save_file

from dspine_train.engine import Engine
from dspine_train.engine.errors import CheckpointError
from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from dspine_train.training.config import ModelConfig
from dspine_train.training.draft_builder import build_draft
from scripts.tools.bench.reference_parity import record_engine_rounds

NEW = 24  # new tokens per prompt
VOCAB = 200  # ids the tokenizer uses; the mask token is 200
# SpecForge's names for the tensors whose name differs from ours (read from its source).
THEIR_NAMES = {
    "injection.gate_recv.weight": "injection.receiver_gate.weight",
    "injection.gate_recv.bias": "injection.bias",
    "injection.gate_pred.weight": "injection.predecessor_gate.weight",
    "token_codes": "transfer_codes",
}


def _randomise_injection(draft, seed: int) -> None:
    """Unit-norm token codes and non-zero writes and gates: the injection changes proposals."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        codes = torch.randn(draft.token_codes.shape, generator=gen)
        draft.token_codes.copy_(F.normalize(codes, dim=-1))
        for name, param in draft.injection.named_parameters():
            if name.startswith(("writes.", "gate_pred.", "gate_recv.")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def _specforge_checkpoint(draft, path) -> None:
    """What SpecForge's `DSpineDraftModel.save_pretrained` writes for this draft, built by hand."""
    c = draft.config
    path.mkdir(parents=True)
    fields = {
        "architectures": ["DSpineDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dspine.DSpineDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": c.block_size,
        "bos_token_id": None, "eos_token_id": None, "dtype": "float32",
        "dflash_config": {"mask_token_id": c.mask_token_id,
                          "target_layer_ids": list(c.target_layer_ids)},
        "dspine_config": {
            "transfer_rank": c.transfer_dim, "message_size": c.message_size,
            "top_k": c.candidate_k, "ce_weight": 0.1, "alignment_weight": 0.5,
            "alignment_warmup_steps": 146, "replacement_layers": 3,
            "replacement_probability": 0.5, "replacement_hold_ratio": 1 / 6,
            "replacement_end_ratio": 1 / 3, "candidate_mass_threshold": 0.0001,
        },
        "head_dim": c.head_dim, "hidden_act": "silu", "hidden_size": c.hidden_size,
        "initializer_range": 0.02, "intermediate_size": c.intermediate_size, "is_causal": True,
        "layer_types": ["full_attention"] * c.num_layers,
        "max_position_embeddings": c.max_position_embeddings, "max_window_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_key_value_heads, "num_target_layers": c.target_num_layers,
        "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None,
        "rope_theta": c.rope_parameters["rope_theta"], "sliding_window": None,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
        "vocab_size": c.vocab_size,
    }
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    tensors = {THEIR_NAMES.get(k, k): v.clone() for k, v in draft.state_dict().items()}
    tensors["transfer_ready"] = torch.tensor(True)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Target, prompts with its greedy continuations, our draft (`ours`, our export) and the
    same draft as a SpecForge checkpoint (`sf`)."""
    root = tmp_path_factory.mktemp("specforge")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6, eos_token_id=None
    )
    build_tokenizer(root / "target", vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 7, 10, 5)]
    reference = [hf_greedy(hf, p, NEW) for p in prompts]
    draft = tiny_draft(hf, VOCAB, candidate_k=6)
    _randomise_injection(draft, seed=1)
    draft.save_pretrained(root / "ours")
    _specforge_checkpoint(draft, root / "sf")
    return {"root": root, "hf": hf, "prompts": prompts, "reference": reference, "draft": draft}


def _engine_rounds(root, draft_dir, prompts, write_eps=None):
    engine = Engine.from_pretrained(root / "target", draft_dir, max_seq_len=96,
                                    eos_token_ids=[], max_batch_size=1)
    if write_eps is not None:
        engine.draft.injection.eps = write_eps
    rounds = record_engine_rounds(engine)
    outputs = [engine.generate([p], max_new_tokens=NEW, chat=False).token_ids[0]
               for p in prompts]
    return outputs, list(rounds)


# ----------------------------------------------------------------------------- import
def test_specforge_checkpoint_is_served_with_the_original_drafts_proposals(world):
    root, prompts = world["root"], world["prompts"]
    imported = load_draft(root / "sf")
    config, original = imported.config, world["draft"].config
    assert (config.method, config.block_attention, config.injection, config.transition_cache) \
        == ("dspine", "causal", True, True)
    for name in ("num_layers", "block_size", "mask_token_id", "target_layer_ids",
                 "target_num_layers", "transfer_dim", "message_size", "candidate_k",
                 "hidden_size", "head_dim", "rope_parameters", "rms_norm_eps"):
        assert getattr(config, name) == getattr(original, name), name
    assert (config.alignment_warmup_steps, config.distill_mass_threshold) == (146, 1e-4)
    ours = world["draft"].state_dict()
    assert all(imported.state_dict()[k].equal(v) for k, v in ours.items())

    outputs, rounds = _engine_rounds(root, root / "sf", prompts)
    assert outputs == world["reference"]  # lossless: the target's greedy output
    expected_outputs, expected_rounds = _engine_rounds(root, root / "ours", prompts)
    assert expected_outputs == world["reference"]
    assert rounds == expected_rounds and len(rounds) >= 2 * len(prompts)
    # SpecForge's write scale ||h|| / sqrt(H) is ours without the epsilon: the same proposals
    assert _engine_rounds(root, root / "sf", prompts, write_eps=0.0) == (outputs, rounds)
    # the injection matters: without its writes the same draft proposes other tokens
    blank = root / "blank"
    silent = tiny_draft(world["hf"], VOCAB, candidate_k=6)
    silent.load_state_dict(world["draft"].state_dict())
    with torch.no_grad():
        for write in silent.injection.writes:
            write.weight.zero_()
    silent.save_pretrained(blank)
    _, blank_rounds = _engine_rounds(root, blank, prompts[:2])
    assert [r[2] for r in blank_rounds] != [r[2] for r in rounds[: len(blank_rounds)]]


def test_model_init_from_accepts_a_specforge_checkpoint(world):
    root, hf = world["root"], world["hf"]
    model_cfg = ModelConfig(target_path=str(root / "target"), init_from=str(root / "sf"))
    draft = build_draft(model_cfg, world["draft"].config, None, hf.config, seed=0)
    assert draft.config.block_attention == "causal"
    assert draft.injection.gate_recv.bias.equal(world["draft"].injection.gate_recv.bias)
    assert draft.token_codes.equal(world["draft"].token_codes)


# ----------------------------------------------------------------------------- export
def test_round_trip_ours_specforge_ours_is_bit_identical(world, tmp_path, capsys):
    root = world["root"]
    assert export_main([str(root / "ours"), str(tmp_path / "sf"), "--format", "specforge"]) == 0
    assert "wrote specforge draft" in capsys.readouterr().out
    # the same names, blocks and keys as the checkpoint built from SpecForge's source
    ours_sf, hand = load_file(tmp_path / "sf" / "model.safetensors"), load_file(
        root / "sf" / "model.safetensors")
    assert ours_sf.keys() == hand.keys() and all(ours_sf[k].equal(hand[k]) for k in hand)
    fields = json.loads((tmp_path / "sf" / "config.json").read_text())
    hand_fields = json.loads((root / "sf" / "config.json").read_text())
    assert fields["architectures"] == ["DSpineDraftModel"] and fields["model_type"] == "qwen3"
    assert fields["dspine_config"].keys() == hand_fields["dspine_config"].keys()
    assert fields["dflash_config"] == hand_fields["dflash_config"]
    for key in ("block_size", "is_causal", "num_target_layers", "num_hidden_layers", "head_dim"):
        assert fields[key] == hand_fields[key], key
    assert fields["dspine_config"]["alignment_warmup_steps"] == 150  # ours, carried

    back = export_dir(tmp_path / "sf", tmp_path / "back", "dspine")
    before, after = load_file(root / "ours" / "model.safetensors"), load_file(
        back / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(before[k].dtype == after[k].dtype and before[k].equal(after[k]) for k in before)
    again, original = load_draft(back).config.to_dict(), load_draft(root / "ours").config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        again.pop(key, None)
        original.pop(key, None)
    assert again == original  # every field, the ones SpecForge has no key for included


def test_drafts_specforge_cannot_represent_are_refused_by_name(world, tmp_path, capsys):
    hf = world["hf"]
    for overrides, name in (({"method": "dflash"}, "method='dflash'"),
                            ({"transition_cache": False}, "transition_cache=False"),
                            ({"embed_scale": 8.0}, "embed_scale=8.0")):
        src = tmp_path / name.split("=")[0]
        tiny_draft(hf, VOCAB, **overrides).save_pretrained(src)
        out = tmp_path / f"{src.name}_sf"
        assert export_main([str(src), str(out), "--format", "specforge"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and name in err and "--format dspine" in err
        assert not out.exists()  # nothing half-written


# ----------------------------------------------------------------------------- refusals
def _edited_copy(world, tmp_path, edit_config=None, edit_tensors=None):
    src, out = world["root"] / "sf", tmp_path / "edited"
    out.mkdir()
    fields = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if edit_config:
        edit_config(fields)
    if edit_tensors:
        edit_tensors(tensors)
    (out / "config.json").write_text(json.dumps(fields))
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(
    ("edit_config", "edit_tensors", "message"),
    [
        (lambda f: f.update(kv_lora_rank=64), None, r"unknown key kv_lora_rank"),
        (lambda f: f["dspine_config"].update(gate_temperature=2.0), None,
         r"unknown key dspine_config\.gate_temperature"),
        (lambda f: f["dspine_config"].pop("top_k"), None, r"dspine_config\.top_k missing"),
        (lambda f: f["dspine_config"].update(top_k=4.0), None,
         r"dspine_config\.top_k=4\.0 \(an integer\)"),
        (lambda f: f["dflash_config"].update(attention_mode="mla"), None,
         r"attention mode\(s\) \['mla'\]"),
        (lambda f: f.pop("is_causal"), None, r"is_causal=None \(true or false"),
        (lambda f: f["dflash_config"].update(shift_label=True), None,
         r"dflash_config\.shift_label=True"),
        (lambda f: f.update(layer_types=["sliding_attention", "full_attention"]), None,
         r"layer_types=\['full_attention', 'sliding_attention'\]"),
        (None, lambda t: t.update({"injection.gate_scale": torch.ones(16)}),
         r"unexpected: injection\.gate_scale"),
        (None, lambda t: t.pop("injection.bias"), r"missing: injection\.bias"),
        (None, lambda t: t.pop("transfer_ready"), r"missing: transfer_ready"),
        (None, lambda t: t.update(transfer_ready=torch.tensor(False)), r"transfer_ready is false"),
    ],
)
def test_unmapped_fields_and_tensors_are_refused_by_name(world, tmp_path, edit_config,
                                                         edit_tensors, message):
    edited = _edited_copy(world, tmp_path, edit_config, edit_tensors)
    with pytest.raises(FormatError, match=message):
        load_draft(edited)


def test_the_engine_names_the_refused_field(world, tmp_path):
    edited = _edited_copy(world, tmp_path, lambda f: f.update(output_multiplier=2.0))
    with pytest.raises(CheckpointError, match=r"unknown key output_multiplier"):
        Engine.from_pretrained(world["root"] / "target", edited, max_seq_len=64)


def test_a_bidirectional_specforge_draft_and_another_schedule_load(world, tmp_path):
    def edit(fields):
        fields["is_causal"] = False
        fields["dspine_config"]["replacement_probability"] = 0.3

    edited = _edited_copy(world, tmp_path, edit)
    draft = load_draft(edited)
    assert draft.config.block_attention == "bidirectional"
    # the curriculum is a config field here too: the checkpoint's value is kept
    assert draft.config.replacement_probability == 0.3
    # no dspine_train_config block (a checkpoint SpecForge wrote): SpecForge's objective options
    assert (draft.config.refine_normalization, draft.config.alignment_layer_reduction,
            draft.config.readout_init) == ("supervised", "sum", "directions")
