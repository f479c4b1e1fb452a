"""CUDA-graph capture of fixed-shape engine steps (CUDA only; the CPU runs the same code eager).

A step is a function of tensors whose shapes never change between calls (a verify forward over
`(B, g + 1)` tokens, a draft block for `B` anchors) and that reads everything else from buffers
that are updated in place (KV caches, lengths). It is captured once per shape and replayed with
new inputs copied into its static input buffers; replay launches the whole step at once, which
is what makes a small-batch step on a GPU cost about one weight read.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch

StepFn = Callable[..., tuple[torch.Tensor, ...]]


class GraphedStep:
    """`fn(*inputs)` captured as a CUDA graph at the shapes of `example_inputs`.

    Outputs are static tensors overwritten by the next replay: consume them before calling again.
    The warm-up runs happen on a side stream, as capture requires; `fn` must not change the
    committed state of any cache (writes past the committed lengths are fine).
    """

    def __init__(self, fn: StepFn, example_inputs: tuple[torch.Tensor, ...], warmup: int = 2):
        self.inputs = tuple(x.clone() for x in example_inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new)
        self.graph.replay()
        return self.outputs


class StepCache:
    """Graphed steps keyed by shape; falls back to eager `fn` when capture is off or fails."""

    def __init__(self, fn: StepFn, enabled: bool, name: str) -> None:
        self.fn = fn
        self.enabled = enabled
        self.name = name
        self._steps: dict[Hashable, GraphedStep] = {}

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.enabled:
            return self.fn(*inputs)
        key = tuple(tuple(x.shape) for x in inputs)
        step = self._steps.get(key)
        if step is None:
            try:
                step = GraphedStep(self.fn, inputs)
            except RuntimeError as err:  # an op in fn that cannot be captured
                warnings.warn(
                    f"CUDA-graph capture of the {self.name} step failed ({err}); running it eager",
                    stacklevel=2,
                )
                self.enabled = False
                return self.fn(*inputs)
            self._steps[key] = step
        return step(*inputs)
