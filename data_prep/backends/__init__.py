"""Generation backends for regeneration: a local transformers model or OpenAI-compatible servers.

Both regenerate a conversation turn by turn (:class:`TurnByTurn`): the system turn and every
user turn are kept, every assistant turn is replaced by the target's reply to the conversation
so far, so later user turns see the target's own earlier answers.  ``Backend.regenerate`` takes
rows and yields a :class:`RowOutcome` per row, in completion order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from data_prep.config import BackendKind, RegenerateConfig
from data_prep.schema import Conversation, Message


@dataclass(frozen=True)
class Reply:
    """One generated assistant turn."""

    text: str
    truncated: bool  # stopped by max_new_tokens, not by an end-of-turn token
    completion_tokens: int


@dataclass(frozen=True)
class RowOutcome:
    """A regenerated row, or the reason it failed."""

    id: str
    row: Conversation | None = None
    error: str | None = None  # "<reason code>: <detail>"
    completion_tokens: int = 0


class TurnFailed(Exception):
    """A turn could not be generated; the message is ``"<reason code>: <detail>"``."""


class TurnByTurn:
    """The regeneration state of one conversation."""

    def __init__(self, conversation: Conversation) -> None:
        messages = conversation["messages"]
        self.id = conversation["id"]
        system = [m for m in messages[:1] if m["role"] == "system"]
        self._users = [m for m in messages if m["role"] == "user"]
        first = system + self._users[:1]
        self.history: list[Message] = [dict(m) for m in first]  # type: ignore[misc]
        self._next_user = 1
        self.completion_tokens = 0
        self.error: str | None = None

    @property
    def pending(self) -> bool:
        """Whether a reply is still to be generated."""
        return self.error is None and self.history[-1]["role"] == "user"

    def add_reply(self, reply: Reply) -> None:
        """Append the target's reply and the next user turn, if any."""
        if not reply.text.strip():
            self.error = "empty_reply: the target returned an empty answer"
            return
        message: Message = {"role": "assistant", "content": reply.text}
        if reply.truncated:
            message["truncated"] = True
        self.history.append(message)
        self.completion_tokens += reply.completion_tokens
        if self._next_user < len(self._users):
            self.history.append(dict(self._users[self._next_user]))  # type: ignore[arg-type]
            self._next_user += 1

    def fail(self, reason: str) -> None:
        """Mark the row failed; no more turns are generated for it."""
        self.error = reason

    def outcome(self) -> RowOutcome:
        """The finished row or its failure."""
        if self.error is not None:
            return RowOutcome(self.id, error=self.error)
        return RowOutcome(self.id, {"id": self.id, "messages": self.history},
                          completion_tokens=self.completion_tokens)


class Backend(Protocol):
    """What the regeneration driver needs from a backend."""

    def regenerate(self, rows: Iterable[Conversation]) -> Iterator[RowOutcome]:
        """Regenerate ``rows``; yield one outcome per row as each finishes."""
        ...


def backend_identity(config: RegenerateConfig) -> dict[str, str]:
    """Which model generates, recorded with the shards so a resume cannot mix two models (nor,
    locally, two precisions: greedy answers of a float32 and a bfloat16 target differ)."""
    if config.backend == BackendKind.http:
        return {"backend": "http", "model": config.http.model}
    from data_prep.backends.local import resolve_device, resolve_dtype

    dtype = resolve_dtype(config.local.dtype, resolve_device(config.local.device))
    return {"backend": "local", "model": str(Path(config.local.model_path).resolve()),
            "dtype": str(dtype).removeprefix("torch.")}


def build_backend(config: RegenerateConfig) -> Backend:
    """The backend ``config.backend`` names."""
    if config.backend == BackendKind.http:
        from data_prep.backends.http import HttpBackend

        return HttpBackend(config.http, config.sampling)
    from data_prep.backends.local import LocalBackend

    return LocalBackend(config.local, config.sampling)
