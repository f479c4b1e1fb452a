"""What a server serves and how it batches: the app's settings, built from the flags by
`serving.cli` (kept apart from the app so the command line parses without the web stack)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    """Settings of one server (see docs/SERVING.md)."""

    model_name: str  # the model id clients send and /v1/models lists
    default_max_tokens: int = 128  # a request's budget when it gives none
    max_batch_size: int = 8  # requests per engine call (at most the engine's capacity)
    batch_window_ms: float = 5.0  # how long the scheduler waits for more requests
    speculative: bool = True  # `Engine.generate`, else `generate_ar`
    num_draft_tokens: int | None = None  # g per round (None: the engine's default)
