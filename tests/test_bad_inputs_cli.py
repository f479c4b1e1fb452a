"""Bad command-line input: one line naming the flag or file, a non-zero exit, nothing written.

One parametrised test per CLI (the engine, the token table, push_to_hub); each case is one
bad input. Engine cases must be rejected before any model is loaded: loading raises here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspine_train import token_table
from dspine_train.engine import cli as engine_cli

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "push_to_hub_cli", REPO / "scripts" / "push_to_hub.py"
)
push_to_hub = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(push_to_hub)


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The only line the command wrote to stderr (a traceback or a second line fails)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def files_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


# --------------------------------------------------------------------------- engine CLI
@pytest.fixture
def engine_files(tmp_path, monkeypatch):
    """A prompts file, a file where a directory is expected; loading any model fails loudly."""

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(engine_cli.Engine, "from_pretrained", no_loading)
    (tmp_path / "prompts.txt").write_text("w1 w2\nw3\n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("w1\ncaf\xe9 w2\n".encode("latin-1"))
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "w1"}\n')
    (tmp_path / "a_file").write_text("")
    return tmp_path


ENGINE_CASES = {
    "batch-size-0": (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    "batch-size-negative": (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
    "max-seq-len-0": (["--max-seq-len", "0"], "--max-seq-len must be >= 1, got 0"),
    "temperature-nan": (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    "temperature-inf": (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    "top-p-nan": (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    "max-new-tokens-0": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    "num-draft-tokens-0": (["--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1"),
    "device-unknown": (["--device", "gpu0"], "--device 'gpu0' is not a torch device"),
    "prompts-not-utf8": (
        ["--prompts", "{root}/latin1.txt"],
        "--prompts {root}/latin1.txt:2: not valid UTF-8 (byte 0xe9 at offset 6)",
    ),
    "prompts-with-bom": (
        ["--prompts", "{root}/bom.jsonl"],
        "--prompts {root}/bom.jsonl: starts with a UTF-8 byte-order mark",
    ),
    "output-under-a-file": (
        ["--output", "{root}/a_file/out.json"],
        "--output {root}/a_file/out.json: {root}/a_file is not a directory",
    ),
    "output-is-a-directory": (["--output", "{root}"], "--output {root}: is a directory"),
    "output-not-writable": (
        ["--output", "/proc/dspine_out.json"],
        "--output /proc/dspine_out.json: cannot write in /proc",
    ),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_cli_rejects_before_loading(engine_files, capsys, case):
    if case == "output-not-writable" and not sys.platform.startswith("linux"):
        pytest.skip("uses /proc")
    root = engine_files
    extra, expected = ENGINE_CASES[case]
    extra = [arg.format(root=root) for arg in extra]
    argv = ["--target", str(root / "target"), "--draft", str(root / "draft"), "--no-chat"]
    argv += ["--prompts", str(root / "prompts.txt"), "--device", "cpu", *extra]
    before = files_under(root)
    assert engine_cli.main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: ") and expected.format(root=root) in line, line
    assert files_under(root) == before  # nothing written, no temporary file left


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_engine_cli_names_a_draft_whose_weights_do_not_match(tmp_path, capsys, change):
    """A draft export whose safetensors lacks a weight (or holds an extra one) passes the file
    checks; its strict load is one `CheckpointError` line naming the draft, not a traceback."""
    from safetensors.torch import load_file

    from tests._engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

    hf = build_tiny_target(tmp_path / "target", "qwen3", num_hidden_layers=6, eos_token_id=None)
    build_tokenizer(tmp_path / "target", vocab_size=200)
    draft = tmp_path / "draft"
    tiny_draft(hf, 200).save_pretrained(draft)
    weights = load_file(draft / "model.safetensors")
    name = sorted(weights)[0]
    if change == "missing":
        del weights[name]
    else:
        name = "layers.9.extra.weight"
        weights[name] = torch.zeros(2)
    save_file(weights, draft / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "prompts.txt").write_text("w1 w2\n", encoding="utf-8")
    out = tmp_path / "out.json"
    argv = ["--target", str(tmp_path / "target"), "--draft", str(draft), "--no-chat",
            "--prompts", str(tmp_path / "prompts.txt"), "--device", "cpu", "--output", str(out)]
    capsys.readouterr()
    assert engine_cli.main(argv) == 2
    err = capsys.readouterr().err
    # transformers' loading progress bars may precede it; the error is the one last line
    assert "Traceback" not in err and err.count("error:") == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {draft}: the weights do not match its config.json "
                           f"({change} keys: "), line
    assert name in line
    assert not out.exists()


# --------------------------------------------------------------------------- token_table CLI
@pytest.fixture
def checkpoints(tmp_path):
    """Tiny safetensors targets: a good one, a tied one with a non-UTF-8 config, a broken index."""
    good = tmp_path / "good"
    good.mkdir()
    save_file({"lm_head.weight": torch.randn(40, 8)}, good / "model.safetensors")
    bad_config = tmp_path / "bad_config"
    bad_config.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(40, 8)}, bad_config / "model.safetensors")
    (bad_config / "config.json").write_bytes(b'{"model_type": "caf\xe9"}')
    missing_shard = tmp_path / "missing_shard"
    missing_shard.mkdir()
    index = {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (missing_shard / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "a_file").write_text("")
    (tmp_path / "out").mkdir()
    return tmp_path


TOKEN_TABLE_CASES = {
    "target-is-a-file": (
        ["--target", "{root}/a_file"],
        "target checkpoint {root}/a_file is not a directory",
    ),
    "config-not-utf8": (
        ["--target", "{root}/bad_config"],
        "{root}/bad_config/config.json is not valid UTF-8",
    ),
    "index-names-a-missing-shard": (
        ["--target", "{root}/missing_shard"],
        "{root}/missing_shard/model.safetensors.index.json maps lm_head.weight to "
        "model-00001-of-00002.safetensors, which is not in {root}/missing_shard",
    ),
    "out-under-a-file": (
        ["--out", "{root}/a_file/table.safetensors"],
        "--out {root}/a_file/table.safetensors: {root}/a_file is not a directory",
    ),
    "out-is-a-directory": (["--out", "{root}/out"], "--out {root}/out: is a directory"),
    "out-not-writable": (
        ["--out", "/proc/dspine_table.safetensors"],
        "--out /proc/dspine_table.safetensors: cannot write in /proc",
    ),
    "transfer-dim-0": (["--transfer-dim", "0"], "--transfer-dim must be >= 1, got 0"),
    "transfer-dim-negative": (["--transfer-dim", "-4"], "--transfer-dim must be >= 1, got -4"),
    "chunk-size-0": (["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
}


@pytest.mark.parametrize("case", list(TOKEN_TABLE_CASES))
def test_token_table_cli_rejects(checkpoints, capsys, case):
    if case == "out-not-writable" and not sys.platform.startswith("linux"):
        pytest.skip("uses /proc")
    root = checkpoints
    extra, expected = TOKEN_TABLE_CASES[case]
    argv = ["--target", str(root / "good"), "--out", str(root / "out" / "table.safetensors")]
    argv += [arg.format(root=root) for arg in extra]
    before = files_under(root)
    assert token_table.main(argv) != 0
    line = one_error_line(capsys)
    assert line.startswith("error: ") and expected.format(root=root) in line, line
    assert files_under(root) == before


# --------------------------------------------------------------------------- push_to_hub
@pytest.fixture
def export(tmp_path, monkeypatch):
    """A valid export directory; building a Hub client fails loudly."""
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken")
    root = tmp_path / "export"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "dspine"}))
    save_file({"fc.weight": torch.ones(2, 2)}, root / "model.safetensors")
    save_file({"fc.weight": torch.ones(2, 2)}, tmp_path / "outside.safetensors")
    return root


def _index_to(root: Path, shard) -> None:
    (root / "model.safetensors").rename(root / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"fc.weight": shard}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


PUSH_CASES = {
    "index-shard-not-a-name": (
        lambda root: _index_to(root, 5),
        "model.safetensors.index.json: weight_map['fc.weight'] = 5 is not a shard file name",
    ),
    "index-shard-outside-the-export": (
        lambda root: _index_to(root, "../outside.safetensors"),
        "weight_map['fc.weight'] = '../outside.safetensors' is not a shard file name",
    ),
}


@pytest.mark.parametrize("case", list(PUSH_CASES))
def test_push_to_hub_rejects_bad_exports(export, capsys, case):
    breakage, expected = PUSH_CASES[case]
    breakage(export)
    before = files_under(export.parent)

    def no_client(**kwargs):
        raise AssertionError("a Hub client was built for a bad export")

    assert push_to_hub.main([str(export), "--repo-id", "org/name"], api_factory=no_client) == 2
    line = one_error_line(capsys)
    assert line.startswith("dspine-train push: error: ") and expected in line, line
    assert files_under(export.parent) == before  # no model card written
