"""Tokenisation stage: Arrow output, truncation and drop policy, train/eval split, config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _data_helpers import QWEN3_TEMPLATE, chat_row, word_level_tokenizer, write_jsonl
from hydra import compose, initialize_config_dir
from omegaconf.errors import ConfigKeyError

from data_prep.config import REPO_ROOT, to_data_config
from data_prep.tokenize import REPORT_FILE, SPLITS_FILE, run_tokenize

RECIPES = str(REPO_ROOT / "recipes")
WORDS = ["question", "answer", "number", "long", "ok"] + [str(i) for i in range(40)]


def compose_data(*overrides: str):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose(config_name="data_prep_job", overrides=list(overrides))
    return to_data_config(cfg.data)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    word_level_tokenizer(QWEN3_TEMPLATE, WORDS).save_pretrained(path)
    return path


def test_tokenize_stage_end_to_end(tmp_path, tokenizer_dir):
    from datasets import load_from_disk

    rows = [chat_row(f"row-{i:02d}", f"question number {i}", f"answer number {i}")
            for i in range(40)]
    rows += [
        chat_row("long", "long " * 10, "answer " + " ".join(str(i) for i in range(39))),
        {"id": "prompt-only", "messages": [{"role": "user", "content": "question"}]},
        {"id": "one-token", "messages": [{"role": "user", "content": "question"},
                                         {"role": "assistant", "content": "ok",
                                          "truncated": True}]},
        chat_row("eot-inside", "question", "ok <|im_end|> ok"),
        {"id": "bad-role", "messages": [{"role": "robot", "content": "beep"}]},
    ]
    inputs = write_jsonl(tmp_path / "conversations.jsonl", rows)
    out = tmp_path / "tokenized"
    data = compose_data(f"data.tokenize.tokenizer_path={tokenizer_dir}",
                        f"data.tokenize.input_paths=[{inputs}]",
                        f"data.tokenize.output_dir={out}", "data.tokenize.num_proc=2",
                        "data.tokenize.max_length=40", "data.tokenize.eval_fraction=0.25",
                        "data.regenerate.sampling.enable_thinking=false")
    report = run_tokenize(data)

    assert report["input_rows"] == 45
    assert report["kept"] == 41 and report["truncated_rows"] == 1
    assert report["drop_reasons"] == {"no_assistant_turn": 1, "too_few_supervised_tokens": 1,
                                      "end_of_turn_in_content": 1, "unknown_role": 1}
    assert report["kept"] + report["dropped"] == report["input_rows"]
    assert report["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert json.loads((out / REPORT_FILE).read_text())["kept"] == 41

    dataset = load_from_disk(str(out))
    assert set(dataset) == {"train", "eval"}
    assert dataset["train"].column_names == ["input_ids", "loss_mask", "length"]
    assert str(dataset["train"].features["input_ids"].feature.dtype) == "int32"
    assert str(dataset["train"].features["loss_mask"].feature.dtype) == "int8"
    splits = json.loads((out / SPLITS_FILE).read_text())
    assert {name: len(ids) for name, ids in splits.items()} == {
        name: len(part) for name, part in dataset.items()}
    assert 0 < len(splits["eval"]) < 41 and set(splits["train"]).isdisjoint(splits["eval"])
    assert splits["train"] == sorted(splits["train"])

    train = dataset["train"]
    for index, row_id in enumerate(splits["train"]):
        row = train[index]
        assert row["length"] == len(row["input_ids"]) == len(row["loss_mask"]) <= 40
        if row_id == "long":
            assert row["length"] == 40 and all(row["loss_mask"][-5:])  # cut inside the answer
        elif row_id == "row-07":
            # user turn + empty think block unsupervised; "answer number 7 <|im_end|>" supervised
            assert sum(row["loss_mask"]) == 4 and row["loss_mask"][-1] == 0


def test_tokenize_output_does_not_depend_on_input_order(tmp_path, tokenizer_dir):
    from datasets import load_from_disk

    rows = [chat_row(f"r{i}", f"question {i}", f"answer {i} {i}") for i in range(12)]
    outputs = []
    for name, ordered in (("a", rows), ("b", rows[::-1])):
        inputs = write_jsonl(tmp_path / f"{name}.jsonl", ordered)
        data = compose_data(f"data.tokenize.tokenizer_path={tokenizer_dir}",
                            f"data.tokenize.input_paths=[{inputs}]",
                            f"data.tokenize.output_dir={tmp_path / name}",
                            "data.tokenize.eval_fraction=0.3")
        run_tokenize(data)
        outputs.append(load_from_disk(str(tmp_path / name)))
    for split in ("train", "eval"):
        assert outputs[0][split]["input_ids"] == outputs[1][split]["input_ids"]


def test_drop_truncation_policy(tmp_path, tokenizer_dir):
    inputs = write_jsonl(tmp_path / "c.jsonl", [
        chat_row("short", "question", "answer"),
        chat_row("long", "long " * 30, "answer")])
    data = compose_data(f"data.tokenize.tokenizer_path={tokenizer_dir}",
                        f"data.tokenize.input_paths=[{inputs}]",
                        f"data.tokenize.output_dir={tmp_path / 'out'}",
                        "data.tokenize.max_length=20", "data.tokenize.truncation=drop",
                        "data.tokenize.eval_fraction=0")
    report = run_tokenize(data)
    assert report["drop_reasons"] == {"too_long": 1} and report["train_rows"] == 1


def test_unknown_config_keys_are_named():
    with pytest.raises(Exception, match="tokenize.bogus"):
        compose_data("data.tokenize.bogus=1")
    with pytest.raises(ConfigKeyError, match="bogus"):
        compose_data("+data.source.bogus=1")
    with pytest.raises(ValueError, match="tokenize.eval_fraction"):
        compose_data("data.tokenize.eval_fraction=1.5")


def test_every_recipe_composes():
    for recipe in sorted(Path(RECIPES, "data").glob("*.yaml")):
        overrides = [f"data={recipe.stem}", "data.tokenize.tokenizer_path=/some/tokenizer"]
        data = compose_data(*overrides)
        assert data.source.builtin is not None or data.source.paths or data.source.hub


def test_cli_rejects_unknown_key_with_nonzero_exit(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "data_prep.tokenize", "data.tokenize.max_lenght=10",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "max_lenght" in result.stderr


def test_no_usable_rows_is_a_clear_error_and_writes_nothing(tmp_path, tokenizer_dir):
    from data_prep.schema import DataError

    inputs = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "robot", "messages": [{"role": "robot", "content": "beep"}]},
        {"id": "prompt", "messages": [{"role": "user", "content": "question"}]}])
    data = compose_data(f"data.tokenize.tokenizer_path={tokenizer_dir}",
                        f"data.tokenize.input_paths=[{inputs}]",
                        f"data.tokenize.output_dir={tmp_path / 'out'}")
    with pytest.raises(DataError, match="no_assistant_turn"):
        run_tokenize(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


# ----------------------------------------------------------- output directory ownership
def _tokenize_into(tmp_path: Path, tokenizer_dir: Path, out: Path, *extra: str):
    inputs = write_jsonl(tmp_path / "c.jsonl", [chat_row(f"r{i}", f"question {i}", f"answer {i}")
                                                 for i in range(8)])
    return compose_data(f"data.tokenize.tokenizer_path={tokenizer_dir}",
                        f"data.tokenize.input_paths=[{inputs}]",
                        f"data.tokenize.output_dir={out}", "data.tokenize.eval_fraction=0",
                        *extra)


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_tokenize_refuses_the_regeneration_directory(tmp_path, tokenizer_dir):
    from data_prep.schema import DataError
    from dspine_train.owned_dir import OwnedDirError

    shards = tmp_path / "regenerated"
    shards.mkdir()
    write_jsonl(shards / "part-00000.jsonl", [chat_row("a", "question", "answer")])
    (shards / "regenerate_settings.json").write_text("{}\n")
    before = _files(shards)
    data = _tokenize_into(tmp_path, tokenizer_dir, shards,
                          f"data.regenerate.output_dir={tmp_path / 'elsewhere'}")
    with pytest.raises((OwnedDirError, DataError),
                       match=r"data\.tokenize\.output_dir: .*regenerated .*not written by"):
        run_tokenize(data)
    assert _files(shards) == before
    # and, when the shards are the input, as an overlap of the input
    data = compose_data(f"data.tokenize.tokenizer_path={tokenizer_dir}",
                        f"data.regenerate.output_dir={shards}",
                        f"data.tokenize.output_dir={shards}")
    with pytest.raises(OwnedDirError, match=r"data\.tokenize\.output_dir: .* overlaps"):
        run_tokenize(data)
    assert _files(shards) == before


def test_tokenize_refuses_a_directory_with_unrelated_files(tmp_path, tokenizer_dir):
    from dspine_train.owned_dir import OwnedDirError

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(OwnedDirError, match="notes.txt"):
        run_tokenize(_tokenize_into(tmp_path, tokenizer_dir, out))
    assert _files(out) == {"notes.txt": b"keep me"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "mine"]


def test_tokenize_refuses_a_file_and_leaves_no_old_copy(tmp_path, tokenizer_dir):
    from dspine_train.owned_dir import OwnedDirError

    out = tmp_path / "tokenized"
    out.write_text("a file")
    with pytest.raises(OwnedDirError, match="not a plain directory"):
        run_tokenize(_tokenize_into(tmp_path, tokenizer_dir, out))
    assert out.read_text() == "a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "tokenized"]


def test_tokenize_replaces_its_own_output_and_an_unmarked_older_one(tmp_path, tokenizer_dir):
    from data_prep.tokenize import MARKER

    out = tmp_path / "tokenized"
    run_tokenize(_tokenize_into(tmp_path, tokenizer_dir, out))
    assert (out / MARKER).is_file()
    (out / MARKER).unlink()  # an output written before the marker existed
    report = run_tokenize(_tokenize_into(tmp_path, tokenizer_dir, out, "data.tokenize.seed=3"))
    assert report["settings"]["seed"] == 3 and (out / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "tokenized"]


def test_tokenize_cleans_builds_left_by_a_killed_run(tmp_path, tokenizer_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid whose process has exited
    out = tmp_path / "tokenized"
    run_tokenize(_tokenize_into(tmp_path, tokenizer_dir, out))
    build = tmp_path / f".tokenized.tmp-{dead.pid}-x1y2"
    (build / "cache").mkdir(parents=True)
    stale = tmp_path / f".tokenized.old-{dead.pid}"
    stale.mkdir()
    live = tmp_path / f".tokenized.tmp-{os.getppid()}-live"  # a running process's build
    live.mkdir()
    run_tokenize(_tokenize_into(tmp_path, tokenizer_dir, out))
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "c.jsonl", "tokenized"]


def test_a_kill_between_the_two_renames_puts_the_old_output_back(tmp_path):
    from dspine_train.checkpoint_io import clean_dead_builds

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    aside = tmp_path / f".out.old-{dead.pid}"
    aside.mkdir()
    (aside / "data").write_text("old output")
    assert clean_dead_builds(tmp_path / "out") == []
    assert (tmp_path / "out" / "data").read_text() == "old output" and not aside.exists()
