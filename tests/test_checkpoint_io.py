"""Checkpoint I/O: atomic files, directory replacement without a missing moment, weight reading."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from dspine_train import checkpoint_io
from dspine_train.checkpoint_io import (
    SafetensorsWeights,
    WeightsError,
    WeightsNotFoundError,
    build_dir,
    clean_dead_builds,
    exchange_paths,
    publish_dir,
    replace_dir,
    write_atomic,
    write_json_atomic,
    write_text_atomic,
)

LINUX = sys.platform.startswith("linux")


# --------------------------------------------------------------------------- files
def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "result.json"
    write_json_atomic(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert path.read_text().endswith("\n")
    assert path.stat().st_mode & 0o777 == 0o644  # mkstemp's 0600 is not kept
    write_text_atomic(path, "second")
    assert path.read_text() == "second"
    assert os.listdir(path.parent) == ["result.json"]


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "card.md"
    path.write_text("old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        write_atomic(path, half_then_fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["card.md"]


def test_a_full_disk_at_fsync_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "part-00000.jsonl"
    path.write_text("old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        write_text_atomic(path, "new")
    assert err.value.errno == errno.ENOSPC
    assert path.read_text() == "old" and os.listdir(tmp_path) == [path.name]


def test_regeneration_removes_partial_shards_of_both_namings(tmp_path):
    from data_prep.shards import remove_partial_shards

    (tmp_path / "part-00000.jsonl").write_text("{}\n")
    (tmp_path / ".part-00001.jsonl.k2j4x.tmp").write_text("{")  # write_text_atomic's temp
    (tmp_path / "part-00001.jsonl.tmp").write_text("{")  # the naming of older versions
    assert remove_partial_shards(tmp_path) == 2
    assert os.listdir(tmp_path) == ["part-00000.jsonl"]


# --------------------------------------------------------------------------- directories
def _make(path: Path, content: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "a.txt").write_text(content)
    (path / "b.txt").write_text(content)
    return path


def _content(path: Path) -> str | None:
    """'old'/'new' when `path` is a whole output, else None (missing or mixed)."""
    try:
        values = {(path / name).read_text() for name in ("a.txt", "b.txt")}
    except OSError:
        return None
    return values.pop() if len(values) == 1 else None


@pytest.mark.skipif(not LINUX, reason="renameat2 is Linux-only")
def test_exchange_is_taken_on_linux(tmp_path, monkeypatch):
    a, b = _make(tmp_path / "a", "A"), _make(tmp_path / "b", "B")
    assert exchange_paths(a, b) is True
    assert _content(a) == "B" and _content(b) == "A"

    def no_fallback(*args: object) -> None:
        raise AssertionError("the rename-aside fallback ran on Linux")

    monkeypatch.setattr(checkpoint_io, "_replace_by_renames", no_fallback)
    dest = _make(tmp_path / "out", "old")
    replace_dir(_make(build_dir(dest), "new"), dest)
    assert _content(dest) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]


def test_exchange_reports_unsupported_without_changing_anything(tmp_path, monkeypatch):
    def einval(*args: object) -> int:
        import ctypes

        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(checkpoint_io, "_load_renameat2", lambda: einval)
    a, b = _make(tmp_path / "a", "A"), _make(tmp_path / "b", "B")
    assert exchange_paths(a, b) is False
    assert _content(a) == "A" and _content(b) == "B"


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "fallback"])
def test_replace_dir_result_and_replacing_a_missing_destination(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(checkpoint_io, "exchange_paths", lambda a, b: False)
    dest = tmp_path / "out"
    replace_dir(_make(build_dir(dest), "first"), dest)  # nothing there yet
    assert _content(dest) == "first"
    replace_dir(_make(build_dir(dest), "second"), dest)
    assert _content(dest) == "second"
    assert os.listdir(tmp_path) == ["out"]
    assert dest.stat().st_mode & 0o777 == 0o755  # mkdtemp's 0700 is not kept


def _observe_every_step(monkeypatch, check) -> list[str]:
    """Call `check()` before and after every rename and tree deletion; return the log."""
    log: list[str] = []
    real_rename, real_rmtree = os.rename, shutil.rmtree

    def rename(src, dst, *args, **kwargs):
        check()
        real_rename(src, dst, *args, **kwargs)
        log.append(f"rename {Path(src).name} -> {Path(dst).name}")
        check()

    def rmtree(path, *args, **kwargs):
        check()
        real_rmtree(path, *args, **kwargs)
        log.append(f"rmtree {Path(path).name}")
        check()

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return log


@pytest.mark.skipif(not LINUX, reason="renameat2 is Linux-only")
def test_replace_dir_never_leaves_the_destination_missing(tmp_path, monkeypatch):
    dest = _make(tmp_path / "out", "old")
    source = _make(build_dir(dest), "new")
    seen = []

    def check() -> None:
        seen.append(_content(dest))
        assert seen[-1] in ("old", "new"), f"{dest} is missing or mixed"

    log = _observe_every_step(monkeypatch, check)
    replace_dir(source, dest)
    assert _content(dest) == "new" and log  # the old copy was deleted after the swap
    assert not source.exists()


def _run_killed(dest: Path, kill_in: str, exchange: bool) -> None:
    """In a child process: replace `dest` with a 'new' build, dying (os._exit) inside
    `kill_in` -- a step of checkpoint_io -- as a kill -9 would."""
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from dspine_train import checkpoint_io as io
        dest = Path({str(dest)!r})
        if not {exchange!r}:
            io.exchange_paths = lambda a, b: False
        real_rename = os.rename
        renames = []
        def die(*args):
            os._exit(9)
        def second_rename_dies(src, dst):
            renames.append(src)
            if len(renames) == 2:
                os._exit(9)
            real_rename(src, dst)
        if {kill_in!r} == "remove":
            io._remove = die
        else:
            io.os.rename = second_rename_dies
        build = io.build_dir(dest)
        for name in ("a.txt", "b.txt"):
            (build / name).write_text("new")
        io.replace_dir(build, dest)
    """)
    repo = Path(__file__).resolve().parents[1]  # import this checkout's package
    done = subprocess.run([sys.executable, "-c", code], cwd=repo)
    assert done.returncode == 9


@pytest.mark.skipif(not LINUX, reason="renameat2 is Linux-only")
def test_a_kill_after_the_exchange_leaves_the_new_output_and_a_cleanable_build(tmp_path):
    dest = _make(tmp_path / "out", "old")
    _run_killed(dest, "remove", exchange=True)
    assert _content(dest) == "new"
    (leftover,) = [p for p in tmp_path.iterdir() if p.name != "out"]
    assert leftover.name.startswith(".out.tmp-") and _content(leftover) == "old"
    assert clean_dead_builds(dest) == [leftover]
    assert os.listdir(tmp_path) == ["out"] and _content(dest) == "new"


def test_fallback_kill_between_renames_is_repaired(tmp_path):
    """The documented window of the fallback: the old output aside, put back on cleanup."""
    dest = _make(tmp_path / "out", "old")
    _run_killed(dest, "rename", exchange=False)
    assert not dest.exists()  # the window the exchange closes
    removed = clean_dead_builds(dest)
    assert _content(dest) == "old"
    assert [p.name.startswith(".out.tmp-") for p in removed] == [True]
    assert os.listdir(tmp_path) == ["out"]


def test_fallback_restores_the_old_output_when_the_second_rename_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_io, "exchange_paths", lambda a, b: False)
    dest = _make(tmp_path / "out", "old")
    source = _make(build_dir(dest), "new")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src) == source:
            raise OSError(errno.EIO, "I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        replace_dir(source, dest)
    assert _content(dest) == "old" and _content(source) == "new"


def test_clean_dead_builds_keeps_live_builds(tmp_path):
    dest = tmp_path / "out"
    live = tmp_path / f".out.tmp-{os.getppid()}-abc"  # a running process's build
    live.mkdir()
    mine = build_dir(dest)
    assert clean_dead_builds(dest) == []
    assert live.is_dir() and mine.is_dir()


def test_publish_dir_first_writer_wins(tmp_path):
    dest = tmp_path / "fixture"
    assert publish_dir(_make(build_dir(dest), "first"), dest) is True
    late = _make(build_dir(dest), "second")
    assert publish_dir(late, dest) is False
    assert _content(dest) == "first" and not late.exists()


# ------------------------------------------------------- the writers that had a missing moment
class _FakeDraft:
    """Stands in for the draft: its own tiny weights, a real config (the dspine format derives
    the DFlash and DSpine blocks of `config.json` from it)."""

    def __init__(self) -> None:
        from dspine_train import DSpineConfig
        from tests._model_helpers import USED_VOCAB, tiny_target

        self.config = DSpineConfig.from_target(tiny_target().config, used_vocab_size=USED_VOCAB,
                                               num_layers=2)

    def save_pretrained(self, path, state_dict, safe_serialization):
        save_file(dict(state_dict), str(Path(path) / "model.safetensors"))
        (Path(path) / "config.json").write_text("{}")


class _FakeAccelerator:
    is_main_process = True

    def __init__(self, value: float) -> None:
        self.value = value

    def get_state_dict(self, engine):
        return {"draft.w": torch.full((2,), self.value)}

    def unwrap_model(self, engine):
        return SimpleNamespace(draft=_FakeDraft())

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, path: str) -> None:
        (Path(path) / "model.bin").write_text(str(self.value))


def test_export_replaces_an_old_export_with_no_moment_without_one(tmp_path, monkeypatch):
    """Old code: `rmtree(out_dir)` then rename -- a window with no export at all."""
    from dspine_train.training.run_export import INFO_FILE, export_draft

    table = tmp_path / "table.safetensors"
    table.write_bytes(b"table")
    out = tmp_path / "final"
    export_draft(_FakeAccelerator(1.0), None, out, table, {"run": "old"})

    def check() -> None:
        info = out / INFO_FILE
        assert info.is_file(), f"{out} has no whole export at this moment"
        assert json.loads(info.read_text())["run"] in ("old", "new")

    _observe_every_step(monkeypatch, check)
    export_draft(_FakeAccelerator(2.0), None, out, table, {"run": "new"})
    monkeypatch.undo()
    assert json.loads((out / INFO_FILE).read_text())["run"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "table.safetensors"]


def test_resaving_a_checkpoint_step_has_no_moment_without_it(tmp_path, monkeypatch):
    """Old code: the same step saved again was `rmtree`d before the rename."""
    from dspine_train.training.checkpointing import (
        STATE_FILE,
        CheckpointManager,
        TrainState,
        checkpoint_name,
    )

    manager = CheckpointManager(tmp_path, keep_last=2, accelerator=_FakeAccelerator(1.0),
                                run_config={"optim": {"lr": 1.0}})
    final = manager.save(TrainState(step=5, position=10))
    assert final.name == checkpoint_name(5)

    def check() -> None:
        assert (final / STATE_FILE).is_file(), f"{final} is missing at this moment"

    manager.accelerator = _FakeAccelerator(2.0)
    _observe_every_step(monkeypatch, check)
    manager.save(TrainState(step=5, position=11))
    monkeypatch.undo()
    assert json.loads((final / STATE_FILE).read_text())["position"] == 11
    assert (final / "model.bin").read_text() == "2.0"
    assert os.listdir(tmp_path) == [final.name]


# --------------------------------------------------------------------------- safetensors
@pytest.fixture
def sharded(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2),
               "lm_head.weight": torch.ones(3, 2), "model.norm.weight": torch.zeros(2)}
    root = tmp_path / "sharded"
    root.mkdir()
    save_file({"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]},
              str(root / "model-1.safetensors"))
    save_file({k: tensors[k] for k in ("lm_head.weight", "model.norm.weight")},
              str(root / "model-2.safetensors"))
    weight_map = {"model.embed_tokens.weight": "model-1.safetensors",
                  "lm_head.weight": "model-2.safetensors",
                  "model.norm.weight": "model-2.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root, tensors


def test_reads_single_file_lazily(tmp_path):
    tensors = {"a": torch.ones(2), "b": torch.zeros(3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with SafetensorsWeights(tmp_path) as weights:
        assert sorted(weights.keys()) == ["a", "b"] and "a" in weights
        assert weights.files == [tmp_path / "model.safetensors"]
        assert weights.get_shape("b") == [3]
        stream = weights.tensors(["b"])
        assert not isinstance(stream, dict)  # a generator: nothing read before it is asked
        assert torch.equal(dict(stream)["b"], tensors["b"])


def test_reads_sharded_checkpoint(sharded):
    root, tensors = sharded
    with SafetensorsWeights(root) as weights:
        assert weights.files == [root / "model-1.safetensors", root / "model-2.safetensors"]
        assert weights.file_of("model.norm.weight") == root / "model-2.safetensors"
        read = dict(weights.tensors())
    assert read.keys() == tensors.keys()
    assert all(torch.equal(read[k], tensors[k]) for k in tensors)


def test_single_file_wins_over_an_index_as_in_transformers(sharded):
    root, _ = sharded
    save_file({"only": torch.ones(1)}, str(root / "model.safetensors"))
    assert SafetensorsWeights(root).keys() == ["only"]


def test_missing_shard_names_the_index_and_the_file(sharded):
    root, _ = sharded
    (root / "model-2.safetensors").unlink()
    with pytest.raises(WeightsNotFoundError,
                       match=r"model.safetensors.index.json maps lm_head.weight to "
                             r"model-2.safetensors, which is not in"):
        SafetensorsWeights(root)
    assert issubclass(WeightsNotFoundError, FileNotFoundError)


def test_truncated_shard_names_the_file(sharded):
    root, _ = sharded
    shard = root / "model-2.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    weights = SafetensorsWeights(root)
    assert torch.equal(weights.get_tensor("model.embed_tokens.weight"), torch.arange(6.0).reshape(3, 2))
    with pytest.raises(WeightsError, match=rf"{shard}: not a valid safetensors file"):
        weights.get_tensor("lm_head.weight")
    with pytest.raises(WeightsError, match=rf"{shard}: not a valid safetensors file"):
        SafetensorsWeights(root).check()


def test_missing_tensor_names_the_file(sharded):
    root, _ = sharded
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = "model-1.safetensors"  # the shard lacks it
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    weights = SafetensorsWeights(root)
    with pytest.raises(WeightsError, match=r"model-1.safetensors: has no tensor 'extra.weight'"):
        weights.get_tensor("extra.weight")
    with pytest.raises(WeightsError, match=r"index.json: no tensor 'absent'"):
        weights.get_tensor("absent")


@pytest.mark.parametrize("shard", ["../outside.safetensors", ".hidden.safetensors", 5])
def test_index_naming_a_path_outside_is_refused(sharded, shard):
    root, _ = sharded
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": shard}}))
    with pytest.raises(WeightsError, match=r"weight_map\['x'\] = .* is not a shard file name"):
        SafetensorsWeights(root)


def test_no_weights_and_no_directory(tmp_path):
    with pytest.raises(WeightsNotFoundError, match=r"model.safetensors: missing \(neither"):
        SafetensorsWeights(tmp_path)
    with pytest.raises(WeightsNotFoundError, match="does not exist"):
        SafetensorsWeights(tmp_path / "nowhere")


def test_training_reader_names_a_truncated_shard(sharded):
    """Old code: a raw SafetensorError from safe_open, not a TrainingError naming the key."""
    from dspine_train.training.errors import TrainingError
    from dspine_train.training.target import read_embedding_and_head

    root, tensors = sharded
    embed, head = read_embedding_and_head(str(root))
    assert torch.equal(embed, tensors["model.embed_tokens.weight"])
    assert torch.equal(head, tensors["lm_head.weight"])
    shard = root / "model-1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(TrainingError, match=rf"model.target_path: {shard}: not a valid"):
        read_embedding_and_head(str(root))
