"""What a request, a warmup or a tree budget may ask of an engine: checked before any forward.

Each check raises `GenerationInputError` with one line naming the setting (and its CLI flag)
and the bound it broke; nothing has run when it does.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspine_train.engine.errors import GenerationInputError
from dspine_train.engine.round_planner import RoundShape


def tree_budget(
    tree_paths: int, tree_nodes: int | None, candidate_k: int, num_draft_tokens: int
) -> int | None:
    """Nodes verified per round by a tree round of `tree_paths` lattice paths of
    `num_draft_tokens` tokens in at most `tree_nodes` nodes (None: every path whole), or None
    where the round is a chain. `candidate_k` is the lattice's candidates per slot."""
    if tree_paths == 1 or num_draft_tokens == 0:
        return None
    # The lattice holds K candidates per slot: K^g distinct paths of g tokens, and at most
    # min(M, K^d) distinct nodes at depth d among M paths; beyond that a tree only repeats
    # paths or pads (every extra node is verified for nothing).
    k, g = candidate_k, num_draft_tokens
    paths_held = k**g
    if tree_paths > paths_held:
        raise GenerationInputError(
            f"tree_paths={tree_paths} (CLI: --tree-paths) exceeds the {paths_held} "
            f"paths the draft's lattice holds ({k}^{g}: candidate_k={k} per slot, "
            f"num_draft_tokens={g})")
    nodes_held = sum(min(tree_paths, k**d) for d in range(1, g + 1))
    if tree_nodes is None:
        return tree_paths * g
    if tree_nodes < g:
        raise GenerationInputError(
            f"tree_nodes={tree_nodes} must be >= num_draft_tokens={g} (the chain fits)")
    if tree_nodes > nodes_held:
        raise GenerationInputError(
            f"tree_nodes={tree_nodes} (CLI: --tree-nodes) exceeds the {nodes_held} "
            f"distinct nodes {tree_paths} paths of {g} tokens can have in the "
            f"draft's lattice (candidate_k={k} per slot)")
    return tree_nodes


def check_sampling(temperature: float, top_p: float, what: str = "") -> None:
    """temperature >= 0 and top_p in (0, 1]."""
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise GenerationInputError(
            f"{what}temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")


def check_prompts_fit(
    longest: int,
    max_new_tokens: int,
    widest: int,
    chain_width: int,
    max_seq_len: int,
    positions: int,
    tree: str | None,
) -> None:
    """Room for the longest prompt, every new token and the widest verify (`widest` nodes)
    written past them; `tree` describes the tree settings when the widest round is a tree whose
    chain (`chain_width` nodes) would have fit."""
    needed = longest + max_new_tokens + widest + 1
    if needed <= max_seq_len:
        return
    room = max_seq_len - longest - max_new_tokens - 1  # left for the verified nodes
    if tree is not None and room >= chain_width:  # the chain would fit: the tree does not
        raise GenerationInputError(
            f"a token tree of {widest} nodes ({tree}) does not fit the cache: "
            f"at most {room} nodes fit beside the longest prompt ({longest} tokens) and "
            f"max_new_tokens ({max_new_tokens}) in max_seq_len={max_seq_len}")
    bound = (f"the target's max_position_embeddings={positions}"
             if max_seq_len >= positions else
             f"max_seq_len={max_seq_len} (CLI: --max-seq-len, at most the target's "
             f"max_position_embeddings={positions})")
    raise GenerationInputError(
        f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + one "
        f"verified block ({widest + 1}) needs {needed} cache positions, beyond {bound}")


def check_warmup(
    batch_sizes: Sequence[int],
    num_draft_tokens: Sequence[int] | int | None,
    kv_buckets: Sequence[int] | None,
    *,
    max_batch_size: int,
    max_draft_tokens: int,
    valid_buckets: list[int],
    kv_bucket_size: int,
    max_seq_len: int,
) -> tuple[list[int], list[int], list[int]]:
    """The warmup's batch sizes, numbers of draft tokens and kv buckets, sorted and checked;
    `max_draft_tokens` the draft's predictions per block (0: no draft)."""
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or not all(1 <= b <= max_batch_size for b in sizes):
        raise GenerationInputError(
            f"warmup batch_sizes={list(batch_sizes)} must be non-empty, each in "
            f"1..max_batch_size={max_batch_size}")
    has_draft = max_draft_tokens > 0
    if num_draft_tokens is None:
        gs = [0, max_draft_tokens] if has_draft else [0]
    elif isinstance(num_draft_tokens, int):
        gs = [num_draft_tokens]
    else:
        gs = sorted({int(g) for g in num_draft_tokens})
    top = max_draft_tokens
    if not gs or not all(0 <= g <= top for g in gs):
        bound = "the draft's predictions per block" if has_draft else "no draft: plain decoding"
        raise GenerationInputError(
            f"warmup num_draft_tokens={gs} must each be in 0..{top} ({bound})")
    buckets = valid_buckets if kv_buckets is None else sorted({int(b) for b in kv_buckets})
    bad = [b for b in buckets if b not in valid_buckets]
    if not buckets or bad:
        raise GenerationInputError(
            f"warmup kv_buckets {bad or '[]'} are not kv buckets of this engine (multiples "
            f"of kv_bucket_size={kv_bucket_size} below max_seq_len={max_seq_len}, "
            f"or max_seq_len itself)")
    return sizes, gs, buckets


def check_request(
    ids: list[list[int]],
    budgets: Sequence[int],
    temperature: float,
    top_p: float,
    stops: Sequence[Sequence[str]],
    shapes: Sequence[RoundShape],
    *,
    max_batch_size: int,
    has_tokenizer: bool,
    max_seq_len: int,
    positions: int,
    tree: str,
) -> None:
    """A generation request, one budget and one list of stop strings per row: prompt count,
    sampling settings, then each row's budget, stop strings and room in the caches for the
    widest of its round `shapes` (`tree` names the settings that size it), the neediest row
    first, so that an error names the longest prompt."""
    if len(ids) > max_batch_size:
        raise GenerationInputError(
            f"{len(ids)} prompts exceed the engine's max_batch_size={max_batch_size}")
    check_sampling(temperature, top_p)
    widest = max(shapes, key=lambda s: s.nodes, default=RoundShape("plain", 0))
    chain = max((s.draft_depth for s in shapes), default=0)
    is_tree = widest.name in ("tree", "hybrid", "ngram")
    rows = sorted(zip(ids, budgets, stops, strict=True), key=lambda r: len(r[0]) + r[1],
                  reverse=True)
    for row, max_new_tokens, stop in rows:
        if max_new_tokens < 1:
            raise GenerationInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop and not has_tokenizer:
            raise GenerationInputError("stop strings need a tokenizer")
        if any(not s for s in stop):  # "" is in every text: each answer would stop at once
            raise GenerationInputError(
                "an empty stop string (CLI: --stop '') would end every answer after its first "
                "token; give a non-empty string")
        check_prompts_fit(len(row), max_new_tokens, widest.nodes, chain, max_seq_len,
                          positions, tree if is_tree else None)
