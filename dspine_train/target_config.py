"""Reading a target model's `config.json` as transformers does, with its problems named.

The engine and the trainer both read a target's config here. transformers fills a missing
field with its class default (`num_hidden_layers: 32` for Qwen3), so a config without the depth
would be read as another model, or fail transformers' own field validation with a traceback;
both are one `ValueError` naming the file instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig

# Fields the draft and the engine size themselves by, which a target's config.json must state.
REQUIRED_FIELDS = ("num_hidden_layers",)


def missing_fields(fields: dict) -> list[str]:
    """The `REQUIRED_FIELDS` a `config.json` dict states neither at its top level nor in its
    `text_config` (multimodal targets keep the language model's fields there)."""
    text = fields.get("text_config") if isinstance(fields.get("text_config"), dict) else {}
    return [name for name in REQUIRED_FIELDS if name not in fields and name not in text]


def read_target_config(source: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The HF config of the target at `source` (a directory, its config.json, or a Hub id).

    `ValueError` naming the file when it lacks a `REQUIRED_FIELDS` entry, is not valid JSON, or
    fails transformers' validation of its fields (`StrictDataclassError`, not a `ValueError`).
    """
    path = Path(source)
    directory = path.parent if path.is_file() else path
    where = directory / "config.json"
    if where.is_file():  # a Hub id is read by transformers alone
        try:
            fields = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{where}: cannot be read ({err})") from err
        missing = missing_fields(fields) if isinstance(fields, dict) else []
        if missing:
            raise ValueError(f"{where}: no {', '.join(missing)} (the target's depth); "
                             "transformers would assume its class default, another model")
    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except StrictDataclassError as err:  # transformers' field validation; one line
        raise ValueError(f"{where}: {' '.join(str(err).split())}") from err
