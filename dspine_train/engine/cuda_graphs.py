"""Compiled, CUDA-graph-captured engine steps (CUDA; the CPU runs the same functions eager).

A step is a function of tensors whose shapes never change between calls (a verify forward over
`(B, g + 1)` tokens, a draft block for `B` anchors, a commit of `B` rows) plus static Python
arguments (the kv-length bucket), and that reads everything else from buffers updated in place
(KV caches, lengths, the engine's `active` flags). On CUDA it is compiled with `torch.compile`
(default mode: inductor fuses the small ops, and our own capture below replaces the
"reduce-overhead" graphs) and captured once per (shapes, static arguments); a replay copies new
inputs into the static input buffers and launches the whole step at once. All captures share one
graph memory pool: steps replay one after another, never concurrently, so their intermediates may
share memory, while each step's outputs stay referenced and are never reused.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

StepFn = Callable[..., tuple[torch.Tensor | None, ...]]


class GraphCaptureError(RuntimeError):
    """A step could not be compiled or captured (raised when the engine is `strict_graphs`)."""


class GraphedStep:
    """`fn(*inputs, **static)` captured as a CUDA graph at the shapes of `example_inputs`.

    Outputs are static tensors overwritten by the next replay: consume them before calling again.
    The warm-up runs (which also trigger compilation) happen on a side stream, as capture
    requires. They really run `fn`: the tensors `state()` returns (what `fn` updates in place,
    e.g. committed lengths) are saved before and restored after, so capturing a step leaves the
    engine as it was (writes past the committed lengths need no restoring: nothing reads them).
    """

    def __init__(
        self,
        fn: StepFn,
        example_inputs: tuple[torch.Tensor, ...],
        static: dict[str, Any],
        pool: Any,
        state: Callable[[], tuple[torch.Tensor, ...]] | None = None,
        warmup: int = 2,
    ) -> None:
        self.inputs = tuple(x.clone() for x in example_inputs)
        saved = [t.clone() for t in state()] if state is not None else []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*self.inputs, **static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs, **static)
        if state is not None:
            for tensor, value in zip(state(), saved, strict=True):
                tensor.copy_(value)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new)
        self.graph.replay()
        return self.outputs


class StepCache:
    """One engine step: compiled (optionally) and graphed per shape (optionally).

    `graphs=False` runs `fn` (compiled or not) eagerly. A compile or capture failure raises
    `GraphCaptureError` when `strict`, and otherwise warns loudly and falls back to the plain
    eager `fn` for this step. `capture_s` accumulates the seconds spent compiling/capturing, so
    callers can keep it out of their timings (`prepare` captures ahead of a timed call; without
    graphs a compiled step compiles in its first call per shape, whose whole time is counted).
    `state` names the tensors `fn` updates in place (see `GraphedStep`).
    """

    def __init__(
        self,
        fn: StepFn,
        name: str,
        *,
        graphs: bool,
        compile: bool = False,
        strict: bool = False,
        pool: Any = None,
        compile_backend: str = "inductor",
        state: Callable[[], tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        self.raw_fn = fn
        self.state = state
        self.fn = torch.compile(fn, fullgraph=True, backend=compile_backend) if compile else fn
        self.compiled = compile
        self.enabled = graphs
        self.strict = strict
        self.name = name
        self.pool = pool
        self.capture_s = 0.0
        self._steps: dict[Hashable, GraphedStep] = {}
        self._compiled_keys: set[Hashable] = set()

    @staticmethod
    def _key(inputs: tuple[torch.Tensor, ...], static: dict[str, Any]) -> Hashable:
        return tuple(tuple(x.shape) for x in inputs), tuple(sorted(static.items()))

    def _fail(self, err: Exception) -> None:
        message = f"{'compile' if self.compiled else 'CUDA-graph capture'} of the {self.name} step failed ({err})"
        if self.strict:
            raise GraphCaptureError(message) from err
        warnings.warn(f"{message}; running it eager from now on", RuntimeWarning, stacklevel=3)
        self.enabled, self.compiled, self.fn = False, False, self.raw_fn

    def prepare(self, *inputs: torch.Tensor, **static: Any) -> None:
        """Compile and capture the step at these shapes now (no-op if done or eager)."""
        key = self._key(inputs, static)
        if self.enabled and key not in self._steps:
            start = time.perf_counter()
            try:
                self._steps[key] = GraphedStep(self.fn, inputs, static, self.pool, self.state)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - any compile/capture failure is reported
                self._fail(err)
            self.capture_s += time.perf_counter() - start

    def _call_eager(
        self, inputs: tuple[torch.Tensor, ...], static: dict[str, Any]
    ) -> tuple[torch.Tensor | None, ...]:
        if not self.compiled:
            return self.fn(*inputs, **static)
        key = self._key(inputs, static)
        first = key not in self._compiled_keys
        start = time.perf_counter()
        try:
            out = self.fn(*inputs, **static)
        except Exception as err:  # noqa: BLE001 - a compile failure is reported, not swallowed
            self._fail(err)
            return self.fn(*inputs, **static)
        if first:  # this call compiled the step
            self._compiled_keys.add(key)
            self.capture_s += time.perf_counter() - start
        return out

    def __call__(self, *inputs: torch.Tensor, **static: Any) -> tuple[torch.Tensor | None, ...]:
        if not self.enabled:
            return self._call_eager(inputs, static)
        key = self._key(inputs, static)
        if key not in self._steps:
            self.prepare(*inputs, **static)
            if not self.enabled:  # the capture failed and fell back
                return self.fn(*inputs, **static)
        return self._steps[key](*inputs)

    @property
    def num_captured(self) -> int:
        """Graphs captured so far."""
        return len(self._steps)
