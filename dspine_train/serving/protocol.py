"""The OpenAI API's request bodies (the fields this server reads) and response shapes.

Requests are validated by pydantic; any field the server does not know is accepted and
ignored, as OpenAI clients send several (`user`, `stream_options`, ...). Fields with a
meaning this server cannot honour (`n` > 1, `logprobs`, `best_of` > 1, ...) are rejected by
`unsupported` with a 400 naming them. `return_token_ids` (as in vLLM) adds each choice's
generated token ids to the response (`choices[i].token_ids`, and per chunk when streaming).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with no choices and the usage."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    return_token_ids: bool = False

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_list(self) -> list[str]:
        """`stop` as a list (OpenAI takes one string or a list)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a field this server cannot honour, or None."""
        if self.n != 1:
            return "n", f"n={self.n}: only n=1 is supported"
        extra = self.model_extra or {}
        for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
            if extra.get(name) not in (None, False, 0, []):
                return name, f"{name} is not supported by this server"
        if extra.get("best_of") not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        return None


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: one prompt, text or token ids."""

    prompt: str | list[str] | list[int]


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are read."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a chat: role and content (text, or a list of text parts)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`; `max_completion_tokens` is the newer name of max_tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    """A response id such as `cmpl-1f0c...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created`: Unix seconds."""
    return int(time.time())


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def usage(prompt_tokens: int, completion_tokens: int, acceptance_length: float | None
          ) -> dict[str, Any]:
    """`usage` with this server's addition `acceptance_length`: the request's tokens kept per
    target verification (its mean acceptance length; null when no verification ran)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "acceptance_length": acceptance_length,
    }
