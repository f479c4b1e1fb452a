"""Token ids to text as they stream: no broken multi-byte characters, no stop string shown.

A byte-level tokenizer can split one character over several tokens; decoding such a prefix
ends in U+FFFD, the replacement character. `TextStream` holds text back while it ends in one,
and while its end could still grow into a stop string, so that the concatenated deltas equal
`final_text` of the whole answer (what a non-streaming response returns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` up to the first occurrence of any stop string (OpenAI's answers leave it out),
    and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def final_text(tokenizer: Any, tokens: Sequence[int], stop: Sequence[str]) -> str:
    """The answer's text: all its tokens decoded, cut before a stop string."""
    return cut_at_stop(tokenizer.decode(list(tokens), skip_special_tokens=True), stop)[0]


class TextStream:
    """Incremental decoding of one answer: `push(tokens)` returns the text safe to send now,
    `finish()` the rest.

    Each push decodes only the tokens since the last stable point together with a few before
    it (so the tokenizer sees the spacing context), as Hugging Face's `TextStreamer` does.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._tokens: list[int] = []
        self._prefix = 0  # tokens before this one are already in `_text`...
        self._read = 0  # ...through this one (the context decoded again for spacing)
        self._text = ""  # decoded, without a trailing partial character
        self._sent = 0  # characters of `_text` already returned
        self.stopped = False  # a stop string was met: nothing more is sent

    def push(self, tokens: Sequence[int]) -> str:
        """Add new tokens; the text that can be sent now (may be empty)."""
        self._tokens.extend(int(t) for t in tokens)
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The text not sent yet, once the answer is complete (a trailing partial character
        is decoded as it stands)."""
        self._text = self._decode(self._tokens)
        return self._release(final=True)

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        text, found = cut_at_stop(self._text, self._stop)
        end = len(text)
        if found:
            self.stopped = True
        elif not final:
            end -= self._held_for_stop(text)
        delta = text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta

    def _held_for_stop(self, text: str) -> int:
        """Characters at the end of `text` that begin some stop string (held back)."""
        held = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held
