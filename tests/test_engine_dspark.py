"""A `method: dspark` draft served by the engine: lossless when greedy and when sampling.

A DSpark block `[anchor, MASK x (B-1)]` drafts B tokens (slot k predicts token anchor+k+1),
decoded left to right by the Markov head (`dspark_walk`); the engine verifies the B drafts in one
target forward. Tiny random Qwen3 targets on CPU in fp32; an untrained draft (nothing accepted)
and one overfit briefly with DSpark's own loss on the target's continuations (every acceptance
pattern occurs), as in `test_engine_lossless.py`.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from _engine_helpers import (
    assert_trained_method_samples_the_target_law,
    build_tiny_target,
    build_tokenizer,
    generate_in_fours,
    hf_features,
    hf_greedy,
    tiny_draft,
    train_method_briefly,
    world_engine,
)

from dspine_train.dspark_objective import dspark_loss
from dspine_train.engine import Engine, GenerationInputError
from dspine_train.engine.ngram import NgramConfig
from dspine_train.export import main as export_main

NEW = 24  # new tokens per prompt in the greedy tests
BLOCK = 8  # drafts per DSpark block: all 8 slots predict
RANK = 16


def train_dspark_briefly(draft, hf_model, sequences: torch.Tensor, steps: int, lr: float):
    """`steps` AdamW steps of DSpark's loss (`dspark_loss`, teacher-forced Markov term) on the
    target's sequences `(B, S)` (CPU, fp32): enough for many accepted drafts."""
    return train_method_briefly(draft, hf_model, sequences, steps, lr,
                                lambda d, o, final, m, a, am, step: dspark_loss(d, o, final, m, a, am))


def _dspark(hf, vocab: int, **overrides):
    """An untrained DSpark draft whose Markov head moves the logits (so a wrong previous token
    in the walk would show). K = 16 candidates per sampled slot, the default an import from the
    speculators format (which does not carry `candidate_k`) takes."""
    overrides.setdefault("candidate_k", 16)
    draft = tiny_draft(hf, vocab, method="dspark", markov_rank=RANK, **overrides)
    torch.manual_seed(1)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.normal_(std=1.0)
        draft.markov_head.markov_w2.weight.normal_(std=0.3)
    return draft


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target (6 layers) with tokenizer, ragged prompts, HF greedy outputs, an
    untrained and a trained DSpark draft, and the trained one exported as speculators and as
    deepspec."""
    root = tmp_path_factory.mktemp("dspark_engine")
    build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6,
                      eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=200)
    # loaded from its directory, so the drafts (and their exports) name their target
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 11, (12,), generator=gen).tolist()
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]
    reference = [hf_greedy(hf, p, NEW) for p in prompts]

    _dspark(hf, 200).save_pretrained(root / "untrained")
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts[:8]])
    trained = train_dspark_briefly(_dspark(hf, 200), hf, sequences, steps=80, lr=1e-2)
    trained.save_pretrained(root / "trained")
    for fmt, name in (("speculators", "spec"), ("deepspec", "deepspec")):
        assert export_main([str(root / "trained"), str(root / name), "--format", fmt]) == 0
    return {"root": root, "hf": hf, "prompts": prompts, "reference": reference}


def _engine(world, draft: str, **kwargs) -> Engine:
    return world_engine(world["root"], draft, **kwargs)


def _batched(engine: Engine, prompts, **kwargs):
    """Greedy speculative decoding four ragged prompts a call: tokens and each call's stats."""
    return generate_in_fours(engine, prompts, NEW, **kwargs)


@pytest.mark.parametrize("draft", ["untrained", "trained"])
def test_greedy_speculative_equals_transformers(world, draft):
    engine = _engine(world, draft)
    assert engine.num_predictions == BLOCK  # the anchor slot drafts too
    spec, stats = _batched(engine, world["prompts"])
    assert spec == world["reference"]
    assert all(len(s.per_position_acceptance) == BLOCK for s in stats)
    accepted = {n for s in stats for row in s.round_accepted for n in row}
    if draft == "trained":
        tau = sum(s.committed for s in stats) / sum(s.verifications for s in stats)
        assert tau > 1.5  # multi-token acceptance really exercised
        # none, some and all of a block's drafts accepted (the 8th slot too)
        assert {0, BLOCK} <= accepted and accepted & set(range(1, BLOCK))
    else:
        assert max(accepted) < BLOCK


def test_ragged_batch_equals_one_by_one(world):
    engine = _engine(world, "trained")
    prompts = world["prompts"][:4]
    assert len({len(p) for p in prompts}) > 1  # ragged
    batch = engine.generate(prompts, max_new_tokens=NEW, chat=False)
    for prompt, tokens in zip(prompts, batch.token_ids):
        alone = engine.generate([prompt], max_new_tokens=NEW, chat=False)
        assert alone.token_ids == [tokens]


@pytest.mark.parametrize("num_draft", [1, 3, BLOCK])
def test_any_number_of_verified_drafts_up_to_block_size_is_lossless(world, num_draft):
    engine = _engine(world, "trained")
    spec, stats = _batched(engine, world["prompts"][:8], num_draft_tokens=num_draft)
    assert spec == world["reference"][:8]
    assert all(len(s.per_position_acceptance) == num_draft for s in stats)
    with pytest.raises(GenerationInputError, match=rf"num_draft_tokens={BLOCK + 1} must be in "
                       rf"1..{BLOCK} .*block_size for a method: dspark draft"):
        engine.generate(world["prompts"][:1], max_new_tokens=4, num_draft_tokens=BLOCK + 1)


def test_each_round_drafts_what_the_trained_network_decodes(world):
    """Round by round, the engine's drafts are the argmax of the training forward at that
    round's anchor (context: the target features of every committed token before it), the Markov
    term teacher-forced on the drafts before each slot: the block decoded exactly as trained."""
    engine = _engine(world, "trained", max_batch_size=1)
    draft = engine.draft
    rounds = []
    propose = draft.propose

    def recording(cache, anchors, *args, **kwargs):
        proposal = propose(cache, anchors, *args, **kwargs)
        rounds.append((int(cache.lengths[0]), int(anchors[0]), proposal.tokens[0].tolist()))
        return proposal

    draft.propose = recording
    prompt = world["prompts"][1]
    tokens = engine.generate([prompt], max_new_tokens=NEW, chat=False).token_ids[0]
    seq = prompt + tokens
    _, feats = hf_features(world["hf"], seq, draft.config.target_layer_ids)
    assert len(rounds) > 2
    for position, anchor, drafted in rounds:
        assert seq[position] == anchor
        ids = torch.tensor([seq + [0] * (BLOCK + 1)])
        context = torch.cat([feats, feats.new_zeros(BLOCK + 1, feats.shape[1])])[None]
        with torch.no_grad():
            out = draft(ids, context, torch.tensor([[position]]), use_flex=False)
            prev = torch.tensor([[[anchor, *drafted[:-1]]]])
            forced = draft.dspark_block(out.hidden, prev).logits[0, 0]  # (Bk, V)
        assert forced.argmax(-1).tolist() == drafted


@pytest.mark.parametrize("fmt", ["spec", "deepspec"])
def test_the_speculators_and_deepspec_exports_serve_the_same_tokens(world, fmt):
    """The trained draft exported with `--format speculators` (or `deepspec`) and imported
    back serves the same tokens, greedy and sampled with a seed."""
    ours, imported = _engine(world, "trained"), _engine(world, fmt)
    assert imported.draft.config.method == "dspark" and imported.num_predictions == BLOCK
    prompts = world["prompts"][:4]
    assert _batched(imported, prompts)[0] == _batched(ours, prompts)[0] == world["reference"][:4]
    sampled = [e.generate(prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, chat=False,
                          seed=3).token_ids for e in (ours, imported)]
    assert sampled[0] == sampled[1]


def test_sampling_matches_the_target_distribution(tmp_path):
    """First three sampled tokens over many seeded rows vs the target's exact marginals; the
    draft samples each slot from its Markov-adjusted top-K softmax given the token drafted before
    it, the q the rejection rule divides by."""
    assert_trained_method_samples_the_target_law(
        tmp_path, lambda hf: _dspark(hf, 30, block_size=4, transfer_dim=8, message_size=8),
        train_dspark_briefly, "dspark")


def test_warmup_runs_every_dspark_step(world):
    """The warm-up (eager on CPU) drafts a block of block_size tokens, greedy and sampling."""
    engine = _engine(world, "untrained", max_batch_size=2)
    engine.warmup(batch_sizes=[1, 2], temperature=0.7)
    out = engine.generate(world["prompts"][:2], max_new_tokens=6, chat=False, temperature=0.7)
    assert [len(t) for t in out.token_ids] == [6, 6]


def test_token_trees_and_ngram_hybrids_refuse_a_dspark_draft(world):
    with pytest.raises(GenerationInputError, match=r"tree_paths=4 .*dspark draft is served as "
                       r"a chain only"):
        _engine(world, "trained", tree_paths=4)
    with pytest.raises(GenerationInputError, match=r"ngram .*with a method: dspark draft"):
        _engine(world, "trained", ngram=NgramConfig())
    engine = _engine(world, "trained")
    with pytest.raises(GenerationInputError, match=r"tree_paths=2"):
        engine.configure_tree(2)
    # the n-gram mode without a draft is not a DSpark matter
    plain = Engine.from_pretrained(world["root"] / "target", ngram=NgramConfig(),
                                   max_seq_len=96, eos_token_ids=[])
    out = plain.generate(world["prompts"][:1], max_new_tokens=NEW, chat=False)
    assert out.token_ids == world["reference"][:1]


@pytest.mark.slow
def test_the_compiled_steps_trace_a_dspark_block_as_one_graph(world):
    """The CUDA path's steps (`fullgraph=True`, strict: no eager fallback) trace DSpark's draft,
    the Markov walk included, greedy and sampling (dynamo with the eager backend: the trace CUDA
    compiles and captures, without kernels on a CPU); the tokens are the eager engine's."""
    prompts = world["prompts"][:2]
    settings = dict(max_new_tokens=12, chat=False, num_draft_tokens=BLOCK)
    eager = _engine(world, "trained", max_batch_size=2)
    engine = _engine(world, "trained", max_batch_size=2, compile=True, compile_backend="eager",
                     strict_graphs=True)
    for temperature in (0.0, 0.8):
        expected = eager.generate(prompts, temperature=temperature, seed=2, **settings)
        compiled = engine.generate(prompts, temperature=temperature, seed=2, **settings)
        assert compiled.token_ids == expected.token_ids
    for step in (engine._draft_step, engine._draft_sample_step):
        assert step.compiled and step._compiled_keys  # ran compiled, no fallback
    assert _batched(engine, prompts)[0] == world["reference"][:2]


def test_adaptive_rounds_choose_between_plain_steps_and_dspark_blocks(world):
    """Without n-gram candidates the planner picks a plain step or the DSpark chain each round
    (costs measured on the engine's own steps); the output is unchanged."""
    engine = _engine(world, "trained", adaptive=True)
    out, stats = _batched(engine, world["prompts"][:4])
    assert out == world["reference"][:4]
    assert set(stats[0].round_shapes) <= {"plain", "chain"}
