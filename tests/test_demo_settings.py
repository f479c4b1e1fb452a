"""The demo's training settings. `--dtype`: one setting for the target's
answers, its cached features and the draft's training precision; `auto` picks bfloat16 only
where the CPU computes it natively. `--draft-vocab-size`: the pruned draft vocabulary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from data_prep.backends import local
from tests._train_helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import demo  # noqa: E402  (scripts/demo.py)

X86_AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16\n"
X86_AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_PLAIN = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


@pytest.mark.parametrize(("text", "native"), [
    (X86_AMX, True), (X86_AVX512, False), (ARM_BF16, True), (ARM_PLAIN, False)])
def test_native_bf16_reads_the_cpu_flags(tmp_path: Path, text: str, native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert local.native_bf16(torch.device("cpu"), cpuinfo) is native


def test_native_bf16_without_cpuinfo_is_false_and_cuda_is_true(tmp_path: Path) -> None:
    assert local.native_bf16(torch.device("cpu"), tmp_path / "missing") is False
    assert local.native_bf16(torch.device("cuda"), tmp_path / "missing") is True


def _args(*argv: str):
    return demo.build_parser().parse_args(["--draft-layers", "2", "--block-size", "8", *argv])


def _demo(tmp_path: Path, *argv: str) -> demo.Demo:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 24}))
    return demo.Demo(_args(*argv), tmp_path / "out", target)


@pytest.mark.parametrize(("native", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_auto_resolves_by_the_machine(monkeypatch: pytest.MonkeyPatch, native: bool,
                                      expected: str) -> None:
    monkeypatch.setattr(local, "native_bf16", lambda device: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _args()
    assert args.dtype == "auto"
    demo.resolve_dtype(args)
    assert args.dtype == expected
    pinned = _args("--dtype", "float32")
    demo.resolve_dtype(pinned)
    assert pinned.dtype == "float32"  # an explicit choice is kept


@pytest.mark.parametrize(("dtype", "precision"), [("bfloat16", "bf16"), ("float32", "fp32")])
def test_training_config_follows_the_dtype(tmp_path: Path, dtype: str, precision: str) -> None:
    config = demo.train_config(_demo(tmp_path, "--dtype", dtype))
    assert config.model.target_dtype == dtype
    assert config.precision.value == precision


def test_an_explicit_train_override_wins(tmp_path: Path) -> None:
    config = demo.train_config(_demo(tmp_path, "--dtype", "bfloat16",
                                     "--train-override", "precision=fp32"))
    assert config.precision.value == "fp32" and config.model.target_dtype == "bfloat16"


def test_regeneration_uses_the_dtype_and_caches_by_it(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import data_prep.regenerate as regenerate

    seen = {}

    def fake_job(*args, **kwargs):
        seen.update(kwargs)
        return "job"

    monkeypatch.setattr(regenerate, "greedy_local_job", fake_job)
    monkeypatch.setattr(regenerate, "run_regeneration", lambda job: {
        "input": 2, "done": 2, "failed": 0, "skipped": 0, "completion_tokens": 10})
    monkeypatch.setattr(regenerate, "summary_line", lambda report: "ok")
    summary = demo.stage_regenerate(_demo(tmp_path, "--dtype", "bfloat16"))
    assert seen["dtype"] == "bfloat16" and summary["dtype"] == "bfloat16"
    # Another dtype is another cache key for every stage the target or the draft runs in.
    for stage in ("regenerate", "features", "train"):
        settings = demo.SPECS[stage].settings
        assert settings(_args("--dtype", "bfloat16")) != settings(_args("--dtype", "float32"))


@pytest.mark.parametrize(("flag", "expected"), [("0", None), ("32768", 32768)])
def test_draft_vocab_size_reaches_the_training_config(tmp_path: Path, flag: str,
                                                      expected: int | None) -> None:
    config = demo.train_config(_demo(tmp_path, "--dtype", "float32", "--draft-vocab-size", flag))
    assert config.model.draft_vocab_size == expected
    settings = demo.SPECS["train"].settings
    assert settings(_args("--draft-vocab-size", "0")) != settings(_args("--draft-vocab-size",
                                                                       "32768"))


def test_a_negative_draft_vocab_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--draft-vocab-size", "-1", "--stages", "prompts"]) == 1
    assert "--draft-vocab-size must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--stages", "--force"])
def test_an_unknown_stage_is_refused_by_flag_before_any_work(
        tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    assert demo.main(["--out", str(out), flag, "prompts,evaluat"]) == 1
    err = capsys.readouterr().err
    assert f"{flag}: unknown stage(s) ['evaluat']" in err
    assert all(stage in err for stage in demo.STAGES)  # the stages it knows are listed
    assert not out.exists()


def test_a_stage_record_is_read_back_and_an_unreadable_one_reruns_the_stage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished stage is skipped on the next run with the record it wrote; a record of another
    shape (another demo version, a hand edit) counts as not done: the stage runs again."""
    d = _demo(tmp_path)
    calls = []
    monkeypatch.setitem(demo.STAGE_FUNCS, "target", lambda _: calls.append(1) or {"run_id": "t1"})
    record, ran = demo.run_stage(d, "target", False)
    assert ran and record.run_id == "t1" and demo.Demo.marker(d, "target") == record
    path = d.stages_dir / "target.json"
    assert json.loads(path.read_text())["summary"] == {}
    path.write_text(json.dumps({"stage": "target", "seconds": 1.0}))  # no fingerprint, no run
    assert d.marker("target") is None
    monkeypatch.setitem(demo.STAGE_FUNCS, "prompts", lambda _: {"prompts": 2})
    with pytest.raises(demo.DemoError, match="needs stage target"):
        demo.run_stage(d, "prompts", False)
    record, ran = demo.run_stage(d, "target", False)  # "target" always checks; it ran again
    assert ran and len(calls) == 2
    first, ran = demo.run_stage(d, "prompts", False)
    again, ran_again = demo.run_stage(d, "prompts", False)
    assert ran and not ran_again and again == first and first.summary == {"prompts": 2}
