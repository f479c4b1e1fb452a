"""The chat template a draft's training rows were rendered with, and checking it when serving.

A draft learns the target's continuations of prompts rendered by one chat template with one
set of kwargs (Qwen3's `enable_thinking`, ...). Served with another rendering (another system
prompt, thinking on instead of off) the target's responses, and so the draft's acceptance,
change. So the tokeniser step (`data_prep.tokenize`) records the template's fingerprint and
kwargs in its report, the trainer copies them into the draft's config (exported with it), and
the engine renders prompts with the recorded kwargs and warns when its tokenizer's template
has another fingerprint. No torch here: `data_prep` imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Config keys of an exported draft recording the chat template its training rows were
# rendered with (`chat_template_record`); the engine renders prompts with the same kwargs and
# warns when its tokenizer's template has another fingerprint.
FINGERPRINT_KEY = "chat_template_fingerprint"
KWARGS_KEY = "chat_template_kwargs"


def chat_template_fingerprint(tokenizer: Any) -> str | None:
    """Short sha256 of the tokenizer's chat template text (None without a template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    if not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def chat_template_record(tokenizer: Any, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """What an export records about the chat template of its training rows: the template's
    fingerprint and the kwargs (e.g. `enable_thinking`) the rows were rendered with."""
    return {FINGERPRINT_KEY: chat_template_fingerprint(tokenizer), KWARGS_KEY: dict(kwargs or {})}


def template_mismatch(draft_config: Any, tokenizer: Any, kwargs: Mapping[str, Any]) -> str | None:
    """Why serving with `tokenizer` and `kwargs` renders prompts unlike the draft's training
    rows, or None (also when the draft records nothing)."""
    recorded = getattr(draft_config, FINGERPRINT_KEY, None)
    problems = []
    current = chat_template_fingerprint(tokenizer)
    if recorded is not None and tokenizer is not None and current != recorded:
        problems.append(f"the tokenizer's chat template has fingerprint {current}, the draft "
                        f"was trained on rows rendered with {recorded}")
    trained_kwargs = getattr(draft_config, KWARGS_KEY, None)
    if trained_kwargs is not None and dict(trained_kwargs) != dict(kwargs):
        problems.append(f"prompts are rendered with chat_template_kwargs {dict(kwargs)}, the "
                        f"training rows with {dict(trained_kwargs)}")
    if not problems:
        return None
    return ("serving with another chat template than the draft was trained on ("
            + "; ".join(problems) + "): acceptance will be lower than in training")


def recorded_in_dataset(dataset_dir: str | Path) -> dict[str, Any] | None:
    """The `chat_template_record` a tokenised dataset's `tokenize_report.json` holds, or None
    (no report: a synthetic or older dataset)."""
    report = Path(dataset_dir) / "tokenize_report.json"
    if not report.is_file():
        return None
    settings = json.loads(report.read_text()).get("settings", {})
    if FINGERPRINT_KEY not in settings and KWARGS_KEY not in settings:
        return None
    return {FINGERPRINT_KEY: settings.get(FINGERPRINT_KEY),
            KWARGS_KEY: dict(settings.get(KWARGS_KEY) or {})}
