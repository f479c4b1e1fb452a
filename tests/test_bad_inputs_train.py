"""Bad inputs to the trainer and the draft loader, refused with one clear message.

Unknown config keys, a target without a tokenizer, an incomplete draft export, a `.bin` draft,
checkpoints of another run, changed settings on resume and damaged checkpoint files. The unit
checks run in-process; the few `train.py` runs share one short module-scoped run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

from dspine_train.engine import CheckpointError
from dspine_train.engine.validation import check_draft_files
from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.training.checkpointing import (
    MANIFEST_FILE,
    STATE_FILE,
    checkpoint_name,
    complete_checkpoints,
    config_differences,
    run_fingerprint,
    verify_manifest,
    write_manifest,
)
from dspine_train.training.config import ConfigError, register_configs, to_train_config
from dspine_train.training.errors import TrainingError
from dspine_train.training.target import used_vocab_size
from dspine_train.training.tiny_assets import TINY_VOCAB, tiny_target_config
from tests._data_helpers import QWEN3_TEMPLATE, word_level_tokenizer
from tests._train_helpers import REPO, check_ok, run_train, tiny_overrides

STEPS = 4  # the shared run: checkpoints at steps 2 and 4


# ---------------------------------------------------------------------------- config keys
def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        return to_train_config(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("override", ["+optim.lrr=5", "+model.layers=3", "+seeds=1"])
def test_appended_keys_are_rejected_naming_the_key(override: str) -> None:
    key = override[1:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}: not a setting of the training schema"):
        _compose("recipe=tiny", override)


def test_cli_rejects_an_appended_key_in_one_line(tmp_path: Path) -> None:
    proc = run_train(["recipe=tiny", "+optim.lrr=5", f"output_dir={tmp_path}/out"])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: optim.lrr: not a setting of the training schema "
        "(dspine_train/training/config.py)")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


# ---------------------------------------------------------------------------- tokenizer
@pytest.fixture(scope="module")
def config_only_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target's config.json alone (no tokenizer files): all `used_vocab_size` reads."""
    path = tmp_path_factory.mktemp("config_only")
    tiny_target_config().save_pretrained(path)
    return path


def test_a_target_without_tokenizer_needs_the_setting(config_only_target: Path) -> None:
    # transformers would build a 1-token placeholder here, and token 1 would become the mask
    with pytest.raises(TrainingError, match=rf"model.target_path '{config_only_target}' has no "
                       r"tokenizer .* set model.used_vocab_size"):
        used_vocab_size(str(config_only_target), TINY_VOCAB)
    assert used_vocab_size(str(config_only_target), TINY_VOCAB, explicit=500) == 500
    with pytest.raises(TrainingError, match=r"model.used_vocab_size must be in 1..512"):
        used_vocab_size(str(config_only_target), TINY_VOCAB, explicit=600)


def test_a_placeholder_sized_tokenizer_is_not_trusted(tmp_path: Path) -> None:
    target = tmp_path / "target"
    tiny_target_config().save_pretrained(target)
    tokenizer = word_level_tokenizer(QWEN3_TEMPLATE, ["a b c d"])  # ~20 tokens for 512 rows
    tokenizer.save_pretrained(target)
    with pytest.raises(TrainingError, match=rf"its tokenizer has {len(tokenizer)} tokens for "
                       r"512 vocabulary rows, not a real tokenizer"):
        used_vocab_size(str(target), TINY_VOCAB)
    assert used_vocab_size(str(target), TINY_VOCAB, explicit=500) == 500


def test_the_tiny_target_ships_a_tokenizer_and_a_setting_must_agree(tiny_assets) -> None:
    used = used_vocab_size(str(tiny_assets["target"]), TINY_VOCAB)
    assert 256 < used < 511  # the real length, not the placeholder's 1; 511 stays the mask
    with pytest.raises(TrainingError, match=rf"model.used_vocab_size is 500 but the tokenizer "
                       rf".* has {used} tokens"):
        used_vocab_size(str(tiny_assets["target"]), TINY_VOCAB, explicit=500)


# ---------------------------------------------------------------------------- draft exports
@pytest.fixture
def draft_dir(tmp_path: Path) -> Path:
    """A small draft for the tiny target, saved as the trainer's export saves it."""
    config = DSpineConfig.from_target(tiny_target_config(), used_vocab_size=500, num_layers=2,
                                      block_size=8, target_layer_ids=[1, 2], transfer_dim=16,
                                      message_size=16, candidate_k=4)
    torch.manual_seed(0)
    DSpineDraftModel(config).save_pretrained(tmp_path / "draft")
    return tmp_path / "draft"


@pytest.mark.parametrize("field", ["block_size", "num_layers", "target_layer_ids", "mask_token_id"])
def test_a_draft_config_lacking_a_field_is_refused(draft_dir: Path, field: str) -> None:
    path = draft_dir / "config.json"
    config = json.loads(path.read_text())
    del config[field]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config.json lacks {field}; a DSpine draft export"):
        DSpineDraftModel.from_pretrained(draft_dir)
    with pytest.raises(CheckpointError, match=rf"config.json lacks {field}"):
        check_draft_files(draft_dir)


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_missing_or_unexpected_weights_are_an_error(draft_dir: Path, change: str) -> None:
    weights = load_file(draft_dir / "model.safetensors")
    if change == "missing":
        del weights["layers.1.mlp.down_proj.weight"]
        expected = r"missing keys: layers.1.mlp.down_proj.weight"
    else:
        weights["layers.2.mlp.down_proj.weight"] = torch.zeros(2, 2)
        expected = r"unexpected keys: layers.2.mlp.down_proj.weight"
    save_file(weights, draft_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"the weights do not match its config.json \({expected}"):
        DSpineDraftModel.from_pretrained(draft_dir)


def test_a_pickled_bin_draft_is_refused(draft_dir: Path) -> None:
    weights = load_file(draft_dir / "model.safetensors")
    (draft_dir / "model.safetensors").unlink()
    torch.save(weights, draft_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin is a pickled \(.bin\) draft; only "
                       "safetensors drafts are loaded"):
        DSpineDraftModel.from_pretrained(draft_dir)
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: pickled .bin drafts are "
                       "refused, safetensors only"):
        check_draft_files(draft_dir)


def test_a_complete_export_still_loads(draft_dir: Path) -> None:
    check_draft_files(draft_dir)
    draft = DSpineDraftModel.from_pretrained(draft_dir)
    assert (draft.config.block_size, draft.config.num_layers) == (8, 2)


# ---------------------------------------------------------------------------- manifests
def _fake_checkpoints(root: Path) -> tuple[Path, Path]:
    """Two complete checkpoints with manifests (steps 1 and 2); returns them."""
    made = []
    for step in (1, 2):
        path = root / checkpoint_name(step)
        (path / "pytorch_model").mkdir(parents=True)
        (path / "pytorch_model" / "mp_rank_00_model_states.pt").write_bytes(bytes(range(200)))
        (path / STATE_FILE).write_text(json.dumps({"step": step}))
        write_manifest(path)
        made.append(path)
    return made[0], made[1]


def _damage(path: Path, how: str) -> str:
    shard = path / "pytorch_model" / "mp_rank_00_model_states.pt"
    if how == "missing":
        shard.unlink()
        return r"file pytorch_model/mp_rank_00_model_states.pt is missing"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
        return r"file pytorch_model/mp_rank_00_model_states.pt has 100 bytes, 200 were saved"
    if how == "changed":  # same size, other bytes: what a crafted pickle would look like
        shard.write_bytes(bytes(reversed(range(200))))
        return r"file pytorch_model/mp_rank_00_model_states.pt differs from its sha256"
    if how == "extra":
        (path / "pytorch_model" / "payload.pt").write_bytes(b"x")
        return r"file pytorch_model/payload.pt is not in manifest.json"
    (path / MANIFEST_FILE).unlink()
    return r"no manifest.json"


@pytest.mark.parametrize("how", ["missing", "truncated", "changed", "extra", "no manifest"])
def test_a_checkpoint_that_differs_from_its_manifest_is_refused(tmp_path: Path, how: str) -> None:
    first, second = _fake_checkpoints(tmp_path)
    verify_manifest(second)
    expected = _damage(second, how)
    with pytest.raises(TrainingError, match=rf"checkpoint {second}: {expected}.*resume from the "
                       rf"previous checkpoint, checkpoint.resume_from={first}"):
        verify_manifest(second)
    _damage(first, how)
    with pytest.raises(TrainingError, match="no earlier checkpoint exists"):
        verify_manifest(first)


def test_the_fingerprint_ignores_only_the_listed_settings() -> None:
    config = {"optim": {"lr": 0.01, "max_steps": 24}, "logging": {"log_every": 1},
              "model": {"num_layers": 2}, "output_dir": "a"}
    same = {"optim": {"lr": 0.01, "max_steps": 48}, "logging": {"log_every": 5},
            "model": {"num_layers": 2}, "output_dir": "b"}
    other = {"optim": {"lr": 0.02, "max_steps": 24}, "logging": {"log_every": 1},
             "model": {"num_layers": 3}, "output_dir": "a"}
    assert run_fingerprint(config) == run_fingerprint(same)
    assert config_differences(config, same) == []
    assert run_fingerprint(config) != run_fingerprint(other)
    assert config_differences(config, other) == ["model.num_layers: 2 -> 3", "optim.lr: 0.01 -> 0.02"]


# ---------------------------------------------------------------------------- train.py runs
@pytest.fixture(scope="module")
def short_run(tiny_assets, tmp_path_factory) -> Path:
    """4 ZeRO-2 steps of the tiny recipe, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("short_run")
    check_ok(run_train(tiny_overrides(tiny_assets, out, f"optim.max_steps={STEPS}",
                                      "checkpoint.every=2", "eval.every=0")))
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _refused(proc) -> str:
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_each_checkpoint_carries_its_config_and_manifest(short_run: Path) -> None:
    saved = complete_checkpoints(short_run / "checkpoints")
    assert [p.name for p in saved] == [checkpoint_name(2), checkpoint_name(4)]
    for path in saved:
        verify_manifest(path)
        config = json.loads((path / "run_config.json").read_text())
        assert config["config"]["optim"]["max_steps"] == STEPS
        assert config["fingerprint"] == run_fingerprint(config["config"])


@pytest.mark.slow
def test_a_fresh_run_into_a_directory_with_checkpoints_is_refused(
    tiny_assets, short_run: Path, tmp_path: Path
) -> None:
    out = _copy(short_run, tmp_path)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    line = _refused(run_train(tiny_overrides(tiny_assets, out, f"optim.max_steps={STEPS}")))
    assert f"checkpoint.dir: {out / 'checkpoints'} already holds 2 checkpoint(s)" in line
    assert "checkpoint.resume_from=latest" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_resuming_with_other_settings_names_every_changed_key(
    tiny_assets, short_run: Path, tmp_path: Path
) -> None:
    out = _copy(short_run, tmp_path)
    line = _refused(run_train(tiny_overrides(
        tiny_assets, out, f"optim.max_steps={STEPS}", "checkpoint.resume_from=latest",
        "optim.lr=0.02", "data.batch_size=2", "model.num_layers=3", "model.target_layer_ids=[0,1,2]",
        "model.block_size=4")))
    assert f"checkpoint {out / 'checkpoints' / checkpoint_name(4)} belongs to a run with other " \
           "settings" in line
    for change in ("data.batch_size: 4 -> 2", "model.block_size: 8 -> 4",
                   "model.num_layers: 2 -> 3", "optim.lr: 0.01 -> 0.02",
                   "model.target_layer_ids: [1, 2] -> [0, 1, 2]"):
        assert change in line, change


@pytest.mark.slow
def test_resuming_a_truncated_checkpoint_names_the_file_and_the_previous_one(
    tiny_assets, short_run: Path, tmp_path: Path
) -> None:
    out = _copy(short_run, tmp_path)
    latest = out / "checkpoints" / checkpoint_name(STEPS)
    shard = latest / "pytorch_model" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:-64])
    line = _refused(run_train(tiny_overrides(tiny_assets, out, f"optim.max_steps={STEPS}",
                                             "checkpoint.resume_from=latest")))
    assert f"checkpoint {latest}: file pytorch_model/mp_rank_00_model_states.pt has" in line
    assert "truncated or changed" in line
    assert f"checkpoint.resume_from={out / 'checkpoints' / checkpoint_name(2)}" in line


@pytest.mark.slow
def test_more_steps_and_other_logging_may_change_on_resume(
    tiny_assets, short_run: Path, tmp_path: Path
) -> None:
    out = _copy(short_run, tmp_path)
    proc = run_train(tiny_overrides(tiny_assets, out, f"optim.max_steps={STEPS + 2}",
                                    "checkpoint.resume_from=latest", "logging.log_every=2",
                                    "eval.every=1"))
    check_ok(proc)
    assert f"resumed from {out / 'checkpoints' / checkpoint_name(STEPS)} at step {STEPS}" \
        in proc.stdout
    assert f"the run now has {STEPS + 2} steps" in proc.stdout
    assert json.loads((out / "final" / "training_info.json").read_text())["step"] == STEPS + 2


# ---------------------------------------------------------------------------- no supervision
@pytest.mark.parametrize("mask", [[0] * 12, [1, 0] * 6], ids=["none", "no_pair"])
def test_data_without_supervised_tokens_is_refused_naming_the_data(
    tiny_assets, tmp_path: Path, mask: list[int]
) -> None:
    """No anchor to train on (all loss_mask 0, or no two consecutive 1s): one line naming the
    setting and the data, before any step (it used to fail in the first step's objective)."""
    import datasets

    ids = list(range(5, 17))
    rows = {"input_ids": [ids] * 8, "loss_mask": [mask] * 8, "length": [len(ids)] * 8}
    data = tmp_path / "data"
    datasets.DatasetDict(train=datasets.Dataset.from_dict(rows)).save_to_disk(str(data))
    out = tmp_path / "out"
    line = _refused(run_train(tiny_overrides(tiny_assets, out, f"data.train_path={data}")))
    assert line == (f"error: data.train_path: no row of '{data}' (split 'train') has two "
                    "consecutive supervised tokens (loss_mask 1): nothing to train on; check "
                    "the loss masks of the data")
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
