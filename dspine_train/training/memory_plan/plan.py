"""The memory plan's records: resident items, their total, the verdict and the printed table.

Formulas are written in the notation of the package docstring (`training.memory_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3

# Share of the GPU left free by `fits`: CUDA context, NCCL and DeepSpeed buffers, allocator
# fragmentation and the activation gradients the plan does not itemise.
DEFAULT_HEADROOM_FRACTION = 0.10

# The draft attention kernels a plan can describe (`estimate_memory(attention_path=...)`).
ATTENTION_PATHS = {
    "flex": "compiled flex attention (CUDA): block-sparse mask, no score matrix",
    "dense": "dense SDPA with a boolean (b, 1, Q, KV) mask (CPU)",
}


@dataclass(frozen=True)
class MemoryItem:
    """One resident item of the plan.

    Attributes:
        name: what the memory holds.
        bytes: bytes per GPU.
        formula: how `bytes` was computed, in the notation of the package docstring.
        partitioned: True when the item is divided over the world size (ZeRO).
    """

    name: str
    bytes: int
    formula: str
    partitioned: bool = False

    @property
    def gib(self) -> float:
        """Size in GiB."""
        return self.bytes / GIB


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory breakdown of a training setup; see the package docstring for the formulas.

    Attributes:
        items: resident items, in the order they are printed.
        draft_parameters: P, trainable parameters of the draft.
        target_parameters: parameters of the frozen target (all of them, even when offline
            features keep only the embedding and head on the GPU).
        zero_stage: 2 or 3.
        world_size: W.
        tokens_per_step: b * S * W * grad_accum_steps, padded tokens per optimizer step.
        gpu_memory_gib: the GPU size the verdict of `table()` refers to (None: no verdict).
        headroom_fraction: share of the GPU `fits` keeps free.
        attention_path: the draft attention the plan counts, "flex" or "dense" (see
            `attention_items`).
    """

    items: tuple[MemoryItem, ...]
    draft_parameters: int
    target_parameters: int
    zero_stage: int
    world_size: int
    tokens_per_step: int
    gpu_memory_gib: float | None = None
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    attention_path: str = "flex"

    @property
    def total_bytes(self) -> int:
        """Sum of all items, bytes per GPU."""
        return sum(item.bytes for item in self.items)

    @property
    def total_gib(self) -> float:
        """Sum of all items, GiB per GPU."""
        return self.total_bytes / GIB

    @property
    def required_gpu_gib(self) -> float:
        """Smallest GPU (GiB) on which `fits` is True: total / (1 - headroom)."""
        return self.total_gib / (1.0 - self.headroom_fraction)

    def item(self, name: str) -> MemoryItem:
        """The item called `name`; `KeyError` lists the names when there is none."""
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(f"no memory item {name!r}; items are {[i.name for i in self.items]}")

    def fits(self, gpu_gib: float | None = None) -> bool:
        """Whether the total stays within `(1 - headroom_fraction)` of a `gpu_gib` GPU.

        `gpu_gib` defaults to the plan's `gpu_memory_gib`; `ValueError` when neither is set.
        """
        gpu_gib = self.gpu_memory_gib if gpu_gib is None else gpu_gib
        if gpu_gib is None:
            raise ValueError("fits: pass gpu_gib or build the plan with gpu_memory_gib")
        return self.total_gib <= gpu_gib * (1.0 - self.headroom_fraction)

    def table(self, gpu_gib: float | None = None) -> str:
        """A readable table: one row per item (GiB and formula), the total and the verdict."""
        gpu_gib = self.gpu_memory_gib if gpu_gib is None else gpu_gib
        name_width = max(len(item.name) for item in self.items)
        header = (
            f"Per-GPU memory plan: ZeRO-{self.zero_stage}, world size {self.world_size}, "
            f"draft {self.draft_parameters / 1e6:,.1f} M trainable parameters, "
            f"target {self.target_parameters / 1e9:,.2f} B parameters, "
            f"{self.tokens_per_step:,} tokens per optimizer step"
        )
        lines_attention = f"draft attention: {ATTENTION_PATHS[self.attention_path]}"
        lines = [header, lines_attention, f"{'item':<{name_width}}  {'GiB':>8}  formula"]
        lines.append("-" * len(lines[-1]))
        for item in self.items:
            note = f"{item.formula}  [partitioned over W]" if item.partitioned else item.formula
            lines.append(f"{item.name:<{name_width}}  {item.gib:>8.2f}  {note}")
        lines.append("-" * len(lines[2]))
        lines.append(f"{'total':<{name_width}}  {self.total_gib:>8.2f}")
        headroom = f"{self.headroom_fraction:.0%} headroom"
        if gpu_gib is None:
            lines.append(f"needs a GPU of at least {self.required_gpu_gib:.1f} GiB ({headroom})")
        else:
            verdict = "FITS" if self.fits(gpu_gib) else "DOES NOT FIT"
            lines.append(
                f"verdict: {verdict} on a {gpu_gib:g} GiB GPU "
                f"(needs {self.required_gpu_gib:.1f} GiB with {headroom})"
            )
        return "\n".join(lines)
