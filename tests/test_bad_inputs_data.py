"""Bad inputs to the data CLIs (regenerate, tokenize, cache_features), one test per case.

Each case runs the CLI in this process (so a fault can be injected with monkeypatch) and
checks what a user sees: a non-zero exit, one ``error:`` line naming the file or key, no
traceback, and nothing half-written.  The second half covers the data-loss cases: outputs that
overlap inputs, and feature caches that do not match the data or target they are read with.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _data_helpers import (
    QWEN3_TEMPLATE,
    FakeChatServer,
    chat_row,
    word_level_tokenizer,
    write_jsonl,
)

from tests._train_helpers import build_tiny_assets, single_thread

RECIPES = str(Path(__file__).resolve().parents[1] / "recipes")
WORDS = ["question", "answer", "ok"] + [str(i) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    word_level_tokenizer(QWEN3_TEMPLATE, WORDS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny_assets(tmp_path_factory.mktemp("tiny_assets"))


def run_cli(main: Callable[[], None], args: list[str], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """Run a Hydra CLI in-process; return its exit status and the stderr it wrote."""
    # --config-path: in-process, Hydra would look for the recipes as a Python package
    monkeypatch.setattr(sys, "argv", ["cli", f"--config-path={RECIPES}", *args,
                                      f"hydra.run.dir={tmp_path / 'hydra'}"])
    try:
        with single_thread():
            main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *expected: str) -> None:
    """Non-zero exit, exactly one `error:` line holding every `expected` text, no traceback."""
    assert code != 0, err[-2000:]
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]


def rows(n: int) -> list[dict]:
    return [chat_row(f"r{i}", f"question {i}", f"answer {i} ok") for i in range(n)]


def tokenize(tokenizer_dir: Path, inputs: list[Path], out: Path, *extra: str) -> list[str]:
    return [f"data.tokenize.tokenizer_path={tokenizer_dir}",
            f"data.tokenize.input_paths=[{','.join(map(str, inputs))}]",
            f"data.tokenize.output_dir={out}", "data.tokenize.eval_fraction=0.3", *extra]


def regenerate(inputs: list[Path], out: Path, *extra: str) -> list[str]:
    return ["data.source.builtin=null", f"data.source.paths=[{','.join(map(str, inputs))}]",
            f"data.regenerate.output_dir={out}", "data.regenerate.backend=http",
            "data.regenerate.http.max_retries=0", *extra]


def cache_args(assets: dict[str, Path], tmp_path: Path, features: Path, *extra: str) -> list[str]:
    return ["recipe=tiny", f"output_dir={tmp_path / 'run'}",
            f"model.target_path={assets['target']}", f"data.train_path={assets['data']}",
            f"model.token_table_path={assets['token_table']}", "logging.progress_bar=false",
            f"data.offline_features_dir={features}", *extra]


def leftovers(path: Path) -> list[str]:
    """`path` and its hidden build siblings, where they exist: a half-written output."""
    if not path.parent.exists():
        return []
    return sorted(p.name for p in path.parent.iterdir()
                  if p.name == path.name or p.name.startswith(f".{path.name}."))


# --------------------------------------------------------------- tokenize: bad inputs
def test_tokenize_directory_input_without_data_files(tokenizer_dir, tmp_path, monkeypatch,
                                                     capsys):
    from data_prep.tokenize import main

    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / ".hidden.jsonl").write_text("{}\n")  # hidden files do not count
    out = tmp_path / "out" / "tokenized"
    code, err = run_cli(main, tokenize(tokenizer_dir, [tmp_path / "inputs"], out),
                        tmp_path, monkeypatch, capsys)
    assert_one_line_error(code, err, str(tmp_path / "inputs"), "no data file")
    assert leftovers(out) == []


def test_tokenize_directory_input_with_a_bad_file(tokenizer_dir, tmp_path, monkeypatch, capsys):
    from data_prep.tokenize import main

    (tmp_path / "inputs").mkdir()
    write_jsonl(tmp_path / "inputs" / "a.jsonl", rows(6))
    (tmp_path / "inputs" / "notes.txt").write_text("not conversations\n")
    out = tmp_path / "out" / "tokenized"
    code, err = run_cli(main, tokenize(tokenizer_dir, [tmp_path / "inputs"], out),
                        tmp_path, monkeypatch, capsys)
    assert_one_line_error(code, err, "notes.txt", "not a data file")
    assert leftovers(out) == []


def test_tokenize_directory_of_jsonl_files_reads_every_file(tokenizer_dir, tmp_path,
                                                            monkeypatch, capsys):
    from data_prep.tokenize import main

    (tmp_path / "inputs").mkdir()
    write_jsonl(tmp_path / "inputs" / "a.jsonl", rows(6)[:3])
    write_jsonl(tmp_path / "inputs" / "b.jsonl", rows(6)[3:])
    (tmp_path / "inputs" / "README.md").write_text("# a dataset card is not data\n")
    out = tmp_path / "tokenized"
    code, err = run_cli(main, tokenize(tokenizer_dir, [tmp_path / "inputs"], out,
                                       "data.tokenize.eval_fraction=0"),
                        tmp_path, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert json.loads((out / "tokenize_report.json").read_text())["kept"] == 6


@pytest.mark.parametrize("container", ["jsonl", "json"])
def test_tokenize_accepts_a_utf8_byte_order_mark(container, tokenizer_dir, tmp_path,
                                                 monkeypatch, capsys):
    from data_prep.tokenize import main

    data = rows(6)
    body = (json.dumps(data) if container == "json"
            else "\n".join(json.dumps(row) for row in data) + "\n")
    path = tmp_path / f"bom.{container}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    out = tmp_path / "tokenized"
    code, err = run_cli(main, tokenize(tokenizer_dir, [path], out, "data.tokenize.eval_fraction=0"),
                        tmp_path, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    report = json.loads((out / "tokenize_report.json").read_text())
    assert report["kept"] == 6 and report["drop_reasons"] == {}


@pytest.mark.parametrize("fraction", ["0.001", "0"])
def test_tokenize_eval_split_left_empty_is_an_error(fraction, tokenizer_dir, tmp_path,
                                                    monkeypatch, capsys):
    """0.001: no id of r0..r2 hashes below it, the eval split would be empty; 0: no eval."""
    from datasets import load_from_disk

    from data_prep.tokenize import main

    inputs = write_jsonl(tmp_path / "c.jsonl", rows(3))
    out = tmp_path / "tokenized"
    code, err = run_cli(main, tokenize(tokenizer_dir, [inputs], out,
                                       f"data.tokenize.eval_fraction={fraction}"),
                        tmp_path, monkeypatch, capsys)
    if fraction == "0":
        assert code == 0, err[-2000:]
        assert set(load_from_disk(str(out))) == {"train"}
        return
    assert_one_line_error(code, err, "data.tokenize.eval_fraction", "eval split")
    assert leftovers(out) == []


def test_tokenize_full_disk_names_enospc_and_keeps_the_old_output(tokenizer_dir, tmp_path,
                                                                  monkeypatch, capsys):
    import datasets

    from data_prep.tokenize import main

    inputs = write_jsonl(tmp_path / "c.jsonl", rows(10))
    out = tmp_path / "tokenized"
    code, err = run_cli(main, tokenize(tokenizer_dir, [inputs], out), tmp_path, monkeypatch,
                        capsys)
    assert code == 0, err[-2000:]
    before = (out / "tokenize_report.json").read_text()

    def full_disk(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", full_disk)
    code, err = run_cli(main, tokenize(tokenizer_dir, [inputs], out, "data.tokenize.seed=1"),
                        tmp_path, monkeypatch, capsys)
    assert_one_line_error(code, err, "ENOSPC", "data.tokenize.output_dir")
    assert (out / "tokenize_report.json").read_text() == before
    assert leftovers(out) == ["tokenized"]


# --------------------------------------------------------------- regenerate: bad inputs
def test_regenerate_empty_input_is_not_success(tmp_path, monkeypatch, capsys):
    from data_prep.regenerate import main

    (tmp_path / "empty.jsonl").write_text("")
    out = tmp_path / "regenerated"
    code, err = run_cli(main, regenerate([tmp_path / "empty.jsonl"], out), tmp_path,
                        monkeypatch, capsys)
    assert_one_line_error(code, err, "data.source", "no row")
    assert not out.exists()


def test_regenerate_directory_input_without_data_files(tmp_path, monkeypatch, capsys):
    from data_prep.regenerate import main

    (tmp_path / "inputs").mkdir()
    out = tmp_path / "regenerated"
    code, err = run_cli(main, regenerate([tmp_path / "inputs"], out), tmp_path, monkeypatch,
                        capsys)
    assert_one_line_error(code, err, str(tmp_path / "inputs"), "no data file")
    assert not out.exists()


@pytest.mark.parametrize("url", ["localhost:30000", "ftp://host:1", "http://", "http://h:99999",
                                 "http://a b:1"])
def test_regenerate_malformed_url_names_its_key(url, tmp_path, monkeypatch, capsys):
    from data_prep.regenerate import main

    inputs = write_jsonl(tmp_path / "c.jsonl", rows(2))
    out = tmp_path / "regenerated"
    code, err = run_cli(main, regenerate([inputs], out,
                                         f"data.regenerate.http.urls=['http://127.0.0.1:1','{url}']"),
                        tmp_path, monkeypatch, capsys)
    assert_one_line_error(code, err, "regenerate.http.urls[1]", repr(url))
    assert not out.exists()


def test_regenerate_full_disk_names_enospc_and_leaves_no_partial_shard(tmp_path, monkeypatch,
                                                                       capsys):
    from data_prep.regenerate import main

    inputs = write_jsonl(tmp_path / "c.jsonl", rows(3))
    out = tmp_path / "regenerated"

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)  # the fsync of every atomic file write
    with FakeChatServer() as server:
        code, err = run_cli(main, regenerate([inputs], out,
                                             f"data.regenerate.http.urls=[{server.url}]"),
                            tmp_path, monkeypatch, capsys)
    assert_one_line_error(code, err, "ENOSPC", "data.regenerate.output_dir")
    assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == []


# --------------------------------------------------------------- cache_features: bad inputs
def _token_dataset(path: Path, loss_mask: list[int]) -> Path:
    import datasets

    ids = [5, 6, 7, 8, 9, 10]
    datasets.Dataset.from_dict({"input_ids": [ids] * 8, "loss_mask": [loss_mask] * 8,
                                "length": [len(ids)] * 8}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("mask", [[0] * 6, [1, 0, 1, 0, 1, 0]], ids=["none", "no_pair"])
def test_cache_features_refuses_data_without_supervised_tokens(mask, tiny_assets, tmp_path,
                                                               monkeypatch, capsys):
    from dspine_train.training.cache_features import main

    data = _token_dataset(tmp_path / "data", mask)
    features = tmp_path / "features"
    code, err = run_cli(main, cache_args(tiny_assets, tmp_path, features,
                                         f"data.train_path={data}"),
                        tmp_path, monkeypatch, capsys)
    assert_one_line_error(code, err, "data.train_path", "supervised")
    assert not features.exists()


def full_disk_on_save(save_file: Callable[..., None], number: int) -> Callable[..., None]:
    """`save_file` that fails with ENOSPC on its `number`-th call (the shards before it land)."""
    saves: list[str] = []

    def save(tensors, filename, *args, **kwargs):
        saves.append(filename)
        if len(saves) == number:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return save_file(tensors, filename, *args, **kwargs)

    return save


def test_cache_features_full_disk_names_enospc_and_keeps_a_resumable_build(
        tiny_assets, tmp_path, monkeypatch, capsys):
    """A full disk on the third shard: one error line naming ENOSPC and the partial build; no
    cache appears, the saved shards are kept, and the rerun resumes after them into the cache an
    uninterrupted run writes, file for file."""
    import dspine_train.training.cache_features as tool
    import dspine_train.training.offline_features as offline

    monkeypatch.setattr(tool, "SHARD_TOKENS", 1500)  # several shards of the tiny data
    whole = tmp_path / "whole"
    code, err = run_cli(tool.main, cache_args(tiny_assets, tmp_path, whole), tmp_path,
                        monkeypatch, capsys)
    assert code == 0, err[-2000:]

    monkeypatch.setattr(offline, "save_file", full_disk_on_save(offline.save_file, 3))
    features = tmp_path / "features"
    code, err = run_cli(tool.main, cache_args(tiny_assets, tmp_path, features), tmp_path,
                        monkeypatch, capsys)
    partial = tmp_path / ".features.partial"
    assert_one_line_error(code, err, "ENOSPC", "data.offline_features_dir",
                          f"kept in {partial}: rerun to resume")
    assert leftovers(features) == [".features.partial"]  # no cache, a resumable build
    assert sorted(p.name for p in (partial / "train").iterdir()) == [
        "progress.json", "shard_00000.safetensors", "shard_00001.safetensors"]

    code, err = run_cli(tool.main, cache_args(tiny_assets, tmp_path, features), tmp_path,
                        monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert leftovers(features) == ["features"]
    assert _files(features) == _files(whole)


def _partial_build_then_rerun(tiny_assets, tmp_path, monkeypatch, capsys,
                              first: tuple[str, ...], second: tuple[str, ...]) -> str:
    """A cache build with `first` stopped by a full disk (its partial build kept), then a whole
    run with `second`; that run's output."""
    import dspine_train.training.cache_features as tool
    import dspine_train.training.offline_features as offline

    monkeypatch.setattr(tool, "SHARD_TOKENS", 1500)
    features = tmp_path / "features"
    with monkeypatch.context() as patch:
        patch.setattr(offline, "save_file", full_disk_on_save(offline.save_file, 2))
        code, _ = run_cli(tool.main, cache_args(tiny_assets, tmp_path, features, *first),
                          tmp_path, patch, capsys)
    assert code == 1 and (tmp_path / ".features.partial" / "train" / "progress.json").is_file()
    monkeypatch.setattr(sys, "argv", ["cli", f"--config-path={RECIPES}",
                                      *cache_args(tiny_assets, tmp_path, features, *second),
                                      f"hydra.run.dir={tmp_path / 'hydra'}"])
    with single_thread():
        tool.main()
    return capsys.readouterr().out


def test_cache_features_discards_a_partial_build_of_other_settings(tiny_assets, tmp_path,
                                                                   monkeypatch, capsys):
    """A partial build made with other settings (here max_length 64, rerun with 32) is not
    resumed: the run says so and builds the cache of its own settings whole."""
    from safetensors.torch import load_file

    features = tmp_path / "features"
    out = _partial_build_then_rerun(tiny_assets, tmp_path, monkeypatch, capsys, (),
                                    ("data.max_length=32",))
    assert f"discarding {tmp_path / '.features.partial'}" in out
    assert leftovers(features) == ["features"]
    for split in ("train", "eval"):
        index = json.loads((features / split / "index.json").read_text())
        assert index["max_length"] == 32
        rows = 0
        for shard in index["shards"]:  # every row cut to 32 tokens: none from the 64 build
            offsets = load_file(str(features / split / shard["file"]))["offsets"]
            assert int(offsets.diff().max()) <= 32
            rows += len(offsets) - 1
        assert rows == index["num_rows"]


def test_cache_features_does_not_resume_a_partial_build_of_other_bf16_products(
        tiny_assets, tmp_path, monkeypatch, capsys):
    """How a bf16 target's products ran (`cpu_bf16_matmul`) decides the cached values, so a
    partial build made with PyTorch's native kernels is not finished with float32 products."""
    features = tmp_path / "features"
    bf16 = "model.target_dtype=bfloat16"
    out = _partial_build_then_rerun(tiny_assets, tmp_path, monkeypatch, capsys,
                                    (bf16, "cpu_bf16_matmul=native"),
                                    (bf16, "cpu_bf16_matmul=float32"))
    assert f"discarding {tmp_path / '.features.partial'}" in out
    assert "the target's bf16 matrix products run in float32" in out
    assert leftovers(features) == ["features"]


def test_cache_features_refuses_a_build_directory_it_did_not_write(tiny_assets, tmp_path,
                                                                    monkeypatch, capsys):
    from dspine_train.training.cache_features import main

    foreign = tmp_path / ".features.partial"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("mine")
    code, err = run_cli(main, cache_args(tiny_assets, tmp_path, tmp_path / "features"),
                        tmp_path, monkeypatch, capsys)
    assert_one_line_error(code, err, "data.offline_features_dir", str(foreign), "did not write")
    assert _files(foreign) == {"mine.txt": b"mine"} and not (tmp_path / "features").exists()


# --------------------------------------------------------------- cache_features: overlaps
def _copy_assets(assets: dict[str, Path], root: Path) -> dict[str, Path]:
    """A private copy of the tiny target and dataset: the test may see them destroyed."""
    copy = dict(assets)
    for key in ("target", "data"):
        copy[key] = root / "assets" / key
        shutil.copytree(assets[key], copy[key])
    return copy


def _files(path: Path) -> dict[str, bytes]:
    """Every file under `path` by relative name, with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["dataset", "inside_dataset", "target", "containing_inputs"])
def test_cache_features_refuses_an_output_overlapping_an_input(where, tiny_assets, tmp_path,
                                                               monkeypatch, capsys):
    from dspine_train.training.cache_features import main

    assets = _copy_assets(tiny_assets, tmp_path)
    features = {"dataset": assets["data"], "inside_dataset": assets["data"] / "features",
                "target": assets["target"], "containing_inputs": tmp_path / "assets"}[where]
    before = _tree(tmp_path / "assets")
    code, err = run_cli(main, cache_args(assets, tmp_path, features), tmp_path, monkeypatch,
                        capsys)
    key = "model.target_path" if where == "target" else "data.train_path"
    assert_one_line_error(code, err, "data.offline_features_dir", "overlaps", key)
    assert _tree(tmp_path / "assets") == before


def test_cache_features_refuses_a_directory_it_did_not_write(tiny_assets, tmp_path,
                                                             monkeypatch, capsys):
    from dspine_train.training.cache_features import main

    features = tmp_path / "shards"
    features.mkdir()
    write_jsonl(features / "part-00000.jsonl", rows(2))
    (features / "train").mkdir()
    (features / "train" / "keep.txt").write_text("mine")
    code, err = run_cli(main, cache_args(tiny_assets, tmp_path, features), tmp_path,
                        monkeypatch, capsys)
    assert_one_line_error(code, err, "data.offline_features_dir", str(features), "not written")
    assert sorted(_tree(features)) == ["part-00000.jsonl", "train/keep.txt"]


# --------------------------------------------------------------- feature cache identity
@pytest.fixture(scope="module")
def cached(tiny_assets, tmp_path_factory) -> Path:
    """A feature cache of the tiny assets, made by the CLI."""
    from hydra import compose, initialize_config_dir

    from dspine_train.training.cache_features import cache_features

    root = tmp_path_factory.mktemp("cached")
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose(config_name="config",
                      overrides=cache_args(tiny_assets, root, root / "features"))
    with single_thread():
        cache_features(cfg)
    return root / "features"


def _reader(assets: dict[str, Path], target: Path, data: Path, cache: Path):
    import datasets

    from dspine_train.training.data import TokenBatches
    from dspine_train.training.offline_features import OfflineFeatures, cache_identity

    batches = TokenBatches(datasets.load_from_disk(str(data))["train"], 64, 512,
                           "data.train_path")
    return OfflineFeatures(cache / "train", cache_identity(str(target), [1, 2], 64, batches))


def test_feature_cache_rerun_replaces_its_own_output(cached, tiny_assets, tmp_path,
                                                     monkeypatch, capsys):
    from dspine_train.training.cache_features import main

    features = tmp_path / "features"
    shutil.copytree(cached, features)
    code, err = run_cli(main, cache_args(tiny_assets, tmp_path, features), tmp_path,
                        monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert sorted(p.name for p in features.iterdir()) == [".data_prep.cache_features", "eval",
                                                        "train"]
    assert [p.name for p in features.parent.iterdir() if ".tmp-" in p.name] == []


def test_feature_cache_accepts_the_same_inputs_at_other_paths(cached, tiny_assets, tmp_path):
    assets = _copy_assets(tiny_assets, tmp_path)
    reader = _reader(assets, assets["target"], assets["data"], cached)
    assert reader.index["num_rows"] == 128


def test_feature_cache_refuses_another_target_naming_both(cached, tiny_assets, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from dspine_train.training.errors import TrainingError

    assets = _copy_assets(tiny_assets, tmp_path)
    # a fine-tune of the same base: same config, same file size, other weights
    weights = assets["target"] / "model.safetensors"
    tensors = load_file(str(weights))
    for name in tensors:
        if "layers.1." in name:
            tensors[name] = tensors[name] + torch.full_like(tensors[name], 0.01)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == (tiny_assets["target"] / "model.safetensors").stat().st_size
    with pytest.raises(TrainingError) as error:
        _reader(assets, assets["target"], assets["data"], cached)
    message = str(error.value)
    assert str(tiny_assets["target"]) in message and str(assets["target"]) in message
    assert "another target" in message


def test_feature_cache_refuses_other_data_with_the_same_row_count(cached, tiny_assets,
                                                                 tmp_path):
    import datasets

    from dspine_train.training.errors import TrainingError

    other = tmp_path / "other_data"
    splits = datasets.load_from_disk(str(tiny_assets["data"]))

    def shift(row):
        return {"input_ids": [(i + 1) % 500 for i in row["input_ids"]]}

    datasets.DatasetDict({name: split.map(shift) for name, split in splits.items()}
                         ).save_to_disk(str(other))
    assert len(datasets.load_from_disk(str(other))["train"]) == len(splits["train"])
    with pytest.raises(TrainingError) as error:
        _reader(tiny_assets, tiny_assets["target"], other, cached)
    message = str(error.value)
    assert str(tiny_assets["data"]) in message and str(other) in message
    assert "other token data" in message
