"""Token-tree verification over the DSpine lattice (engine.token_tree, engine.tree_verify)."""

from __future__ import annotations

import itertools

import pytest
import torch
from _engine_helpers import (
    assert_sampled_like,
    build_tiny_target,
    build_tokenizer,
    hf_greedy,
    sample_rows,
    sampling_engine,
    tiny_draft,
    train_draft_briefly,
)

from dspine_train.engine import Engine, load_target
from dspine_train.engine.decode_loop import chain_round, round_of
from dspine_train.engine.errors import GenerationInputError
from dspine_train.engine.sampling import Sampler
from dspine_train.engine.stats import StepTimer
from dspine_train.engine.token_tree import build_tree, greedy_indices, top_paths
from dspine_train.engine.tree_verify import greedy_tree_accept, sampled_tree_accept
from dspine_train.modeling.transition_cache import walk_table

NEW = 20


# ----------------------------------------------------------------------------- proposal
def _path_score(logp: torch.Tensor, path: tuple[int, ...]) -> float:
    score, prev = 0.0, 0
    for t, j in enumerate(path):
        score += float(logp[t, prev, j])
        prev = j
    return score


@pytest.mark.parametrize("num_paths", [1, 2, 5, 27, 40])
def test_top_paths_are_the_chain_then_the_best_others(num_paths):
    gen = torch.Generator().manual_seed(num_paths)
    batch, depth, k = 3, 3, 3
    table = torch.randn(batch, depth + 1, k, k, generator=gen)
    table[:, 0] = table[:, 0, :1]  # slot 0 has one predecessor: identical rows
    paths = top_paths(table, num_paths, depth)
    assert paths.shape == (batch, num_paths, depth)
    # Path 0 is the chain the transition-cache walk decodes.
    cand = torch.arange(k).expand(batch, depth, k)
    walked = walk_table(table[:, :depth], cand).tokens
    assert torch.equal(paths[:, 0], walked)
    assert torch.equal(paths[:, 0], greedy_indices(table[:, :depth]))
    logp = torch.log_softmax(table[:, :depth], dim=-1)
    for b in range(batch):
        chain = tuple(paths[b, 0].tolist())
        others = sorted(
            (p for p in itertools.product(range(k), repeat=depth) if p != chain),
            key=lambda p: -_path_score(logp[b], p),
        )
        want = others[: num_paths - 1]
        got = [tuple(p) for p in paths[b, 1:].tolist()]
        # Where the lattice has fewer paths than asked for, the rest repeat the chain.
        assert got == want + [chain] * (num_paths - 1 - len(want))


def _reference_tree(paths: list[list[int]], num_nodes: int):
    """Unique prefixes in path-major order, cut at num_nodes: (token, parent, depth) per node."""
    index: dict[tuple[int, ...], int] = {(): 0}
    nodes = []
    for path in paths:
        for d in range(len(path)):
            prefix = tuple(path[: d + 1])
            if prefix not in index and len(nodes) < num_nodes:
                index[prefix] = len(nodes) + 1
                nodes.append((path[d], index[prefix[:-1]], d + 1))
    return nodes


@pytest.mark.parametrize("num_paths,num_nodes", [(1, 4), (3, 12), (6, 7), (6, 24), (8, 30)])
def test_build_tree_merges_prefixes_in_path_major_order(num_paths, num_nodes):
    gen = torch.Generator().manual_seed(num_nodes)
    batch, depth = 4, 4
    # Few distinct tokens, so paths share prefixes (and some repeat entirely).
    paths = torch.randint(0, 3, (batch, num_paths, depth), generator=gen)
    anchors = torch.arange(batch) + 100
    tree = build_tree(anchors, paths, num_nodes)
    for b in range(batch):
        ref = _reference_tree(paths[b].tolist(), num_nodes)
        n = len(ref)
        assert tree.tokens[b, 0] == anchors[b] and tree.depths[b, 0] == 0
        assert tree.valid[b].tolist() == [True] * (n + 1) + [False] * (num_nodes - n)
        assert [tuple(x) for x in zip(
            tree.tokens[b, 1 : n + 1].tolist(),
            tree.parents[b, 1 : n + 1].tolist(),
            tree.depths[b, 1 : n + 1].tolist(),
        )] == ref
        for i in range(num_nodes + 1):  # ancestors: follow parents by hand
            chain, node = {0, i}, i
            while node != 0:
                node = int(tree.parents[b, node])
                chain.add(node)
            want = [j in chain for j in range(num_nodes + 1)]
            assert tree.ancestors[b, i].tolist() == want


def test_greedy_tree_accept_follows_the_target_argmax():
    # root -> a(1) -> b(2); root -> c(3) -> d(4); vocab 10.
    tokens = torch.tensor([[9, 5, 6, 7, 8]])
    paths = torch.tensor([[[5, 6], [7, 8]]])
    tree = build_tree(tokens[:, 0], paths, 4)
    assert torch.equal(tree.tokens, tokens)
    logits = torch.zeros(1, 5, 10)
    logits[0, 0, 7] = logits[0, 3, 8] = logits[0, 4, 2] = 1.0  # target: 7, 8, then 2
    acc, path = greedy_tree_accept(tree, logits, depth=2)
    assert acc.num_accepted.tolist() == [2]
    assert acc.tokens.tolist() == [[7, 8, 2]] and path.tolist() == [[0, 3, 4]]
    logits[0, 3, 8], logits[0, 3, 1] = 0.0, 1.0  # now the target wants 1 after 7: bonus 1
    acc, path = greedy_tree_accept(tree, logits, depth=2)
    assert acc.num_accepted.tolist() == [1] and acc.tokens[0, :2].tolist() == [7, 1]


# ----------------------------------------------------------------------------- tree attention
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target, a briefly trained DSpine draft, ragged prompts and their greedy
    continuations."""
    root = tmp_path_factory.mktemp("tree")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=4, eos_token_id=None
    )
    build_tokenizer(root / "target", vocab_size=200)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 11, (12,), generator=gen).tolist()
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts[:8]])
    draft = train_draft_briefly(tiny_draft(hf, 200), hf, sequences, steps=40, lr=1e-2)
    draft.save_pretrained(root / "draft")
    return {"root": root, "prompts": prompts, "sequences": sequences}


def _engine(world, **kwargs) -> Engine:
    kwargs.setdefault("max_batch_size", 4)
    root = world["root"]
    return Engine.from_pretrained(
        root / "target", root / "draft", max_seq_len=112, eos_token_ids=[], **kwargs
    )


@pytest.mark.parametrize("family", ["qwen3", "gemma3-sliding"])
def test_tree_attention_equals_each_path_run_alone(world, family, tmp_path):
    path = world["root"] / "target"
    if family != "qwen3":
        from _full_vocab_helpers import build_full_vocab_target

        # Sliding-window layers whose window (2) is shorter than the tree depth (3).
        path = tmp_path / "gemma"
        build_full_vocab_target(path, "gemma", sliding_window=2)
    target = load_target(path)
    target.set_feature_layers([1, 3])
    target.setup(2, 64)
    prompts = [world["prompts"][0][:5] + [7, 8], [3, 4, 5, 6, 9, 10, 11, 12, 13]]
    gen = torch.Generator().manual_seed(3)
    paths = torch.randint(1, 4, (2, 4, 3), generator=gen)  # shared prefixes, depth 3
    tree = build_tree(torch.tensor([21, 22]), paths, num_nodes=9)
    lengths = torch.tensor([len(p) for p in prompts])

    def prefill():
        target.cache.reset(2)
        padded = torch.tensor([p + [0] * (9 - len(p)) for p in prompts])
        target(padded, kv_len=9, prefill=True)
        target.cache.crop(lengths)

    with torch.inference_mode():
        prefill()
        out = target(tree.tokens, kv_len=64, tree_depths=tree.depths, tree_ancestors=tree.ancestors)
        logits = target.logits(out.hidden)
        for b in range(2):
            for i in range(1, 10):
                if not tree.valid[b, i]:
                    continue
                chain = [j for j in range(10) if tree.ancestors[b, i, j]]  # root .. i in order
                prefill()
                alone = target(tree.tokens[:, chain], kv_len=64)
                torch.testing.assert_close(
                    target.logits(alone.hidden)[b, -1], logits[b, i], rtol=1e-4, atol=1e-4
                )
                torch.testing.assert_close(
                    alone.features[b, -1], out.features[b, i], rtol=1e-4, atol=1e-4
                )


# ----------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("paths,nodes", [(2, None), (4, 10), (8, 7), (3, 16)])
def test_tree_greedy_output_equals_plain_decoding(world, paths, nodes):
    engine = _engine(world, tree_paths=paths, tree_nodes=nodes)
    prompts = world["prompts"]
    for start in range(0, len(prompts), 4):  # ragged batches of 4
        batch = prompts[start : start + 4]
        ar = engine.generate_ar(batch, max_new_tokens=NEW, chat=False)
        tree = engine.generate(batch, max_new_tokens=NEW, chat=False)
        assert tree.token_ids == ar.token_ids
        assert tree.stats.tree_paths == paths
        assert tree.stats.tree_nodes == (nodes or paths * (engine.block_size - 1))


def test_tree_over_per_slot_candidates_without_transition_cache(world, tmp_path):
    """A draft decoding per slot (`transition_cache: false`, as DFlash) gets a lattice of its
    slots' top-K with slot scores; the tree is still lossless."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(world["root"] / "target")
    tiny_draft(hf, 200, transition_cache=False).save_pretrained(tmp_path / "per_slot")
    engine = Engine.from_pretrained(
        world["root"] / "target", tmp_path / "per_slot", max_seq_len=112, eos_token_ids=[],
        max_batch_size=4, tree_paths=4, tree_nodes=12,
    )
    batch = world["prompts"][4:8]
    tree = engine.generate(batch, max_new_tokens=NEW, chat=False)
    assert tree.token_ids == engine.generate_ar(batch, max_new_tokens=NEW, chat=False).token_ids
    assert tree.stats.tree_paths == 4


def test_tree_of_one_path_is_the_chain(world, monkeypatch):
    chain_engine = _engine(world)
    tree_engine = _engine(world)
    # Force the tree round with M = 1, N = g: the tree machinery walking the chain alone.
    monkeypatch.setattr(tree_engine, "_tree_budget", lambda num_draft: num_draft)
    batch = world["prompts"][:4]
    chain = chain_engine.generate(batch, max_new_tokens=NEW, chat=False)
    tree = tree_engine.generate(batch, max_new_tokens=NEW, chat=False)
    assert tree.token_ids == chain.token_ids
    assert tree.stats.round_accepted == chain.stats.round_accepted
    assert tree.stats.tau == chain.stats.tau and tree.stats.tree_paths == 1


def test_tree_never_accepts_fewer_tokens_than_the_chain(world):
    engine = _engine(world, max_batch_size=1, tree_paths=4, tree_nodes=12)
    g = engine.block_size - 1
    sampler = Sampler(0.0, 1.0, torch.Generator().manual_seed(0))
    timer = StepTimer(engine.device)
    chain_counts, tree_counts = [], []
    # States: prefixes of the target's own continuations, so acceptance varies.
    for row in world["sequences"].tolist():
        for cut in range(3, 30, 3):
            prefix = row[:cut]
            anchor = torch.tensor(engine.generate([prefix], max_new_tokens=1, chat=False).token_ids[0])
            with torch.inference_mode():
                chain_acc, _, _ = chain_round(engine, anchor, cut, g, sampler, timer)
                tree = engine.round_shapes(g)[-1]  # the tree of 4 paths in 12 nodes
                tree_acc, _, _ = round_of(engine, tree, anchor, cut, None, sampler, timer)
            chain_counts.append(int(chain_acc.num_accepted))
            tree_counts.append(int(tree_acc.num_accepted))
    assert all(t >= c for t, c in zip(tree_counts, chain_counts, strict=True))
    assert any(t > c for t, c in zip(tree_counts, chain_counts, strict=True))


def test_tree_sampling_matches_the_target_distribution(tmp_path):
    """First three tokens sampled with tree verification vs the target's exact marginals (the
    chain's test in test_engine_lossless, with trees)."""
    prompt, rows = [3, 17, 8, 25], 500
    engine, exact = sampling_engine(tmp_path, prompt, rows, tree_paths=4, tree_nodes=12)
    tokens, results = sample_rows(engine, prompt, rows)
    for result in results:
        assert result.stats.tree_paths == 4 and result.stats.tree_nodes == 12
    assert_sampled_like(tokens, exact)
    # Some tree nodes were accepted and some not: both branches shaped the samples.
    assert all(1.0 < result.stats.tau < 3.0 for result in results)


def test_sampled_tree_accept_draws_the_target_token_at_each_node():
    # root -> 5 -> 6; root -> 7. The target puts all its mass on 7, then on 2 after 7.
    tree = build_tree(torch.tensor([9]), torch.tensor([[[5, 6], [7, 7]]]), 4)
    probs = torch.zeros(1, 5, 10)
    probs[0, :, 1] = 1.0
    probs[0, 0, 7] = probs[0, 0, 1] = 0.5  # at the root: 7 or 1, half each
    probs[0, 3, 2], probs[0, 3, 1] = 1.0, 0.0  # after 7: always 2
    seen = set()
    for seed in range(16):
        acc, _ = sampled_tree_accept(tree, probs, 2, torch.Generator().manual_seed(seed))
        seen.add(tuple(acc.tokens[0, : int(acc.num_accepted) + 1].tolist()))
    assert seen == {(7, 2), (1,)}


def test_warmup_runs_the_tree_steps(world):
    engine = _engine(world, tree_paths=3)
    calls = []
    for step in engine._tree.steps:
        def counted(*args, _fn=step.fn, _name=step.name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)

        step.fn = counted
    engine.warmup(batch_sizes=[1, 2], num_draft_tokens=[0, 3])
    # Once per batch size on CPU (nothing to capture), at the one tree budget for g = 3.
    assert calls == ["tree draft", "tree verify"] * 2
    batch = world["prompts"][:2]
    ar = engine.generate_ar(batch, max_new_tokens=8, chat=False)
    assert engine.generate(batch, max_new_tokens=8, chat=False, num_draft_tokens=3).token_ids == (
        ar.token_ids
    )


def test_tree_settings_are_checked(world):
    with pytest.raises(GenerationInputError, match="tree_paths"):
        _engine(world, tree_paths=0)
    engine = _engine(world, tree_paths=2, tree_nodes=3)
    with pytest.raises(GenerationInputError, match="tree_nodes=3 must be >= num_draft_tokens"):
        engine.generate([[1, 2]], max_new_tokens=4, chat=False)
    # The tree's nodes need cache room: the request is refused before any forward.
    engine.configure_tree(8, None)
    with pytest.raises(GenerationInputError,
                       match=r"a token tree of 56 nodes .* at most 51 nodes fit"):
        engine.generate([[1] * 40], max_new_tokens=20, chat=False)
