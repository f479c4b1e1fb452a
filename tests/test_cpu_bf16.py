"""bf16 matrix products on a CPU without native bf16 (`dspine_train/cpu_bf16.py`): computed in
float32 from the bf16 operands and rounded once, gradients included; everything else untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dspine_train import cpu_bf16
from dspine_train.cpu_bf16 import Bf16Matmul, bf16_matmuls, resolve_bf16_matmul

CPU = torch.device("cpu")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_each_product_is_float32_math_rounded_once() -> None:
    x, w, b = _bf16(5, 48, seed=0), _bf16(40, 48, seed=1), _bf16(40, seed=2)
    a, c = _bf16(3, 5, 48, seed=3), _bf16(3, 48, 7, seed=4)
    cases = {
        "linear": (lambda: F.linear(x, w, b), F.linear(x.float(), w.float(), b.float())),
        "linear without bias": (lambda: F.linear(x, w), x.float() @ w.float().T),
        "@": (lambda: x @ w.T, x.float() @ w.float().T),
        "matmul": (lambda: torch.matmul(a, c), torch.matmul(a.float(), c.float())),
        "bmm": (lambda: a.bmm(c), torch.bmm(a.float(), c.float())),
        "einsum": (lambda: torch.einsum("bij,bjk->bik", a, c), a.float() @ c.float()),
    }
    with bf16_matmuls("float32", CPU) as mode:
        assert mode == Bf16Matmul.float32
        got = {name: run() for name, (run, _) in cases.items()}
    for name, (_, want) in cases.items():
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], want.bfloat16()), name


def test_other_products_and_the_native_setting_are_left_alone() -> None:
    x, w = _bf16(64, 96, seed=0), _bf16(80, 96, seed=1)
    x32, w32 = x.float() * 1.001, w.float()  # float32 values no bf16 holds
    with bf16_matmuls("float32", CPU):
        float32 = F.linear(x32, w32)
        with pytest.raises(RuntimeError):  # mixed dtypes fail as they do without the mode
            F.linear(x, w32)
    assert torch.equal(float32, F.linear(x32, w32))
    with bf16_matmuls("native", CPU) as mode:
        native = F.linear(x, w)
    assert mode == Bf16Matmul.native and torch.equal(native, F.linear(x, w))


def test_bf16_parameters_get_bf16_gradients_of_float32_products() -> None:
    layer = torch.nn.Linear(48, 32).bfloat16()
    x, target = _bf16(6, 48, seed=0).requires_grad_(), _bf16(6, 32, seed=1)
    with bf16_matmuls("float32", CPU):
        F.mse_loss(layer(x), target).backward()
    # the same computation, written out: float32 products of the bf16 values, cast back
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    out = F.linear(x2.float(), w.float(), b.float()).bfloat16()
    F.mse_loss(out, target).backward()
    for got, want in ((layer.weight.grad, w.grad), (layer.bias.grad, b.grad), (x.grad, x2.grad)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_a_bf16_model_is_as_close_to_its_float32_self_as_with_native_products() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config).eval()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = model(ids, output_hidden_states=True).hidden_states
        model.bfloat16()
        errors = {}
        for setting in ("native", "float32"):
            with bf16_matmuls(setting, CPU):
                states = model(ids, output_hidden_states=True).hidden_states
            errors[setting] = max(float((s.float() - e).norm() / e.norm())
                                  for s, e in zip(states, exact, strict=True))
    # bf16 keeps ~3 significant digits: both errors are of that size, neither much larger
    assert 0 < errors["native"] < 0.05 and 0 < errors["float32"] < 0.05
    assert errors["float32"] < 2 * errors["native"], errors


@pytest.mark.parametrize(("setting", "device", "native", "want"), [
    ("auto", "cpu", False, "float32"),
    ("auto", "cpu", True, "native"),
    ("auto", "cuda", False, "native"),
    ("float32", "cuda", False, "native"),  # CUDA computes bf16 natively: no effect there
    ("float32", "cpu", True, "float32"),
    ("native", "cpu", False, "native"),
])
def test_auto_uses_float32_products_only_on_a_cpu_without_native_bf16(
        monkeypatch, setting: str, device: str, native: bool, want: str) -> None:
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda device: native)
    assert resolve_bf16_matmul(setting, torch.device(device)) == Bf16Matmul(want)


def test_a_bad_setting_names_the_values() -> None:
    with pytest.raises(ValueError, match="fp16"):
        resolve_bf16_matmul("fp16", CPU)


def test_training_runs_under_the_configured_products(monkeypatch, capsys) -> None:
    """`run_training` trains (its evaluations included) inside the mode `cpu_bf16_matmul`
    resolves to, and says so when it is float32."""
    from torch.overrides import _get_current_function_mode_stack

    import dspine_train.training.trainer as trainer
    from dspine_train.training.config import compose_train_config

    seen = []

    class Recorder:
        def __init__(self, config) -> None:  # noqa: ANN001
            self.accelerator = SimpleNamespace(device=device)

        def train(self) -> str:
            seen.append([type(m).__name__ for m in _get_current_function_mode_stack()])
            x, w = _bf16(3, 8, seed=0), _bf16(4, 8, seed=1)
            return F.linear(x, w)

    monkeypatch.setattr(trainer, "Trainer", Recorder)
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda device: False)
    device = CPU
    x, w = _bf16(3, 8, seed=0), _bf16(4, 8, seed=1)
    out = trainer.run_training(compose_train_config("recipe=tiny", "precision=bf16"))
    assert torch.equal(out, F.linear(x.float(), w.float()).bfloat16())
    assert "bf16 matrix products run in float32" in capsys.readouterr().out
    trainer.run_training(compose_train_config("recipe=tiny", "precision=bf16", "cpu_bf16_matmul=native"))
    trainer.run_training(compose_train_config("recipe=tiny", "precision=fp32"))  # no bf16
    device = torch.device("meta")  # the accelerator's device decides: not a CPU, no mode
    trainer.run_training(compose_train_config("recipe=tiny", "precision=bf16"))
    assert seen == [["_Float32Products"], [], [], []]
    assert "bf16 matrix products" not in capsys.readouterr().out


def test_the_benchmark_times_both_settings_side_by_side(tmp_path) -> None:
    import json

    from scripts.bench_cpu_bf16 import main

    out = tmp_path / "bench.json"
    assert main(["--hidden", "32", "--intermediate", "64", "--layers", "1", "--heads", "2",
                 "--tokens", "16", "--iters", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["part"], r["setting"]): r for r in report["results"]}
    assert set(rows) == {(p, s) for p in ("forward", "forward+backward")
                         for s in ("native", "float32")}
    for (part, _), r in rows.items():
        assert len(r["runs_s"]) == 2 and r["median_s"] > 0
        native = rows[(part, "native")]["median_s"]
        assert r["speedup_vs_native"] == pytest.approx(native / r["median_s"])
    assert report["auto"] in ("native", "float32")
    assert all(0 < e < 0.05 for e in report["relative_error_vs_float32"].values())


def test_float32_copies_of_frozen_operands_are_reused_until_they_change() -> None:
    """A frozen operand (a head multiplied chunk after chunk) is copied to float32 once while it
    lives unchanged; an in-place change, or a tensor autograd tracks, gets a fresh copy."""
    head = _bf16(4096, 64, seed=0)  # 1 MiB in float32: large enough to keep
    x = _bf16(3, 64, seed=1)
    with bf16_matmuls("float32", CPU):
        mode = torch.overrides._get_current_function_mode_stack()[-1]
        first = F.linear(x, head)
        kept = [entry[2] for entry in mode.copies.entries.values()]
        assert len(kept) == 1 and torch.equal(kept[0], head.float())
        assert torch.equal(F.linear(x, head), first)
        assert [entry[2] for entry in mode.copies.entries.values()][0] is kept[0]  # reused
        head.mul_(2)  # a new version: not the old copy
        assert torch.equal(F.linear(x, head), F.linear(x.float(), head.float()).bfloat16())
        del head, kept  # a dead tensor's copy is dropped
        assert not mode.copies.entries and mode.copies.bytes == 0
        weight = _bf16(4096, 64, seed=2).requires_grad_()
        F.linear(x, weight).float().sum().backward()
        assert not mode.copies.entries and weight.grad is not None
