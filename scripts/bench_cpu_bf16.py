"""bf16 matrix products on this CPU: PyTorch's kernels against float32 products rounded once.

Times, side by side and interleaved, a bf16 Qwen2-shaped decoder (the demo target's widths,
random weights, or ``--target PATH``) under ``cpu_bf16_matmul=native`` and ``=float32``
(`dspine_train/cpu_bf16.py`): its forward without gradients (what ``cache_features`` runs on the
target) and a forward + backward with bf16 parameters (a bf16 training step). Also reports each
setting's distance to the same model in float32 (relative error of the last hidden state), and
which setting ``auto`` picks here.

    python scripts/bench_cpu_bf16.py                          # 4 layers of the demo target's width
    python scripts/bench_cpu_bf16.py --target artifacts/default_target --iters 2

Prints a table and writes JSON (``--out``, default bench_results/cpu_bf16.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from dspine_train.cpu_bf16 import Bf16Matmul, bf16_matmuls, native_bf16, resolve_bf16_matmul

SETTINGS = (Bf16Matmul.native, Bf16Matmul.float32)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The decoder stack, in float32 (the reference; the timed copy is cast to bf16)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if args.target:
        return AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).model
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=2)
    return Qwen2ForCausalLM(config).model


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a local causal LM directory (default: random weights)")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per timed forward")
    parser.add_argument("--iters", type=int, default=3, help="timed rounds of each setting")
    parser.add_argument("--out", type=Path, default=Path("bench_results/cpu_bf16.json"))
    args = parser.parse_args(argv)
    if args.iters < 1 or args.tokens < 1:
        parser.error("--iters and --tokens must be at least 1")

    reference = build_model(args).eval()
    model = copy.deepcopy(reference).bfloat16()
    ids = torch.randint(0, reference.config.vocab_size, (1, args.tokens),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = reference(ids).last_hidden_state
    del reference

    def forward(setting: Bf16Matmul) -> torch.Tensor:
        with torch.no_grad(), bf16_matmuls(setting, torch.device("cpu")):
            return model(ids).last_hidden_state

    def train_step(setting: Bf16Matmul) -> None:
        model.zero_grad(set_to_none=True)
        with bf16_matmuls(setting, torch.device("cpu")):
            model(ids).last_hidden_state.float().square().mean().backward()

    errors = {s.value: relative_error(forward(s), exact) for s in SETTINGS}  # also a warm-up
    model.requires_grad_(True)
    for setting in SETTINGS:
        train_step(setting)
    times: dict[str, dict[str, list[float]]] = {"forward": {}, "forward+backward": {}}
    for _ in range(args.iters):  # interleaved: both settings see the same machine load
        for part, run in (("forward", forward), ("forward+backward", train_step)):
            for setting in SETTINGS:
                start = time.perf_counter()
                run(setting)
                times[part].setdefault(setting.value, []).append(time.perf_counter() - start)

    rows = []
    for part, by_setting in times.items():
        native = statistics.median(by_setting["native"])
        for name, values in by_setting.items():
            median = statistics.median(values)
            rows.append({"part": part, "setting": name, "median_s": median,
                         "speedup_vs_native": native / median, "runs_s": values})
    auto = resolve_bf16_matmul(Bf16Matmul.auto, torch.device("cpu"))
    print(f"{'part':<17} {'setting':<8} {'median s':>9} {'x native':>9}")
    for r in rows:
        print(f"{r['part']:<17} {r['setting']:<8} {r['median_s']:>9.3f} "
              f"{r['speedup_vs_native']:>9.2f}")
    print("relative error of the last hidden state against float32: "
          + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()))
    print(f"native bf16 on this CPU: {native_bf16(torch.device('cpu'))}; "
          f"cpu_bf16_matmul=auto picks {auto.value}")
    report = {"results": rows, "relative_error_vs_float32": errors, "auto": auto.value,
              "native_bf16": native_bf16(torch.device("cpu")),
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "machine": platform.platform(), "cpu": platform.processor()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
