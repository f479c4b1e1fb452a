"""Side-by-side runs of our DFlash (or DFlash2) draft and z-lab's reference client (`dflash`).

Used by `tests/test_dflash_format.py` (tiny target) and `scripts/dflash_roundtrip.py` (a real
target). Nothing here imports `dflash`: the reference model is passed in, so the package stays
a test/script dependency only.

* `our_block_logits` / `reference_block_logits`: slot logits of one block after the same
  context features, each computed the way its own decode loop calls it;
* `record_engine_rounds` / `record_reference_rounds`: what each decode loop drafted, round by
  round (block start position, block length, drafted tokens), for a batch of one;
* `compare_rounds`: do both loops draft the same tokens at the same positions, and how many
  drafted tokens did the target accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dspine_train.modeling import DSpineDraftModel

if TYPE_CHECKING:
    import transformers

    from dspine_train.engine import Engine


def our_block_logits(draft: DSpineDraftModel, feats: torch.Tensor, anchor: int) -> torch.Tensor:
    """Our slot logits (Bk-1, V) for the block anchored at `anchor` after context features
    `feats` (T, n*H) at positions 0..T-1 (the draft must be bound to its target)."""
    cache = draft.new_context_cache(1, feats.shape[0] + draft.config.block_size)
    draft.append_context(cache, feats[None].to(draft.fc.weight.dtype),
                         torch.tensor([feats.shape[0]], device=feats.device))
    logits, _, _ = draft.draft_forward(cache, torch.tensor([anchor], device=feats.device))
    return logits[0]


@torch.no_grad()
def reference_block_logits(
    model: Any, target: transformers.PreTrainedModel, feats: torch.Tensor, anchor: int) -> torch.Tensor:
    """The reference `DFlashDraftModel`'s slot logits for the same block, called as its
    `spec_generate` calls it (target embedding of [anchor, mask...], target head)."""
    size = model.block_size
    ids = torch.full((1, size), model.mask_token_id, device=feats.device)
    ids[0, 0] = anchor
    scale = float((getattr(model.config, "dflash_config", None) or {}).get(
        "input_embedding_scale", 1.0))
    noise = F.embedding(ids, target.get_input_embeddings().weight) * scale  # as spec_generate
    hidden = model(target_hidden=feats[None], noise_embedding=noise,
                   position_ids=torch.arange(feats.shape[0] + size, device=feats.device)[None])
    return model.compute_logits(hidden[:, 1:], target.lm_head)[0]


def record_engine_rounds(engine: Engine) -> list[tuple[int, int, list[int]]]:
    """Start recording (block start, block length, drafted tokens) of every draft call of
    `engine` (batch of one, greedy: the engine calls `draft.propose`); returns the live list."""
    rounds: list[tuple[int, int, list[int]]] = []
    # the draft's own method, also when an earlier recording wrapped it (one list at a time)
    propose = type(engine.draft).propose.__get__(engine.draft)

    def recording(cache, anchor_ids, *args, **kwargs):  # noqa: ANN001, ANN202 - propose's
        start = int(cache.lengths[0])
        out = propose(cache, anchor_ids, *args, **kwargs)
        rounds.append((start, engine.block_size, out.tokens[0].tolist()))
        return out

    engine.draft.propose = recording
    return rounds


def record_reference_rounds(model: Any) -> list[tuple[int, int, list[int]]]:
    """The same for the reference model (one recording per model instance): the argmax of
    its slot logits, or a DFlash2's selector walk (`propose`)."""
    rounds: list[tuple[int, int, list[int]]] = []

    def hook(module, args, kwargs):  # noqa: ANN001, ANN202, ARG001 - forward pre-hook
        size = kwargs["noise_embedding"].shape[1]
        rounds.append((int(kwargs["position_ids"][0, -size]), size, []))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    if hasattr(model, "propose"):  # DFlash2: the selector's walk drafts the tokens
        propose = model.propose

        def walk(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - propose's
            out = propose(*args, **kwargs)
            rounds[-1][2].extend(out[0][0].tolist())
            return out

        model.propose = walk
        return rounds
    compute = model.compute_logits

    def logits(hidden, head):  # noqa: ANN001, ANN202 - compute_logits'
        out = compute(hidden, head)
        rounds[-1][2].extend(out.argmax(-1)[0].tolist())
        return out

    model.compute_logits = logits
    return rounds


@dataclass
class RoundComparison:
    """The full-block rounds of both loops on one prompt.

    compared: rounds where the reference drafted a whole block; same: whether our engine
    drafted the same tokens at the same start in each of them (and committed as many tokens
    after them); accepted: drafted tokens of those rounds that the target's greedy output
    confirms (the same for both loops when `same`).
    """

    compared: int
    same: bool
    accepted: int


def compare_rounds(reference: list[tuple[int, int, list[int]]],
                   ours: list[tuple[int, int, list[int]]],
                   block_size: int, sequence: list[int]) -> RoundComparison:
    """Compare the rounds recorded on one prompt; `sequence` is prompt + greedy output.

    The reference drafts a shorter block at the length limit (fewer mask slots, which
    bidirectional attention sees), where the engine drafts a whole one: those rounds are left
    out; every earlier round must match.
    """
    full = [(start, tokens) for start, size, tokens in reference if size == block_size]
    same = full == [(start, tokens) for start, _, tokens in ours[: len(full)]]
    ref_starts, our_starts = [r[0] for r in reference], [r[0] for r in ours]
    n = min(len(full) + 1, len(ref_starts), len(our_starts))
    same = same and ref_starts[:n] == our_starts[:n]
    accepted = 0
    for start, tokens in full:
        agree = [t == sequence[start + 1 + k] for k, t in enumerate(tokens)
                 if start + 1 + k < len(sequence)]
        accepted += next((k for k, ok in enumerate(agree) if not ok), len(agree))
    return RoundComparison(len(full), same, accepted)
