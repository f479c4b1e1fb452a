"""Which tree to verify next: the round shape that maximises expected tokens per second.

A round's cost is the draft forward (when the draft runs) plus the target's verify of its
nodes; its gain is 1 + the drafted tokens the target accepts. On a GPU the verify costs about
the same for 1 or 30 nodes, so the widest tree wins; on a CPU the verify is compute-bound and
grows with the nodes, and a weak draft can cost more than it brings. The planner therefore

* measures the costs (`RoundCosts`): the seconds of one round of each shape (its draft forward,
  if any, and its verify), timed on the engine's own steps (`Engine.calibrate`, run by `warmup`
  and by the first call that needs it);
* estimates the gain of each shape from the call's own rounds so far: for the n-gram branch, the
  mean number of its tokens the target would take, per size n of the suffix that matched; for
  the draft, the same for its chain. A proposal is scored against the tokens the sequence goes
  on to commit (`round_results.ProposalLedger`), so an n-gram proposal is scored in every round,
  verified or not; the draft's chain is known only where the draft ran, so the draft is re-tried
  every `explore_every` rounds it did not run. Before any score it assumes one token each
  (`PRIOR_TOKENS`, counted as `PRIOR_WEIGHT` rounds);
* picks the shape with the largest `(1 + expected accepted) / cost`, where a plain step (one
  token for one 1-token verify) is always among the shapes: no tree is chosen whose expected
  gain does not pay for its cost.

Only which tree is verified changes: every round is verified losslessly, so the output is the
same whatever the planner chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_TOKENS = 1.0
PRIOR_WEIGHT = 2.0


@dataclass(frozen=True)
class RoundShape:
    """One kind of round: `draft_depth` drafted tokens per path (0: the draft does not run),
    `ngram` whether the n-gram branch is merged in, `nodes` the verified nodes (the root not
    counted; 0 is a plain decoding step), `draft_tree` whether the draft's part is a tree of
    its top paths rather than its chain."""

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
        block: the draft's tree, or any round with the n-gram branch merged in."""
        return self.ngram or self.draft_tree


def round_shapes(
    ngram_tokens: int | None, num_draft_tokens: int, tree_nodes: int | None
) -> list[RoundShape]:
    """The shapes a round may take, the widest (what a non-adaptive engine always verifies)
    last: a plain step; the n-gram branch alone (`ngram_tokens` nodes; None: no n-gram
    candidates); the draft's chain of g = `num_draft_tokens` (0: no draft) or its tree of
    `tree_nodes`; and the draft with the n-gram branch merged in."""
    shapes = [RoundShape("plain", 0)]
    if ngram_tokens is not None:
        shapes.append(RoundShape("ngram", ngram_tokens, 0, ngram=True))
    if num_draft_tokens > 0:
        draft_nodes = tree_nodes or num_draft_tokens
        drafted_tree = tree_nodes is not None
        name = "tree" if drafted_tree else "chain"
        shapes.append(RoundShape(name, draft_nodes, num_draft_tokens, draft_tree=drafted_tree))
        if ngram_tokens is not None:
            shapes.append(RoundShape("hybrid", draft_nodes + ngram_tokens, num_draft_tokens,
                                     ngram=True, draft_tree=drafted_tree))
    return shapes


@dataclass
class RoundCosts:
    """Measured seconds of one round of each shape (`seconds[shape.name]`: its draft forward,
    if any, and its verify), at batch size `batch`."""

    seconds: dict[str, float]
    batch: int

    def of(self, shape: RoundShape) -> float:
        return self.seconds[shape.name]


@dataclass
class _Mean:
    total: float = PRIOR_TOKENS * PRIOR_WEIGHT
    count: float = PRIOR_WEIGHT

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    @property
    def value(self) -> float:
        return self.total / self.count


@dataclass
class RoundPlanner:
    """Chooses each round's shape among `shapes` (see the module docstring); `adaptive=False`
    always takes the last shape (the widest: what the engine is configured to verify)."""

    shapes: Sequence[RoundShape]
    costs: RoundCosts | None
    adaptive: bool = True
    explore_every: int = 16
    _ngram: dict[int, _Mean] = field(default_factory=dict)
    _draft: _Mean = field(default_factory=_Mean)
    _since_draft: int = 0
    chosen: dict[str, int] = field(default_factory=dict)

    def choose(self, match_sizes: Sequence[int]) -> RoundShape:
        """The shape of the next round, given the n-gram suffix size matched by each running
        sequence (0: no match)."""
        shape = self.shapes[-1]
        if self.adaptive and self.costs is not None and len(self.shapes) > 1:
            explore = self._since_draft >= self.explore_every
            options = [s for s in self.shapes if s.drafts] if explore else self.shapes
            options = options or list(self.shapes)
            # Ties go to the wider shape (later in `shapes`): same expected rate, more chances.
            best = max(range(len(options)), key=lambda i: (self.rate(options[i], match_sizes), i))
            shape = options[best]
        self._since_draft = 0 if shape.drafts else self._since_draft + 1
        self.chosen[shape.name] = self.chosen.get(shape.name, 0) + 1
        return shape

    def expected(self, shape: RoundShape, match_sizes: Sequence[int]) -> float:
        """Expected accepted drafted tokens per sequence for `shape`."""
        if not match_sizes:
            return 0.0
        total = 0.0
        for size in match_sizes:
            gain = 0.0
            if shape.ngram and size > 0:
                gain = self._ngram_mean(size)
            if shape.drafts:
                gain = max(gain, self._draft.value)
            total += gain
        return total / len(match_sizes)

    def rate(self, shape: RoundShape, match_sizes: Sequence[int]) -> float:
        """Expected tokens per second of `shape` (1 + expected accepted, over its cost)."""
        assert self.costs is not None
        return (1.0 + self.expected(shape, match_sizes)) / max(self.costs.of(shape), 1e-9)

    def record_ngram(self, size: int, accepted: int) -> None:
        """One sequence's round: its n-gram proposal (suffix size `size` > 0) matched the
        target's tokens for `accepted` tokens."""
        self._ngram_stat(size).add(accepted)

    def record_draft(self, accepted: int) -> None:
        """One sequence's round where the draft ran: its chain matched `accepted` tokens."""
        self._draft.add(accepted)

    def _ngram_stat(self, size: int) -> _Mean:
        if size not in self._ngram:
            self._ngram[size] = _Mean()
        return self._ngram[size]

    def _ngram_mean(self, size: int) -> float:
        return self._ngram_stat(size).value


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
