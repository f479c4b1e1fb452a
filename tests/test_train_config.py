"""Recipes compose over the typed schema; bad keys and values fail early, naming the key;
`plan_only` sizes a recipe without loading weights."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from dspine_train.training.config import (
    ConfigError,
    Precision,
    TrainConfig,
    compose_train_config,
)
from tests._train_helpers import REPO, run_train

RECIPES = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_into_the_schema(recipe: str) -> None:
    config = compose_train_config(f"recipe={recipe}")
    assert isinstance(config, TrainConfig) and config.name == recipe
    assert config.model.target_path and config.data.train_path
    assert config.output_dir == f"outputs/{recipe}"


# The published DSpine setting for Qwen3-8B as docs/METHOD.md states it: the one place the
# tests hold these numbers. The recipe sets some, DSpineConfig's defaults give the rest.
PUBLISHED_DRAFT = {
    "num_layers": 5, "block_size": 16, "target_layer_ids": [1, 9, 17, 25, 33],  # METHOD 1
    "transfer_dim": 1024, "message_size": 512,  # METHOD 2.1, 2.2
    "replacement_layers": 3, "replacement_probability": 0.5,  # METHOD 2.2 curriculum
    "replacement_hold_ratio": 1 / 6, "replacement_end_ratio": 1 / 3,
    "loss_gamma": 7.0, "ce_weight": 0.1, "candidate_k": 16,  # METHOD 2.3
    "alignment_weight": 0.5, "alignment_warmup_steps": 150, "alignment_layer_reduction": "sum",
    "distill_mass_threshold": 1e-4, "block_attention": "causal", "injection": True,
}
PUBLISHED_RUN = {"optim.lr": 6e-4, "optim.warmup_ratio": 0.04, "optim.epochs": 6,
                 "optim.max_grad_norm": 1.0, "data.max_length": 3072, "deepspeed.stage": 2,
                 "precision": Precision.bf16}


def test_qwen3_8b_composes_to_the_published_setting() -> None:
    from dspine_train.training.memory_plan.for_recipe import plan_draft_config

    c = compose_train_config("recipe=qwen3_8b")
    draft = plan_draft_config(c)  # the recipe's draft fields over DSpineConfig's defaults
    assert {name: getattr(draft, name) for name in PUBLISHED_DRAFT} == PUBLISHED_DRAFT
    run = {key: functools.reduce(getattr, key.split("."), c) for key in PUBLISHED_RUN}
    assert run == PUBLISHED_RUN


def test_fields_and_groups_override_from_the_command_line() -> None:
    c = compose_train_config("recipe=tiny", "deepspeed=zero3", "optim.lr=0.5",
                             "model.injection=false", "model.block_attention=bidirectional")
    assert c.deepspeed.stage == 3 and c.deepspeed.config_file == "deepspeed/zero3.json"
    assert c.optim.lr == 0.5
    assert c.model.draft_overrides()["injection"] is False
    assert c.model.draft_overrides()["block_attention"] == "bidirectional"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.foo=1", "model.foo"),
        ("data.batch_size=abc", "data.batch_size"),
        ("precision=fp16", "precision"),
    ],
)
def test_unknown_keys_and_wrong_types_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigCompositionException, match=message):
        compose_train_config("recipe=tiny", override)


def test_out_of_range_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match="deepspeed.stage must be 2 or 3"):
        compose_train_config("recipe=tiny", "deepspeed.stage=1")
    with pytest.raises(ConfigError, match="optim.warmup_ratio"):
        compose_train_config("recipe=tiny", "optim.warmup_ratio=1.5")


def test_cli_rejects_an_unknown_key_before_any_work(tmp_path: Path) -> None:
    proc = run_train(["recipe=tiny", "model.foo=1", f"output_dir={tmp_path}/out"])
    assert proc.returncode != 0
    assert "Could not override 'model.foo'" in proc.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_plan_only_sizes_the_8b_recipe_without_weights(tmp_path: Path) -> None:
    proc = run_train(["recipe=qwen3_8b", "plan_only=true", f"output_dir={tmp_path}/plan"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO-2, world size 8" in proc.stdout
    assert "FITS on a 80 GiB GPU" in proc.stdout


def test_plan_device_picks_the_attention_path_the_plan_counts() -> None:
    from dspine_train.training.memory_plan.for_recipe import memory_plan_for

    gpu = memory_plan_for(compose_train_config("recipe=qwen3_8b"))
    cpu = memory_plan_for(compose_train_config("recipe=qwen3_8b", "plan_device=cpu"))
    assert gpu.attention_path == "flex" and cpu.attention_path == "dense"
    assert "compiled flex attention" in gpu.table()
    # 8192 queries x 11264 keys: the dense masks (1 + 5 layers * 2 bytes) are GiB, flex's tiles KiB
    assert cpu.item("attention masks (dense)").bytes == 8192 * 11264 * (1 + 5 * 2)
    assert gpu.item("attention block mask (flex)").bytes < 2**20
    assert memory_plan_for(compose_train_config("recipe=tiny")).attention_path == "dense"


def test_hub_push_settings_compose_private_by_default() -> None:
    c = compose_train_config("recipe=qwen3_8b", "export.push_to_hub=org/dspine-qwen3-8b")
    assert c.export.push_to_hub == "org/dspine-qwen3-8b" and c.export.push_private is True
    assert c.export.push_target_id is None  # the recipe's target is a Hub id already
    assert compose_train_config("recipe=tiny").export.push_to_hub is None


@pytest.mark.parametrize("overrides, message", [
    (["export.push_to_hub=org/sub/name"], "export.push_to_hub 'org/sub/name': not a Hub repository id"),
    (["export.push_to_hub='bad id'"], "export.push_to_hub 'bad id': not a Hub repository id"),
    (["export.push_to_hub=name"], "export.push_to_hub 'name': give the namespace too"),
    (["export.push_to_hub=org/n", "export.push_target_id=/ckpt/q"],
     "export.push_target_id '/ckpt/q': not a Hub model id"),
    (["export.push_to_hub=org/n", "export.push_timeout=0"],
     "export.push_timeout must be a positive number of seconds"),
    (["export.push_to_hub=org/n", "export.push_endpoint=huggingface.co"],
     "export.push_endpoint 'huggingface.co': not an http\\(s\\) URL"),
    (["export.push_to_hub=org/n", "export.format=dflash", "model.method=dflash"],
     "export.push_to_hub: the Hub upload publishes a dspine-format export"),
])
def test_a_bad_hub_push_setting_is_refused_at_config_time(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_train_config("recipe=qwen3_8b", *overrides)


def test_a_local_target_needs_a_hub_id_to_push() -> None:
    """A local target path is never uploaded: the run must name the target's Hub id."""
    with pytest.raises(ConfigError, match="export.push_target_id: model.target_path "
                                          "'artifacts/tiny_target' is a local path"):
        compose_train_config("recipe=tiny", "export.push_to_hub=org/tiny")
    c = compose_train_config("recipe=tiny", "export.push_to_hub=org/tiny",
                             "export.push_target_id=Qwen/Qwen3-0.6B")
    assert c.export.push_target_id == "Qwen/Qwen3-0.6B"


def test_cli_refuses_a_bad_repo_id_before_any_work(tmp_path: Path) -> None:
    proc = run_train(["recipe=qwen3_8b", "export.push_to_hub=org/sub/name",
                      f"output_dir={tmp_path}/out"])
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: export.push_to_hub 'org/sub/name': not a Hub repository id")
    # nothing trained (Hydra's own record of the run aside)
    assert {p.name for p in (tmp_path / "out").iterdir()} <= {"hydra", "train.log"}


def test_a_recipe_finds_its_files_from_another_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.target_config_path: targets/qwen3_8b` is read under the recipes when the working
    directory has no such path (an installed package run from anywhere)."""
    from dspine_train.recipe_files import RECIPES_DIR, resolve_recipe_path
    from dspine_train.training.memory_plan.for_recipe import plan_target_config

    config = compose_train_config("recipe=qwen3_8b")
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe_path(config.model.target_config_path) == (
        RECIPES_DIR / "targets" / "qwen3_8b")
    assert plan_target_config(config).num_hidden_layers == 36
    (tmp_path / "targets" / "qwen3_8b").mkdir(parents=True)  # the working directory's wins
    assert resolve_recipe_path("targets/qwen3_8b") == Path("targets/qwen3_8b")


def test_without_a_checkout_the_recipes_come_from_the_installed_package(tmp_path: Path) -> None:
    """`recipe_files.recipes_dir` as it runs in a wheel install: no `recipes/` beside the
    package, the copy inside it; with neither, an error naming both places."""
    package = tmp_path / "site" / "dspine_train"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "recipe_files.py").write_text(
        (REPO / "dspine_train" / "recipe_files.py").read_text())
    probe = "import dspine_train.recipe_files as r; print(r.RECIPES_DIR)"

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(package.parent)})

    missing = run()
    assert missing.returncode != 0
    assert f"neither {tmp_path / 'site' / 'recipes'}" in missing.stderr
    assert str(package / "recipes") in missing.stderr
    (package / "recipes").mkdir()
    (package / "recipes" / "config.yaml").write_text("defaults: []\n")
    found = run()
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(package / "recipes")
