"""The recipe-driven commands (`train.py`, `training.cache_features`, `data_prep.tokenize`,
`data_prep.regenerate`'s local backend): `--help` without a recipe lists the recipes and exits 0;
a base model's tokenizer (no chat template) and a target config without its depth are one line
naming the setting or file, not transformers' own message or a traceback.
"""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
from _data_helpers import QWEN3_TEMPLATE, chat_row, word_level_tokenizer, write_jsonl

from data_prep.backends.local import LocalBackend
from data_prep.config import LocalBackendConfig, SamplingConfig
from data_prep.schema import DataError
from dspine_train.training.errors import TrainingError
from dspine_train.training.target import load_target_config
from tests._train_helpers import REPO, single_thread

RECIPES = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("run", [
    lambda: runpy.run_path(str(REPO / "train.py"), run_name="__main__"),
    lambda: runpy.run_module("dspine_train.training.cache_features", run_name="__main__"),
], ids=["train", "cache_features"])
def test_help_without_a_recipe_lists_the_recipes(run, monkeypatch, capsys):
    """Run as a command (`__main__`) in this process, where its imports are already loaded."""
    monkeypatch.setattr(sys, "argv", ["cmd", "--help"])
    with pytest.raises(SystemExit) as exit_:
        run()
    assert exit_.value.code in (0, None)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and "You must specify" not in printed.err
    listed = printed.out.split("recipe=NAME (required)", 1)[1]
    assert RECIPES and all(f"  {name}\n" in listed for name in RECIPES), printed.out


@pytest.fixture
def base_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer as a base model ships it: no chat template."""
    tokenizer = word_level_tokenizer(QWEN3_TEMPLATE, ["question", "answer", "ok"])
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def test_tokenize_with_a_base_model_tokenizer_names_the_setting(base_tokenizer, tmp_path,
                                                                monkeypatch, capsys):
    from data_prep.tokenize import main

    rows = write_jsonl(tmp_path / "rows.jsonl", [chat_row("r0", "question", "answer ok")])
    out = tmp_path / "tokenized"
    monkeypatch.setattr(sys, "argv", [
        "cli", f"--config-path={REPO / 'recipes'}", f"data.tokenize.tokenizer_path={base_tokenizer}",
        f"data.tokenize.input_paths=[{rows}]", f"data.tokenize.output_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}"])
    with single_thread(), pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: data.tokenize.tokenizer_path {base_tokenizer}: the tokenizer has no "
                     "chat template (a base model?); point it at a chat model's tokenizer, or "
                     "add a chat_template to its tokenizer_config.json"], err
    assert not out.exists()


def test_regenerate_with_a_base_model_names_the_setting(base_tokenizer):
    from transformers import AutoTokenizer

    config = LocalBackendConfig(model_path=str(base_tokenizer), device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer)
    with pytest.raises(DataError, match=rf"^regenerate\.local\.model_path {base_tokenizer}: the "
                                        r"tokenizer has no chat template"):
        LocalBackend(config, SamplingConfig(), model=object(), tokenizer=tokenizer)


def test_a_target_config_without_its_depth_is_named(tiny_assets, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_assets["target"], target)
    fields = json.loads((target / "config.json").read_text())
    del fields["num_hidden_layers"]
    (target / "config.json").write_text(json.dumps(fields))
    with pytest.raises(TrainingError, match=rf"^model\.target_path: .*{target / 'config.json'}: "
                                            r"no num_hidden_layers \(the target's depth\)"):
        load_target_config(str(target))
