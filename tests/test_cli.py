"""The `dspine-train` command (`dspine_train.cli`): the pipeline help, each step's own help, an
unknown step, `serve` with and without the server, the `[project.scripts]` entry, and steps
run through the command giving what their old entry points give (`train`, `token-table`).

The installed script is `dspine_train.cli:main`; the tests run it as `python -m dspine_train.cli`
(the same function) so that they never reinstall the package into the shared environment.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest
import tomllib
from safetensors import safe_open

from dspine_train import cli, token_table
from tests._train_helpers import REPO, check_ok, run_module, tiny_overrides, train_env

# The pipeline, in the order `dspine-train --help` must teach it.
PIPELINE = ("regenerate", "tokenize", "cache-features", "token-table", "train", "export",
            "generate", "eval", "push", "serve")

# What only each step's own help prints: its usage line or its docstring's first line.
OWN_HELP = {
    "regenerate": "regenerate is powered by Hydra",  # Hydra's help, as `python -m data_prep...`
    "tokenize": "tokenize is powered by Hydra",
    "cache-features": "Cache the frozen target's features to disk",
    "token-table": "usage: python -m dspine_train.token_table",
    "train": "The train command: compose a recipe",
    "export": "usage: python -m dspine_train.export",
    "generate": "usage: python -m dspine_train.engine",
    "eval": "usage: dspine-train eval",
    "push": "usage: dspine-train push",
}


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m dspine_train.cli ARGS` from the repository root, offline."""
    return run_module(["-m", "dspine_train.cli", *args], timeout)


def test_help_lists_every_step_in_pipeline_order() -> None:
    proc = run_cli("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "usage: dspine-train STEP [ARGS ...]"
    # one line per step, each starting with its name, in pipeline order
    rows = [line.split()[0] for line in lines if line.startswith("  ") and not
            line.startswith("   ") and line.split()[0] in PIPELINE]
    assert rows == list(PIPELINE)
    assert cli.STEP_NAMES == PIPELINE
    assert "data.tokenize.output_dir" in proc.stdout and "output_dir/final" in proc.stdout
    # the example chain runs the steps in the same order (serve is not part of it)
    chain = [line.split()[1] for line in lines if line.startswith("  dspine-train ")]
    assert chain[:len(PIPELINE) - 1] == list(PIPELINE[:-1]), chain
    assert "`dspine-train STEP --help`" in proc.stdout


def test_no_step_prints_the_pipeline_and_exits_2(capsys) -> None:
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: dspine-train STEP")


@pytest.mark.parametrize("step", sorted(OWN_HELP))
def test_each_step_shows_its_own_help(step: str, capsys) -> None:
    assert cli.main([step, "--help"]) == 0
    out = capsys.readouterr().out
    assert OWN_HELP[step] in out, out[:500]
    assert "usage: dspine-train STEP" not in out  # not the pipeline's help
    others = [text for name, text in OWN_HELP.items() if name != step]
    assert not any(text in out for text in others), out[:500]


def test_train_help_lists_the_recipes(capsys) -> None:
    """Without `recipe=`, `train --help` prints the recipes to choose from, as `train.py`'s."""
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "recipe=NAME (required)" in out and "  tiny" in out


def test_an_unknown_step_exits_2_naming_the_valid_ones() -> None:
    proc = run_cli("trian", "recipe=tiny", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("dspine-train: error: unknown step 'trian'; choose one of: ")
    assert line.split("choose one of: ")[1].startswith(", ".join(PIPELINE))


def test_serve_without_the_server_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "dspine_train.serving.cli", None)  # import fails
    assert cli.main(["serve", "--port", "8000"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("dspine-train: error: `serve` is not available in this build")
    assert "dspine_train.serving.cli" in captured.err


def test_serve_dispatches_to_the_server_main(monkeypatch) -> None:
    """When `dspine_train.serving.cli` imports, `serve` passes it the arguments unchanged and
    exits with its status."""
    seen: list[list[str]] = []
    server = types.ModuleType("dspine_train.serving.cli")
    server.main = lambda argv: seen.append(list(argv)) or 5
    monkeypatch.setitem(sys.modules, "dspine_train.serving.cli", server)
    assert cli.main(["serve", "--port", "8000", "recipe=x"]) == 5
    assert seen == [["--port", "8000", "recipe=x"]]


def test_project_scripts_entry_is_the_dispatcher() -> None:
    """`[project.scripts]` installs `dspine-train` as `dspine_train.cli:main`, which is importable."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["dspine-train"].partition(":")
    assert getattr(importlib.import_module(module), function) is cli.main


def test_every_step_module_is_packaged() -> None:
    """The installed command imports only the packaged tree (`dspine_train*`, `data_prep*`:
    setup.py's `find_packages(include=...)`), never `scripts/` (not installed)."""
    calls = [node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "find_packages"]
    (include,) = [ast.literal_eval(k.value) for k in calls[0].keywords if k.arg == "include"]
    packages = list(include)
    assert packages and all(p.endswith("*") for p in packages)
    for step in cli.STEPS:
        assert any(step.module.split(".")[0] == p.rstrip("*") for p in packages), step


def test_train_cfg_job_prints_what_train_py_composes() -> None:
    """`dspine-train train --cfg job recipe=tiny` == `python train.py --cfg job recipe=tiny`."""
    args = ["--cfg", "job", "recipe=tiny", "optim.lr=1e-3"]
    new, old = run_cli("train", *args, timeout=120), run_module(["train.py", *args], 120)
    check_ok(new)
    check_ok(old)
    assert new.stdout == old.stdout
    assert "name: tiny" in new.stdout and "lr: 0.001" in new.stdout


def test_token_table_through_the_command_matches_the_module(tiny_assets, tmp_path) -> None:
    """`dspine-train token-table` writes the file `python -m dspine_train.token_table` writes."""
    target = str(tiny_assets["target"])
    new, old = tmp_path / "new.safetensors", tmp_path / "old.safetensors"
    assert cli.main(["token-table", "--target", target, "--out", str(new)]) == 0
    assert token_table.main(["--target", target, "--out", str(old)]) == 0
    with safe_open(new, "pt") as a, safe_open(old, "pt") as b:
        assert a.metadata() == b.metadata()
        assert sorted(a.keys()) == sorted(b.keys()) and a.keys()
        for key in a.keys():
            assert a.get_tensor(key).equal(b.get_tensor(key)), key


def test_a_bad_flag_keeps_the_step_exit_status(tmp_path, capsys) -> None:
    """A step's own refusal comes back as its exit status (token-table: 2 for a bad flag)."""
    assert cli.main(["token-table", "--target", str(tmp_path), "--out", str(tmp_path / "t"),
                     "--chunk-size", "0"]) == 2
    assert "error: --chunk-size must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_train_through_the_command_trains(tiny_assets, tmp_path: Path) -> None:
    """`dspine-train train recipe=tiny ...`: one process trains, exports the draft and logs the
    run as `train.py` does (Hydra's log is `<output_dir>/train.log`)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dspine_train.cli", "train",
         *tiny_overrides(tiny_assets, out, "optim.max_steps=2", "eval.every=0")],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    check_ok(proc)
    assert "done: 2 steps; draft exported to" in proc.stdout
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    assert (out / "train.log").is_file() and (out / "hydra" / "overrides.yaml").is_file()
