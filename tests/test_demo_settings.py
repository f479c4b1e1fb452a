"""The demo's training settings. `--dtype`: the target's cached features and the draft's
training precision; `auto` picks bfloat16 only where the CPU computes it natively. The target
answers the prompts in the dtype the engine evaluates in (float32 on a CPU). `--draft-vocab-size`:
the pruned draft vocabulary."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspine_train import cpu_bf16
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
    assert cpu_bf16.native_bf16(torch.device("cpu"), cpuinfo) is native


def test_native_bf16_without_cpuinfo_is_false_and_cuda_is_true(tmp_path: Path) -> None:
    assert cpu_bf16.native_bf16(torch.device("cpu"), tmp_path / "missing") is False
    assert cpu_bf16.native_bf16(torch.device("cuda"), tmp_path / "missing") is True


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
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda device: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _args()
    assert args.dtype == "auto"
    demo.resolve_dtype(args)
    assert args.dtype == expected
    assert args.serve_dtype == "float32"  # answers and engine: the CPU's bit-exact dtype
    assert args.answer_dtype == "float32"
    pinned = _args("--dtype", "float32", "--answer-dtype", "bfloat16")
    demo.resolve_dtype(pinned)
    assert pinned.dtype == "float32"  # an explicit choice is kept
    assert (pinned.answer_dtype, pinned.serve_dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize(("dtype", "precision"), [("bfloat16", "bf16"), ("float32", "fp32")])
def test_training_config_follows_the_dtype(tmp_path: Path, dtype: str, precision: str) -> None:
    config = demo.train_config(_demo(tmp_path, "--dtype", dtype))
    assert config.model.target_dtype == dtype
    assert config.precision.value == precision


def test_an_explicit_train_override_wins(tmp_path: Path) -> None:
    config = demo.train_config(_demo(tmp_path, "--dtype", "bfloat16",
                                     "--train-override", "precision=fp32"))
    assert config.precision.value == "fp32" and config.model.target_dtype == "bfloat16"


def test_regeneration_uses_the_serving_dtype_and_caches_by_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The answers come from the target in the dtype the engine serves it in, whatever
    `--dtype` (the features' and the training's) says."""
    import data_prep.regenerate as regenerate

    seen = {}

    def fake_job(*args, **kwargs):
        seen.update(kwargs)
        return "job"

    monkeypatch.setattr(regenerate, "greedy_local_job", fake_job)
    monkeypatch.setattr(regenerate, "run_regeneration", lambda job: {
        "input": 2, "done": 2, "failed": 0, "skipped": 0, "completion_tokens": 10})
    monkeypatch.setattr(regenerate, "summary_line", lambda report: "ok")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = _demo(tmp_path, "--dtype", "bfloat16")
    demo.resolve_dtype(run.args)
    summary = demo.stage_regenerate(run)
    assert seen["dtype"] == "float32" and summary["dtype"] == "float32"

    def resolved(*argv: str, cuda: bool = False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        args = _args(*argv)
        demo.resolve_dtype(args)
        return args

    # Another dtype is another cache key for every stage the target or the draft runs in:
    # --dtype for the features and the training, the serving dtype for the answers and the
    # evaluation.
    for stage in ("features", "train"):
        settings = demo.SPECS[stage].settings
        assert settings(resolved("--dtype", "bfloat16")) != settings(resolved("--dtype",
                                                                              "float32"))
    for stage in ("regenerate", "evaluate"):
        settings = demo.SPECS[stage].settings
        assert settings(resolved("--dtype", "bfloat16")) == settings(resolved("--dtype",
                                                                              "float32"))
        assert settings(resolved()) != settings(resolved(cuda=True))


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


@pytest.mark.parametrize(("cuda", "native"), [(False, True), (False, False), (True, True)])
def test_answers_evaluation_and_parity_share_one_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  cuda: bool, native: bool) -> None:
    """The answers are regenerated in the dtype the engine evaluates and checks parity in, so
    the dataset's answers are the engine's greedy ones (no parity warning that the defaults
    caused: before, a CPU with native bf16 answered in bf16 and evaluated in fp32)."""
    import data_prep.benchmarks as benchmarks
    import data_prep.regenerate as regenerate
    import dspine_train.evaluation.harness as harness
    import dspine_train.evaluation.parity as parity
    from dspine_train.benchmark_prompts import Benchmark

    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda device: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    seen: dict[str, object] = {}
    monkeypatch.setattr(regenerate, "greedy_local_job",
                        lambda *a, **kw: seen.setdefault("regenerate", kw["dtype"]))
    monkeypatch.setattr(regenerate, "run_regeneration", lambda job: {
        "input": 1, "done": 1, "failed": 0, "skipped": 0, "completion_tokens": 1})
    monkeypatch.setattr(regenerate, "summary_line", lambda report: "ok")
    monkeypatch.setattr(benchmarks, "load_benchmark", lambda name, limit: Benchmark(
        name, [[{"role": "user", "content": "hi"}]], ["0"], {}))

    def fake_engine(*args, **kwargs):
        seen["evaluate"] = kwargs.get("dtype")  # None: the engine's default for the device
        return SimpleNamespace(configure_ngram=lambda *a, **kw: None)

    def fake_parity(*args, **kwargs):
        seen["parity"] = kwargs.get("dtype", torch.float32)  # parity's own default
        raise RuntimeError("stop here: the dtypes are recorded")

    monkeypatch.setattr(harness, "build_engine", fake_engine)
    monkeypatch.setattr(harness, "evaluate", lambda *a, **kw: [])
    monkeypatch.setattr(harness, "save_results", lambda *a, **kw: None)
    monkeypatch.setattr(harness, "results_markdown", lambda results: "")
    monkeypatch.setattr(harness, "plot_results", lambda *a, **kw: None)
    monkeypatch.setattr(parity, "parity_from_dataset", fake_parity)

    run = _demo(tmp_path)
    demo.resolve_dtype(run.args)
    demo.stage_regenerate(run)
    run.path("draft").mkdir(parents=True)
    run.path("draft", "config.json").write_text(json.dumps({"block_size": 8}))
    run.path("eval").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="stop here"):
        demo.stage_evaluate(run)
    config = demo.train_config(run)
    # One dtype for everything the target generates: the answers, the engine's evaluation and
    # its parity check; float32 on a CPU (even one with native bf16), bfloat16 on CUDA.
    served = torch.bfloat16 if cuda else torch.float32
    engine_default = torch.bfloat16 if cuda else torch.float32  # the default target is bf16
    assert getattr(torch, seen["regenerate"]) == served
    assert (seen["evaluate"] or engine_default) == served
    assert seen["parity"] == served
    # --dtype auto: the features and the training in what the machine runs fastest
    trained = torch.bfloat16 if native else torch.float32
    assert getattr(torch, config.model.target_dtype) == trained
    assert config.precision.value == ("bf16" if trained == torch.bfloat16 else "fp32")


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


def test_a_record_names_its_threads_and_an_older_record_without_them_still_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads the children ran with are part of the record (training's numerics depend
    on them); a record written before this field existed is still read as done."""
    d = _demo(tmp_path, "--threads", "1")
    monkeypatch.setitem(demo.STAGE_FUNCS, "target", lambda _: {"run_id": "t1"})
    record, _ = demo.run_stage(d, "target", False)
    saved = json.loads((d.stages_dir / "target.json").read_text())
    assert saved["environment"]["omp_num_threads"] == "1"
    assert saved["environment"]["torch"] == torch.__version__
    older = {k: v for k, v in saved.items() if k != "environment"}
    (d.stages_dir / "target.json").write_text(json.dumps(older))
    assert d.marker("target") is not None and d.marker("target").run_id == record.run_id


def test_files_digest_follows_names_and_bytes(tmp_path: Path) -> None:
    from scripts.tools.demo.records import files_digest

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"\x00\x01")
    (tmp_path / "a" / "y.bin").write_bytes(b"\x02")
    first = files_digest(tmp_path / "a")
    assert files_digest(tmp_path / "a") == first
    (tmp_path / "a" / "y.bin").write_bytes(b"\x03")
    assert files_digest(tmp_path / "a") != first
    (tmp_path / "a" / "y.bin").write_bytes(b"\x02")
    (tmp_path / "a" / "y.bin").rename(tmp_path / "a" / "z.bin")
    assert files_digest(tmp_path / "a") != first
    assert files_digest(tmp_path / "a" / "x.bin") != files_digest(tmp_path / "a" / "z.bin")
