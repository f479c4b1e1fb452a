"""Tree verification: one target forward over a token tree, greedy acceptance, compaction.

A round with `tree_paths` M > 1 (greedy shown; sampling below):

    propose_tree(draft, anchors)            -> tree of <= N nodes under each anchor (token_tree)
    target(tree) in one forward              -> logits and context features at every node; a node
                                                sits at position length + depth and sees the
                                                committed context and its own ancestors only
    greedy_tree_accept                       -> from the root, follow the child whose token is the
                                                target's argmax at the current node; that path
                                                plus the bonus token (argmax at its last node)
                                                (sampled_tree_accept when sampling)
    compact_path                             -> the accepted nodes' K/V moved to slots
                                                length + 0..a, their features gathered in order

The result is an ordinary `Acceptance` `(B, depth + 1)` plus path-ordered features, so the engine
records and commits it exactly as a chain round. Path 0 of every tree is the greedy chain, so a
greedy tree round never accepts fewer tokens than the chain round would. When sampling
(temperature > 0), `sampled_tree_accept` draws the target's token at each node and descends
while a child holds it: multi-candidate rejection with the tree's deterministic (point-mass)
candidates, lossless like the chain's rejection sampling.

The forward, the acceptance and the compaction are one step (`TreeVerifier.verify_step`), so
all of it is compiled and CUDA-graph-captured together; when sampling, its random draws are
inputs drawn just before from the call's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dspine_train.engine.acceptance import Acceptance
from dspine_train.engine.cuda_graphs import StepCache
from dspine_train.engine.kv_cache import StaticKVCache
from dspine_train.engine.sampling import tempered_probs
from dspine_train.engine.stats import StepTimer
from dspine_train.engine.token_tree import TokenTree, hybrid_tree, lattice_paths, propose_tree
from dspine_train.modeling.exponential_race import exponential_noise, race


def greedy_tree_accept(
    tree: TokenTree, logits: torch.Tensor, depth: int
) -> tuple[Acceptance, torch.Tensor]:
    """Greedy acceptance over `tree` (nodes at most `depth` deep) given target
    `logits (B, N + 1, V)` at its nodes.

    Returns the `Acceptance` (tokens `(B, depth + 1)`: the accepted path's tokens then the
    bonus) and `path (B, depth + 1)`: block indices of the root and the accepted nodes in
    order (entries past `num_accepted` repeat the last accepted node).
    """
    argmax = logits.argmax(-1)  # (B, N + 1)
    return _walk(tree, depth, lambda node, _: argmax.gather(1, node[:, None]).squeeze(1))


def sampled_tree_accept(
    tree: TokenTree,
    probs: torch.Tensor,
    depth: int,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[Acceptance, torch.Tensor]:
    """Lossless acceptance over `tree` when sampling; `probs (B, N + 1, V)` the target's
    distributions at its nodes (after temperature / top-p). Returns as `greedy_tree_accept`.
    The draw at level l (0: the root) is the exponential race with `noise[:, l]`, `noise
    (B, depth + 1, V)` Exp(1) draws (from `generator` when not given; given, the acceptance
    is a pure function of tensors, which the engine's tree step compiles and captures).

    The tree's candidates are deterministic (the top lattice paths), i.e. point-mass proposals.
    Multi-candidate rejection (SpecInfer) with point masses tries the children in turn: child c
    is accepted with probability residual(c), and a rejection removes c from the residual; child
    c is thus taken with probability p(c) and the walk stops with a draw from p restricted to
    the other tokens. That is the same law as drawing x ~ p at the node and descending when a
    child holds x, which is what this does: every emitted token is a draw from the target's
    distribution given the committed tokens and the accepted path, so the output has the law
    of plain sampling.
    """
    batch, _, vocab = probs.shape
    if noise is None:
        noise = exponential_noise((batch, depth + 1, vocab), generator, probs.device)

    def draw(node: torch.Tensor, level: int) -> torch.Tensor:
        rows = probs.gather(1, node[:, None, None].expand(-1, 1, vocab)).squeeze(1)  # (B, V)
        return race(rows, noise[:, level])

    return _walk(tree, depth, draw)


def _walk(
    tree: TokenTree, depth: int, choose: Callable[[torch.Tensor, int], torch.Tensor]
) -> tuple[Acceptance, torch.Tensor]:
    """From the root, descend to the child holding `choose(node, level)` (the target's token
    after `node`, `level` deep) while one does; the first token without a child, or the token
    after the deepest node, is the bonus. Static shapes: `depth` steps for every row, no host
    reads."""
    batch, device = tree.tokens.shape[0], tree.tokens.device
    node = torch.zeros(batch, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    bonus = torch.zeros(batch, dtype=torch.long, device=device)
    path, tokens, accepted = [node], [], []
    for level in range(depth):
        want = choose(node, level)  # (B,)
        match = (tree.parents == node[:, None]) & (tree.tokens == want[:, None]) & tree.valid
        match[:, 0] = False  # the root is its own parent, never its own child
        found = match.any(-1) & alive
        bonus = torch.where(alive & ~found, want, bonus)
        child = match.int().argmax(-1)  # siblings hold distinct tokens: at most one match
        node = torch.where(found, child, node)
        alive = found
        path.append(node)
        tokens.append(tree.tokens.gather(1, node[:, None]).squeeze(1))
        accepted.append(found)
    bonus = torch.where(alive, choose(node, depth), bonus)  # all levels accepted: one more
    prefix = torch.stack(accepted, dim=1) if accepted else alive[:, None][:, :0]  # (B, D)
    num_accepted = prefix.long().sum(-1)
    drafted = torch.stack(tokens, dim=1) if tokens else bonus[:, None][:, :0]
    out = torch.cat([drafted, bonus[:, None]], dim=1)
    out = out.scatter(1, num_accepted[:, None], bonus[:, None])
    return Acceptance(num_accepted, out, prefix), torch.stack(path, dim=1)


def compact_path(cache: StaticKVCache, path: torch.Tensor, batch: int) -> None:
    """Move the K/V of the accepted path's nodes (`path (B, D + 1)` block indices) to slots
    `lengths + 0..D` of every layer. Slots past the accepted ones receive copies of the last
    accepted node, past the committed length where nothing reads them."""
    lengths = cache.lengths[:batch, None]
    src = lengths + path  # (B, D + 1)
    dst = lengths + torch.arange(path.shape[1], device=path.device)[None, :]
    rows = torch.arange(batch, device=path.device)[:, None]
    for buffer in (cache.keys, cache.values):
        # Advanced indexing on (batch, slot): (B, D + 1, layers, heads, head_dim). Every source
        # is read before any write. (A gather / scatter_ along the slot axis is ~200x slower on
        # CPU: it walks the whole capacity.)
        moved = buffer[rows, :, :, src]
        buffer[rows, :, :, dst] = moved


class TreeVerifier:
    """The tree round's steps (see the module docstring), owned by the engine.

    `draft_step` (anchors -> the tree's fields; the budget `paths / nodes / depth` is a static
    argument) and `verify_step` (tree -> acceptance, compaction, the accepted path's features)
    have static shapes and run as `StepCache`s built with the engine's `step_options` (compiled
    and CUDA-graph-captured on CUDA, like the chain's steps). The verify step holds the target
    forward, the acceptance (greedy, or sampling with its randomness drawn ahead and passed in)
    and the K/V compaction in one graph: rerunning it (a capture's warm-up runs) rewrites the
    tree's K/V before moving them, so it is idempotent. `draft_cache()` returns the engine's
    current draft context cache.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        draft_cache: Callable[[], Any],
        step_options: dict[str, Any],
    ) -> None:
        self.target = target
        self.draft = draft
        self.draft_cache = draft_cache
        self.draft_steps = StepCache(self.draft_step, "tree draft", **step_options)
        self.hybrid_steps = StepCache(self.hybrid_step, "hybrid draft", **step_options)
        self.verify_steps = StepCache(self.verify_step, "tree verify", **step_options)

    @property
    def steps(self) -> tuple[StepCache, ...]:
        """The step caches (for capture counts and times)."""
        return self.draft_steps, self.hybrid_steps, self.verify_steps

    def draft_step(
        self, anchors: torch.Tensor, kv_len: int, paths: int, nodes: int, depth: int
    ) -> tuple[torch.Tensor, ...]:
        """The tree of each anchor as `TokenTree`'s fields, in order."""
        tree = propose_tree(self.draft, self.draft_cache(), anchors, paths, nodes, depth, kv_len)
        return tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestors

    def hybrid_step(
        self,
        anchors: torch.Tensor,
        ngram_tokens: torch.Tensor,
        ngram_lengths: torch.Tensor,
        kv_len: int,
        paths: int,
        nodes: int,
        depth: int,
    ) -> tuple[torch.Tensor, ...]:
        """The tree of the draft's top-`paths` lattice paths of `depth` tokens (`depth` 0: no
        draft forward) merged with each anchor's n-gram continuation (`hybrid_tree`)."""
        draft_paths = None
        if depth > 0:
            draft_paths = lattice_paths(
                self.draft, self.draft_cache(), anchors, paths, depth, kv_len
            )
        tree = hybrid_tree(anchors, draft_paths, ngram_tokens, ngram_lengths, nodes)
        return tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestors

    def verify_step(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        valid: torch.Tensor,
        ancestors: torch.Tensor,
        *sampling: torch.Tensor,
        kv_len: int,
        depth: int,
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor | None, ...]:
        """One target forward over the tree, acceptance, and the accepted path's K/V moved
        into order: `num_accepted (B,)`, `tokens (B, depth + 1)`, `accepted (B, depth)` (the
        `Acceptance`) and the path's features `(B, depth + 1, F)` (None without them).

        Greedy without `sampling`; sampling with `sampling = (temperature, noise)`: the
        temperature as a 0-dim tensor and the Exp(1) `noise (B, depth + 1, V)` of
        `sampled_tree_accept`."""
        tree = TokenTree(tokens, parents, depths, valid, ancestors)
        out = self.target(tokens, kv_len=kv_len, tree_depths=depths, tree_ancestors=ancestors)
        logits = self.target.logits(out.hidden)
        if sampling:
            temperature, noise = sampling
            probs = tempered_probs(logits, temperature, top_p)
            acc, path = sampled_tree_accept(tree, probs, depth, noise=noise)
        else:
            acc, path = greedy_tree_accept(tree, logits, depth)
        compact_path(self.target.cache, path, path.shape[0])
        features = out.features
        if features is not None:
            index = path[:, :, None].expand(-1, -1, features.shape[-1])
            features = features.gather(1, index)  # (B, D + 1, F): root, then accepted nodes
        return acc.num_accepted, acc.tokens, acc.accepted, features

    def run_round(
        self,
        anchors: torch.Tensor,
        budget: dict[str, int],
        draft_kv: int,
        verify_kv: int,
        sampling: tuple[float, float, torch.Generator | None, torch.Tensor | None],
        timer: StepTimer,
        ngram: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[Acceptance, torch.Tensor | None, torch.Tensor]:
        """Draft the trees, verify and accept them in one step: the `Acceptance`, the
        accepted path's features in order (root first), ready for the engine's commit, and the
        tree's tokens `(B, N + 1)` (path-major: nodes 1..g are the draft's chain).
        `sampling` is (temperature, top_p, generator, temperature as a 0-dim tensor);
        temperature 0 is greedy. `ngram` (tokens `(B, L)`, lengths `(B,)`) adds each anchor's
        n-gram branch (`hybrid_tree`); `budget["depth"]` 0 then drafts nothing."""
        step, inputs = self.draft_steps, (anchors,)
        depth = budget["depth"]
        if ngram is not None:
            step, inputs = self.hybrid_steps, (anchors, *ngram)
            depth = max(depth, ngram[0].shape[1])
        step.prepare(*inputs, kv_len=draft_kv, **budget)  # capture outside the timing
        with timer.section("draft"):
            tree = TokenTree(*step(*inputs, kv_len=draft_kv, **budget))
        inputs, static = self.verify_inputs(tree, depth, verify_kv, *sampling)
        self.verify_steps.prepare(*inputs, **static)
        with timer.section("verify"):
            num_accepted, tokens, accepted, features = self.verify_steps(*inputs, **static)
        return Acceptance(num_accepted, tokens, accepted), features, tree.tokens

    def verify_inputs(
        self,
        tree: TokenTree,
        depth: int,
        kv_len: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        scale: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """The verify step's inputs and static arguments. When sampling, the acceptance's
        Exp(1) draws are drawn here from `generator`, outside the step, and `scale` is the
        temperature as a 0-dim tensor (made here when not given)."""
        inputs = (tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestors)
        if temperature <= 0.0:
            return inputs, dict(kv_len=kv_len, depth=depth)
        batch, vocab = tree.tokens.shape[0], self.target.lm_head.weight.shape[0]
        noise = exponential_noise((batch, depth + 1, vocab), generator, tree.tokens.device)
        if scale is None:
            scale = torch.full((), temperature, device=tree.tokens.device)
        return (*inputs, scale, noise), dict(kv_len=kv_len, depth=depth, top_p=top_p)

    def warmup(
        self,
        batch: int,
        budget: dict[str, int],
        draft_kvs: list[int],
        verify_kvs: list[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        ngram_width: int = 0,
    ) -> None:
        """Capture both steps at these kv lengths (CUDA), or run each once (CPU); the verify
        step greedy, and also sampling at `top_p` when `temperature` > 0. `ngram_width` > 0:
        the hybrid draft step with n-gram branches of that many tokens."""
        anchors = torch.zeros(batch, dtype=torch.long, device=self.target.device)
        step, inputs, depth = self.draft_steps, (anchors,), budget["depth"]
        if ngram_width > 0:
            branch = torch.zeros(batch, ngram_width, dtype=torch.long, device=anchors.device)
            lengths = torch.full((batch,), ngram_width, dtype=torch.long, device=anchors.device)
            step, inputs = self.hybrid_steps, (anchors, branch, lengths)
            depth = max(depth, ngram_width)
        for kv in draft_kvs:
            step.prepare(*inputs, kv_len=kv, **budget)
        tree = TokenTree(*step(*inputs, kv_len=draft_kvs[0], **budget))
        settings = [(0.0, 1.0)] + ([(temperature, top_p)] if temperature > 0.0 else [])
        generator = torch.Generator(anchors.device).manual_seed(0)  # leave the global RNG be
        for temp, nucleus in settings:
            sampling = (temp, nucleus, generator)
            for kv in verify_kvs:
                inputs, static = self.verify_inputs(tree, depth, kv, *sampling)
                self.verify_steps.prepare(*inputs, **static)
            if not self.verify_steps.enabled:
                inputs, static = self.verify_inputs(tree, depth, verify_kvs[0], *sampling)
                self.verify_steps(*inputs, **static)
