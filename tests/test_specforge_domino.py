"""`--format specforge` for a `method: domino` draft: SpecForge's `DominoDraftModel` checkpoint.

The names and keys are those SpecForge's loader reads (`specforge/modeling/draft/domino.py`,
`dflash.py`) and its published `configs/qwen3-8b-domino.json` holds; written by hand here (the
package is not installed). Export -> import -> export is byte-identical and the import is the
same network; what the format cannot hold, or a checkpoint this project cannot run, is refused
by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from tests._model_helpers import context_features, tiny_draft, tiny_target

# SpecForge's dflash_config keys of a Domino draft (configs/qwen3-8b-domino.json).
DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids", "projector_type",
                      "pure_draft_prefix_len", "emb_dim", "gru_hidden_dim", "shift_label"}
HEAD_TENSORS = {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight",
                "embed_proj.2.weight"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("domino")
    target = tiny_target(seed=2)
    draft = tiny_draft(target, method="domino", block_size=5, domino_emb_dim=12,
                       domino_gru_hidden_dim=20, domino_shift_label=True, domino_prefix_len=1)
    torch.manual_seed(4)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    draft.save_pretrained(root / "ours")
    assert export_main([str(root / "ours"), str(root / "sf"), "--format", "specforge"]) == 0
    return {"root": root, "target": target, "draft": draft}


def test_the_checkpoint_has_specforges_keys_and_tensor_names(world):
    sf = world["root"] / "sf"
    fields = json.loads((sf / "config.json").read_text())
    cfg = world["draft"].config
    assert fields["architectures"] == ["DominoDraftModel"]
    assert fields["model_type"] == "qwen3"
    assert set(fields["dflash_config"]) == DFLASH_CONFIG_KEYS
    assert fields["dflash_config"] == {
        "mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids,
        "projector_type": "domino", "pure_draft_prefix_len": 1, "emb_dim": 12,
        "gru_hidden_dim": 20, "shift_label": True}
    assert (fields["block_size"], fields["num_target_layers"], fields["emb_dim"]) == (
        5, cfg.target_num_layers, 12)
    assert fields["num_hidden_layers"] == cfg.num_layers
    assert fields["layer_types"] == ["full_attention"] * cfg.num_layers
    tensors = load_file(sf / "model.safetensors")
    h, g, v = cfg.hidden_size, 20, cfg.vocab_size
    assert HEAD_TENSORS <= set(tensors)
    assert tuple(tensors["prefix_gru.weight_ih_l0"].shape) == (3 * g, h)
    assert tuple(tensors["prefix_gru.weight_hh_l0"].shape) == (3 * g, g)
    assert tuple(tensors["embed_proj.0.weight"].shape) == (12, h + g)
    assert tuple(tensors["embed_proj.2.weight"].shape) == (v, 12)
    others = set(tensors) - HEAD_TENSORS
    assert all(k.startswith(("fc.", "hidden_norm.", "layers.", "norm.")) for k in others)
    assert not any(k.startswith(("injection.", "token_codes")) for k in tensors)


def test_round_trip_is_bit_identical_and_the_same_network(world, tmp_path):
    root = world["root"]
    assert export_main([str(root / "sf"), str(tmp_path / "again"), "--format", "specforge"]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "again" / name).read_bytes() == (root / "sf" / name).read_bytes(), name
    imported = load_draft(root / "sf")
    ours = world["draft"]
    assert imported.config.method == "domino" and imported.config.domino_shift_label
    state = imported.state_dict()
    for k, v in ours.state_dict().items():
        if not k.startswith(("injection.", "token_codes")):
            assert state[k].equal(v), k
    target = world["target"]
    imported.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
    ids = torch.tensor([[3, 17, 200, 45, 9, 88, 120, 7, 61]])
    feats, _ = context_features(target, ours, ids)
    for model in (ours, imported):
        cache = model.new_context_cache(1, 20)
        model.append_context(cache, feats, torch.tensor([ids.shape[1]]))
        model._drafted = model.propose(cache, torch.tensor([11])).tokens
    assert imported._drafted.equal(ours._drafted)
    # back to our own format: the same draft
    assert export_main([str(root / "sf"), str(tmp_path / "dspine"), "--format", "dspine"]) == 0
    back = load_draft(tmp_path / "dspine")
    assert back.config.method == "domino"
    assert back.state_dict()["embed_proj.2.weight"].equal(ours.state_dict()["embed_proj.2.weight"])


def _edited(world, tmp_path, edit_config=None, edit_tensors=None):
    out = tmp_path / "edited"
    out.mkdir()
    fields = json.loads((world["root"] / "sf" / "config.json").read_text())
    tensors = load_file(world["root"] / "sf" / "model.safetensors")
    if edit_config:
        edit_config(fields)
    if edit_tensors:
        edit_tensors(tensors)
    (out / "config.json").write_text(json.dumps(fields))
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("edit,match", [
    (lambda f: f["dflash_config"].update(projector_type="mlp"), "projector_type"),
    (lambda f: f["dflash_config"].update(attention_modes="mla"), "attention_modes"),
    (lambda f: f["dflash_config"].pop("gru_hidden_dim"), "gru_hidden_dim"),
    (lambda f: f["dflash_config"].update(shift_label="yes"), "shift_label"),
    (lambda f: f.update(layer_types=["sliding_attention"] * 3), "layer_types"),
    (lambda f: f.update(layer_types=["sliding_attention"] * 3, use_sliding_window=True,
                        sliding_window=64, is_causal=False), "sliding_window=64"),
])
def test_keys_this_project_does_not_run_are_refused_by_name(world, tmp_path, edit, match):
    with pytest.raises(FormatError, match=match):
        load_draft(_edited(world, tmp_path, edit_config=edit))


def test_missing_unexpected_and_nested_tensors(world, tmp_path):
    with pytest.raises(FormatError, match="missing: prefix_gru.weight_hh_l0"):
        load_draft(_edited(world, tmp_path,
                           edit_tensors=lambda t: t.pop("prefix_gru.weight_hh_l0")))
    (tmp_path / "edited").rename(tmp_path / "e1")
    with pytest.raises(FormatError, match="unexpected: extra.weight"):
        load_draft(_edited(world, tmp_path,
                           edit_tensors=lambda t: t.update({"extra.weight": torch.zeros(1)})))
    (tmp_path / "edited").rename(tmp_path / "e2")

    def nest(tensors):  # SpecForge's older checkpoints: heads under logit_head.
        for key in list(tensors):
            if key.startswith(("prefix_gru.", "embed_proj.")):
                tensors["logit_head." + key] = tensors.pop(key)
    nested = load_draft(_edited(world, tmp_path, edit_tensors=nest))
    assert nested.state_dict()["prefix_gru.weight_ih_l0"].equal(
        world["draft"].state_dict()["prefix_gru.weight_ih_l0"])


def test_formats_that_would_drop_the_heads_refuse_a_domino_draft(world, tmp_path):
    for fmt in ("dflash", "speculators", "deepspec"):
        with pytest.raises(FormatError, match="domino"):
            export_dir(world["root"] / "ours", tmp_path / fmt, fmt)


def test_model_init_from_continues_a_specforge_domino_checkpoint(world):
    from dspine_train.training.config import ModelConfig
    from dspine_train.training.draft_builder import build_draft
    from dspine_train.training.initialisation.from_export import export_config

    sf = str(world["root"] / "sf")
    config = export_config(sf)
    assert config.method == "domino" and config.domino_gru_hidden_dim == 20
    model_cfg = ModelConfig(target_path="unused", init_from=sf)
    draft = build_draft(model_cfg, config, None, world["target"].config, seed=0)
    for name in ("prefix_gru.weight_ih_l0", "embed_proj.2.weight", "fc.weight"):
        assert draft.state_dict()[name].equal(world["draft"].state_dict()[name]), name
