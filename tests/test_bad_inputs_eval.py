"""Bad input to `scripts/eval_acceptance.py`: one `error:` line naming the flag or file, exit
status 1, no traceback, nothing written; no flag is silently ignored or replaced.

The flag cases are refused before any model is loaded (the target and draft paths do not
exist); the chat-template case needs a real target and draft, built tiny.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from _engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

REPO = Path(__file__).resolve().parents[1]


def _script():
    """`scripts/eval_acceptance.py` as a module (its `main(argv)` returns the exit status)."""
    spec = importlib.util.spec_from_file_location("eval_acceptance",
                                                  REPO / "scripts" / "eval_acceptance.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _refused(tmp_path: Path, capsys, argv: list[str], target: Path | None = None,
             draft: Path | None = None) -> str:
    """Run the script; assert exit 1, a single `error:` line, no traceback and no --out
    directory; return the line."""
    out = tmp_path / "out"
    base = ["--target", str(target or tmp_path / "no_target"),
            "--draft", str(draft or tmp_path / "no_draft"), "--out", str(out)]
    capsys.readouterr()
    assert _script().main([*base, *argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert not out.exists()
    return err.strip().splitlines()[-1]


CASES = {
    "max-new-tokens-0": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    "parity-max-new-tokens-0": (["--parity", "--data", "d", "--max-new-tokens", "0"],
                                "--max-new-tokens must be >= 1, got 0"),
    "tree-nodes-without-tree-paths": (["--tree-nodes", "5"],
                                      "--tree-nodes 5 sizes a token tree: it needs --tree-paths > 1"),
    "parity-with-tree-paths": (["--parity", "--data", "d", "--tree-paths", "4"],
                               "--parity compares the trainer's T=0 chain with the engine's; "
                               "--tree-paths would not apply"),
    "parity-with-temperatures": (["--parity", "--data", "d", "--temperatures", "0,1"],
                                 "--temperatures would not apply"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flags_that_would_be_ignored_or_replaced_are_refused(tmp_path, capsys, case):
    argv, expected = CASES[case]
    line = _refused(tmp_path, capsys, argv)
    assert line.startswith("error: ") and expected in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_named(tmp_path, capsys):
    line = _refused(tmp_path, capsys, ["--device", "cuda"])
    assert line == "error: --device cuda: CUDA is not available here (use --device cpu)", line


def test_a_benchmark_file_that_is_not_utf8_names_line_and_offset(tmp_path, capsys):
    bench = tmp_path / "latin1.jsonl"
    bench.write_bytes('{"prompt": "w1"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    line = _refused(tmp_path, capsys, ["--bench", str(bench)])
    assert line == (f"error: {bench}:2: not valid UTF-8 (byte 0xe9 at offset 32); save the "
                    "file as UTF-8"), line


def test_a_base_model_target_names_the_target_and_the_setting(tmp_path, capsys):
    hf = build_tiny_target(tmp_path / "target", "qwen3", num_hidden_layers=6, eos_token_id=None)
    build_tokenizer(tmp_path / "target", vocab_size=200)  # no chat template: a base model
    tiny_draft(hf, 200).save_pretrained(tmp_path / "draft")
    bench = tmp_path / "prompts.jsonl"
    bench.write_text('{"prompt": "w1 w2"}\n', encoding="utf-8")
    line = _refused(tmp_path, capsys, ["--bench", str(bench), "--device", "cpu"],
                    target=tmp_path / "target", draft=tmp_path / "draft")
    assert line.startswith(f"error: {tmp_path / 'target'}: the target's tokenizer has no chat "
                           "template"), line
    assert "chat_template" in line.split("no chat template", 1)[1]  # where a template goes


def test_a_benchmark_prompt_beyond_the_target_s_positions_names_the_bound(tmp_path, capsys):
    """The harness sizes the engine's cache from the prompts, never beyond the target's
    positions: a prompt that needs more is refused naming them, not a traceback."""
    hf = build_tiny_target(tmp_path / "target", "qwen3", num_hidden_layers=6, eos_token_id=None)
    tokenizer = build_tokenizer(tmp_path / "target", vocab_size=200)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(tmp_path / "target")
    tiny_draft(hf, 200).save_pretrained(tmp_path / "draft")
    bench = tmp_path / "long.jsonl"
    words = " ".join(f"w{2 + i % 150}" for i in range(600))
    bench.write_text(f'{{"prompt": "{words}"}}\n', encoding="utf-8")
    line = _refused(tmp_path, capsys, ["--bench", str(bench), "--device", "cpu",
                                       "--max-new-tokens", "4"],
                    target=tmp_path / "target", draft=tmp_path / "draft")
    assert line.startswith("error: the longest prompt (600 tokens) + max_new_tokens (4)"), line
    assert line.endswith("beyond the target's max_position_embeddings=512"), line
