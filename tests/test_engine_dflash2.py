"""A `method: dflash2` draft served by the engine: lossless when greedy and when sampling.

A DFlash2 block `[anchor, MASK x (B-1)]` drafts B-1 tokens (slot k predicts token anchor+k),
decoded left to right by its candidate selector over each slot's top `selector_top_k`
(`dflash2_walk`); the engine verifies them in one target forward. Tiny random Qwen3 targets on
CPU in fp32; an untrained draft and one overfit briefly with DFlash2's own loss on the target's
continuations (every acceptance pattern occurs), as in `test_engine_dspark.py`.
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

from dspine_train.dflash2_objective import dflash2_loss
from dspine_train.engine import Engine, GenerationInputError
from dspine_train.engine.ngram import NgramConfig
from dspine_train.export import main as export_main

NEW = 24  # new tokens per prompt in the greedy tests
BLOCK = 8  # a DFlash2 block drafts BLOCK - 1 tokens
RANK = 16


def train_dflash2_briefly(draft, hf_model, sequences: torch.Tensor, steps: int, lr: float):
    """`steps` AdamW steps of DFlash2's loss (`dflash2_loss`: unary KL + the selector's CE with
    the true predecessors) on the target's sequences `(B, S)` (CPU, fp32)."""
    return train_method_briefly(draft, hf_model, sequences, steps, lr,
                                lambda d, o, final, m, a, am, step: dflash2_loss(d, o, final, m, a, am))


def _dflash2(hf, vocab: int, **overrides):
    """An untrained DFlash2 draft whose convolutions and selector move the drafts (so a wrong
    predecessor in the walk, or a missing tap, would show)."""
    draft = tiny_draft(hf, vocab, method="dflash2", selector_rank=RANK, **overrides)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn_like(conv.base_kernel) * 0.3)
                conv.kernel_projection.weight.normal_(std=0.05)
        draft.candidate_selector.predecessor_codebook.normal_(std=0.5)
        draft.candidate_selector.successor_codebook.normal_(std=0.5)
    return draft


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target (6 layers) with tokenizer, ragged prompts, HF greedy outputs, an
    untrained and a trained DFlash2 draft, and the trained one exported as speculators."""
    root = tmp_path_factory.mktemp("dflash2_engine")
    build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6,
                      eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=200)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 11, (12,), generator=gen).tolist()
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]
    reference = [hf_greedy(hf, p, NEW) for p in prompts]

    _dflash2(hf, 200).save_pretrained(root / "untrained")
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts[:8]])
    trained = train_dflash2_briefly(_dflash2(hf, 200), hf, sequences, steps=80, lr=1e-2)
    trained.save_pretrained(root / "trained")
    assert export_main([str(root / "trained"), str(root / "spec"), "--format",
                        "speculators"]) == 0
    return {"root": root, "hf": hf, "prompts": prompts, "reference": reference}


def _engine(world, draft: str, **kwargs) -> Engine:
    return world_engine(world["root"], draft, **kwargs)


def _batched(engine: Engine, prompts, **kwargs):
    """Greedy speculative decoding four ragged prompts a call: tokens and each call's stats."""
    return generate_in_fours(engine, prompts, NEW, **kwargs)


@pytest.mark.parametrize("draft", ["untrained", "trained"])
def test_greedy_speculative_equals_transformers(world, draft):
    engine = _engine(world, draft)
    assert engine.num_predictions == BLOCK - 1  # DFlash's layout: the anchor is given
    spec, stats = _batched(engine, world["prompts"])
    assert spec == world["reference"]
    assert all(len(s.per_position_acceptance) == BLOCK - 1 for s in stats)
    accepted = {n for s in stats for row in s.round_accepted for n in row}
    if draft == "trained":
        tau = sum(s.committed for s in stats) / sum(s.verifications for s in stats)
        assert tau > 1.5  # multi-token acceptance really exercised
        # none, some and all of a block's drafts accepted
        assert {0, BLOCK - 1} <= accepted and accepted & set(range(1, BLOCK - 1))
    else:
        assert max(accepted) < BLOCK - 1


def test_ragged_batch_equals_one_by_one(world):
    engine = _engine(world, "trained")
    prompts = world["prompts"][:4]
    assert len({len(p) for p in prompts}) > 1  # ragged
    batch = engine.generate(prompts, max_new_tokens=NEW, chat=False)
    for prompt, tokens in zip(prompts, batch.token_ids):
        alone = engine.generate([prompt], max_new_tokens=NEW, chat=False)
        assert alone.token_ids == [tokens]


@pytest.mark.parametrize("num_draft", [1, 3, BLOCK - 1])
def test_any_number_of_verified_drafts_is_lossless(world, num_draft):
    engine = _engine(world, "trained")
    spec, stats = _batched(engine, world["prompts"][:8], num_draft_tokens=num_draft)
    assert spec == world["reference"][:8]
    assert all(len(s.per_position_acceptance) == num_draft for s in stats)
    with pytest.raises(GenerationInputError, match=rf"num_draft_tokens={BLOCK} must be in "
                       rf"1..{BLOCK - 1}"):
        engine.generate(world["prompts"][:1], max_new_tokens=4, num_draft_tokens=BLOCK)


def test_each_round_drafts_the_selector_decoded_exactly_as_trained(world):
    """Round by round, the engine's drafts are the training forward at that round's anchor
    (context: the target features of every committed token before it), each slot's token the
    best of its top-K under the selector scored as training scores it (`score_candidates`) with
    the token drafted before it as predecessor; and the selector changes some draft."""
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
    changed = False
    for position, anchor, drafted in rounds:
        assert seq[position] == anchor
        ids = torch.tensor([seq + [0] * (BLOCK + 1)])
        context = torch.cat([feats, feats.new_zeros(BLOCK + 1, feats.shape[1])])[None]
        with torch.no_grad():
            out = draft(ids, context, torch.tensor([[position]]), use_flex=False)
            hidden = out.hidden[0, 0, 1:]  # (Bk-1, H)
            unary = draft.logits(hidden)
            cand = unary.topk(draft.config.selector_top_k, dim=-1).indices
            prev = torch.tensor([anchor, *drafted[:-1]])
            scores = draft.candidate_selector.score_candidates(unary, draft.norm(hidden), prev,
                                                               cand)
        assert cand.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1).tolist() == drafted
        changed |= unary.argmax(-1).tolist() != drafted
    assert changed


def test_the_speculators_export_serves_the_same_tokens(world):
    """The trained draft exported with `--format speculators` and imported back serves the same
    tokens, greedy and sampled with a seed."""
    ours, imported = _engine(world, "trained"), _engine(world, "spec")
    assert imported.draft.config.method == "dflash2" and imported.num_predictions == BLOCK - 1
    prompts = world["prompts"][:4]
    assert _batched(imported, prompts)[0] == _batched(ours, prompts)[0] == world["reference"][:4]
    sampled = [e.generate(prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, chat=False,
                          seed=3).token_ids for e in (ours, imported)]
    assert sampled[0] == sampled[1]


def test_sampling_matches_the_target_distribution(tmp_path):
    """First three sampled tokens over many seeded rows vs the target's exact marginals; the
    draft samples each slot from the selector's softmax over its top-K given the token drafted
    before it, the q the rejection rule divides by."""
    assert_trained_method_samples_the_target_law(
        tmp_path, lambda hf: _dflash2(hf, 30, block_size=4, transfer_dim=8, message_size=8, selector_top_k=8),
        train_dflash2_briefly, "dflash2")


def test_warmup_runs_every_dflash2_step(world):
    """The warm-up (eager on CPU) drafts a block, greedy and sampling."""
    engine = _engine(world, "untrained", max_batch_size=2)
    engine.warmup(batch_sizes=[1, 2], temperature=0.7)
    out = engine.generate(world["prompts"][:2], max_new_tokens=6, chat=False, temperature=0.7)
    assert [len(t) for t in out.token_ids] == [6, 6]


def test_token_trees_and_ngram_hybrids_refuse_a_dflash2_draft(world):
    with pytest.raises(GenerationInputError, match=r"tree_paths=4 .*dflash2 draft is served as "
                       r"a chain only"):
        _engine(world, "trained", tree_paths=4)
    with pytest.raises(GenerationInputError, match=r"ngram .*with a method: dflash2 draft"):
        _engine(world, "trained", ngram=NgramConfig())


@pytest.mark.slow
def test_the_compiled_steps_trace_a_dflash2_block_as_one_graph(world):
    """The CUDA path's steps (`fullgraph=True`, strict) trace DFlash2's draft, convolutions and
    selector walk included, greedy and sampling (dynamo, eager backend); the tokens are the
    eager engine's."""
    prompts = world["prompts"][:2]
    settings = dict(max_new_tokens=12, chat=False, num_draft_tokens=BLOCK - 1)
    eager = _engine(world, "trained", max_batch_size=2)
    engine = _engine(world, "trained", max_batch_size=2, compile=True, compile_backend="eager",
                     strict_graphs=True)
    for temperature in (0.0, 0.8):
        expected = eager.generate(prompts, temperature=temperature, seed=2, **settings)
        compiled = engine.generate(prompts, temperature=temperature, seed=2, **settings)
        assert compiled.token_ids == expected.token_ids
    for step in (engine._draft_step, engine._draft_sample_step):
        assert step.compiled and step._compiled_keys
