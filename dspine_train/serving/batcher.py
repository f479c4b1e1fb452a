"""The scheduler: one worker thread owns the engine and runs the queued requests in batches.

Windowed batching. The worker takes the oldest waiting request, waits up to `window_s` for
more (until `max_batch_size` are waiting), and runs every waiting request that shares the
oldest one's batch-level settings (temperature, top_p, and the seed when sampling) as one
engine call; the others wait for a later batch. Prompts arrive as token ids (the app applies
the chat template), so completions and chat completions share batches. Each request keeps its
own token budget and stop strings (`Engine.generate` takes them per row). A request that
arrives while a batch runs waits for the next one: rows do not join a running batch
(continuous batching is not built).

Each request's events reach its handler through `Job.emit`, called on the worker thread: its
tokens as each round commits them, then `Finished` (or `Failed`). A cancelled job (a client
gone) is skipped if still queued, and ended at the next round if running.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspine_train.engine import Engine, GenerationResult
from dspine_train.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchKey:
    """The settings one engine call shares between its rows."""

    temperature: float
    top_p: float
    seed: int | None  # a sampling request's seed; None: greedy, or sampling with no seed


@dataclass
class Tokens:
    """New tokens of a job, as a round committed them."""

    token_ids: list[int]


@dataclass
class Finished:
    """A job's end: all its tokens, why it ended, and its acceptance length (None where no
    verification ran, i.e. one token)."""

    token_ids: list[int]
    finish_reason: str
    acceptance_length: float | None


@dataclass
class Failed:
    """A job the engine could not run."""

    error: BaseException


Event = Tokens | Finished | Failed


@dataclass
class Job:
    """One request as the worker sees it."""

    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    key: BatchKey
    emit: Callable[[Event], None]  # called on the worker thread
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def cancel(self) -> None:
        """Drop the job (its client is gone): skipped if queued, ended at the next round."""
        self.cancelled.set()


class ServerClosing(RuntimeError):
    """Raised by `submit` once `close` has begun."""


class Batcher:
    """The worker thread that owns `engine` and the queue in front of it.

    `speculative` runs `generate` (else `generate_ar`) with `num_draft_tokens` (None: the
    engine's default)."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        *,
        max_batch_size: int,
        window_s: float,
        speculative: bool,
        num_draft_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_batch_size = min(max_batch_size, engine.max_batch_size)
        self.window_s = window_s
        self.speculative = speculative
        self.num_draft_tokens = num_draft_tokens
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="dspine-batcher", daemon=True)

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the worker is running and accepting requests."""
        return self._thread.is_alive() and not self._closing

    def check(self, prompt_ids: list[int], max_tokens: int, key: BatchKey, stop: list[str]
              ) -> None:
        """Raise `GenerationInputError` where the engine could not run this request (too long
        for the cache, ...), before it is queued with others."""
        self.engine.check_request(
            [prompt_ids], max_tokens, key.temperature, key.top_p, stop=stop,
            speculative=self.speculative, num_draft_tokens=self.num_draft_tokens)

    def submit(self, job: Job) -> None:
        """Queue `job`; raises `ServerClosing` once shutdown has begun."""
        with self._cond:
            if self._closing:
                raise ServerClosing("the server is shutting down")
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, finish every queued and running one, stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._run(batch)
            except Exception as err:  # a failed batch fails its jobs, not the server
                log.exception("engine batch failed")
                for job in batch:
                    job.emit(Failed(err))
            finally:
                self.metrics.running.set(0)

    def _take_batch(self) -> list[Job] | None:
        """The next batch (None once closing with nothing queued)."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None
            key = self._queue[0].key
            deadline = time.monotonic() + self.window_s
            while not self._closing and self._count(key) < self.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch = [job for job in self._queue if job.key == key][: self.max_batch_size]
            for job in batch:
                self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))
        return batch

    def _count(self, key: BatchKey) -> int:
        return sum(job.key == key for job in self._queue)

    def _run(self, batch: list[Job]) -> None:
        """One engine call for `batch` (its cancelled jobs dropped), events to each job."""
        jobs = [job for job in batch if not job.cancelled.is_set()]
        self.metrics.cancelled.inc(len(batch) - len(jobs))
        if not jobs:
            return
        self.metrics.running.set(len(jobs))
        self.metrics.batch_size.observe(len(jobs))

        def on_tokens(row: int, tokens: list[int]) -> bool:
            job = jobs[row]
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
                self.metrics.first_token.observe(job.first_token_at - job.queued_at)
            job.emit(Tokens(tokens))
            return job.cancelled.is_set()

        key = jobs[0].key
        kwargs: dict[str, Any] = dict(
            max_new_tokens=[job.max_tokens for job in jobs],
            temperature=key.temperature,
            top_p=key.top_p,
            stop=[job.stop for job in jobs],
            # Unseeded sampling draws a fresh seed per call (greedy ignores it).
            seed=key.seed if key.seed is not None else random.randrange(2**62),
            on_tokens=on_tokens,
        )
        if self.speculative:
            result = self.engine.generate([j.prompt_ids for j in jobs],
                                          num_draft_tokens=self.num_draft_tokens, **kwargs)
        else:
            result = self.engine.generate_ar([j.prompt_ids for j in jobs], **kwargs)
        self._finish(jobs, result)

    def _finish(self, jobs: list[Job], result: GenerationResult) -> None:
        stats = result.stats
        self.metrics.generated_tokens.inc(stats.new_tokens)
        self.metrics.prompt_tokens.inc(stats.prompt_tokens)
        self.metrics.tokens_per_s.set(stats.tokens_per_s)
        done = time.perf_counter()
        for row, job in enumerate(jobs):
            tokens = result.token_ids[row]
            rounds = len(stats.round_accepted[row])
            # Kept tokens per verification: the prefill's first token is no verification's.
            tau = (len(tokens) - 1) / rounds if rounds else None
            if tau is not None:
                self.metrics.acceptance_length.observe(tau)
            if result.finish_reasons[row] == "cancelled":
                self.metrics.cancelled.inc()
            self.metrics.latency.observe(done - job.queued_at)
            job.emit(Finished(tokens, result.finish_reasons[row], tau))
