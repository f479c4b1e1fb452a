"""The engine's command line and benchmark script on a tiny target and draft."""

from __future__ import annotations

import errno
import json
import os

import pytest
from _engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

from dspine_train.engine.cli import main
from tests._train_helpers import run_module


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf = build_tiny_target(root / "target", "qwen3", num_hidden_layers=6, eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=200)
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    (root / "prompts.jsonl").write_text('{"prompt": "w1 w2 w3"}\n"w4 w5"\n{"prompt": "w9"}\n')
    return root


def test_cli_generates_and_writes_json(files, capsys):
    out = files / "out.json"
    argv = [
        "--target",
        str(files / "target"),
        "--draft",
        str(files / "draft"),
        "--prompts",
        str(files / "prompts.jsonl"),
        "--no-chat",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--max-seq-len",
        "32",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["prompt"] for r in report["results"]] == ["w1 w2 w3", "w4 w5", "w9"]
    assert report["stats"]["mode"] == "speculative" and report["stats"]["num_sequences"] == 3
    assert "tok/s" in capsys.readouterr().out
    # Plain decoding of the same prompts gives the same tokens.
    assert main(argv[:-2] + ["--ar", "--output", str(files / "ar.json")]) == 0
    ar = json.loads((files / "ar.json").read_text())
    assert [r["token_ids"] for r in ar["results"]] == [r["token_ids"] for r in report["results"]]


def test_cli_exits_non_zero_with_a_clear_message(files, capsys):
    argv = [
        "--target",
        str(files / "target"),
        "--draft",
        str(files / "missing"),
        "--prompts",
        str(files / "prompts.jsonl"),
        "--no-chat",
    ]
    assert main(argv) == 2
    assert "no config.json" in capsys.readouterr().err
    (files / "bad.jsonl").write_text('{"text": "w1"}\n')
    argv[5] = str(files / "bad.jsonl")
    argv[3] = str(files / "draft")
    assert main(argv) == 2
    assert "bad.jsonl:1: no string field 'prompt'" in capsys.readouterr().err


def test_bench_script_prints_table_and_writes_json(files):
    out = files / "bench.json"
    cmd = [
        "scripts/bench_engine.py",
        "--target",
        str(files / "target"),
        "--draft",
        str(files / "draft"),
        "--prompts",
        str(files / "prompts.jsonl"),
        "--no-chat",
        "--max-new-tokens",
        "4",
        "--num-draft-tokens",
        "2",
        "7",
        "--max-seq-len",
        "32",
        "--repeats",
        "2",
        "--output",
        str(out),
    ]
    done = run_module(cmd)  # this checkout's packages, offline, one thread
    assert done.returncode == 0, done.stderr
    assert "speedup" in done.stdout and "walk_vs_serial" in done.stdout
    report = json.loads(out.read_text())
    assert [(r["mode"], r["g"]) for r in report["runs"]] == [
        ("autoregressive", 0),
        ("speculative", 2),
        ("speculative", 7),
    ]
    assert all(r["identical"] for r in report["runs"])
    assert 0.0 <= report["draft_step_costs"]["injection_share"] < 1.0


def test_cli_output_failure_after_generation_leaves_nothing(files, capsys, monkeypatch):
    """A write that fails at the end (here a full disk) is one line, exit 1, no partial file."""
    out_dir = files / "full_disk"
    argv = ["--target", str(files / "target"), "--prompts", str(files / "prompts.jsonl")]
    argv += ["--no-chat", "--max-new-tokens", "2", "--max-seq-len", "32"]
    argv += ["--output", str(out_dir / "out.json")]

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", disk_full)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err  # above the error line: only the progress bar
    assert err.strip().splitlines()[-1] == (
        f"error: --output {out_dir / 'out.json'}: cannot write (No space left on device)"
    )
    assert list(out_dir.iterdir()) == []  # neither the file nor its temporary


def test_cli_tree_paths_verify_a_token_tree(files, capsys):
    argv = [
        "--target", str(files / "target"), "--draft", str(files / "draft"),
        "--prompts", str(files / "prompts.jsonl"), "--no-chat", "--max-new-tokens", "6",
        "--batch-size", "2", "--max-seq-len", "32",
    ]
    assert main([*argv, "--output", str(files / "chain.json")]) == 0
    assert main([*argv, "--tree-paths", "2", "--output", str(files / "tree.json")]) == 0
    chain, tree = (json.loads((files / f"{n}.json").read_text()) for n in ("chain", "tree"))
    assert tree["stats"]["tree_paths"] == 2 and tree["stats"]["tree_nodes"] == 14
    assert [r["token_ids"] for r in tree["results"]] == [r["token_ids"] for r in chain["results"]]
    capsys.readouterr()
    assert main([*argv, "--tree-paths", "0"]) == 2
    assert "--tree-paths must be >= 1, got 0" in capsys.readouterr().err


def test_bench_script_compares_chain_and_trees(files):
    out = files / "bench_tree.json"
    cmd = [
        "scripts/bench_engine.py",
        "--target", str(files / "target"), "--draft", str(files / "draft"),
        "--prompts", str(files / "prompts.jsonl"), "--no-chat", "--max-new-tokens", "4",
        "--max-seq-len", "32", "--tree-paths", "1,2", "--tree-nodes", "9",
        "--tree-rounds", "1", "--skip-step-costs", "--output", str(out),
    ]
    done = run_module(cmd)  # this checkout's packages, offline, one thread
    assert done.returncode == 0, done.stderr
    assert "tok/s x" in done.stdout
    rows = json.loads(out.read_text())["tree_runs"]
    assert [(r["mode"], r["paths"], r["nodes"]) for r in rows] == [("chain", 1, 7), ("tree", 2, 9)]
    assert all(r["identical"] for r in rows) and rows[0]["tau_vs_chain"] == 1.0


def test_cli_ngram_modes_are_lossless_and_bad_flags_named(files, capsys):
    argv = [
        "--target", str(files / "target"), "--prompts", str(files / "prompts.jsonl"), "--no-chat",
        "--max-new-tokens", "6", "--batch-size", "2", "--max-seq-len", "48",
    ]
    assert main([*argv, "--output", str(files / "plain.json")]) == 0
    runs = {
        "ngram": ["--ngram", "--ngram-tokens", "4"],  # no draft: the n-gram mode
        "hybrid": ["--draft", str(files / "draft"), "--ngram", "--adaptive"],
    }
    plain = json.loads((files / "plain.json").read_text())
    for name, flags in runs.items():
        assert main([*argv, *flags, "--output", str(files / f"{name}.json")]) == 0
        report = json.loads((files / f"{name}.json").read_text())
        assert report["stats"]["mode"] == "speculative"
        assert sum(report["stats"]["round_shapes"].values()) == report["stats"]["steps"]
        assert [r["token_ids"] for r in report["results"]] == [
            r["token_ids"] for r in plain["results"]
        ]
    capsys.readouterr()
    assert main([*argv, "--ngram", "--ngram-min-n", "3", "--ngram-max-n", "2"]) == 2
    assert "--ngram-max-n" in capsys.readouterr().err
