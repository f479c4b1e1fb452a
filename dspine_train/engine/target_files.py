"""What the engine reads beside a target's weights: its tokenizer and its end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspine_train.engine.errors import GenerationInputError
from dspine_train.engine.target_model import TargetModel


def load_tokenizer(source: str | Path | Any, *, required: bool) -> Any | None:
    """A tokenizer object, loaded from a directory when given a path; None if it has none."""
    if not isinstance(source, (str, Path)):
        return source
    directory = Path(source)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build a placeholder from config.json alone; an engine without a
        # tokenizer (token-id prompts only) is the honest outcome.
        if required:
            raise GenerationInputError(
                f"{directory}: no tokenizer files ({', '.join(TOKENIZER_FILES)})"
            )
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError) as err:
        raise GenerationInputError(f"{directory}: cannot load its tokenizer ({err})") from err


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def eos_token_ids(target_dir: Path, model: TargetModel, tokenizer: Any | None) -> list[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    for source in (target_dir / "generation_config.json",):
        if source.is_file():
            value = json.loads(source.read_text()).get("eos_token_id")
            if value is not None:
                return [value] if isinstance(value, int) else list(value)
    value = getattr(model.hf_config, "eos_token_id", None)
    if value is not None:
        return [value] if isinstance(value, int) else list(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
