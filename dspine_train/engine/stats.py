"""What a generation call measures about itself: acceptance and where the time went."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class GenerationStats:
    """Counters of one `generate` / `generate_ar` call (all sequences of the batch together).

    A *verification* is one target forward over a block for one active sequence (one decode step
    in plain decoding). `committed` counts the tokens the sequences *kept*: a round's accepted
    drafts and bonus, less whatever an EOS, a stop string or the `max_new_tokens` budget cut off
    in a sequence's last round. `tau` is kept tokens per verification; a round's last kept token
    stands as its bonus, so `per_position_acceptance[i]` is the share of verifications in which
    draft token i + 1 was accepted and kept with a token after it, and `tau = 1 +
    sum(per_position_acceptance)`. `round_accepted` holds the drafts the target accepted, cut or
    not (what the draft achieved, for the parity check).
    """

    mode: str
    num_sequences: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forwards after the prefill (batched)
    verifications: int = 0  # per-sequence verifications (steps x active sequences)
    committed: int = 0  # tokens kept from verifications (after EOS / stop / length cuts)
    accepted_at: list[int] = field(default_factory=list)  # per draft position
    # Per sequence, the drafts accepted in each of its verifications, in order: round r of a
    # sequence verified the block anchored r rounds (and sum(accepted) + r tokens) after its
    # first new token. The parity check (`dspine_train.evaluation.parity`) aligns these with the trainer's
    # simulated evaluation on the same anchors.
    round_accepted: list[list[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0  # wall time, compiling / CUDA-graph capture excluded
    capture_s: float = 0.0  # compiling / capturing steps met for the first time in this call
    # Token-tree verification: lattice paths and nodes (anchor excluded) verified per round;
    # 1 and 0 for a chain (including the sampling fallback of a tree engine).
    tree_paths: int = 1
    tree_nodes: int = 0
    # Rounds per shape ("plain", "ngram", "chain", "tree", "hybrid"; see `engine.round_planner`)
    # and the host seconds spent finding n-gram candidates (inside total_s).
    round_shapes: dict[str, int] = field(default_factory=dict)
    ngram_s: float = 0.0
    # Tokens verified past the anchors, summed over the rounds (a round's width: the cost a
    # CPU pays; plain decoding verifies none).
    nodes_verified: int = 0

    @property
    def tau(self) -> float:
        """Mean acceptance length: kept tokens per verification (1.0 for plain decoding)."""
        return self.committed / self.verifications if self.verifications else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of verifications in which draft position i + 1 was accepted."""
        if not self.verifications:
            return [0.0 for _ in self.accepted_at]
        return [count / self.verifications for count in self.accepted_at]

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time (prefill included)."""
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def draft_ms_per_step(self) -> float:
        """Mean draft time per step in milliseconds."""
        return 1e3 * self.draft_s / self.steps if self.steps else 0.0

    @property
    def verify_ms_per_step(self) -> float:
        """Mean target (verify or decode) forward time per step in milliseconds."""
        return 1e3 * self.verify_s / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, object]:
        """Counters plus the derived rates, JSON-ready."""
        out: dict[str, object] = asdict(self)
        out.update(
            tau=self.tau,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_s=self.tokens_per_s,
            draft_ms_per_step=self.draft_ms_per_step,
            verify_ms_per_step=self.verify_ms_per_step,
        )
        return out


def sum_stats(parts: list[GenerationStats]) -> GenerationStats:
    """Counters and times of several calls added up (rates are then recomputed from them)."""
    width = max(len(part.accepted_at) for part in parts)
    total = GenerationStats(mode=parts[0].mode, accepted_at=[0] * width)
    for part in parts:
        for name in (
            "num_sequences",
            "prompt_tokens",
            "new_tokens",
            "steps",
            "verifications",
            "committed",
            "prefill_s",
            "draft_s",
            "verify_s",
            "total_s",
            "ngram_s",
            "nodes_verified",
        ):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        for i, count in enumerate(part.accepted_at):
            total.accepted_at[i] += count
        for shape, count in part.round_shapes.items():
            total.round_shapes[shape] = total.round_shapes.get(shape, 0) + count
        total.round_accepted += [list(rounds) for rounds in part.round_accepted]
    total.tree_paths, total.tree_nodes = parts[0].tree_paths, parts[0].tree_nodes
    return total


class StepTimer:
    """Times named sections on a device without syncing inside a step.

    On CPU, sections are timed with `perf_counter` (the work is synchronous). On CUDA, each
    section records a pair of events on the current stream, and `samples()` / `totals()`
    synchronise once at the end. The engine sums a section over a call's rounds (`totals`);
    benchmarks keep each timed body (`samples`) for a median or a minimum.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._samples: dict[str, list[float]] = defaultdict(list)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the body under `name`."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            start_s = time.perf_counter()
            yield
            self._samples[name].append(time.perf_counter() - start_s)

    def samples(self) -> dict[str, list[float]]:
        """Seconds of each timed body per section, in order (synchronises the device once)."""
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self._samples[name].append(start.elapsed_time(end) / 1e3)
            self._events.clear()
        return {name: list(times) for name, times in self._samples.items()}

    def totals(self) -> dict[str, float]:
        """Seconds per section, summed over its timed bodies (synchronises the device once)."""
        return {name: sum(times) for name, times in self.samples().items()}


def time_calls(
    fn: Callable[[], object],
    device: torch.device,
    iters: int,
    after: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of `iters` calls of `fn()` on `device` (CUDA events, else perf_counter).

    `after()` runs after each call outside the timing (to restore state a call changed); on
    CUDA it is queued on the same stream, so the next call still starts after it. Warm-up
    (compilation, graph capture, caches) is the caller's: nothing here runs untimed first.
    """
    timer = StepTimer(device)
    for _ in range(iters):
        with timer.section("call"):
            fn()
        if after is not None:
            after()
    return timer.samples().get("call", [])


def median_ms(
    fn: Callable[[], object],
    device: torch.device,
    iters: int,
    after: Callable[[], object] | None = None,
) -> float:
    """Median milliseconds of `iters` calls of `fn()` on `device` (see `time_calls`)."""
    return 1e3 * statistics.median(time_calls(fn, device, iters, after))
