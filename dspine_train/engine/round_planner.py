"""Which tree to verify next: the round shape that maximises expected tokens per second.

A round's cost is the draft forward (when the draft runs) plus the target's verify of its
nodes; its gain is 1 + the drafted tokens the target accepts. On a GPU the verify costs about
the same for 1 or 30 nodes, so the widest tree wins; on a CPU the verify is compute-bound and
grows with the nodes, and a weak draft can cost more than it brings. The planner therefore

* measures the costs (`RoundCosts`): the seconds of one round of each shape (its draft forward,
  if any, and its verify), timed on the engine's own steps (`Engine.calibrate`, run by `warmup`
  and by the first call that needs it). The n-gram branch alone is a chain of its first k
  tokens, one shape per k (`ngram_widths`: every k on a CPU, the widest on a GPU where the
  verify is flat), so a short match buys a short verify;
* estimates the gain of each shape from what its proposals scored so far (`PlannerMemory`):
  for the n-gram branch, the distribution of how many of its tokens the target took, per size n
  of the suffix that matched; for the draft, the same for its chain. The expected accepted
  tokens of a round verifying k of a proposal's tokens is E[min(accepted, k)]. A proposal is
  scored against the tokens the sequence goes on to commit (`round_results.ProposalLedger`), so
  an n-gram proposal is scored in every round, verified or not; the draft's chain is scored
  only where the draft ran, so the draft's estimate carries an exploration bonus (UCB:
  `EXPLORE * sqrt(ln rounds / draft observations)`) that re-tries it ever more rarely while it
  keeps losing. Scores decay (`DECAY` per observation), so the estimates follow the traffic,
  and they persist across the calls of one engine (what a server learns about its requests).
  Before any score each proposal is assumed to take one token (`PRIOR_TOKENS`, counted as
  `PRIOR_WEIGHT` observations);
* picks the shape with the largest `(1 + expected accepted) / cost`, where a plain step (one
  token for one 1-token verify) is always among the shapes: no tree is chosen whose expected
  gain does not pay for its cost.

Only which tree is verified changes: every round is verified losslessly, so the output is the
same whatever the planner chooses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_TOKENS = 1
PRIOR_WEIGHT = 2.0
DECAY = 0.98
EXPLORE = 1.0


@dataclass(frozen=True)
class RoundShape:
    """One kind of round: `draft_depth` drafted tokens per path (0: the draft does not run),
    `ngram` whether the n-gram branch is verified, `nodes` the verified nodes (the root not
    counted; 0 is a plain decoding step), `draft_tree` whether the draft's part is a tree of
    its top paths rather than its chain. The n-gram branch alone is a chain of its first
    `nodes` tokens; merged with the draft it is a branch of the draft's tree."""

    name: str
    nodes: int
    draft_depth: int = 0
    ngram: bool = False
    draft_tree: bool = False

    @property
    def drafts(self) -> bool:
        return self.draft_depth > 0

    @property
    def tree(self) -> bool:
        """Whether the round verifies a token tree (`engine.tree_verify`) rather than a chain
        block: the draft's tree, or the draft with the n-gram branch merged in."""
        return self.draft_tree or (self.ngram and self.drafts)

    @property
    def key(self) -> str:
        """The shape's name in `RoundCosts`: the n-gram chains by their width."""
        return f"{self.name}{self.nodes}" if self.ngram and not self.drafts else self.name


def round_shapes(
    ngram_widths: Sequence[int] | None, num_draft_tokens: int, tree_nodes: int | None
) -> list[RoundShape]:
    """The shapes a round may take, the widest (what a non-adaptive engine with a draft always
    verifies) last: a plain step; the n-gram branch alone, a chain of each width in
    `ngram_widths` (None: no n-gram candidates); the draft's chain of g = `num_draft_tokens`
    (0: no draft) or its tree of `tree_nodes`; and the draft with the widest n-gram branch
    merged in."""
    shapes = [RoundShape("plain", 0)]
    widths = sorted(ngram_widths or [])
    shapes += [RoundShape("ngram", k, 0, ngram=True) for k in widths]
    if num_draft_tokens > 0:
        draft_nodes = tree_nodes or num_draft_tokens
        drafted_tree = tree_nodes is not None
        name = "tree" if drafted_tree else "chain"
        shapes.append(RoundShape(name, draft_nodes, num_draft_tokens, draft_tree=drafted_tree))
        if widths:
            shapes.append(RoundShape("hybrid", draft_nodes + widths[-1], num_draft_tokens,
                                     ngram=True, draft_tree=drafted_tree))
    return shapes


@dataclass
class RoundCosts:
    """Measured seconds of one round of each shape (`seconds[shape.key]`: its draft forward,
    if any, and its verify), at batch size `batch`."""

    seconds: dict[str, float]
    batch: int

    def of(self, shape: RoundShape) -> float:
        return self.seconds[shape.key]


@dataclass
class AcceptedCounts:
    """How many tokens of a proposal the target took: a decayed histogram (`weights[j]`: the
    weight of proposals of which exactly j tokens were taken), starting from the prior."""

    weights: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.weights:
            self.weights = [0.0] * (PRIOR_TOKENS + 1)
            self.weights[PRIOR_TOKENS] = PRIOR_WEIGHT

    def add(self, accepted: int) -> None:
        self.weights = [w * DECAY for w in self.weights]
        if accepted >= len(self.weights):
            self.weights += [0.0] * (accepted + 1 - len(self.weights))
        self.weights[accepted] += 1.0

    @property
    def total(self) -> float:
        return sum(self.weights)

    def expected(self, limit: int) -> float:
        """Expected tokens taken by a round that verifies at most `limit` of them."""
        return sum(w * min(j, limit) for j, w in enumerate(self.weights)) / self.total


@dataclass
class PlannerMemory:
    """What the proposals scored so far (kept by the engine across its calls): the n-gram
    branch per matched suffix size, the draft's chain, and the rounds planned."""

    ngram: dict[int, AcceptedCounts] = field(default_factory=dict)
    draft: AcceptedCounts = field(default_factory=AcceptedCounts)
    draft_observations: float = 0.0
    rounds: int = 0

    def ngram_counts(self, size: int) -> AcceptedCounts:
        if size not in self.ngram:
            self.ngram[size] = AcceptedCounts()
        return self.ngram[size]


@dataclass
class RoundPlanner:
    """Chooses each round's shape among `shapes` (see the module docstring). `adaptive=False`
    verifies what the engine is configured to: the widest shape with a draft, and without one
    the n-gram chain just wide enough for the longest proposal (a plain step when nothing
    matched), as prompt-lookup decoding does."""

    shapes: Sequence[RoundShape]
    costs: RoundCosts | None
    adaptive: bool = True
    memory: PlannerMemory = field(default_factory=PlannerMemory)
    chosen: dict[str, int] = field(default_factory=dict)

    def choose(
        self, match_sizes: Sequence[int], proposal_lengths: Sequence[int] | None = None
    ) -> RoundShape:
        """The shape of the next round, given the n-gram suffix size matched by each running
        sequence (0: no match) and the length of its proposal (default: as long as any)."""
        lengths = list(proposal_lengths) if proposal_lengths is not None else [
            max((s.nodes for s in self.shapes), default=0) if n > 0 else 0 for n in match_sizes]
        if self.adaptive and self.costs is not None and len(self.shapes) > 1:
            # Ties go to the wider shape (later in `shapes`): same expected rate, more chances.
            best = max(range(len(self.shapes)),
                       key=lambda i: (self.rate(self.shapes[i], match_sizes, lengths), i))
            shape = self.shapes[best]
        else:
            shape = self._configured(lengths)
        self.memory.rounds += 1
        self.chosen[shape.name] = self.chosen.get(shape.name, 0) + 1
        return shape

    def _configured(self, lengths: Sequence[int]) -> RoundShape:
        if any(s.drafts for s in self.shapes):
            return self.shapes[-1]
        longest = max(lengths, default=0)
        chains = [s for s in self.shapes if s.ngram and s.nodes >= longest]
        return self.shapes[0] if longest == 0 or not chains else chains[0]

    def expected(
        self, shape: RoundShape, match_sizes: Sequence[int], lengths: Sequence[int]
    ) -> float:
        """Expected accepted drafted tokens per sequence for `shape` (with the draft's
        exploration bonus)."""
        if not match_sizes:
            return 0.0
        draft = self._draft_gain(shape.draft_depth) if shape.drafts else 0.0
        total = 0.0
        for size, length in zip(match_sizes, lengths, strict=True):
            gain = 0.0
            if shape.ngram and size > 0 and length > 0:
                gain = self.memory.ngram_counts(size).expected(min(shape.nodes, length))
            total += max(gain, draft)
        return total / len(match_sizes)

    def _draft_gain(self, depth: int) -> float:
        memory = self.memory
        bonus = EXPLORE * math.sqrt(
            math.log(memory.rounds + 1) / (memory.draft_observations + PRIOR_WEIGHT))
        return memory.draft.expected(depth) + bonus

    def rate(
        self, shape: RoundShape, match_sizes: Sequence[int], lengths: Sequence[int]
    ) -> float:
        """Expected tokens per second of `shape` (1 + expected accepted, over its cost)."""
        assert self.costs is not None
        gain = self.expected(shape, match_sizes, lengths)
        return (1.0 + gain) / max(self.costs.of(shape), 1e-9)

    def record_ngram(self, size: int, accepted: int) -> None:
        """One sequence's round: its n-gram proposal (suffix size `size` > 0) matched the
        target's tokens for `accepted` tokens."""
        self.memory.ngram_counts(size).add(accepted)

    def record_draft(self, accepted: int) -> None:
        """One sequence's round where the draft ran: its chain matched `accepted` tokens."""
        self.memory.draft.add(accepted)
        self.memory.draft_observations += 1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
