"""Bad draft exports given to the engine, the export CLI and `model.init_from`: one line naming
the file and the key, a non-zero exit (or the tool's own error type), no traceback.

A draft `config.json` is type-checked once, where `DSpineConfig` is made from it, so every reader
refuses a wrongly typed field by name; a truncated `model.safetensors` is named by every reader;
a DFlash checkpoint's `dflash_config` is read as written (a fractional block size is refused,
missing context layers are said).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from _engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

from dspine_train.engine import cli as engine_cli
from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from dspine_train.training.config import ModelConfig
from dspine_train.training.draft_builder import build_draft, draft_config_for
from dspine_train.training.errors import TrainingError

VOCAB = 200


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target (6 layers), a DSpine draft export and a DFlash checkpoint for it."""
    root = tmp_path_factory.mktemp("bad_drafts")
    hf = build_tiny_target(root / "target", "qwen3", num_hidden_layers=6, eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=VOCAB)
    tiny_draft(hf, VOCAB).save_pretrained(root / "draft")
    tiny_draft(hf, VOCAB, method="dflash").save_pretrained(root / "dflash_src")
    export_dir(root / "dflash_src", root / "dflash", "dflash")
    (root / "prompts.txt").write_text("w1 w2 w3\n", encoding="utf-8")
    return {"root": root, "hf": hf}


def _copy(world, name: str, tmp_path: Path, **changes) -> Path:
    """A copy of export `name` whose config.json has `changes` applied (None deletes a key)."""
    out = tmp_path / name
    shutil.copytree(world["root"] / name, out)
    fields = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        block, _, sub = key.partition("__")
        where = fields[block] if sub else fields
        if value is None:
            where.pop(sub or key)
        else:
            where[sub or key] = value
    (out / "config.json").write_text(json.dumps(fields))
    return out


def _last_error_line(err: str) -> str:
    """The one `error:` line of a run, checked to be the last line, with no traceback."""
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err.strip().splitlines()[-1]


# A wrongly typed field, and the words that must name it (file, key, what it must be).
BAD_TYPES = {
    "block_size-string": ({"block_size": "8"}, 'block_size must be an integer, got "8"'),
    "num_layers-float": ({"num_layers": 2.0}, "num_layers must be an integer, got 2.0"),
    "rms_norm_eps-string": ({"rms_norm_eps": "1e-6"}, 'rms_norm_eps must be a number, got "1e-6"'),
    "draft_vocab_size-string": ({"draft_vocab_size": "128"},
                                'draft_vocab_size must be an integer or null, got "128"'),
    "transition_cache-string": ({"transition_cache": "yes"},
                                'transition_cache must be true/false or null, got "yes"'),
    "target_layer_ids-string": ({"target_layer_ids": "1,2"},
                                'target_layer_ids must be a list of integers or null, got "1,2"'),
}


@pytest.mark.parametrize("case", list(BAD_TYPES))
def test_engine_refuses_a_wrongly_typed_draft_field_by_name(world, tmp_path, capsys, case):
    changes, expected = BAD_TYPES[case]
    draft = _copy(world, "draft", tmp_path, **changes)
    argv = ["--target", str(world["root"] / "target"), "--draft", str(draft), "--no-chat",
            "--prompts", str(world["root"] / "prompts.txt"), "--device", "cpu",
            "--max-new-tokens", "3"]
    capsys.readouterr()
    assert engine_cli.main(argv) == 2  # refused at load, not met at decode time (or exit 0)
    line = _last_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {draft / 'config.json'}: ") and expected in line, line


@pytest.mark.parametrize("case", ["block_size-string", "num_layers-float",
                                  "transition_cache-string"])
def test_export_refuses_a_wrongly_typed_draft_field_by_name(world, tmp_path, capsys, case):
    changes, expected = BAD_TYPES[case]
    draft = _copy(world, "draft", tmp_path, **changes)
    out = tmp_path / "out"
    assert export_main([str(draft), str(out), "--format", "dspine"]) == 2
    line = _last_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {draft / 'config.json'}: ") and expected in line, line
    assert not out.exists()


@pytest.mark.parametrize("case", ["rms_norm_eps-string", "draft_vocab_size-string",
                                  "target_layer_ids-string"])
def test_init_from_refuses_a_wrongly_typed_draft_field_by_name(world, tmp_path, case):
    changes, expected = BAD_TYPES[case]
    draft = _copy(world, "draft", tmp_path, **changes)
    model = ModelConfig(target_path=str(world["root"] / "target"), init_from=str(draft))
    with pytest.raises(TrainingError) as err:
        draft_config_for(model, world["hf"].config, VOCAB)
    assert str(err.value).startswith(f"model.init_from: {draft / 'config.json'}: ")
    assert expected in str(err.value)


def test_a_whole_number_for_a_float_field_is_that_number(world, tmp_path):
    """JSON writes 1.0 as 1 in some tools: a float field takes it (an integer field does not
    take 2.0, above)."""
    draft = _copy(world, "draft", tmp_path, loss_gamma=7, ce_weight=0)
    config = load_draft(draft).config
    assert config.loss_gamma == 7.0 and isinstance(config.loss_gamma, float)
    assert config.ce_weight == 0.0 and isinstance(config.ce_weight, float)


# ------------------------------------------------------------------- truncated weights
def _truncated(world, tmp_path: Path) -> Path:
    draft = _copy(world, "draft", tmp_path)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    return draft


def test_export_names_a_truncated_weights_file(world, tmp_path, capsys):
    draft = _truncated(world, tmp_path)
    out = tmp_path / "out"
    assert export_main([str(draft), str(out), "--format", "dspine"]) == 2
    line = _last_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {draft / 'model.safetensors'}: not a valid safetensors "
                           "file, truncated or corrupted"), line
    assert not out.exists()


def test_init_from_names_a_truncated_weights_file(world, tmp_path):
    draft = _truncated(world, tmp_path)
    model = ModelConfig(target_path=str(world["root"] / "target"), init_from=str(draft))
    config = draft_config_for(model, world["hf"].config, VOCAB)  # config.json is fine
    with pytest.raises(TrainingError, match=rf"^model\.init_from: {draft / 'model.safetensors'}"
                                            r": not a valid safetensors file, truncated"):
        build_draft(model, config, None, world["hf"].config, seed=0)


# ------------------------------------------------------------------- DFlash checkpoints
def test_a_fractional_dflash_block_size_is_refused(world, tmp_path):
    dflash = _copy(world, "dflash", tmp_path, dflash_config__block_size=8.5)
    with pytest.raises(FormatError, match=r"block_size must be an integer, got 8\.5"):
        load_draft(dflash)


def test_dflash_without_target_layer_ids_says_which_layers_it_takes(world, tmp_path):
    """DFlash's own loader takes the formula's layers when the key is absent, so such
    checkpoints are read as it reads them, with a warning naming the layers and the key."""
    dflash = _copy(world, "dflash", tmp_path, dflash_config__target_layer_ids=None)
    with pytest.warns(UserWarning, match=r"no dflash_config\.target_layer_ids; taking the "
                                         r"default layers \[1, 3\]"):
        draft = load_draft(dflash)
    assert draft.config.target_layer_ids == [1, 3]
    with warnings.catch_warnings():  # a checkpoint that names its layers loads silently
        warnings.simplefilter("error")
        load_draft(world["root"] / "dflash")
