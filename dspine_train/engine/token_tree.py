"""Token trees from the DSpine lattice: the top-M paths, merged into one tree of <= N nodes.

The draft's transition cache scores every pair of top-K candidates of adjacent slots (METHOD 2.4):
`table (B, T, K, K)`, `table[t, i, j]` the score of `cand[t, j]` after `cand[t - 1, i]` (slot 0's
rows all read the anchor). A path picks one candidate per slot; its score is the sum over slots
of `log_softmax(table[t, i, :])[j]`, the draft's own conditional log-probability restricted to
the candidates. `top_paths` finds the best M paths exactly (list-Viterbi: the best M partial
paths ending at each candidate of each slot), with the greedy chain (argmax of each row, the
path `walk_table` walks) forced in as path 0, so a tree always contains the chain.

`build_tree` merges the paths by common prefix into a token tree, nodes in path-major order (all
of path 0, then the nodes path 1 adds, ...), cut at N nodes. Every node comes after its parent,
so any cut keeps a valid tree. All shapes are static for a given (M, N, depth): no host reads,
no data-dependent shapes, so the step can be compiled and captured as a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine_train.modeling.transition_cache import top_candidates, transition_table, walk_table


@dataclass
class TokenTree:
    """A token tree per sequence, as the verify block `[root, node_1 .. node_N]`.

    tokens: (B, N + 1) long, index 0 the root (the anchor).
    parents: (B, N + 1) long, block index of each node's parent (the root's is 0).
    depths: (B, N + 1) long, 0 for the root; a node's target position is length + depth.
    valid: (B, N + 1) bool, False on padding nodes (fewer unique nodes than N); never accepted.
    ancestors: (B, N + 1, N + 1) bool, `[i, j]` True where j is i or an ancestor of i.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    ancestors: torch.Tensor


def lattice(
    draft: torch.nn.Module,
    slot_logits: torch.Tensor,
    pre: torch.Tensor,
    recv: torch.Tensor,
    anchors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's `(table (B, T, K, K), cand (B, T, K))` from one `draft_forward`.

    With `transition_cache` it is the transition table the chain walks; without it (per-slot
    decoding, DFlash) every row of slot t is the slot's own logits of its top-K. `cand` holds
    target ids: a pruned draft's ids are mapped as its `walk` maps them.
    """
    config = draft.config
    k = min(int(config.candidate_k), slot_logits.shape[-1])
    rows = top_candidates(slot_logits, k)  # (B, T, K) rows of slot_logits: draft ids
    cand = draft.draft_to_target(rows) if getattr(config, "draft_vocab_size", None) else rows
    if config.transition_cache:
        table = transition_table(draft.refined_scores, pre[..., 1:, :], recv, anchors, cand)
    else:
        scores = slot_logits.gather(-1, rows)  # (B, T, K)
        table = scores[..., None, :].expand(*cand.shape[:-1], k, k)
    return table.float(), cand


def greedy_indices(table: torch.Tensor) -> torch.Tensor:
    """Candidate indices `(B, T)` of the greedy chain: the chain's own `walk_table` at T=0, run
    over the candidates' positions 0..K-1 instead of their token ids."""
    k = table.shape[-1]
    positions = torch.arange(k, device=table.device).expand(*table.shape[:-2], k)
    return walk_table(table, positions).tokens


def top_paths(table: torch.Tensor, num_paths: int, depth: int) -> torch.Tensor:
    """Candidate indices `(B, M, depth)` of M paths over the first `depth` slots of `table`.

    Path 0 is the greedy chain; paths 1.. are the best other paths by summed row log-softmax,
    best first (exact). Where the lattice has fewer than M paths the rest repeat path 0.
    """
    table = table[:, :depth]
    batch, _, k, _ = table.shape
    logp = torch.log_softmax(table, dim=-1)  # (B, D, K, K): rows are predecessors
    # Slot 0: one predecessor (the anchor); M partial paths per candidate, only rank 0 real.
    m = num_paths + 1  # one spare so the greedy chain can be dropped from the list
    neg = torch.finfo(logp.dtype).min / 4  # "no path"; stays finite when summed over slots
    score = torch.full((batch, k, m), neg, device=table.device)
    score[:, :, 0] = logp[:, 0, 0]
    back: list[torch.Tensor] = []  # per slot >= 1: (B, K, m) flat index pred * m + rank
    for t in range(1, depth):
        # (B, K_pred, m, 1) + (B, K_pred, 1, K_next) -> (B, K_next, K_pred * m)
        total = score[:, :, :, None] + logp[:, t][:, :, None, :]
        total = total.permute(0, 3, 1, 2).reshape(batch, k, k * m)
        score, index = torch.topk(total, m, dim=-1)  # sorted: rank 0 is the best
        back.append(index)
    final, flat = torch.topk(score.reshape(batch, k * m), m, dim=-1)  # (B, m)
    last, rank = flat // m, flat % m
    rows = [last]
    for index in reversed(back):
        rows_of = index.gather(1, last[:, :, None].expand(batch, m, m))  # (B, m, m)
        prev = rows_of.gather(2, rank[:, :, None]).squeeze(2)  # (B, m): pred * m + rank
        last, rank = prev // m, prev % m
        rows.append(last)
    paths = torch.stack(rows[::-1], dim=-1)  # (B, m, depth)
    chain = greedy_indices(table)  # (B, depth)
    # Drop the chain (and non-paths) from the list, put it first, keep the order otherwise.
    drop = (paths == chain[:, None]).all(-1) | (final <= neg / 2)
    order = torch.sort(drop.int(), dim=1, stable=True).indices[:, : num_paths - 1]
    others = paths.gather(1, order[:, :, None].expand(-1, -1, depth))
    others = torch.where(drop.gather(1, order)[:, :, None], chain[:, None], others)
    return torch.cat([chain[:, None], others], dim=1)


def build_tree(
    anchors: torch.Tensor,
    path_tokens: torch.Tensor,
    num_nodes: int,
    path_valid: torch.Tensor | None = None,
) -> TokenTree:
    """Merge `path_tokens (B, M, D)` (path 0 first) under `anchors (B,)` into <= N nodes.

    `path_valid (B, M, D)` marks the tokens each path really holds (a path shorter than D, or
    none at all); a path ends at its first invalid token. None: every token is valid."""
    batch, num_paths, depth = path_tokens.shape
    device = path_tokens.device
    if path_valid is None:
        path_valid = torch.ones_like(path_tokens, dtype=torch.bool)
    path_valid = path_valid.long().cumprod(dim=-1).bool()  # a path ends at its first gap
    # same[b, m, n, d]: paths m and n share their first d + 1 tokens, all of them valid.
    eq = path_tokens[:, :, None, :] == path_tokens[:, None, :, :]
    eq = eq & path_valid[:, :, None, :] & path_valid[:, None, :, :]
    same = eq.long().cumprod(dim=-1).bool()  # (B, M, M, D)
    owner = same.int().argmax(dim=2)  # (B, M, D): the first path holding this prefix
    own = torch.arange(num_paths, device=device)[None, :, None]
    is_new = (owner == own) & path_valid  # (B, M, D): this (path, depth) opens a node
    # Path-major order: the running count of new nodes is each new node's rank.
    rank = is_new.reshape(batch, -1).long().cumsum(-1).reshape(batch, num_paths, depth) - 1
    kept = is_new & (rank < num_nodes)
    # Block index (1-based) of the node holding prefix (m, d): its owner's rank + 1.
    node_of = rank.gather(1, owner) + 1  # (B, M, D)
    parent_of = torch.cat(
        [torch.zeros(batch, num_paths, 1, dtype=torch.long, device=device), node_of[..., :-1]],
        dim=-1,
    )
    depth_of = torch.arange(1, depth + 1, device=device).expand(batch, num_paths, depth)
    size = num_nodes + 1
    # Scatter each kept (path, depth) into its slot; the rest go to a dump slot past the end.
    target = torch.where(kept, node_of, size).reshape(batch, -1)

    def place(values: torch.Tensor, fill: int) -> torch.Tensor:
        out = torch.full((batch, size + 1), fill, dtype=torch.long, device=device)
        return out.scatter(1, target, values.reshape(batch, -1))[:, :size]

    tokens = place(path_tokens, 0)
    tokens[:, 0] = anchors
    parents = place(parent_of, 0)
    depths = place(depth_of, 1)  # padding nodes: a child of the root that nothing accepts
    depths[:, 0] = 0
    valid = place(torch.ones_like(path_tokens), 0).bool()
    valid[:, 0] = True
    return TokenTree(tokens, parents, depths, valid, ancestor_mask(parents, depth))


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """`(B, N + 1, N + 1)`: `[i, j]` True where j is i or one of its ancestors."""
    batch, size = parents.shape
    node = torch.arange(size, device=parents.device).expand(batch, size)
    mask = torch.zeros(batch, size, size, dtype=torch.bool, device=parents.device)
    mask.scatter_(2, node[:, :, None], True)
    for _ in range(depth):  # the root is its own parent, so extra steps are harmless
        node = parents.gather(1, node)
        mask.scatter_(2, node[:, :, None], True)
    return mask


def propose_tree(
    draft: torch.nn.Module,
    cache: object,
    anchors: torch.Tensor,
    num_paths: int,
    num_nodes: int,
    depth: int,
    kv_len: int | None = None,
) -> TokenTree:
    """One draft forward per sequence, then the tree of its top-`num_paths` lattice paths."""
    tokens = lattice_paths(draft, cache, anchors, num_paths, depth, kv_len)
    return build_tree(anchors, tokens, num_nodes)


def lattice_paths(
    draft: torch.nn.Module,
    cache: object,
    anchors: torch.Tensor,
    num_paths: int,
    depth: int,
    kv_len: int | None = None,
) -> torch.Tensor:
    """Token ids `(B, M, depth)` of the top-`num_paths` lattice paths (path 0 the chain)."""
    slot_logits, pre, recv = draft.draft_forward(cache, anchors, kv_len)
    table, cand = lattice(draft, slot_logits, pre, recv, anchors)
    paths = top_paths(table, num_paths, depth)  # (B, M, D) candidate indices
    cand = cand[:, :depth]  # (B, D, K)
    return cand[:, None].expand(-1, num_paths, -1, -1).gather(-1, paths[..., None]).squeeze(-1)


def hybrid_tree(
    anchors: torch.Tensor,
    draft_paths: torch.Tensor | None,
    ngram_tokens: torch.Tensor,
    ngram_lengths: torch.Tensor,
    num_nodes: int,
) -> TokenTree:
    """One tree of the draft's lattice paths `(B, M, g)` (None: no draft) and each sequence's
    n-gram continuation `ngram_tokens (B, L)` of `ngram_lengths (B,)` tokens (0: no match).

    Path order, which decides what a node budget keeps: the draft's chain, then the n-gram
    branch, then the draft's other paths. Shared prefixes merge into one node, so an n-gram
    branch that agrees with the chain adds only the nodes past the agreement. The tree's depth
    is max(g, L)."""
    batch, width = ngram_tokens.shape
    device = ngram_tokens.device
    steps = torch.arange(width, device=device)
    ngram_valid = (steps[None, :] < ngram_lengths[:, None])[:, None]  # (B, 1, L)
    ngram = ngram_tokens[:, None]
    if draft_paths is None:
        return build_tree(anchors, ngram, num_nodes, ngram_valid)
    depth = max(width, draft_paths.shape[-1])
    tokens = [_pad(draft_paths[:, :1], depth), _pad(ngram, depth), _pad(draft_paths[:, 1:], depth)]
    valid = [
        _pad(torch.ones_like(draft_paths[:, :1], dtype=torch.bool), depth),
        _pad(ngram_valid, depth),
        _pad(torch.ones_like(draft_paths[:, 1:], dtype=torch.bool), depth),
    ]
    return build_tree(anchors, torch.cat(tokens, dim=1), num_nodes, torch.cat(valid, dim=1))


def _pad(paths: torch.Tensor, depth: int) -> torch.Tensor:
    """`paths (B, M, d)` padded with zeros (False) to `(B, M, depth)`."""
    return torch.nn.functional.pad(paths, (0, depth - paths.shape[-1]))
