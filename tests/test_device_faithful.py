"""The CUDA paths, run for real on an accelerator: the device-faithful harness (`fakegpu`, any
machine: `device_harness.py`) in `make test`, and a real CUDA device in `make gpu-check`.

Each test runs the product's own code (the trainer through accelerate and DeepSpeed, every kind
of engine round, the engine CLI and the evaluation harness) with its tensors on the device, so a
CPU tensor mixed into a device op fails here as it fails on CUDA, and counts the host syncs
that a round or a micro-batch makes against the documented budget.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from _engine_helpers import build_tiny_target, build_tokenizer, hf_greedy, tiny_draft
from _train_helpers import REPO, check_ok, read_metrics, run_module, tiny_overrides
from device_harness import DEVICE_TYPE, DeviceError, FakeDevice, accelerator

from dspine_train.engine import Engine
from dspine_train.engine.ngram import NgramConfig
from dspine_train.training.trainer import MICRO_BATCH_SYNCS

DEVICES = [DEVICE_TYPE, pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]
NEW = 12


# ------------------------------------------------------------------------------ the harness
def test_the_harness_fails_where_cuda_fails_and_counts_host_reads() -> None:
    with FakeDevice() as dev:
        x = torch.arange(4.0, device=dev.device)
        assert x.device.type == DEVICE_TYPE and (x * torch.tensor(2.0)).device == x.device
        with pytest.raises(DeviceError, match="not on the expected device"):
            torch.stack([x, torch.zeros(4)])  # what the trainer's metrics did on CUDA
        with pytest.raises(DeviceError):
            x + torch.ones(4)
        with pytest.raises(DeviceError, match="generator"):
            torch.rand(2, device=dev.device, generator=torch.Generator().manual_seed(0))
        gen = torch.Generator(dev.device).manual_seed(0)
        assert torch.rand(2, device=dev.device, generator=gen).device == x.device
        with dev.counting() as syncs:
            x.sum().item()
            x.tolist()
            x.cpu()
            x[x > 1]
            if (x > 2).any():
                pass
        assert syncs == Counter(item=2, to_host=2, data_dependent=1)


# ------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_engine")
    hf = build_tiny_target(root / "target", "qwen3", head_scale=4.0, eos_token_id=None)
    tok = build_tokenizer(root / "target", vocab_size=200)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(root / "target")
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    (root / "prompts.jsonl").write_text('"w1 w2 w3"\n"w4 w5"\n')
    reference = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return root, reference


@pytest.fixture(params=DEVICES)
def dev(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with accelerator(request.param) as device:
        yield device


def _engine(root: Path, dev, **kwargs) -> Engine:
    return Engine.from_pretrained(root / "target", root / "draft", device=dev.device,
                                  dtype=torch.float32, max_batch_size=4, max_seq_len=128,
                                  eos_token_ids=[], kv_bucket_size=32, **kwargs)


ROUNDS = [  # (name, tree paths, temperature, speculative, n-gram candidates)
    ("plain decoding", 1, 0.0, False, False),
    ("greedy chain", 1, 0.0, True, False),
    ("sampling chain", 1, 1.0, True, False),
    ("greedy tree", 3, 0.0, True, False),
    ("sampling tree", 3, 1.0, True, False),
    ("greedy hybrid", 2, 0.0, True, True),
    ("sampling hybrid", 1, 1.0, True, True),
]


@pytest.mark.parametrize("name,paths,temperature,speculative,ngram", ROUNDS,
                         ids=[r[0] for r in ROUNDS])
def test_every_round_runs_on_the_device_with_one_host_read(files, dev, name, paths, temperature,
                                                           speculative, ngram) -> None:
    root, reference = files
    engine = _engine(root, dev, tree_paths=paths, ngram=NgramConfig() if ngram else None)
    run = engine.generate if speculative else engine.generate_ar
    with dev.counting() as syncs:
        out = run(PROMPTS, max_new_tokens=NEW, chat=False, temperature=temperature, seed=3)
    assert [len(t) for t in out.token_ids] == [NEW] * len(PROMPTS)
    if temperature == 0.0:
        assert out.token_ids == reference  # lossless on the device
    # the prefill's first-token read, then one read of the acceptance per round
    assert sum(syncs.values()) <= out.stats.steps + 1, syncs.sites
    if dev.device.type == DEVICE_TYPE:
        assert sum(syncs.values()) == out.stats.steps + 1, syncs.sites


def test_warmup_and_commit_run_on_the_device_without_host_reads(files, dev) -> None:
    root, reference = files
    engine = _engine(root, dev, tree_paths=2)
    with dev.counting() as syncs:
        engine.warmup(batch_sizes=[1, 3], num_draft_tokens=[0, 7])
        engine.warmup(batch_sizes=[1, 3], num_draft_tokens=[7], temperature=1.0)
    assert sum(syncs.values()) == 0, syncs.sites
    assert engine.generate(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference


def test_ngram_mode_and_adaptive_rounds_add_no_host_read(files, dev) -> None:
    """The n-gram proposals are found on the host and copied in; an adaptive engine measures
    its round costs at warmup (outside the counted call) and then reads once per round."""
    root, reference = files
    for draft in (False, True):
        engine = Engine.from_pretrained(
            root / "target", root / "draft" if draft else None, device=dev.device,
            dtype=torch.float32, max_batch_size=4, max_seq_len=128, eos_token_ids=[],
            kv_bucket_size=32, ngram=NgramConfig(), adaptive=True)
        engine.warmup(batch_sizes=[len(PROMPTS)], num_draft_tokens=[7] if draft else None)
        with dev.counting() as syncs:
            out = engine.generate(PROMPTS, max_new_tokens=NEW, chat=False)
        assert out.token_ids == reference
        assert sum(syncs.values()) <= out.stats.steps + 1, syncs.sites
        if dev.device.type == DEVICE_TYPE:
            assert sum(syncs.values()) == out.stats.steps + 1, syncs.sites


def test_the_cli_and_the_evaluation_harness_run_on_the_device(files, dev, capsys) -> None:
    from data_prep.benchmarks import Benchmark
    from dspine_train.engine.cli import main
    from dspine_train.evaluation.harness import evaluate

    root, _ = files
    out = root / f"cli_{dev.device.type}.json"
    argv = ["--target", str(root / "target"), "--draft", str(root / "draft"), "--prompts",
            str(root / "prompts.jsonl"), "--no-chat", "--max-new-tokens", "6", "--batch-size",
            "2", "--max-seq-len", "32", "--device", str(dev.device), "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["stats"]["num_sequences"] == 2
    bench = Benchmark("tiny", [[{"role": "user", "content": "w1 w2 w3"}]] * 2, ["0", "1"], {})
    results = evaluate(root / "target", root / "draft", [bench], [0.0, 1.0], max_new_tokens=8,
                       device=str(dev.device))
    assert [r.lossless for r in results] == [True, None]


# ------------------------------------------------------------------------------ the trainer
def _device_train(dev_kind: str, report: Path, overrides: list[str]):
    return run_module([str(REPO / "tests" / "device_train.py"), "--device", dev_kind,
                       "--report", str(report), "--", *overrides], timeout=600)


def _check_micro_batch_syncs(report: dict) -> None:
    """Every micro-batch reads the host `MICRO_BATCH_SYNCS` times itself; the libraries below
    it only in the documented places (docs/GPU.md): transformers' padding-mask check of the
    online target, DeepSpeed's gradient-norm checks at the accumulation boundary."""
    sites = report["first_micro_batch_sites"]
    ours = [s for s in sites if " <- " not in s[2]]
    theirs = Counter(s[2].split(" <- ")[1].split(":")[0] for s in sites if " <- " in s[2])
    assert len(ours) == MICRO_BATCH_SYNCS, sites
    assert set(theirs) <= {"transformers/masking_utils.py", "runtime/utils.py"}, sites
    assert theirs["transformers/masking_utils.py"] <= 2 and theirs["runtime/utils.py"] <= 3
    if report["device"].startswith(DEVICE_TYPE):
        assert len(set(report["micro_batch_syncs"])) == 1  # every micro-batch alike


TRAIN_STEPS, HALF = 4, 2
EVERY_TERM = ["model.distill=true", "model.refine_weight=1.0", "model.alignment_weight=0.5",
              "model.token_ce_intermediate=true"]


@pytest.fixture(scope="module", params=DEVICES)
def device_run(request, tiny_assets, tmp_path_factory):
    """The tiny recipe on the device, online target, every objective term on: 4 steps with a
    logged step, an evaluation and a checkpoint every 2, then the export."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    root = tmp_path_factory.mktemp(f"device_run_{request.param}")
    overrides = tiny_overrides(tiny_assets, root / "run", f"optim.max_steps={TRAIN_STEPS}",
                               f"logging.log_every={HALF}", f"eval.every={HALF}",
                               f"checkpoint.every={HALF}", "data.num_anchors=32", *EVERY_TERM)
    proc = _device_train(request.param, root / "report.json", overrides)
    check_ok(proc)
    return request.param, root, overrides, json.loads((root / "report.json").read_text())


def test_training_steps_evaluates_checkpoints_and_exports_on_the_device(device_run) -> None:
    kind, root, _, report = device_run
    assert report["steps"] == TRAIN_STEPS and report["device"].startswith(kind)
    rows = read_metrics(root / "run")
    assert [r["step"] for r in rows if "loss" in r] == [HALF, TRAIN_STEPS]
    assert all("alignment_beta" in r and "token_ce_intermediate" in r for r in rows if "loss" in r)
    assert [r["step"] for r in rows if "eval/tau" in r] == [HALF, TRAIN_STEPS]
    assert (root / "run" / "final" / "model.safetensors").is_file()
    _check_micro_batch_syncs(report)
    # online distillation: the target's distribution projected once per position, never once
    # per block slot (32 anchors x 7 slots overlap: 4x the positions of a batch)
    assert 0 < report["target_head_rows"][0] <= report["micro_batch_positions"][0]
    assert report["target_head_rows"] == report["micro_batch_positions"]


def test_a_resumed_device_run_repeats_the_uninterrupted_one(device_run, tmp_path) -> None:
    kind, root, overrides, _ = device_run
    from dspine_train.training.checkpointing import checkpoint_name

    ckpt = root / "run" / "checkpoints" / checkpoint_name(HALF)
    resumed = [o for o in overrides if not o.startswith("output_dir=")]
    check_ok(_device_train(kind, tmp_path / "report.json", [
        *resumed, f"output_dir={tmp_path / 'run'}", f"checkpoint.resume_from={ckpt}"]))
    full = {r["step"]: r["loss"] for r in read_metrics(root / "run") if "loss" in r}
    again = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert again == {TRAIN_STEPS: full[TRAIN_STEPS]}


@pytest.mark.parametrize("kind", DEVICES)
def test_training_from_cached_features_runs_on_the_device(kind, tiny_assets, tmp_path) -> None:
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    features = tmp_path / "features"
    overrides = tiny_overrides(tiny_assets, tmp_path / "run", "optim.max_steps=2",
                               "logging.log_every=1", "eval.every=2", *EVERY_TERM[:3],
                               f"data.offline_features_dir={features}")
    check_ok(run_module(["-m", "dspine_train.training.cache_features", *overrides]))
    proc = _device_train(kind, tmp_path / "report.json", overrides)
    check_ok(proc)
    assert "cached once per token" in proc.stdout
    _check_micro_batch_syncs(json.loads((tmp_path / "report.json").read_text()))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("method", ["dspark", "dflash2", "domino"])
def test_the_other_methods_train_on_the_device(kind, method, tiny_assets, tmp_path) -> None:
    """DSpark, DFlash2 and Domino (their objectives make the vocabulary gradient in forward,
    `*VocabTerms`) train, evaluate and export with every tensor on the device, and each
    micro-batch reads the host the same number of times."""
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    overrides = tiny_overrides(tiny_assets, tmp_path / "run", f"model.method={method}",
                               "optim.max_steps=3", "logging.log_every=1", "eval.every=3")
    proc = _device_train(kind, tmp_path / "report.json", overrides)
    check_ok(proc)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == 3 and report["device"].startswith(kind)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/tau" in r] == [3]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    if kind == DEVICE_TYPE:
        assert len(set(report["micro_batch_syncs"])) == 1, report["micro_batch_syncs"]


# ------------------------------------------------------------------------------ compilation
@pytest.mark.slow
def test_the_engine_steps_compile_with_inductor_and_stay_lossless(files) -> None:
    """The steps compiled by inductor, the backend CUDA uses (here it generates C++ for the
    CPU): a lowering failure (an op inductor cannot lower, a graph break under fullgraph)
    shows up here, not on a user's GPU. Strict: a failed compile raises."""
    root, reference = files
    engine = Engine.from_pretrained(root / "target", root / "draft", device="cpu",
                                    dtype=torch.float32, max_batch_size=4, max_seq_len=128,
                                    eos_token_ids=[], kv_bucket_size=128, compile=True,
                                    compile_backend="inductor", strict_graphs=True)
    assert engine.generate_ar(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference
    assert engine.generate(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference
    engine.configure_tree(3)
    assert engine.generate(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference
    sampled = engine.generate(PROMPTS, max_new_tokens=NEW, chat=False, temperature=1.0, seed=1)
    assert [len(t) for t in sampled.token_ids] == [NEW] * len(PROMPTS)
    compiled = [s for s in engine._steps() if s.compiled]
    assert compiled and all(s.capture_s > 0 for s in compiled if s._compiled_keys)
