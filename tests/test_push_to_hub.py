"""`scripts/push_to_hub.py` and `dspine_train.hub` with the Hub client replaced by a local fake."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from huggingface_hub import ModelCard
from safetensors.numpy import save_file

from dspine_train import hub, hub_cli
from dspine_train.model_card import METHOD_SUMMARIES

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "push_to_hub.py"
TOKEN = "hf_SECRETtokenValue1234567890"

_spec = importlib.util.spec_from_file_location("push_to_hub_script", SCRIPT)
push_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(push_script)


_TEMPLATE: dict[str, bytes] = {}  # a tiny real export's files, built once per session


def _template() -> dict[str, bytes]:
    """The files of a tiny export the engine's strict loader accepts (2 layers, block 4)."""
    if not _TEMPLATE:
        import tempfile

        import torch

        from dspine_train.formats import write_format
        from dspine_train.modeling import DSpineConfig, DSpineDraftModel

        config = DSpineConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
            num_layers=2, target_layer_ids=[1, 2], target_num_layers=4, block_size=4,
            mask_token_id=63, transfer_dim=16, message_size=8, candidate_k=4,
            target_name_or_path="Qwen/Qwen3-8B", target_model_type="qwen3")
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            write_format(DSpineDraftModel(config), Path(tmp), "dspine")
            _TEMPLATE.update({p.name: p.read_bytes() for p in Path(tmp).iterdir()})
        rng = np.random.default_rng(0)
        with tempfile.TemporaryDirectory() as tmp:
            table = Path(tmp) / "token_table.safetensors"
            save_file({"codes": rng.standard_normal((64, 16)).astype(np.float32)}, str(table))
            _TEMPLATE[table.name] = table.read_bytes()
    return _TEMPLATE


def make_export(root: Path, **config_overrides) -> Path:
    """A small export the engine loads: config.json (model_type dspine, target
    Qwen/Qwen3-8B), model.safetensors, token_table.safetensors; `config_overrides` are
    written into config.json."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in _template().items():
        (root / name).write_bytes(content)
    config = json.loads((root / "config.json").read_text())
    config.update(config_overrides)
    (root / "config.json").write_text(json.dumps(config))
    return root


class FakeHfApi:
    """Records every call; no network."""

    instances: list[FakeHfApi] = []

    def __init__(self, token=None, endpoint=None, fail_with: str | None = None):
        self.token = token
        self.endpoint = endpoint
        self.calls: list[tuple[str, dict]] = []
        self.fail_with = fail_with
        self.uploaded_card: str | None = None
        FakeHfApi.instances.append(self)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        if self.fail_with:
            raise RuntimeError(self.fail_with)
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, **kwargs):
        self.calls.append(("create_commit", kwargs))
        # a file's path, or the bytes uploaded instead of it (a cleaned JSON file)
        self.uploaded = {
            op.path_in_repo: op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes)
            else Path(op.path_or_fileobj)
            for op in kwargs["operations"]
        }
        self.uploaded_card = self.uploaded["README.md"].read_text()
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/1")

    def content(self, name: str) -> bytes:
        """What was uploaded as `name`."""
        item = self.uploaded[name]
        return item if isinstance(item, bytes) else item.read_bytes()


@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """HF_TOKEN set to a known secret, no cached login, offline."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no_token"))
    FakeHfApi.instances.clear()


def run_main(argv, api_factory=FakeHfApi):
    return push_script.main([str(a) for a in argv], api_factory=api_factory)


def test_push_creates_repo_and_uploads_with_card(tmp_path, hf_env, capsys):
    export = make_export(tmp_path / "export")
    (export / "eval_results.json").write_text(
        json.dumps(
            {
                "acceptance_length": 3.25,
                "acceptance_length_per_position": [0.9, 0.7, 0.5],
                "temperature": 0.0,
                "num_prompts": 80,
            }
        )
    )
    (export / "training_info.json").write_text(
        json.dumps({"recipe": "qwen3_8b", "dataset": "sharegpt-regenerated"})
    )
    argv = [export, "--repo-id", "org/dspine-qwen3-8b", "--commit-message", "v1"]
    assert run_main(argv) == 0

    (api,) = FakeHfApi.instances
    assert api.token == TOKEN
    assert api.calls[0] == (
        "create_repo",
        {"repo_id": "org/dspine-qwen3-8b", "private": True, "exist_ok": True, "repo_type": "model"},
    )
    name, upload = api.calls[1]
    assert name == "create_commit"
    assert upload["repo_id"] == "org/dspine-qwen3-8b"
    assert api.uploaded == {
        name: export / name
        for name in (
            "README.md",
            "config.json",
            "eval_results.json",
            "model.safetensors",
            "token_table.safetensors",
            "training_info.json",
        )
    }
    assert upload["commit_message"] == "v1"
    assert upload["repo_type"] == "model"

    card = ModelCard(api.uploaded_card)
    assert card.data.base_model == "Qwen/Qwen3-8B"
    assert card.data.library_name == "dspine-train"
    assert {"speculative-decoding", "dspine"} <= set(card.data.tags)
    assert "Mean acceptance length: **3.250**" in card.text
    assert "| share of blocks with the first k accepted | 0.9 | 0.7 | 0.5 |" in card.text
    assert "| num_prompts | 80 |" in card.text
    assert "- recipe: qwen3_8b" in card.text and "- data: sharegpt-regenerated" in card.text
    assert 'DSpineDraftModel.from_pretrained("org/dspine-qwen3-8b"' in card.text
    assert (export / "README.md").read_text() == api.uploaded_card

    out, err = capsys.readouterr()
    assert "https://huggingface.co/org/dspine-qwen3-8b/commit/1" in out
    assert TOKEN not in out + err


@pytest.mark.parametrize(
    "flags, private", [([], True), (["--private"], True), (["--public"], False)]
)
def test_private_unless_public(tmp_path, hf_env, flags, private):
    export = make_export(tmp_path / "export")
    assert run_main([export, "--repo-id", "org/name", *flags]) == 0
    assert FakeHfApi.instances[0].calls[0][1]["private"] is private


def test_visibility_flags_exclude_each_other(tmp_path, hf_env, capsys):
    export = make_export(tmp_path / "export")
    with pytest.raises(SystemExit):
        run_main([export, "--repo-id", "org/name", "--public", "--private"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_dotfiles_are_never_uploaded_or_listed(tmp_path, hf_env, capsys):
    export = make_export(tmp_path / "export")
    (export / ".env").write_text("HF_TOKEN=hf_leaked")
    (export / ".git").mkdir()
    (export / ".git" / "config").write_text("[core]")
    (export / ".ipynb_checkpoints").mkdir()
    (export / ".ipynb_checkpoints" / "notes.txt").write_text("draft")
    (export / "extra").mkdir()
    (export / "extra" / ".DS_Store").write_bytes(b"\0")
    (export / "extra" / "plot.png").write_bytes(b"png")
    assert run_main([export, "--repo-id", "org/name"]) == 0
    uploaded = set(FakeHfApi.instances[0].uploaded)
    assert uploaded == {
        "README.md",
        "config.json",
        "model.safetensors",
        "token_table.safetensors",
        "extra/plot.png",
    }
    assert run_main([export, "--repo-id", "org/name", "--dry-run"]) == 0
    listed = capsys.readouterr().out.split("--- README.md ---")[0]
    assert "extra/plot.png" in listed
    assert ".env" not in listed and ".git" not in listed and ".DS_Store" not in listed


def test_card_holds_no_local_absolute_paths(tmp_path, hf_env):
    target = tmp_path / "ckpt" / "Qwen3-8B"
    target.mkdir(parents=True)
    export = make_export(tmp_path / "export", target_name_or_path=str(target))
    (export / "training_info.json").write_text(
        json.dumps(
            {"recipe": "/home/me/recipes/qwen3_8b.yaml", "dataset": ["/data/sg.jsonl", "uc"]}
        )
    )
    (export / "eval_results.json").write_text(
        json.dumps({"acceptance_length": 3.0, "prompts": "~/bench/prompts.jsonl (80 rows)"})
    )
    # A local target is uploaded only with its Hub id (see the test below); the card alone:
    text = hub.render_model_card(hub.validate_export(export), repo_id="org/name")
    for local in (str(tmp_path), "/home/me", "/data/", "~/bench"):
        assert local not in text
    assert "`Qwen3-8B`" in text
    assert "- recipe: qwen3_8b.yaml" in text and "- data: sg.jsonl, uc" in text
    assert "| prompts | prompts.jsonl (80 rows) |" in text
    assert 'from_pretrained("TARGET_MODEL"' in text  # no local path in the usage snippet
    # Hub ids and URLs are not paths.
    assert hub.public_text("see https://hf.co/org/x and org/y, 3/4") == (
        "see https://hf.co/org/x and org/y, 3/4"
    )


@pytest.mark.parametrize(("method", "name", "fmt"), [
    ("dspine", "A DSpine draft model", None),
    ("dspark", "A DSpark draft model", "speculators"),
    ("dflash2", "A DFlash2 draft model", "speculators"),
    ("domino", "A Domino draft model", "specforge"),
])
def test_the_card_says_which_method_the_draft_is_and_how_servers_read_it(tmp_path, method,
                                                                         name, fmt):
    """A draft of another method is not described as DSpine's: the card names its method (text,
    table, tags) and the export its serving stacks read."""
    info = hub.ExportInfo(tmp_path, {"model_type": "dspine", "method": method, "block_size": 8},
                          ["model.safetensors"], 3, 100, None, {})
    text = hub.render_model_card(info, repo_id="org/name")
    card = ModelCard(text)
    body = card.text
    summary = next(line for line in body.splitlines() if "lossless speculative decoding" in line)
    assert summary.startswith(name), summary
    assert f"| method | {method} |" in body
    assert method in card.data.tags
    for other, (title, _) in METHOD_SUMMARIES.items():
        if other != method:
            assert title not in body
    command = f"--format {fmt}`" if fmt else "--format"
    assert (command in body) == (fmt is not None)


def test_a_windowed_dflash2_card_names_the_format_that_keeps_its_window(tmp_path):
    info = hub.ExportInfo(tmp_path, {"model_type": "dspine", "method": "dflash2",
                                     "block_size": 8, "sliding_window": 2048},
                          ["model.safetensors"], 3, 100, None, {})
    body = ModelCard(hub.render_model_card(info, repo_id="org/name")).text
    assert "--format dflash`" in body and "--format speculators" not in body


def test_a_metric_holding_a_pipe_keeps_its_row_of_the_card(tmp_path, hf_env):
    """A `|` in an eval_results value must not split the card's metric row into 3 cells."""
    export = make_export(tmp_path / "export")
    (export / "eval_results.json").write_text(
        json.dumps({"acceptance_length": 3.0, "prompts": "chat | code"}))
    text = hub.render_model_card(hub.validate_export(export), repo_id="org/name")
    row = next(line for line in text.splitlines() if line.startswith("| prompts |"))
    assert re.split(r"(?<!\\)\|", row.strip()[1:-1]) == [" prompts ", " chat \\| code "]


def _local_target_export(tmp_path: Path) -> tuple[Path, Path]:
    """An export trained on a local target directory, as the trainer writes it."""
    target = tmp_path / "ckpt" / "Qwen3-8B"
    target.mkdir(parents=True)
    export = make_export(tmp_path / "export", target_name_or_path=str(target))
    (export / "training_info.json").write_text(json.dumps(
        {"recipe": "qwen3_8b", "step": 10, "target": str(target),
         "data": str(tmp_path / "data" / "tokenized"), "note": "see </s> and org/x"}))
    (export / "nested").mkdir()
    (export / "nested" / "extra.json").write_text(json.dumps({"paths": ["/home/me/x.txt"]}))
    return export, target


@pytest.mark.parametrize("flag", ["--target-id", "--base-model"])
def test_uploaded_json_carries_no_local_path(tmp_path, hf_env, flag):
    export, target = _local_target_export(tmp_path)
    local = {p: p.read_bytes() for p in export.rglob("*.json")}
    assert run_main([export, "--repo-id", "org/name", flag, "Qwen/Qwen3-8B"]) == 0
    (api,) = FakeHfApi.instances
    uploaded = {name: api.content(name) for name in api.uploaded if name.endswith(".json")}
    assert set(uploaded) == {"config.json", "training_info.json", "nested/extra.json"}
    for name, content in uploaded.items():
        assert str(tmp_path).encode() not in content and b"/home/me" not in content, name
    config = json.loads(uploaded["config.json"])
    assert config["target_name_or_path"] == "Qwen/Qwen3-8B"
    assert {k: v for k, v in config.items() if k != "target_name_or_path"} == {
        k: v for k, v in json.loads(local[export / "config.json"]).items()
        if k != "target_name_or_path"}
    assert json.loads(uploaded["training_info.json"]) == {
        "recipe": "qwen3_8b", "step": 10, "target": "Qwen/Qwen3-8B", "data": "tokenized",
        "note": "see </s> and org/x"}  # only whole-value paths change
    assert json.loads(uploaded["nested/extra.json"]) == {"paths": ["x.txt"]}
    assert ModelCard(api.uploaded_card).data.base_model == "Qwen/Qwen3-8B"
    # the local export is unchanged: the engine reads the local target from it
    assert {p: p.read_bytes() for p in export.rglob("*.json")} == local


def test_a_local_target_without_a_hub_id_is_refused(tmp_path, hf_env, capsys):
    export, target = _local_target_export(tmp_path)
    before = sorted(export.rglob("*"))

    def no_client(**kwargs):
        raise AssertionError("nothing may be uploaded")

    for extra in ([], ["--dry-run"]):
        assert run_main([export, "--repo-id", "org/name", *extra], api_factory=no_client) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dspine-train push: error: {export / 'config.json'}: target_name_or_path "
                       f"'{target}' is a local path, which is never uploaded; give the target's "
                       "Hub id with --target-id ORG/NAME"]
    assert sorted(export.rglob("*")) == before  # no card written either
    # the library call refuses too, before any request
    with pytest.raises(hub.ExportError, match="target_name_or_path .* is a local path"):
        hub.push_export(export, "org/name", "card", token=TOKEN, api_factory=no_client)


def test_dry_run_marks_the_cleaned_files(tmp_path, hf_env, capsys):
    export, _ = _local_target_export(tmp_path)
    assert run_main([export, "--repo-id", "org/name", "--target-id", "Qwen/Qwen3-8B",
                     "--dry-run"]) == 0
    listed = capsys.readouterr().out.split("--- README.md ---")[0]
    assert "config.json" in listed and "training_info.json" in listed
    assert listed.count("(local paths removed)") == 3
    assert str(tmp_path) not in listed


def test_dry_run_prints_plan_and_card_without_network_or_writes(tmp_path, hf_env, capsys):
    export = make_export(tmp_path / "export")
    before = sorted(p.name for p in export.iterdir())

    def no_client(**kwargs):
        raise AssertionError("a dry run must not build a Hub client")

    argv = [export, "--repo-id", "org/name", "--private", "--dry-run"]
    assert run_main(argv, api_factory=no_client) == 0
    out, err = capsys.readouterr()
    assert "repository: org/name (model, private if created)" in out
    assert "token: found" in out
    size = (export / "model.safetensors").stat().st_size
    assert f"model.safetensors  {size / 1024:.1f} KiB" in out
    table = (export / "token_table.safetensors").stat().st_size
    assert f"token_table.safetensors  {hub_cli._size(table)}" in out
    assert "README.md" in out and "config.json" in out
    assert "--- README.md ---" in out and "base_model: Qwen/Qwen3-8B" in out
    assert TOKEN not in out + err
    assert sorted(p.name for p in export.iterdir()) == before  # nothing written


def _remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    "breakage, named, message",
    [
        (lambda e: _remove(e / "config.json"), "config.json", "missing"),
        (lambda e: (e / "config.json").write_text("{not json"), "config.json", "not valid JSON"),
        (
            lambda e: (e / "config.json").write_text(json.dumps({"model_type": "qwen3"})),
            "config.json",
            "model_type is 'qwen3', expected 'dspine'",
        ),
        (lambda e: _remove(e / "model.safetensors"), "model.safetensors", "missing"),
        (
            lambda e: (e / "model.safetensors").write_bytes(
                (e / "model.safetensors").read_bytes()[:-16]
            ),
            "model.safetensors",
            "not a valid safetensors file",
        ),
        (
            lambda e: (e / "eval_results.json").write_text('{"acceptance_length": "high"}'),
            "eval_results.json",
            "'acceptance_length' must be a finite number",
        ),
    ],
)
def test_invalid_export_fails_naming_the_file(tmp_path, hf_env, capsys, breakage, named, message):
    export = make_export(tmp_path / "export")
    breakage(export)
    assert run_main([export, "--repo-id", "org/name"]) == 2
    out, err = capsys.readouterr()
    assert str(export / named) in err and message in err, err
    assert FakeHfApi.instances == []  # nothing reached the Hub
    assert not (export / "README.md").exists()


def test_missing_export_dir_and_bad_repo_id(tmp_path, hf_env, capsys):
    assert run_main([tmp_path / "nope", "--repo-id", "org/name"]) == 2
    assert f"{tmp_path / 'nope'}: not a directory" in capsys.readouterr().err
    export = make_export(tmp_path / "export")
    assert run_main([export, "--repo-id", "org/sub/name"]) == 2
    assert "--repo-id 'org/sub/name'" in capsys.readouterr().err


def test_sharded_export_is_validated(tmp_path):
    export = make_export(tmp_path / "export")
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "numpy") as weights:
        shapes = {name: weights.get_slice(name).get_shape() for name in weights.keys()}
    (export / "model.safetensors").rename(export / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors"
                                            for name in shapes}}
    (export / "model.safetensors.index.json").write_text(json.dumps(index))
    info = hub.validate_export(export)
    assert info.weight_files == ["model-00001-of-00001.safetensors"]
    assert (info.num_tensors, info.num_values) == (
        len(shapes), sum(int(np.prod(shape)) for shape in shapes.values()))


def test_no_token_fails_before_any_upload(tmp_path, hf_env, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    export = make_export(tmp_path / "export")
    assert run_main([export, "--repo-id", "org/name"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    assert FakeHfApi.instances == []


def test_upload_error_is_reported_without_the_token(tmp_path, hf_env, capsys):
    export = make_export(tmp_path / "export")

    def failing(token=None, endpoint=None):
        return FakeHfApi(token, endpoint, fail_with=f"401 Unauthorized for token {token}")

    assert run_main([export, "--repo-id", "org/name"], api_factory=failing) == 1
    out, err = capsys.readouterr()
    assert "upload to org/name failed: 401 Unauthorized for token ***" in err
    assert TOKEN not in out + err


@pytest.fixture
def silent_endpoint():
    """http://127.0.0.1:PORT of a TCP server that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_hold():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept_and_hold, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("via", ["flag", "HF_ENDPOINT"])
def test_an_endpoint_that_never_answers_fails_with_a_clear_error(tmp_path, silent_endpoint, via):
    export = make_export(tmp_path / "export")
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS_"))
    }
    env.update(HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=str(REPO))
    argv = [sys.executable, str(SCRIPT), str(export), "--repo-id", "org/name", "--timeout", "1"]
    if via == "flag":
        argv += ["--endpoint", silent_endpoint]
    else:
        env["HF_ENDPOINT"] = silent_endpoint
    # Without request timeouts this waits forever; the subprocess limit only bounds the test.
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"dspine-train push: error: upload to org/name failed: {silent_endpoint} did not answer "
        "within 1 s (ReadTimeout); check the endpoint and the network, or raise --timeout"
    )
    assert TOKEN not in done.stdout + done.stderr
    assert not (export / "README.md").exists()  # failed before the card was written


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--timeout", "0"], "--timeout 0.0: must be a positive number of seconds"),
        (["--timeout", "nan"], "--timeout nan: must be a positive number of seconds"),
        (["--endpoint", "huggingface.co"], "--endpoint 'huggingface.co': not an http(s) URL"),
        (["--base-model", "/ckpt/Qwen3-8B"], "--base-model '/ckpt/Qwen3-8B': not a Hub model id"),
    ],
)
def test_bad_flags_fail_before_any_upload(tmp_path, hf_env, capsys, flags, message):
    export = make_export(tmp_path / "export")
    assert run_main([export, "--repo-id", "org/name", *flags]) == 2
    assert message in capsys.readouterr().err
    assert FakeHfApi.instances == []


# ------------------------------------------------------------------ links, loading
def _linked_export(tmp_path: Path) -> tuple[Path, Path]:
    """An export with links out of it: to a file, to a folder, and one dangling."""
    export = make_export(tmp_path / "export")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0:secret\n")
    (export / "notes.txt").symlink_to(outside / "passwd")
    (export / "extra").mkdir()
    (export / "extra" / "data").symlink_to(outside, target_is_directory=True)
    (export / "gone.json").symlink_to(outside / "missing.json")
    return export, outside


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
def test_links_in_the_export_refuse_the_push(tmp_path, hf_env, capsys, extra):
    """A link's content is not the export's: nothing is listed or uploaded, and the one-line
    error names every link (the dry run and the upload alike)."""
    export, _ = _linked_export(tmp_path)
    before = {p: p.lstat().st_mtime_ns for p in export.rglob("*")}
    assert run_main([export, "--repo-id", "org/name", *extra]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith(f"dspine-train push: error: {export}: ")
    for name in ("notes.txt", "extra/data", "gone.json"):
        assert name in line
    assert "passwd" not in out and "root:x" not in out
    assert FakeHfApi.instances == []  # nothing reached the Hub
    assert {p: p.lstat().st_mtime_ns for p in export.rglob("*")} == before  # no card written


def test_the_upload_itself_refuses_links(tmp_path, hf_env):
    """`push_export` (the library call behind the upload) refuses before any request."""
    export, _ = _linked_export(tmp_path)

    def no_client(**kwargs):
        raise AssertionError("nothing may be uploaded")

    with pytest.raises(hub.ExportError, match="notes.txt"):
        hub.push_export(export, "org/name", "card", token=TOKEN, api_factory=no_client)
    with pytest.raises(hub.ExportError, match="extra/data"):
        hub.upload_files(export)
    assert not (export / "README.md").exists()
    # without the links the same export uploads, and only its regular files
    for name in ("notes.txt", "extra/data", "gone.json"):
        (export / name).unlink()
    assert run_main([export, "--repo-id", "org/name"]) == 0
    (api,) = FakeHfApi.instances
    assert all(not (export / name).is_symlink() for name in api.uploaded)
    assert b"root:x" not in b"".join(api.content(name) for name in api.uploaded)


def _without(key: str):
    def breakage(export: Path) -> None:
        config = json.loads((export / "config.json").read_text())
        del config[key]
        (export / "config.json").write_text(json.dumps(config))
    return breakage


def _set(**fields):
    def breakage(export: Path) -> None:
        config = json.loads((export / "config.json").read_text())
        config.update(fields)
        (export / "config.json").write_text(json.dumps(config))
    return breakage


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
@pytest.mark.parametrize(
    "breakage, named",
    [
        (_set(block_size="8"), None),  # a wrongly typed field: the loader stops on it
        (_without("hidden_size"), "hidden_size"),
        (_set(num_layers=3), "weights do not match"),  # the weights hold 2 layers
    ],
    ids=["block_size_str", "no_hidden_size", "layers_not_in_weights"],
)
def test_an_export_the_engine_cannot_load_is_refused(tmp_path, hf_env, capsys, extra, breakage,
                                                     named):
    """The dry run and the upload load the export as the engine does; a draft nobody could
    load is refused in one line, before anything is written or uploaded."""
    export = make_export(tmp_path / "export")
    breakage(export)
    before = {p: p.read_bytes() for p in export.iterdir()}
    assert run_main([export, "--repo-id", "org/name", *extra]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith("dspine-train push: error: the draft does not load as the engine "
                           f"loads it: {export}"), line
    if named:
        assert named in line
    assert "--- README.md ---" not in out
    assert FakeHfApi.instances == []
    assert {p: p.read_bytes() for p in export.iterdir()} == before  # no card written


def test_a_loadable_export_passes_the_load_check(tmp_path):
    export = make_export(tmp_path / "export")
    info = hub.validate_export(export)
    assert info.config["block_size"] == 4


# ------------------------------------------------------------------ the real client, loopback
@pytest.fixture
def loopback_hub(hf_env, monkeypatch):
    """A writable loopback Hub (`tests/_hub_writable.py`) the real `HfApi` uploads to."""
    from huggingface_hub import constants

    from tests._hub_writable import WritableHub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    with WritableHub() as server:
        yield server


@pytest.mark.parametrize("flags, private", [([], True), (["--public"], False)])
def test_the_real_client_uploads_to_a_loopback_hub(tmp_path, loopback_hub, capsys, flags,
                                                   private):
    """`test_push_creates_repo_and_uploads_with_card` through `HfApi` and HTTP: the repository
    is created private unless --public, every export file arrives byte for byte, the card too."""
    export = make_export(tmp_path / "export")
    (export / "eval_results.json").write_text(json.dumps(
        {"acceptance_length": 3.25, "acceptance_length_per_position": [0.9, 0.7, 0.5]}))
    (export / "training_info.json").write_text(
        json.dumps({"recipe": "qwen3_8b", "dataset": "sharegpt-regenerated"}))
    argv = [export, "--repo-id", "org/dspine-qwen3-8b", "--commit-message", "v1",
            "--endpoint", loopback_hub.url, "--timeout", "30", *flags]
    assert run_main(argv, api_factory=None) == 0

    repo = loopback_hub.models["org/dspine-qwen3-8b"]
    assert repo.private is private
    assert repo.commits == ["v1"]
    assert loopback_hub.tokens == {TOKEN}
    assert repo.files == {p.name: p.read_bytes() for p in export.iterdir()}  # README.md too
    assert set(repo.files) == {"README.md", "config.json", "eval_results.json",
                               "model.safetensors", "token_table.safetensors",
                               "training_info.json"}
    card = ModelCard(repo.files["README.md"].decode())
    assert card.data.base_model == "Qwen/Qwen3-8B"
    assert "Mean acceptance length: **3.250**" in card.text
    assert "- recipe: qwen3_8b" in card.text and "- data: sharegpt-regenerated" in card.text
    out, err = capsys.readouterr()
    assert f"{loopback_hub.url}/org/dspine-qwen3-8b/commit/" in out
    assert TOKEN not in out + err


def test_safetensors_metadata_carries_no_local_path(tmp_path, loopback_hub):
    """The token table records the path it was built at: uploaded by its last component, the
    tensors byte for byte; the local file is unchanged."""
    from safetensors.numpy import load as load_bytes
    from safetensors.numpy import load_file

    export = make_export(tmp_path / "export")
    table = export / "token_table.safetensors"
    tensors = load_file(str(table))
    save_file(tensors, str(table), metadata={"format": "dspine-token-table",
                                             "source": f"{tmp_path}/cache/token_table.safetensors"})
    local = table.read_bytes()
    assert run_main([export, "--repo-id", "org/name", "--endpoint", loopback_hub.url],
                    api_factory=None) == 0
    uploaded = loopback_hub.models["org/name"].files["token_table.safetensors"]
    assert str(tmp_path).encode() not in uploaded
    size = int.from_bytes(uploaded[:8], "little")
    assert json.loads(uploaded[8:8 + size])["__metadata__"] == {
        "format": "dspine-token-table", "source": "token_table.safetensors"}
    back = load_bytes(uploaded)
    assert back.keys() == tensors.keys()
    assert all(np.array_equal(back[k], tensors[k]) for k in tensors)
    assert table.read_bytes() == local
    # a file without local paths in its metadata is uploaded as it is
    assert loopback_hub.models["org/name"].files["model.safetensors"] == (
        export / "model.safetensors").read_bytes()
