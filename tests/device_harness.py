"""A device-faithful stand-in for an accelerator, on a CPU-only machine.

The real code runs with its tensors on a device that is not the CPU (`fakegpu`, PyTorch's
PrivateUse1 backend renamed), while every value is computed on the CPU underneath. The harness
fails the way CUDA fails, and counts what CUDA would make the host wait for:

* **device rules**: every op on a `fakegpu` tensor is first run on `meta` shadows of its
  arguments (the CPU arguments kept as they are), so PyTorch's own cross-device checks decide:
  `torch.stack` / `torch.cat` / `matmul` of a device and a CPU tensor raise as on CUDA, a 0-dim
  CPU scalar in an elementwise op passes as on CUDA. A random op must get a generator of the
  tensor's device (`torch.Generator("fakegpu")` makes one), as CUDA demands.
* **host syncs**: each device-to-host read is counted by kind (`item`: `.item()`, `int()`, a
  Python `if` on a tensor; `to_host`: `.cpu()`, `.tolist()`, `.numpy()`, a copy into a CPU
  tensor; `data_dependent`: `nonzero`, boolean-mask indexing, `unique`, ... whose output shape
  the host must learn), with the Python stack of each for the report.

Nothing here knows the project: it is a context manager any test enters around real code
(`with FakeDevice() as dev: engine = Engine.from_pretrained(..., device=dev.device)`). What it
cannot show (CUDA graphs, streams, pinned memory, kernels, compiled code) is listed in
docs/GPU.md with how each is checked.
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE_TYPE = "fakegpu"
aten = torch.ops.aten


@functools.cache
def _install() -> torch.device:
    """Register `fakegpu` as PyTorch's PrivateUse1 backend, with the device module, hooks and
    device guard PyTorch's Python bindings look up (PyTorch's own Python-backend setup), once."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE)
    module = getattr(torch, DEVICE_TYPE)
    module.synchronize = lambda device=None: None
    # autocast (which activation checkpointing re-enters in backward) asks the device module
    module.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    module.is_bf16_supported = lambda including_emulation=True: True
    return torch.device(DEVICE_TYPE, 0)


def _is_fake_device(device: object) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device).type == DEVICE_TYPE
    except (RuntimeError, TypeError):
        return False


class DeviceTensor(torch.Tensor):
    """A tensor on `fakegpu` whose values live in the CPU tensor `elem`."""

    elem: torch.Tensor
    __slots__ = ["elem"]
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> DeviceTensor:
        assert not isinstance(elem, DeviceTensor) and elem.device.type == "cpu"
        # Never an inference tensor: a view of a normal tensor taken in inference mode is a
        # normal tensor, and the wrapper of every output is made here, view or not.
        with torch.inference_mode(False):
            out = torch.Tensor._make_wrapper_subclass(
                cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
                dtype=elem.dtype, layout=elem.layout, device=_install(),
                requires_grad=elem.requires_grad,
            )
        out.elem = elem
        return out

    def __repr__(self) -> str:  # the values, then where they live
        return f"DeviceTensor({self.elem!r}, device='{DEVICE_TYPE}:0')"

    def __reduce_ex__(self, protocol):  # torch.save of a device tensor: reloads onto the device
        return (_rebuild, (self.elem,))

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        mode = _ACTIVE[-1] if _ACTIVE else None
        return _dispatch(func, args, kwargs or {}, mode)


def _rebuild(elem: torch.Tensor) -> DeviceTensor:
    return DeviceTensor(elem)


class DeviceGenerator(torch.Generator):
    """A generator of the `fakegpu` device: a CPU generator that reports the device."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _install()


_ORIGINAL_GENERATOR = torch.Generator


class _GeneratorMeta(type):
    """`torch.Generator(...)` while the harness is on: a `DeviceGenerator` for `fakegpu`;
    `isinstance(g, torch.Generator)` keeps working."""

    def __call__(cls, device: object = "cpu") -> torch.Generator:
        if _is_fake_device(device):
            return DeviceGenerator()
        return _ORIGINAL_GENERATOR(device)

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _ORIGINAL_GENERATOR)


class _Generator(metaclass=_GeneratorMeta):
    pass


class DeviceError(RuntimeError):
    """What CUDA would raise: tensors (or a generator) of two devices in one op."""


# Ops whose output shape depends on values: CUDA must read them back before it can allocate.
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
    aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
    aten.repeat_interleave.Tensor, aten.nonzero_numpy.default,
}
# Ops that return a host value.
_TO_HOST_SCALAR = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


def _shadow(x: object) -> object:
    if isinstance(x, DeviceTensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


def _check_devices(func, args, kwargs) -> None:
    """Run `func` on meta shadows: PyTorch's own cross-device checks raise as on CUDA."""
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    if "device" in kwargs and _is_fake_device(kwargs["device"]):
        kwargs["device"] = torch.device("meta")
    try:
        with torch._C._DisableTorchDispatch():
            func(*tree_map(_shadow, args), **tree_map(_shadow, kwargs))
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        message = str(err)
        if "device" in message and ("meta" in message or "cpu" in message) and (
                "expected" in message.lower() or "same device" in message
                or "two devices" in message):
            raise DeviceError(f"{func}: {message.replace('meta', DEVICE_TYPE)}") from None
        # no meta kernel, or a value-dependent op: the device rule is checked where it runs


def _check_generator(func, args, kwargs) -> None:
    """A random op draws from a generator of its tensors' device (checked where the Python
    generator object is still itself: the dispatcher sees a plain `torch.Generator`)."""
    flat, _ = tree_flatten((args, kwargs))
    gens = [x for x in flat if isinstance(x, _ORIGINAL_GENERATOR)]
    if not gens:
        return
    gen = gens[0]
    on_device = any(isinstance(x, DeviceTensor) for x in flat) or _is_fake_device(
        kwargs.get("device"))
    if on_device and not isinstance(gen, DeviceGenerator):
        raise DeviceError(f"{func}: Expected a '{DEVICE_TYPE}' device type for generator but "
                          f"found '{gen.device.type}'")
    if not on_device and isinstance(gen, DeviceGenerator):
        raise DeviceError(f"{func}: Expected a 'cpu' device type for generator but found "
                          f"'{DEVICE_TYPE}'")


def _unwrap(x: object) -> object:
    if isinstance(x, DeviceTensor):
        return x.elem
    if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
        return torch.device("cpu")
    return x


def _dispatch(func, args, kwargs, mode: FakeDevice | None):
    flat, _ = tree_flatten((args, kwargs))
    on_device = [x for x in flat if isinstance(x, DeviceTensor)]
    to_device = _is_fake_device(kwargs.get("device"))
    if not on_device and not to_device:
        return func(*args, **kwargs)
    _check_devices(func, args, kwargs)
    kind = None
    if func in _TO_HOST_SCALAR:
        kind = "item"
    elif func in _DATA_DEPENDENT or (func is aten.index.Tensor and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])):
        kind = "data_dependent"
    elif func in (aten._to_copy.default, aten.to.dtype_layout) and "device" in kwargs \
            and not to_device:
        kind = "to_host"
    elif func is aten.copy_.default and not isinstance(args[0], DeviceTensor):
        kind = "to_host"
    if kind is not None and mode is not None:
        mode.record(kind, func)
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if kind == "to_host" or func in _TO_HOST_SCALAR or (
            "device" in kwargs and kwargs["device"] is not None and not to_device):
        return out  # on the host, or on the device the op was asked for (cpu, meta)
    inputs = {id(x.elem): x for x in on_device}

    def wrap(x: object) -> object:
        if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor) \
                and x.device.type == "cpu":
            # in-place and out= ops hand back their own argument: the same wrapper
            same = inputs.get(id(x))
            return same if same is not None else DeviceTensor(x)
        return x

    return tree_map(wrap, out)


class _ToDevice(torch.autograd.Function):
    """A host-to-device copy that autograd can see through (the gradient comes back to host)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> DeviceTensor:
        return DeviceTensor(x.detach().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.elem if isinstance(grad, DeviceTensor) else grad


def to_device(x: torch.Tensor) -> torch.Tensor:
    """Copy a CPU tensor onto `fakegpu` (what `.to("cuda")` does)."""
    if isinstance(x, DeviceTensor):
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _ToDevice.apply(x)
    return DeviceTensor(x.detach().clone())


_CREATE = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy}


class _FunctionMode(TorchFunctionMode):
    """Moves to `fakegpu` the calls that never reach the dispatcher with that device
    (`Tensor.to`, `torch.tensor(..., device=)`, `Module.to` through them)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_generator(func, args, kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args and isinstance(
                args[0], torch.Tensor):
            target = _to_target(func, args, kwargs)
            if target is not None and _is_fake_device(target[0]):
                device, dtype, non_blocking, copy, memory_format = target
                x = args[0]
                if isinstance(x, DeviceTensor):
                    out = x if dtype is None or dtype == x.dtype else x.to(dtype)
                    return out.clone() if copy and out is x else out
                if dtype is not None:
                    x = x.to(dtype)
                return to_device(x)
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and args and isinstance(
                args[0], DeviceTensor):
            if _ACTIVE:
                _ACTIVE[-1].record("to_host", func)
            return func(args[0].elem, *args[1:], **kwargs)
        if func in _CREATE and _is_fake_device(kwargs.get("device")):
            made = func(*args, **{**kwargs, "device": "cpu"})
            return to_device(made)
        return func(*args, **kwargs)


def _to_target(func, args, kwargs):
    """(device, dtype, non_blocking, copy, memory_format) of a `Tensor.to` / `.cuda` call."""
    if func is torch.Tensor.cuda:
        return (_install(), None, False, False, None)
    rest = args[1:]
    copy = kwargs.get("copy", False)
    kw = {k: v for k, v in kwargs.items() if k != "copy"}
    if rest and isinstance(rest[0], torch.Tensor):
        return (rest[0].device, rest[0].dtype, kw.get("non_blocking", False), copy, None)
    try:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kw)
    except (RuntimeError, TypeError):
        # "fakegpu" strings are parsed as devices all the same
        return None
    return (device, dtype, non_blocking, copy, memory_format)


class _DispatchMode(TorchDispatchMode):
    """Sends every op that touches `fakegpu` (a tensor or a `device=` argument) through the
    device rules and the sync counter, and computes it on the CPU."""

    def __init__(self, owner: FakeDevice) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {}, self.owner)


_ACTIVE: list[FakeDevice] = []


class FakeDevice:
    """`with FakeDevice() as dev:` runs code with `dev.device` as its accelerator.

    `dev.syncs` counts host syncs by kind; `dev.sync_sites` keeps where each happened (the
    innermost project frames); `dev.counting()` scopes a count (see `SyncCount`).
    """

    def __init__(self) -> None:
        self.device = _install()
        self.syncs: Counter[str] = Counter()
        self.sync_sites: list[tuple[str, str, str]] = []
        self._modes: list[object] = []

    def record(self, kind: str, func: object) -> None:
        self.syncs[kind] += 1
        stack = [f for f in traceback.extract_stack() if "/torch/" not in f.filename
                 and not f.filename.endswith("device_harness.py")]
        ours = [f for f in stack if "dspine_train" in f.filename or "data_prep" in f.filename]
        where = f"{ours[-1].filename.split('/')[-1]}:{ours[-1].lineno}" if ours else "?"
        if stack and ours and stack[-1] is not ours[-1]:  # inside a library: name it too
            where += f" <- {'/'.join(stack[-1].filename.split('/')[-2:])}:{stack[-1].lineno}"
        self.sync_sites.append((kind, str(func), where))

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    @contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        """The syncs made inside the block, by kind (a fresh Counter filled on exit)."""
        before, sites = Counter(self.syncs), len(self.sync_sites)
        result: Counter[str] = Counter()
        try:
            yield result
        finally:
            result.update(self.syncs - before)
            result.sites = self.sync_sites[sites:]  # type: ignore[attr-defined]

    def __enter__(self) -> FakeDevice:
        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("FakeDevice cannot nest inside another dispatch mode")
        function_mode, dispatch_mode = _FunctionMode(), _DispatchMode(self)
        function_mode.__enter__()
        dispatch_mode.__enter__()
        # Backward on the calling thread: autograd's device threads would run it outside these
        # (thread-local) modes; CUDA runs it on its own thread, which changes no value.
        threads = torch.autograd.set_multithreading_enabled(False)
        threads.__enter__()
        self._modes = [threads, function_mode, dispatch_mode]
        torch.Generator = _Generator  # type: ignore[misc]
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        torch.Generator = _ORIGINAL_GENERATOR  # type: ignore[misc]
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []


def host(x: object) -> object:
    """The CPU values of a (nest of) device tensors, outside any count: for test assertions."""
    return tree_map(lambda t: t.elem.clone() if isinstance(t, DeviceTensor) else t, x)


class CudaDevice:
    """The same interface on a real CUDA device (`make gpu-check`): syncs are those CUDA
    itself reports (`torch.cuda.set_sync_debug_mode("warn")` warns once per synchronizing
    call), by the kind "cuda"."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.syncs: Counter[str] = Counter()
        self.sync_sites: list[tuple[str, str, str]] = []

    @contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        import warnings

        result: Counter[str] = Counter()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            hits = [w for w in caught if "synchroniz" in str(w.message)]
            result["cuda"] += len(hits)
            self.syncs["cuda"] += len(hits)
            result.sites = [("cuda", str(w.message)[:80], f"{w.filename.split('/')[-1]}:{w.lineno}")
                            for w in hits]  # type: ignore[attr-defined]

    def __enter__(self) -> CudaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def accelerator(kind: str) -> FakeDevice | CudaDevice:
    """`fakegpu` (this harness, any machine) or `cuda` (a real device)."""
    if kind == DEVICE_TYPE:
        return FakeDevice()
    if kind == "cuda":
        return CudaDevice()
    raise ValueError(f"unknown device kind {kind!r} (fakegpu or cuda)")
