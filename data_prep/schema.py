"""The normalised conversation schema every stage of ``data_prep`` reads and writes.

One row is ``{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}``.
Readers of every input format turn raw records into this shape with :func:`normalise_record`,
which either returns a :class:`Conversation` or raises :class:`RowError` carrying a short
machine-readable reason; callers decide whether that skips the row or (``strict``) aborts.

Rules a valid row meets (and why):
* roles are ``system``/``user``/``assistant`` after mapping the ShareGPT names
  (``human``/``user`` -> user, ``gpt``/``assistant`` -> assistant); anything else is an
  ``unknown_role`` (tool or bot-specific turns would need a template we do not train on);
* an optional system turn comes first, then user and assistant turns alternate starting with
  a user turn; leading assistant turns are dropped first, because the split ShareGPT release
  cuts long chats into chunks that start with an answer whose question lives in another chunk;
* no message is empty or whitespace-only, and all text is valid Unicode (no lone surrogates,
  which is how undecodable input bytes surface after ``surrogateescape`` decoding);
* the row ends with an assistant turn, or it is a single prompt (optional system + one user
  turn).  A longer row ending with a user turn is a chat whose last answer was cut off; it is
  skipped rather than silently given an answer the source never had.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dspine_train.py_compat import NotRequired, TypedDict

Role = Literal["system", "user", "assistant"]

ROLE_ALIASES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


class Message(TypedDict):
    """One turn of a normalised conversation.

    ``truncated`` (assistant turns written by regeneration only) marks an answer cut at
    ``max_new_tokens``: its end-of-turn token is not supervised, the target never emitted it.
    """

    role: Role
    content: str
    truncated: NotRequired[bool]


class Conversation(TypedDict):
    """One normalised row: a stable id and its messages (see the module docstring)."""

    id: str
    messages: list[Message]


class DataError(ValueError):
    """A fatal input problem; the message names the file and line (``strict`` mode, bad input)."""


class RowError(ValueError):
    """A row that cannot be used.  ``reason`` is a short stable code, ``detail`` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RowRef:
    """Where a row came from: file name and 1-based line (row index for ``datasets`` inputs)."""

    source: str
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass(frozen=True)
class SkippedRow:
    """A row left out of a stage, with the reason recorded in the run's report."""

    ref: RowRef
    reason: str
    detail: str
    id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The report entry for this row."""
        return {"id": self.id, "source": self.ref.source, "line": self.ref.line,
                "reason": self.reason, "detail": self.detail}


def has_lone_surrogate(text: str) -> bool:
    """True if ``text`` cannot be UTF-8 encoded (undecodable input bytes, a bad ``\\ud800``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def stable_id(messages: Sequence[Message], ref: RowRef) -> str:
    """Id for a row without one: hash of its content and its file name + line.

    The line keeps identical rows on different lines distinct; the file's base name (not its
    full path) keeps ids stable when a data directory is moved.
    """
    payload = json.dumps([messages, ref.source, ref.line], ensure_ascii=False, sort_keys=True)
    return "h-" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:20]


def _message_fields(raw: Mapping[str, Any], index: int) -> tuple[str, Any]:
    # ShareGPT uses from/value, OpenAI role/content; some ShareGPT exports mix the two.
    # Arrow-backed rows carry every key of the union schema, absent ones as None.
    role = raw.get("role") if raw.get("role") is not None else raw.get("from")
    content = raw.get("content") if raw.get("content") is not None else raw.get("value")
    if not isinstance(role, str):
        raise RowError("missing_role", f"message {index} has no string 'role'/'from'")
    return role, content


def _text_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI content parts: keep text parts only; anything else is not trainable text.
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise RowError("non_text_content", f"message {index} has a non-text content part")
            texts.append(part["text"])
        return "".join(texts)
    raise RowError("missing_content", f"message {index} has no string 'content'/'value'")


def normalise_messages(raw_messages: Any) -> list[Message]:
    """Map roles, check content and turn order; raise :class:`RowError` on the first problem."""
    if not isinstance(raw_messages, list):
        raise RowError("missing_messages", "'conversations'/'messages' is not a list")
    messages: list[Message] = []
    for index, raw in enumerate(raw_messages):
        if not isinstance(raw, Mapping):
            raise RowError("bad_message", f"message {index} is not an object")
        role_name, content = _message_fields(raw, index)
        role = ROLE_ALIASES.get(role_name.lower())
        if role is None:
            raise RowError("unknown_role", f"message {index} has role {role_name!r}")
        text = _text_content(content, index)
        if has_lone_surrogate(text):
            raise RowError("invalid_utf8", f"message {index} is not valid UTF-8 text")
        if not text.strip():
            raise RowError("empty_content", f"message {index} ({role}) is empty")
        message: Message = {"role": role, "content": text}
        if role == "assistant" and raw.get("truncated") is True:
            message["truncated"] = True
        messages.append(message)

    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    while turns and turns[0]["role"] == "assistant":
        turns = turns[1:]
    if not turns:
        raise RowError("no_user_turn", "no user turn")
    for index, message in enumerate(turns):
        expected = "user" if index % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise RowError("roles_not_alternating",
                           f"turn {index + len(system)} is {message['role']}, expected {expected}")
    if turns[-1]["role"] == "user" and len(turns) > 1:
        raise RowError("ends_with_user_turn", "multi-turn row ends with a user turn")
    return system + turns


def normalise_record(record: Any, ref: RowRef) -> Conversation:
    """Turn one raw ShareGPT / OpenAI-style record into a :class:`Conversation`.

    The record's own ``id`` (ShareGPT ``id``, or ``task_id``) is kept when it is a non-empty
    string or an int; otherwise :func:`stable_id` derives one.
    """
    if not isinstance(record, Mapping):
        raise RowError("not_an_object", "row is not a JSON object")
    raw_messages = record.get("messages")
    if raw_messages is None:
        raw_messages = record.get("conversations")
    if raw_messages is None:
        raise RowError("missing_messages", "row has neither 'conversations' nor 'messages'")
    messages = normalise_messages(raw_messages)
    raw_id = record.get("id") if record.get("id") is not None else record.get("task_id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or raw_id == "":
        row_id = stable_id(messages, ref)
    else:
        row_id = str(raw_id)
        if has_lone_surrogate(row_id):
            raise RowError("invalid_utf8", "row id is not valid UTF-8 text")
    return {"id": row_id, "messages": messages}


def is_prompt_only(conversation: Conversation) -> bool:
    """True for a row that is just a prompt: no assistant turn to keep or supervise yet."""
    return conversation["messages"][-1]["role"] == "user"
