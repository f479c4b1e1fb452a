"""N-gram candidates and hybrid trees (engine.ngram, token_tree.hybrid_tree, round_planner)."""

from __future__ import annotations

import random

import pytest
import torch
from _engine_helpers import (
    assert_sampled_like,
    build_tiny_target,
    hf_greedy,
    sample_rows,
    sampling_engine,
    tiny_draft,
    train_draft_briefly,
)
from test_engine_tree import _reference_tree

from dspine_train.engine import Engine
from dspine_train.engine.errors import GenerationInputError
from dspine_train.engine.ngram import NgramConfig, NgramIndex, pack_proposals
from dspine_train.engine.prompts import SequenceState
from dspine_train.engine.round_planner import (
    PRIOR_TOKENS,
    PRIOR_WEIGHT,
    RoundCosts,
    RoundPlanner,
    round_shapes,
)
from dspine_train.engine.round_results import ProposalLedger
from dspine_train.engine.token_tree import hybrid_tree

NEW = 24


def reference_proposal(tokens: list[int], config: NgramConfig) -> tuple[list[int], int]:
    """Plain-Python prompt lookup: scan every earlier window for the longest suffix."""
    for n in range(config.max_n, config.min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        starts = [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            start = starts[0] if config.match == "earliest" else starts[-1]
            return tokens[start : start + config.num_tokens], n
    return [], 0


@pytest.mark.parametrize("match", ["earliest", "latest"])
@pytest.mark.parametrize("max_n,min_n", [(3, 1), (4, 2), (1, 1)])
def test_index_matches_a_plain_python_scan(match, max_n, min_n):
    config = NgramConfig(max_n=max_n, min_n=min_n, num_tokens=5, match=match)
    rng = random.Random(max_n * 10 + min_n)
    for _ in range(20):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 40))]
        index = NgramIndex(config, tokens[:3])
        for cut in range(3, len(tokens) + 1):  # grown a few tokens at a time, as the engine does
            index.extend(tokens[len(index.tokens) : cut])
            assert index.propose() == reference_proposal(tokens[:cut], config), (tokens, cut)


def test_index_proposes_the_prompt_continuation():
    index = NgramIndex(NgramConfig(max_n=3, min_n=1, num_tokens=4), [5, 6, 7, 8, 9, 1, 5, 6])
    assert index.propose() == ([7, 8, 9, 1], 2)  # "5 6" stood before, followed by 7 8 9 1
    index.extend([2])
    assert index.propose() == ([], 0)  # 2 never occurred before


def test_bad_ngram_settings_are_refused():
    for kwargs, flag in [(dict(min_n=0), "--ngram-min-n"), (dict(max_n=1, min_n=2), "--ngram-max-n"),
                         (dict(num_tokens=0), "--ngram-tokens"), (dict(match="first"), "--ngram-match")]:
        with pytest.raises(GenerationInputError, match=flag):
            NgramConfig(**kwargs)


def test_hybrid_tree_merges_the_ngram_branch_after_the_chain():
    anchors = torch.tensor([100, 101, 102])
    draft = torch.tensor([[[1, 2, 3], [1, 4, 5]], [[1, 2, 3], [6, 6, 6]], [[7, 8, 9], [7, 8, 1]]])
    ngram = torch.tensor([[1, 2, 9, 9], [5, 5, 0, 0], [0, 0, 0, 0]])
    lengths = torch.tensor([4, 2, 0])
    tree = hybrid_tree(anchors, draft, ngram, lengths, num_nodes=9)
    for b in range(3):
        paths = [draft[b, 0].tolist(), ngram[b, : lengths[b]].tolist(), *draft[b, 1:].tolist()]
        ref = _reference_tree(paths, 9)
        n = len(ref)
        assert tree.tokens[b, 0] == anchors[b]
        assert tree.valid[b].tolist() == [True] * (n + 1) + [False] * (9 - n)
        got = list(zip(tree.tokens[b, 1 : n + 1].tolist(), tree.parents[b, 1 : n + 1].tolist(),
                       tree.depths[b, 1 : n + 1].tolist()))
        assert got == ref
    # Without a draft the tree is the n-gram branch alone; no match leaves only the root.
    alone = hybrid_tree(anchors, None, ngram, lengths, num_nodes=4)
    assert alone.valid.sum(-1).tolist() == [5, 3, 1]
    assert alone.tokens[0, 1:].tolist() == [1, 2, 9, 9]


def test_pack_proposals_pads_and_cuts():
    tokens, lengths = pack_proposals([[4, 5], [], [1, 2, 3, 4]], 3, torch.device("cpu"))
    assert tokens.tolist() == [[4, 5, 0], [0, 0, 0], [1, 2, 3]]
    assert lengths.tolist() == [2, 0, 3]


# ----------------------------------------------------------------------------- the planner
WIDTHS = [1, 2, 4, 7]  # the n-gram chains a planner may verify (an engine offers 1..num_tokens)


def _costs(per_node: float, draft: float = 1.5) -> RoundCosts:
    """A verify costing 1 + `per_node` per token past the root; a draft forward `draft`."""
    seconds = {"plain": 1.0, "chain": draft + 1.0 + 7 * per_node,
               "hybrid": draft + 1.0 + 14 * per_node}
    seconds.update({f"ngram{k}": 1.0 + k * per_node for k in WIDTHS})
    return RoundCosts(seconds, 1)


def _planner(costs: RoundCosts) -> RoundPlanner:
    return RoundPlanner(round_shapes(WIDTHS, 7, None), costs, adaptive=True)


@pytest.mark.parametrize("tree_nodes", [None, 12])
def test_round_shapes_say_which_rounds_verify_a_tree(tree_nodes):
    """A plain step, the draft's chain and the n-gram branch alone (a chain of its first k
    tokens, one shape per k) verify a chain block; the n-gram branch merged into the draft's
    part and the draft's tree of its top paths verify a token tree."""
    shapes = round_shapes([1, 2, 7], 7, tree_nodes)
    draft = "chain" if tree_nodes is None else "tree"
    assert [(s.name, s.nodes) for s in shapes] == [
        ("plain", 0), ("ngram", 1), ("ngram", 2), ("ngram", 7), (draft, tree_nodes or 7),
        ("hybrid", (tree_nodes or 7) + 7)]
    assert [s.key for s in shapes] == ["plain", "ngram1", "ngram2", "ngram7", draft, "hybrid"]
    assert [s.tree for s in shapes] == [False, False, False, False, tree_nodes is not None, True]
    assert [s.tree for s in round_shapes(None, 7, tree_nodes)] == [False, tree_nodes is not None]


def test_planner_falls_back_to_plain_steps_when_drafting_does_not_pay():
    planner = _planner(_costs(0.1))
    for _ in range(40):  # nothing the draft or the n-gram branch proposed was taken
        planner.record_draft(0)
        planner.record_ngram(1, 0)
    assert planner.choose([1], [7]).name == "plain"
    assert planner.choose([0], [0]).name == "plain"


def test_planner_verifies_as_much_of_the_ngram_branch_as_pays():
    """Long matches are taken whole (the widest chain); a proposal shorter than the widest
    buys only the width it needs; one-token matches that the target never takes: plain."""
    planner = _planner(_costs(0.1))
    for _ in range(40):
        planner.record_draft(0)
        planner.record_ngram(3, 6)  # long matches: 6 tokens taken
        planner.record_ngram(1, 0)  # one-token matches: nothing
    assert (planner.choose([3], [7]).name, planner.choose([3], [7]).nodes) == ("ngram", 7)
    assert planner.choose([3], [2]).nodes == 2  # only two tokens proposed: a 2-token chain
    assert planner.choose([1], [7]).name == "plain"
    # A match that pays for one token but rarely for more: the short chain.
    short = _planner(_costs(0.3))
    for _ in range(40):
        short.record_draft(0)
        short.record_ngram(2, 1)
    assert (short.choose([2], [7]).name, short.choose([2], [7]).nodes) == ("ngram", 1)
    # With flat costs (a GPU) the widest tree wins.
    flat = _planner(RoundCosts(dict.fromkeys(_costs(0.1).seconds, 1.0), 1))
    flat.record_draft(2)
    assert flat.choose([3], [7]).name == "hybrid"


def test_planner_retries_a_losing_draft_ever_more_rarely():
    """The draft is scored only where it runs: its estimate carries an exploration bonus, so a
    draft that keeps losing is re-tried, less and less often."""
    planner = _planner(_costs(0.1, draft=0.3))  # a chain round costs two plain steps
    names = []
    for _ in range(4000):
        names.append(planner.choose([0], [0]).name)
        if names[-1] == "chain":
            planner.record_draft(0)  # it never pays
    tries = [i for i, name in enumerate(names) if name == "chain"]
    assert set(names) == {"plain", "chain"}
    early, late = sum(1 for i in tries if i < 1000), sum(1 for i in tries if i >= 1000)
    assert early > late >= 1, tries  # re-tried later, but more rarely than at first
    non_adaptive = _planner(_costs(0.1))
    non_adaptive.adaptive = False
    assert non_adaptive.choose([0], [0]).name == "hybrid"


def test_non_adaptive_ngram_mode_verifies_the_proposal_found():
    """Without a draft, the configured n-gram mode verifies a chain as long as the longest
    proposal (the widest when longer) and takes a plain step when nothing matched, as
    transformers' prompt lookup does."""
    planner = RoundPlanner(round_shapes(list(range(1, 8)), 0, None), None, adaptive=False)
    assert (planner.choose([2, 1], [3, 5]).name, planner.choose([2, 1], [3, 5]).nodes) == (
        "ngram", 5)
    assert planner.choose([0], [0]).name == "plain"
    assert planner.choose([3], [7]).nodes == 7


def test_planner_memory_outlives_a_call(world):
    """What the proposals scored persists across an engine's calls (an adaptive engine learns
    its traffic), and is reset with the n-gram settings."""
    engine = _engine(world, draft=False, ngram=NgramConfig(max_n=2, min_n=1, num_tokens=6),
                     adaptive=True)
    engine.generate([world["prompts"][0]], max_new_tokens=12, chat=False)
    memory = engine.planner_memory
    assert memory.rounds > 0 and memory.ngram
    rounds = memory.rounds
    engine.generate([world["prompts"][1]], max_new_tokens=12, chat=False)
    assert engine.planner_memory is memory and memory.rounds > rounds
    engine.configure_ngram(NgramConfig(max_n=2, min_n=1, num_tokens=6), adaptive=True)
    assert engine.planner_memory.rounds == 0


def test_ledger_scores_proposals_against_what_the_sequence_commits():
    """A proposal is scored on the tokens committed after it, even by plain steps that verified
    none of it, as soon as a token differs; a sequence that ends first drops what it cannot
    score."""
    planner = _planner(_costs(0.1))
    ledger = ProposalLedger(planner, 3)
    states = [SequenceState(10, (), None), SequenceState(2, (), None),
              SequenceState(10, (), None)]
    for state in states:
        state.extend([4], ends_with_eos=False)
    ledger.propose(0, 1, "ngram", 2, [5, 6, 7])
    ledger.propose(0, 1, "draft", 0, [5, 9])
    ledger.propose(1, 1, "ngram", 2, [5, 6, 7])
    ledger.propose(2, 1, "ngram", 3, [8, 6, 7])
    scored = []
    for token in (5, 6, 8):  # three plain steps, one token each
        for b, state in enumerate(states):
            if not state.done:
                state.extend([token], ends_with_eos=False)
            ledger.settle(b, state)
        scored.append((dict(planner.memory.ngram), planner.memory.draft_observations))
    # step 1: row 2's proposal (8, ...) differs at once -> scored 0 then; step 2: the draft's
    # (5, 9) differs at its second token -> scored 1; step 3: row 0's -> 2 (5, 6 matched).
    assert 3 in scored[0][0] and 2 not in scored[0][0] and scored[0][1] == 0
    assert scored[1][1] == 1 and 2 not in scored[1][0]
    expected = PRIOR_TOKENS * PRIOR_WEIGHT
    assert planner.memory.ngram[3].expected(7) == pytest.approx(
        (expected * 0.98 + 0) / (PRIOR_WEIGHT * 0.98 + 1))
    assert planner.memory.ngram[2].expected(7) == pytest.approx(  # row 1 ended: not scored
        (expected * 0.98 + 2) / (PRIOR_WEIGHT * 0.98 + 1))
    assert planner.memory.draft.expected(7) == pytest.approx(
        (expected * 0.98 + 1) / (PRIOR_WEIGHT * 0.98 + 1))


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target, a briefly trained draft, and prompts that repeat themselves (a
    prompt, its greedy continuation, the prompt again: the continuation is worth copying)."""
    root = tmp_path_factory.mktemp("ngram")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=4, eos_token_id=None
    )
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 9, (8,), generator=gen).tolist()
    heads = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]
    prompts = [h + hf_greedy(hf, h, 12) + h for h in heads]
    sequences = torch.tensor([p[:16] + hf_greedy(hf, p[:16], 24) for p in prompts])
    train_draft_briefly(tiny_draft(hf, 200), hf, sequences, steps=30, lr=1e-2).save_pretrained(
        root / "draft"
    )
    return {"root": root, "prompts": prompts}


def _engine(world, draft=True, **kwargs) -> Engine:
    root = world["root"]
    return Engine.from_pretrained(
        root / "target", root / "draft" if draft else None, max_seq_len=128, eos_token_ids=[],
        max_batch_size=4, **kwargs,
    )


@pytest.mark.parametrize(
    "draft,paths,adaptive", [(False, 1, False), (True, 1, False), (True, 3, False),
                             (True, 1, True), (False, 1, True)],
)
def test_ngram_and_hybrid_rounds_are_lossless(world, draft, paths, adaptive):
    engine = _engine(world, draft, ngram=NgramConfig(max_n=3, min_n=1, num_tokens=6),
                     tree_paths=paths, adaptive=adaptive)
    prompts = world["prompts"]
    taus = []
    for start in range(0, len(prompts), 3):  # ragged batches of 3, 3 and 2
        batch = prompts[start : start + 3]
        ar = engine.generate_ar(batch, max_new_tokens=NEW, chat=False)
        out = engine.generate(batch, max_new_tokens=NEW, chat=False)
        assert out.token_ids == ar.token_ids
        taus.append(out.stats.tau)
        assert sum(out.stats.round_shapes.values()) == out.stats.steps
    # The prompts repeat themselves: copying them is taken by the target. (An adaptive engine
    # may prefer plain steps on a CPU, where a tiny target's verify grows with the nodes.)
    assert adaptive or max(taus) > 1.5, taus


def test_pure_ngram_mode_needs_no_draft_and_copies(world):
    engine = _engine(world, draft=False, ngram=NgramConfig(max_n=2, min_n=1, num_tokens=8))
    prompt = world["prompts"][0]
    out = engine.generate([prompt], max_new_tokens=12, chat=False)
    assert out.token_ids == engine.generate_ar([prompt], max_new_tokens=12, chat=False).token_ids
    assert out.stats.steps < 12  # some rounds took several tokens
    # Each round verified the proposal found and no more (a plain step where none was), as
    # prompt lookup does: replay the rounds with the plain-Python matcher.
    config, tokens, widths = engine.ngram, [], []
    for accepted in [0] + out.stats.round_accepted[0]:  # the prefill's token, then each round
        tokens = out.token_ids[0][: len(tokens) + accepted + 1]
        widths.append(len(reference_proposal(prompt + tokens, config)[0]))
    widths = widths[: out.stats.steps]
    assert out.stats.nodes_verified == sum(widths)
    assert out.stats.round_shapes == {
        name: count for name, count in (("ngram", sum(w > 0 for w in widths)),
                                        ("plain", widths.count(0))) if count}
    plain = _engine(world, draft=False)
    with pytest.raises(GenerationInputError, match="--ngram"):
        plain.generate([prompt], max_new_tokens=4, chat=False)


def test_adaptive_engine_measures_its_rounds(world):
    engine = _engine(world, ngram=NgramConfig(), adaptive=True)
    engine.warmup(batch_sizes=[2], num_draft_tokens=[engine.block_size - 1])
    costs = engine._costs[(2, engine.block_size - 1)]
    assert set(costs.seconds) == {"plain", "chain", "hybrid"} | {f"ngram{k}" for k in range(1, 8)}
    assert all(s > 0 for s in costs.seconds.values())


def test_hybrid_sampling_matches_the_target_distribution(tmp_path):
    """First three sampled tokens with hybrid trees vs the target's exact marginals."""
    prompt, rows = [3, 17, 8, 3, 17, 8, 25, 3], 500
    engine, exact = sampling_engine(
        tmp_path, prompt, rows, tree_paths=2, ngram=NgramConfig(max_n=2, min_n=1, num_tokens=3)
    )
    tokens, results = sample_rows(engine, prompt, rows)
    for result in results:
        assert result.stats.round_shapes.get("hybrid", 0) == result.stats.steps
    assert_sampled_like(tokens, exact)


def test_an_ngram_branch_that_does_not_fit_the_cache_is_refused_by_name(world):
    engine = _engine(world, ngram=NgramConfig(num_tokens=200))
    with pytest.raises(GenerationInputError, match=r"ngram tokens=200; CLI: .*--ngram-tokens"):
        engine.generate([[1, 2, 3]], max_new_tokens=8, chat=False)
