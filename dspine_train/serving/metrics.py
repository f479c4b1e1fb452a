"""The server's Prometheus metrics, in a registry of its own (one per app, so several servers
in one process do not collide), rendered at `/metrics`."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ACCEPTANCE_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16)


class ServerMetrics:
    """Counters, gauges and histograms of one server (names prefixed `dspine_`)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dspine_requests", "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"], registry=r)
        self.cancelled = Counter(
            "dspine_requests_cancelled", "Requests whose client left before their end",
            registry=r)
        self.prompt_tokens = Counter(
            "dspine_prompt_tokens", "Prompt tokens of the requests generated for", registry=r)
        self.generated_tokens = Counter(
            "dspine_generated_tokens", "Tokens generated (all requests)", registry=r)
        self.tokens_per_s = Gauge(
            "dspine_tokens_per_second", "Generated tokens per second of the last engine batch",
            registry=r)
        self.acceptance_length = Histogram(
            "dspine_acceptance_length",
            "Per request: tokens kept per target verification (1 = no draft token accepted)",
            buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.queue_depth = Gauge(
            "dspine_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge(
            "dspine_running_requests", "Requests in the engine batch now running", registry=r)
        self.batch_size = Histogram(
            "dspine_batch_size", "Requests per engine batch",
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.latency = Histogram(
            "dspine_request_latency_seconds",
            "Seconds from a request's queueing to its last token", buckets=LATENCY_BUCKETS,
            registry=r)
        self.first_token = Histogram(
            "dspine_time_to_first_token_seconds",
            "Seconds from a request's queueing to its first token", buckets=LATENCY_BUCKETS,
            registry=r)

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
