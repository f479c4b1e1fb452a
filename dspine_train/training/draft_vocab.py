"""The pruned draft vocabulary (`model.draft_vocab_size: N`, EAGLE-3 / SpecForge style).

The draft scores only N target ids: the N most frequent supervised tokens of the (regenerated)
training data, plus the special tokens the chat template needs (end of turn, end of text), so
the draft can always propose the end of an answer. The draft keeps the map as its `d2t`
buffer (`DSpineDraftModel.set_draft_vocab`); verification uses the target's full vocabulary,
so decoding stays lossless, and the cost of the pruning is the share of target tokens the
draft can no longer propose (`outside_share`, on held-out data).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import torch

from .errors import TrainingError
from .target import load_target_tokenizer

if TYPE_CHECKING:
    from ..modeling import DSpineDraftModel


def supervised_token_counts(dataset: datasets.Dataset, vocab_size: int) -> np.ndarray:
    """How often each id appears as a supervised token (`loss_mask` 1): (vocab_size,) int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for table in dataset.with_format("arrow").iter(batch_size=4096):
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().astype(bool)
        counts += np.bincount(ids[mask].astype(np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def tokenizer_or_none(path: str) -> Any:
    """The target's tokenizer when it has one (the template tokens a pruned vocabulary keeps)."""
    try:
        return load_target_tokenizer(path)
    except TrainingError:
        return None


def template_token_ids(tokenizer: Any) -> list[int]:
    """The special ids a chat answer may need: the tokenizer's special tokens and the added
    tokens its chat template names (e.g. `<|im_end|>`)."""
    if tokenizer is None:
        return []
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    for token, index in (tokenizer.get_added_vocab() or {}).items():
        if token in template:
            ids.add(index)
    return sorted(ids)


def select_draft_vocab(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` ids kept: every id of `always`, then the most frequent others (ties by the
    lower id), sorted ascending. `ValueError` when `always` alone exceeds `size`."""
    keep = sorted({int(i) for i in always if 0 <= int(i) < counts.shape[0]})
    if len(keep) > size:
        raise ValueError(f"model.draft_vocab_size {size} is smaller than the {len(keep)} special "
                         "tokens the chat template needs")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # by count, then id
    forced = np.zeros(counts.shape[0], dtype=bool)
    forced[keep] = True
    rest = order[~forced[order]][: size - len(keep)]
    return torch.from_numpy(np.sort(np.concatenate([np.array(keep, dtype=np.int64), rest])))


def outside_share(dataset: datasets.Dataset, ids: torch.Tensor, vocab_size: int) -> float:
    """Share of the supervised tokens of `dataset` that are not among `ids` (the draft can never
    propose them; the target still emits them, so this is a bound on the acceptance lost)."""
    counts = supervised_token_counts(dataset, vocab_size)
    total = counts.sum()
    return float(1.0 - counts[ids.numpy()].sum() / total) if total else 0.0


def prune_draft_vocab(draft: DSpineDraftModel, train: datasets.Dataset, held_out: datasets.Dataset | None,
                      tokenizer: Any = None) -> str:
    """Give a fresh draft with `draft_vocab_size` its `d2t` map from the training data; returns
    a line saying what was kept and the held-out (or training) share of tokens outside it."""
    cfg = draft.config
    counts = supervised_token_counts(train, cfg.vocab_size)
    ids = select_draft_vocab(counts, cfg.draft_vocab_size, template_token_ids(tokenizer))
    draft.set_draft_vocab(ids)
    where = "held-out" if held_out is not None else "training"
    share = outside_share(held_out if held_out is not None else train, ids, cfg.vocab_size)
    seen = int((counts > 0).sum())
    return (f"pruned draft vocabulary: {cfg.draft_vocab_size} of {cfg.vocab_size} ids (the most "
            f"frequent of the {seen} distinct supervised training tokens, "
            f"{len(template_token_ids(tokenizer))} template tokens, then the lowest ids); "
            f"{100 * share:.2f}% of the {where} supervised tokens lie outside it")
