"""Turning user prompts into token ids, and deciding on the host when a sequence is done."""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dspine_train.engine.errors import GenerationInputError

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


def encode_prompts(
    prompts: Prompts,
    tokenizer: Any | None,
    *,
    chat: bool,
    vocab_size: int,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of every prompt; text goes through the chat template when `chat` is set,
    rendered with `chat_template_kwargs` (e.g. `enable_thinking`, as the training rows were).

    Prompts given as lists of ids are used as they are. Raises `GenerationInputError` for an
    empty batch, an empty prompt, text without a tokenizer, chat without a chat template, or ids
    outside the vocabulary.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(prompts) == 0:
        raise GenerationInputError("no prompts given")
    encoded: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = _encode_text(prompt, tokenizer, chat=chat, index=index,
                               kwargs=chat_template_kwargs or {})
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise GenerationInputError(f"prompt {index} is empty (no tokens)")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise GenerationInputError(
                f"prompt {index} has token ids {bad[:5]} outside the vocabulary 0..{vocab_size - 1}"
            )
        encoded.append(ids)
    return encoded


def _encode_text(
    text: str, tokenizer: Any | None, *, chat: bool, index: int, kwargs: Mapping[str, Any]
) -> list[int]:
    if tokenizer is None:
        raise GenerationInputError(
            f"prompt {index} is text but the engine has no tokenizer; pass token ids or a tokenizer"
        )
    if not text.strip() and not chat:
        raise GenerationInputError(f"prompt {index} is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            source = getattr(tokenizer, "name_or_path", None) or "the engine's"
            raise GenerationInputError(
                f"chat=True but the tokenizer of {source} has no chat template (a base model?); "
                "pass chat=False (CLI: --no-chat) for raw text, or a tokenizer that has one "
                "(CLI: --tokenizer DIR)"
            )
        if not text.strip():
            raise GenerationInputError(f"prompt {index} is empty")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
            **kwargs,
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


class SequenceState:
    """Host-side record of one sequence: its new tokens and why it stopped.

    `extend` commits tokens one at a time so a stop string or the token budget ends the sequence
    exactly at the token where it is met (EOS is already cut on the device).
    """

    def __init__(
        self,
        max_new_tokens: int,
        stop: Sequence[str],
        tokenizer: Any | None,
    ) -> None:
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._max_new_tokens = max_new_tokens
        self._stop = list(stop)
        self._tokenizer = tokenizer

    @property
    def done(self) -> bool:
        """Whether the sequence has stopped."""
        return self.finish_reason is not None

    def extend(self, new_tokens: Sequence[int], ends_with_eos: bool) -> None:
        """Commit `new_tokens` (already cut after an EOS, flagged by `ends_with_eos`)."""
        for offset, token in enumerate(new_tokens):
            self.tokens.append(int(token))
            if ends_with_eos and offset == len(new_tokens) - 1:
                self.finish_reason = "eos"
            elif self._stop and self._hits_stop():
                self.finish_reason = "stop"
            if len(self.tokens) >= self._max_new_tokens and self.finish_reason is None:
                self.finish_reason = "length"
            if self.done:
                return

    def _hits_stop(self) -> bool:
        # Only the tail can hold a stop string that was not there one token ago. A token covers
        # at least one byte of UTF-8 and a character at most four, so this tail always spans
        # the longest stop string; decoding the whole sequence each time would be quadratic.
        tail = self.tokens[-(4 * max(len(s) for s in self._stop) + 8) :]
        text = self._tokenizer.decode(tail)
        return any(s in text for s in self._stop)


def utf8_problem(path: Path, data: bytes) -> str | None:
    """Why `data`, the bytes of text file `path`, is not UTF-8 text without a byte-order
    mark (naming the file, line and offset of the first bad byte), or None."""
    if data.startswith(codecs.BOM_UTF8):
        return f"{path}: starts with a UTF-8 byte-order mark; save it without one"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        return (
            f"{path}:{line}: not valid UTF-8 (byte 0x{data[err.start]:02x} at offset "
            f"{err.start}); save the file as UTF-8"
        )
    return None


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL rows (`{"prompt": ...}` or a JSON string) or one per line.

    Raises `GenerationInputError` naming the file and line for unreadable rows or an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise GenerationInputError(f"{path}: prompts file not found")
    prompts: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise GenerationInputError(f"{path}:{number}: not valid JSON ({err})") from err
            if isinstance(row, dict):
                if not isinstance(row.get("prompt"), str):
                    raise GenerationInputError(f"{path}:{number}: no string field 'prompt'")
                row = row["prompt"]
            if not isinstance(row, str):
                raise GenerationInputError(
                    f"{path}:{number}: expected a string or {{'prompt': ...}}"
                )
            prompts.append(row)
        else:
            prompts.append(line)
    if not prompts:
        raise GenerationInputError(f"{path}: no prompts in the file")
    return prompts
