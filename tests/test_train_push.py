"""`export.push_to_hub`: a training run uploads its final export, with its model card, to a
writable loopback Hub (`tests/_hub_writable.py`) through the real `huggingface_hub` client; a
failed upload keeps the export and names the command that retries it.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.numpy import load as load_bytes
from safetensors.numpy import load_file

from dspine_train import hub
from dspine_train.training.errors import TrainingError
from dspine_train.training.hub_push import check_push_ready, retry_command
from tests._hub_writable import WritableHub
from tests._train_helpers import REPO, check_ok, tiny_overrides, train_env

pytestmark = pytest.mark.slow  # DeepSpeed training runs as module fixtures

TOKEN = "hf_loopbackToken1234567890"
REPO_ID = "org/tiny-dspine"
TARGET_ID = "Qwen/Qwen3-0.6B"  # the tiny target is local: the upload names a Hub id instead
STEPS = 4
UPLOADED = {"README.md", "config.json", "eval_results.json", "model.safetensors",
            "token_table.safetensors", "training_info.json"}


def hub_env(endpoint: str, home: Path) -> dict[str, str]:
    """A trainer subprocess's environment with the Hub reachable at `endpoint` only."""
    env = train_env()
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        env.pop(key, None)
    env.update(HF_ENDPOINT=endpoint, HF_TOKEN=TOKEN, HF_HOME=str(home),
               HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost",
               no_proxy="127.0.0.1,localhost")
    return env


def train(overrides: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def push_overrides(assets, out: Path, *extra: str) -> list[str]:
    return tiny_overrides(assets, out, f"optim.max_steps={STEPS}", "eval.every=0",
                          "checkpoint.every=0", f"export.push_to_hub={REPO_ID}",
                          f"export.push_target_id={TARGET_ID}", *extra)


def safe_load(source: Path | bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, or of its bytes."""
    return load_bytes(source) if isinstance(source, bytes) else load_file(str(source))


def safetensors_metadata(content: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's bytes."""
    size = int.from_bytes(content[:8], "little")
    return json.loads(content[8:8 + size]).get("__metadata__", {})


def closed_port_url() -> str:
    """http://127.0.0.1:PORT where nothing listens (connections are refused)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def loopback():
    with WritableHub() as server:
        yield server


@pytest.fixture(scope="module")
def pushed_run(tiny_assets, loopback, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`train.py recipe=tiny export.push_to_hub=org/tiny-dspine`: 4 steps, evaluated at the end."""
    out = tmp_path_factory.mktemp("pushed_run")
    proc = train(push_overrides(tiny_assets, out), hub_env(loopback.url, out / "hf_home"))
    check_ok(proc)
    return out, proc


def test_the_run_uploads_its_final_export_private(pushed_run, loopback) -> None:
    out, proc = pushed_run
    final = out / "final"
    repo = loopback.models[REPO_ID]
    assert repo.private is True  # export.push_private defaults to true
    assert loopback.tokens == {TOKEN}
    assert set(repo.files) == UPLOADED
    # the weights arrive byte for byte; the card is the export's README.md
    for name in ("model.safetensors", "README.md"):
        assert repo.files[name] == (final / name).read_bytes(), name
    # the token table's tensors too; its metadata names where it was built by the file name only
    local, uploaded = safe_load(final / "token_table.safetensors"), safe_load(
        repo.files["token_table.safetensors"])
    assert local.keys() == uploaded.keys()
    assert all(np.array_equal(local[k], uploaded[k]) for k in local)
    assert f"uploaded to {REPO_ID}: {loopback.url}/{REPO_ID}/commit/" in proc.stdout
    # only the upload's requests reached the Hub: the run itself stays local
    assert [r.split("?")[0] for r in loopback.requests] == [
        "POST /api/repos/create", "POST /api/validate-yaml",
        f"POST /api/models/{REPO_ID}/preupload/main", f"POST /api/models/{REPO_ID}/commit/main"]


def test_the_uploaded_files_carry_no_local_path(pushed_run, loopback, tiny_assets) -> None:
    out, _ = pushed_run
    repo = loopback.models[REPO_ID]
    config = json.loads(repo.files["config.json"])
    assert config["target_name_or_path"] == TARGET_ID and config["model_type"] == "dspine"
    for name, content in repo.files.items():
        assert str(tiny_assets["root"]).encode() not in content, name
        assert str(out).encode() not in content, name
    with safe_open(str(out / "final" / "token_table.safetensors"), "np") as table:
        local_meta = table.metadata()
    uploaded_meta = safetensors_metadata(repo.files["token_table.safetensors"])
    assert local_meta["source"] == str(tiny_assets["token_table"])
    assert uploaded_meta == {**local_meta, "source": "token_table.safetensors"}
    # the local export keeps its local target: the engine reads it from there
    local = json.loads((out / "final" / "config.json").read_text())
    assert local["target_name_or_path"] == str(tiny_assets["target"])


def test_the_card_names_the_data_the_budget_and_the_measured_acceptance(pushed_run, loopback,
                                                                        tiny_assets) -> None:
    out, _ = pushed_run
    repo = loopback.models[REPO_ID]
    info = json.loads((out / "final" / "training_info.json").read_text())
    results = json.loads((out / "final" / "eval_results.json").read_text())
    budget = info["budget"]
    assert budget["optimizer_steps"] == STEPS and budget["processes"] == 1
    assert budget["global_batch_sequences"] == 4  # the tiny recipe's data.batch_size
    assert budget["sequences_seen"] == STEPS * 4  # 4 rows a batch, inside the first epoch
    assert 0 < budget["tokens_seen"] <= STEPS * 4 * 64 and budget["wall_time_s"] > 0
    import datasets

    rows = len(datasets.load_from_disk(str(tiny_assets["data"]))["train"])
    assert budget["epochs"] == pytest.approx(STEPS / -(-rows // 4), abs=1e-4)
    # the run's final evaluation, as the metrics log has it
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row for row in metrics if "eval/tau" in row]
    assert results["acceptance_length"] == evaluated["eval/tau"] == info["tau"]
    assert results["acceptance_length_per_position"] == info["acceptance_by_position"]
    assert results["step"] == STEPS and results["blocks"] == evaluated["eval/blocks"]

    card = ModelCard(repo.files["README.md"].decode())
    assert card.data.base_model == TARGET_ID and card.data.library_name == "dspine-train"
    assert "- recipe: tiny" in card.text
    assert "- data: data" in card.text  # the local data directory by its last component
    assert f"| optimizer steps | {STEPS} |" in card.text
    assert f"| sequences seen | {STEPS * 4} |" in card.text
    assert f"| tokens seen (unpadded) | {budget['tokens_seen']:,} |" in card.text
    assert "| global batch (sequences) | 4 |" in card.text
    assert f"Mean acceptance length: **{results['acceptance_length']:.3f}**" in card.text
    assert "share of blocks with the first k accepted" in card.text


def test_a_failed_push_keeps_the_export_and_the_retry_command_uploads_it(
        tiny_assets, loopback, tmp_path) -> None:
    dead = closed_port_url()
    out = tmp_path / "run"
    proc = train(push_overrides(tiny_assets, out, "export.push_timeout=5"),
                 hub_env(dead, tmp_path / "hf_home"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    final = out / "final"
    assert line.startswith(f"error: export.push_to_hub: uploading {final} to {REPO_ID} failed: "
                           f"cannot reach {dead}"), line
    assert f"The export is kept at {final}; retry the upload with: " in line
    assert TOKEN not in proc.stdout + proc.stderr
    # the export is whole: it validates and loads as the engine loads it
    assert hub.validate_export(final).config["model_type"] == "dspine"
    assert (out / "training_curves.png").is_file() and (out / "metrics.jsonl").is_file()

    # the command the error names uploads the kept export (here to the loopback Hub)
    command = line.split("retry the upload with: ", 1)[1]
    argv = shlex.split(command)
    assert argv[:2] == ["dspine-train", "push"]  # the installed command, run as its module
    done = subprocess.run([sys.executable, "-m", "dspine_train.cli", *argv[1:]], cwd=REPO, capture_output=True, text=True,
                          env=hub_env(loopback.url, tmp_path / "hf_home"), timeout=300)
    assert done.returncode == 0, done.stderr
    repo_id = argv[argv.index("--repo-id") + 1]
    assert repo_id == REPO_ID and re.search(r"uploaded .* to org/tiny-dspine", done.stdout)
    assert loopback.models[REPO_ID].files["model.safetensors"] == (
        final / "model.safetensors").read_bytes()


def test_a_push_that_cannot_happen_stops_before_training(monkeypatch) -> None:
    """No token, or the Hub switched off: `TrainingError` before any weights exist."""
    from huggingface_hub import constants

    from dspine_train.training.config import ExportConfig

    export = ExportConfig(push_to_hub=REPO_ID, push_target_id=TARGET_ID)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TrainingError, match="export.push_to_hub=org/tiny-dspine: the Hub is "
                                            "switched off .*HF_HUB_OFFLINE"):
        check_push_ready(export)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(TrainingError, match="no Hugging Face token: set HF_TOKEN"):
        check_push_ready(export)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: TOKEN)
    check_push_ready(export)
    check_push_ready(ExportConfig())  # no push asked: nothing checked


def test_the_retry_command_repeats_the_runs_settings() -> None:
    from dspine_train.training.config import ExportConfig

    export = ExportConfig(push_to_hub=REPO_ID, push_private=False, push_target_id=TARGET_ID,
                          push_endpoint="http://hub.local:8080", push_timeout=5)
    assert retry_command(Path("/runs/a b/final"), export) == (
        "dspine-train push '/runs/a b/final' --repo-id org/tiny-dspine --public "
        "--target-id Qwen/Qwen3-0.6B --endpoint http://hub.local:8080 --timeout 5")
    assert retry_command(Path("/r/final"), ExportConfig(push_to_hub=REPO_ID)) == (
        "dspine-train push /r/final --repo-id org/tiny-dspine")


def test_push_settings_do_not_shape_the_run() -> None:
    """A checkpoint written before `export.push_*` existed, or with other push settings, resumes:
    the settings are outside the run's fingerprint."""
    from dataclasses import asdict

    from dspine_train.training.checkpointing import config_differences, run_fingerprint
    from dspine_train.training.config import compose_train_config

    plain = asdict(compose_train_config("recipe=qwen3_8b"))
    pushing = asdict(compose_train_config("recipe=qwen3_8b", "export.push_to_hub=org/n",
                                          "export.push_private=false"))
    older = {**plain, "export": {"format": plain["export"]["format"]}}  # before the push keys
    assert run_fingerprint(plain) == run_fingerprint(pushing) == run_fingerprint(older)
    assert config_differences(older, pushing) == []
    changed = asdict(compose_train_config("recipe=qwen3_8b", "export.format=dspine",
                                          "optim.lr=0.1"))
    assert run_fingerprint(changed) != run_fingerprint(plain)  # a shaping key still counts
