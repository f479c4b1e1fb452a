"""Token ids and loss masks of a conversation under the target's chat template.

``loss_mask`` is 1 exactly on the tokens of each assistant turn's content and on the
end-of-turn token that closes it (``<|im_end|>`` for Qwen), 0 on system/user turns and on the
template's own tokens (role headers, the newline after ``<|im_end|>``, a default system prompt,
the empty ``<think></think>`` block Qwen3 puts in the prompt when thinking is off).

How the assistant spans are found (one method for every template, no per-model rules):

1. Render the whole conversation ``F`` as text with the template.
2. For assistant turn ``i``, render the messages before it (which end with a user turn) both
   plain (``P``) and with the generation prompt (``P + G``).  ``P`` must be a prefix of ``F``:
   templates render history the same however it continues.  The turn's content starts after
   ``P + G`` -- exactly what the target was prompted with when it wrote the turn.  If ``F``
   does not continue with ``G`` (Qwen3 drops the empty think block from turns that are no
   longer the last), the generation prompt rendered without the chat-template kwargs is tried.
3. The span ends at the first end-of-turn token after the content start.  When the text
   between start and end-of-turn ends with the message content verbatim, the span starts at
   the content, and text the template inserted before it (an empty think block Qwen3 adds to
   a final turn written without one) is cut out of the row: the target neither saw nor wrote
   it, so the row is exactly its prompt and its answer, as when the engine serves it (the
   draft's context features must be those the target computes then).  The end-of-turn
   token is found once by rendering a probe conversation and taking the first special token
   after the assistant content, so it is ``<|im_end|>`` for ChatML and ``<|eot_id|>`` for
   Llama 3 without configuration.
4. Tokenise ``F`` (``add_special_tokens=False``; the template already has them) with offsets;
   a token is supervised when its first character lies in a span.

Templates with ``{% generation %}`` markers could report masks themselves, but Qwen's templates
have none, and one method gives one definition of the mask for every target.

An assistant turn marked ``truncated`` (generation hit ``max_new_tokens``) keeps its content
supervised but not the end-of-turn token: the target never emitted it there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data_prep.schema import Message

_PROBE_CONTENT = "dspine-probe-answer"


class TemplateError(ValueError):
    """The chat template renders a conversation in a way the span search cannot follow."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MaskedTokens:
    """A rendered conversation: ids and their 0/1 loss mask, the same length."""

    input_ids: list[int]
    loss_mask: list[int]


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
           chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The chat template applied to ``messages`` as text."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))


def special_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special ids: its named special tokens (``all_special_ids``) and every
    added token flagged ``special`` (Llama-3's ``<|eot_id|>``, Gemma's ``<end_of_turn>`` are
    only the latter in some tokenizer files)."""
    special = set(tokenizer.all_special_ids)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return special


def end_of_turn_token(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The special token the template puts right after an assistant turn's content."""
    probe = [{"role": "user", "content": "ping"},
             {"role": "assistant", "content": _PROBE_CONTENT}]
    text = render(tokenizer, probe, add_generation_prompt=False,
                  chat_template_kwargs=chat_template_kwargs)
    suffix = text[text.rindex(_PROBE_CONTENT) + len(_PROBE_CONTENT):]
    special = special_token_ids(tokenizer)
    for token_id in tokenizer(suffix, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return tokenizer.convert_ids_to_tokens(token_id)
    raise TemplateError("no_end_of_turn", f"no special token follows assistant content in "
                        f"the chat template (suffix {suffix!r})")


def assistant_spans(tokenizer: Any, messages: Sequence[Message], *, end_of_turn: str,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the supervised character spans ``[start, end)`` in it.

    Each span covers one assistant turn's content and, unless the turn is ``truncated``, its
    end-of-turn token.  Raises :class:`TemplateError` when the template defeats the search.
    """
    kwargs = dict(chat_template_kwargs or {})
    full = render(tokenizer, messages, add_generation_prompt=False, chat_template_kwargs=kwargs)
    spans = []
    inserted = []  # [start, end) of template-inserted text to cut out, in order
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if end_of_turn in message["content"]:
            raise TemplateError("end_of_turn_in_content",
                                f"assistant turn {index} contains {end_of_turn!r}")
        history = messages[:index]
        prefix = render(tokenizer, history, add_generation_prompt=False,
                        chat_template_kwargs=kwargs)
        if not full.startswith(prefix):
            raise TemplateError("template_mismatch",
                                f"the template renders the turns before {index} differently "
                                f"when more turns follow")
        start = None
        for header_kwargs in (kwargs, {}):
            prompt = render(tokenizer, history, add_generation_prompt=True,
                            chat_template_kwargs=header_kwargs)
            if prompt.startswith(prefix) and full.startswith(prompt):
                start = len(prompt)
                break
        if start is None:
            raise TemplateError("template_mismatch",
                                f"assistant turn {index} does not follow its generation prompt")
        eot = full.find(end_of_turn, start)
        if eot < 0:
            raise TemplateError("template_mismatch", f"no {end_of_turn!r} after turn {index}")
        # Text the template inserted before the content (an empty think block that Qwen3 adds
        # to a final turn without one) is neither the target's output nor in its prompt when it
        # wrote the turn: cut it out and start at the content proper when that appears
        # verbatim.  Otherwise (the template rewrote the turn) keep the whole turn.
        if full[start:eot].endswith(message["content"]):
            content_start = eot - len(message["content"])
            if content_start > start:
                inserted.append((start, content_start))
            start = content_start
        end = eot if message.get("truncated") else eot + len(end_of_turn)
        spans.append((start, end))
    return _cut(full, spans, inserted)


def _cut(text: str, spans: list[tuple[int, int]], cuts: list[tuple[int, int]],
         ) -> tuple[str, list[tuple[int, int]]]:
    """``text`` without the ``cuts`` ranges, and ``spans`` moved to match (no span overlaps a
    cut: each cut ends where its turn's span starts)."""
    if not cuts:
        return text, spans
    pieces, shifts, last, removed = [], [], 0, 0
    for start, end in cuts:
        pieces.append(text[last:start])
        removed += end - start
        shifts.append((end, removed))
        last = end
    pieces.append(text[last:])

    def moved(position: int) -> int:  # minus everything cut before it
        return position - next((total for end, total in reversed(shifts) if position >= end), 0)

    return "".join(pieces), [(moved(a), moved(b)) for a, b in spans]


def tokenize_conversation(tokenizer: Any, messages: Sequence[Message], *, end_of_turn: str,
                          chat_template_kwargs: Mapping[str, Any] | None = None) -> MaskedTokens:
    """Render, tokenise and mask one conversation (needs a fast tokenizer for offsets)."""
    text, spans = assistant_spans(tokenizer, messages, end_of_turn=end_of_turn,
                                  chat_template_kwargs=chat_template_kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    supervised = bytearray(len(text) + 1)  # one flag per character of the rendered text
    for start, end in spans:
        supervised[start:end] = b"\x01" * (end - start)
    mask = [supervised[start] for start, _ in encoded["offset_mapping"]]
    return MaskedTokens(list(encoded["input_ids"]), mask)


def longest_run(mask: Sequence[int]) -> int:
    """Length of the longest run of consecutive 1s."""
    best = current = 0
    for value in mask:
        current = current + 1 if value else 0
        best = max(best, current)
    return best
