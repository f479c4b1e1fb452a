"""The draft's mask token: an id that fills slots 1..B-1 of every block and never occurs in text.

Two kinds of id qualify, and `pick_mask_token_id` takes the first of the first kind present:

* an embedding row above the tokenizer (Qwen: 151936 rows, 151669 tokens): no text can ever
  produce it, so the first such row is the mask id (the rule drafts have always used);
* a reserved or unused special token of a tokenizer that uses every row (Llama-3's
  `<|reserved_special_token_N|>`, Gemma's `<unusedN>`): an added token is never produced by
  the tokenizer's merges, only by its literal text, which the trainer checks the training
  data for (`training.data.check_token_absent`).

Any other id of the tokenizer is a token the target reads and writes, and is refused by name.
"""

from __future__ import annotations

import re
from typing import Any

# `<|reserved_special_token_12|>` (Llama-3), `<unused42>` (Gemma), `<|reserved_7|>`, ...
RESERVED_TOKEN = re.compile(r"^<\|?(reserved|unused)[a-z_]*\d+\|?>$", re.IGNORECASE)


def reserved_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's added tokens named as reserved/unused, ascending."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted(int(i) for i, token in decoder.items()
                  if RESERVED_TOKEN.match(getattr(token, "content", str(token))))


def pick_mask_token_id(vocab_size: int, used_vocab_size: int | None, tokenizer: Any = None) -> int:
    """The mask id for a target of `vocab_size` rows whose tokenizer uses `used_vocab_size` ids:
    the first row above the tokenizer, else its first reserved/unused special token.
    `ValueError` (starting with `mask_token_id`) when neither exists or cannot be known."""
    if used_vocab_size is None:
        raise ValueError(
            "mask_token_id: pass the target tokenizer (or used_vocab_size) so the first "
            "unused id can be chosen, or give mask_token_id explicitly"
        )
    if used_vocab_size < vocab_size:
        return used_vocab_size
    if tokenizer is None:
        raise ValueError(
            f"mask_token_id: the tokenizer uses all {vocab_size} ids; pass the tokenizer so a "
            "reserved special token can be chosen, or give an explicit mask_token_id"
        )
    reserved = reserved_token_ids(tokenizer)
    if not reserved:
        raise ValueError(
            f"mask_token_id: the tokenizer uses all {vocab_size} ids and has no reserved or "
            "unused special token (<|reserved_special_token_N|>, <unusedN>); give an explicit "
            "mask_token_id that never occurs in the data"
        )
    return reserved[0]


def check_mask_token(mask_token_id: int, tokenizer: Any) -> None:
    """`ValueError` naming the token when `mask_token_id` is one the tokenizer uses for text
    (neither above the tokenizer nor a reserved/unused special token)."""
    used = len(tokenizer)
    if mask_token_id >= used:
        return
    reserved = reserved_token_ids(tokenizer)
    if mask_token_id in reserved:
        return
    name = tokenizer.convert_ids_to_tokens(mask_token_id)
    hint = (f" or a reserved special token such as "
            f"{tokenizer.convert_ids_to_tokens(reserved[0])!r} (id {reserved[0]})" if reserved else "")
    raise ValueError(
        f"mask_token_id {mask_token_id} is {name!r}, a token the tokenizer uses (len {used}); "
        f"pick an id >= {used}{hint}"
    )
