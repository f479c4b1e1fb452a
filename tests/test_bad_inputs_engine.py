"""Bad requests to the engine CLI, most of which only the loaded target and draft can judge:
one `error:` line naming the option and the bound, exit status 2, no traceback, nothing written.

(Most flag values judged before loading are in `test_bad_inputs_cli.py`; `--stop ''` and
`--tree-nodes` without `--tree-paths` are here, with the tree bounds.) The tiny target holds 512
positions; the draft has blocks of 8 (7 drafted tokens) and 4 candidates per slot, so its
lattice holds 4^7 = 16384 paths.
"""

from __future__ import annotations

import json
import shutil

import pytest
from _engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

from dspine_train.engine import cli as engine_cli


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_engine")
    hf = build_tiny_target(root / "target", "qwen3", num_hidden_layers=6, eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=200)  # a base model's: no chat template
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    (root / "prompts.txt").write_text("w1 w2 w3\n", encoding="utf-8")
    (root / "long.txt").write_text(" ".join(f"w{2 + i % 150}" for i in range(600)) + "\n",
                                   encoding="utf-8")
    return root


def _run(files, capsys, *extra: str, chat: bool = False, target=None) -> str:
    """Run the CLI; assert exit 2, one error line (the last; progress bars may precede it),
    no traceback, no output written; return that line."""
    out = files / "out.json"
    argv = ["--target", str(target or files / "target"), "--draft", str(files / "draft"),
            "--prompts", str(files / "prompts.txt"), "--device", "cpu", "--max-new-tokens", "4",
            "--output", str(out), *([] if chat else ["--no-chat"]), *extra]
    capsys.readouterr()
    assert engine_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert not out.exists()
    return err.strip().splitlines()[-1]


CASES = {
    "max-seq-len-beyond-positions": (
        ["--max-seq-len", "600"],
        "max_seq_len=600 (CLI: --max-seq-len) exceeds the target's max_position_embeddings=512",
    ),
    "prompt-beyond-positions": (
        ["--prompts", "{root}/long.txt"],
        "the longest prompt (600 tokens) + max_new_tokens (4) + one verified block (8) needs "
        "612 cache positions, beyond the target's max_position_embeddings=512",
    ),
    "prompt-beyond-max-seq-len": (
        ["--prompts", "{root}/long.txt", "--max-seq-len", "100"],
        "needs 612 cache positions, beyond max_seq_len=100 (CLI: --max-seq-len, at most the "
        "target's max_position_embeddings=512)",
    ),
    "tree-paths-beyond-the-lattice": (
        ["--tree-paths", "100005"],
        "tree_paths=100005 (CLI: --tree-paths) exceeds the 16384 paths the draft's lattice "
        "holds (4^7: candidate_k=4 per slot, num_draft_tokens=7)",
    ),
    "tree-beyond-the-cache": (
        ["--tree-paths", "1000"],
        "a token tree of 7000 nodes (tree_paths=1000, tree_nodes=None; CLI: --tree-paths / "
        "--tree-nodes) does not fit the cache: at most 504 nodes fit",
    ),
    "tree-nodes-beyond-the-lattice": (
        ["--tree-paths", "2", "--tree-nodes", "400"],
        "tree_nodes=400 (CLI: --tree-nodes) exceeds the 14 distinct nodes 2 paths of 7 tokens "
        "can have in the draft's lattice",
    ),
    "tree-nodes-without-tree-paths": (
        ["--tree-nodes", "5"],
        "--tree-nodes 5 sizes a token tree: it needs --tree-paths > 1",
    ),
    "empty-stop-string": (
        ["--stop", ""],
        "--stop '': an empty stop string would end every answer after its first token",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_cli_names_the_option_and_the_bound(files, capsys, case):
    extra, expected = CASES[case]
    line = _run(files, capsys, *(arg.format(root=files) for arg in extra))
    assert line.startswith("error: ") and expected in line, line


def test_a_base_model_without_chat_template_names_the_target_and_the_setting(files, capsys):
    line = _run(files, capsys, chat=True)
    assert line.startswith(f"error: chat=True but the tokenizer of {files / 'target'} has no "
                           "chat template"), line
    assert "--no-chat" in line and "--tokenizer DIR" in line


def test_a_target_config_without_its_depth_is_named(files, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(files / "target", target)
    fields = json.loads((target / "config.json").read_text())
    del fields["num_hidden_layers"]  # its layer_types still list 6: transformers' validation
    (target / "config.json").write_text(json.dumps(fields))
    line = _run(files, capsys, target=target)
    assert line == (f"error: {target / 'config.json'}: no num_hidden_layers (the target's "
                    "depth); transformers would assume its class default, another model"), line

