"""bfloat16 on CPUs: whether a CPU computes it natively, and fast matrix products where it does not.

A bfloat16 matrix product (a GEMM: `linear`, `matmul`, `bmm`, ...) multiplies bf16 operands,
accumulates in float32 and rounds the result to bf16 once. CPUs with AVX512-BF16 or AMX do that
in hardware. Elsewhere (an AVX2 CPU such as AMD Zen 3) PyTorch falls back to a generic kernel
that is ~6x slower than a float32 product of the same size (0.68 s against 0.11 s for a
512x896 by 896x4864 product on one 2026-12-07 AMD EPYC core). `bf16_matmuls` computes
those products from the same bf16 operands in float32 and rounds the result once: the same
semantics at float32 speed. Results differ from the fallback only where float32 sums in another
order round to another bf16 value (one unit in the last place, ~0.01% of elements above), the
difference there already is between two machines' bf16 kernels. Everything else (norms,
activations, softmax, parameters, gradients) stays in bf16, so a bf16 model trains and caches
features as it does elsewhere.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from dspine_train.py_compat import StrEnum

# CPU feature flags (/proc/cpuinfo) of native bfloat16 arithmetic: x86 AVX512-BF16 and AMX,
# Arm's BF16 extension. (oneDNN's own check also accepts plain AVX-512, where bf16 is emulated.)
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def native_bf16(device: torch.device, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether ``device`` computes bfloat16 natively: CUDA, or a CPU with one of
    `BF16_CPU_FLAGS` (there a bfloat16 target answers ~6x faster than a float32 one, measured
    on AMX; elsewhere bfloat16 is emulated and not faster). False where the flags cannot be
    read (a system without /proc/cpuinfo)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = {flag for line in text.splitlines()
             if line.split(":")[0].strip() in ("flags", "Features")
             for flag in line.partition(":")[2].split()}
    return bool(flags & BF16_CPU_FLAGS)


class Bf16Matmul(StrEnum):
    """How bf16 matrix products run on a CPU (`TrainConfig.cpu_bf16_matmul`).

    auto: `float32` on a CPU without native bf16 (`native_bf16`), `native` elsewhere.
    float32: from the bf16 operands in float32, the result rounded to bf16 once.
    native: PyTorch's own bf16 kernels.
    """

    auto = "auto"
    float32 = "float32"
    native = "native"


# What a run prints when its bf16 products run in float32 (`bf16_matmuls`).
FLOAT32_NOTICE = ("bf16 matrix products run in float32, rounded once (this CPU has no native "
                  "bf16; cpu_bf16_matmul=native keeps PyTorch's slower kernels)")


def resolve_bf16_matmul(setting: Bf16Matmul | str, device: torch.device) -> Bf16Matmul:
    """`setting` with `auto` decided for `device` (CUDA is always `native`)."""
    setting = Bf16Matmul(setting)
    if device.type != "cpu":
        return Bf16Matmul.native
    if setting == Bf16Matmul.auto:
        return Bf16Matmul.native if native_bf16(device) else Bf16Matmul.float32
    return setting


# The products a model's forward and backward run through (`nn.Linear` calls `linear`).
_PRODUCTS = frozenset({
    torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
    torch.addmm, torch.baddbmm, torch.einsum,
})


def _cpu_bf16(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16
            and value.device.type == "cpu")


# The float32 copies of operands autograd does not track (a frozen head, a target's weights)
# are kept for reuse while their tensor lives unchanged, up to this many bytes (least recently
# used first out): a draft's objective multiplies the same 151936-row head chunk after chunk,
# and copying it each time took a quarter of a DSpark step. Smaller operands are copied anew.
REUSED_COPIES_BYTES = 4 << 30
REUSED_COPY_MIN_BYTES = 1 << 20


class _Float32Copies:
    """float32 copies of bf16 tensors, reused while the tensor lives with the same version."""

    def __init__(self, budget: int) -> None:
        self.budget, self.bytes = budget, 0
        self.entries: OrderedDict[int, tuple[weakref.ref, int, torch.Tensor]] = OrderedDict()

    def __call__(self, value: Any) -> Any:
        if not _cpu_bf16(value):
            return value
        tracked = value.requires_grad and torch.is_grad_enabled()
        if tracked or value.numel() * 4 < REUSED_COPY_MIN_BYTES:
            return value.float()
        key = id(value)
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is value and entry[1] == value._version:
            self.entries.move_to_end(key)
            return entry[2]
        self._drop(key)
        copy = value.float()
        if copy.nbytes <= self.budget:
            self.entries[key] = (weakref.ref(value, lambda _, key=key: self._drop(key)),
                                 value._version, copy)
            self.bytes += copy.nbytes
            while self.bytes > self.budget:
                self._drop(next(iter(self.entries)))
        return copy

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[2].nbytes


class _Float32Products(TorchFunctionMode):
    """Runs each product whose tensor operands are all CPU bf16 in float32, rounded once."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = _Float32Copies(REUSED_COPIES_BYTES)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in _PRODUCTS and "out" not in kwargs:
            tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
            if tensors and all(_cpu_bf16(t) for t in tensors):
                args, kwargs = tree_map(self.copies, (args, kwargs))
                return func(*args, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


@contextlib.contextmanager
def bf16_matmuls(setting: Bf16Matmul | str, device: torch.device) -> Iterator[Bf16Matmul]:
    """Within the block, bf16 products on `device` run as `setting` resolves (yielded)."""
    mode = resolve_bf16_matmul(setting, device)
    if mode != Bf16Matmul.float32:
        yield mode
        return
    with _Float32Products():
        yield mode
