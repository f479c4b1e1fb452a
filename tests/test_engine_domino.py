"""A `method: domino` draft served by the engine: lossless when greedy and when sampling.

A Domino block drafts B-1 tokens (same-position labels) or B (`domino_shift_label`: the anchor
slot predicts too), decoded left to right by the GRU (`domino_walk`); the engine verifies them
in one target forward. Tiny random Qwen3 targets on CPU in fp32; an untrained draft and one
overfit briefly with Domino's own loss on the target's continuations, as
`test_engine_dspark.py` does for DSpark.
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

from dspine_train.domino_objective import domino_loss
from dspine_train.engine import Engine, GenerationInputError
from dspine_train.engine.ngram import NgramConfig
from dspine_train.export import main as export_main

NEW = 24  # new tokens per prompt in the greedy tests
BLOCK = 8


def train_domino_briefly(draft, hf_model, sequences: torch.Tensor, steps: int, lr: float):
    """`steps` AdamW steps of Domino's loss (teacher-forced GRU, lambda falling 1 -> 0) on the
    target's sequences `(B, S)` (CPU, fp32)."""
    def loss(d, o, final, m, a, am, step):  # label CE only: no target distribution
        return domino_loss(d, o, m, a, am, step, steps)

    return train_method_briefly(draft, hf_model, sequences, steps, lr, loss)


def _domino(hf, vocab: int, **overrides):
    """An untrained Domino draft whose correction moves the logits (a wrong previous token in
    the walk would show). K = 16 candidates per sampled slot."""
    overrides.setdefault("candidate_k", 16)
    draft = tiny_draft(hf, vocab, method="domino", domino_emb_dim=16, domino_gru_hidden_dim=24,
                       **overrides)
    torch.manual_seed(1)
    with torch.no_grad():
        draft.embed_proj[2].weight.normal_(std=0.5)
    return draft


@pytest.fixture(scope="module", params=[False, True], ids=["same-position", "shift-label"])
def world(request, tmp_path_factory):
    """A tiny Qwen3 target with tokenizer, ragged prompts, HF greedy outputs, an untrained and a
    trained Domino draft (same-position labels, or shifted with a pure-draft prefix of 1), the
    trained one exported in SpecForge's format."""
    shift = request.param
    root = tmp_path_factory.mktemp("domino_engine")
    build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6,
                      eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=200)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target").eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 11, (8,), generator=gen).tolist()
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]
    reference = [hf_greedy(hf, p, NEW) for p in prompts]
    settings = dict(domino_shift_label=shift, domino_prefix_len=1 if shift else 0)
    _domino(hf, 200, **settings).save_pretrained(root / "untrained")
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts])
    trained = train_domino_briefly(_domino(hf, 200, **settings), hf, sequences, steps=80, lr=1e-2)
    trained.save_pretrained(root / "trained")
    assert export_main([str(root / "trained"), str(root / "sf"), "--format", "specforge"]) == 0
    drafts = BLOCK if shift else BLOCK - 1
    return {"root": root, "hf": hf, "prompts": prompts, "reference": reference,
            "drafts": drafts}


def _engine(world, draft: str, **kwargs) -> Engine:
    return world_engine(world["root"], draft, **kwargs)


def _batched(engine: Engine, prompts, **kwargs):
    """Greedy speculative decoding four ragged prompts a call: tokens and each call's stats."""
    return generate_in_fours(engine, prompts, NEW, **kwargs)


@pytest.mark.parametrize("draft", ["untrained", "trained"])
def test_greedy_speculative_equals_transformers(world, draft):
    engine = _engine(world, draft)
    assert engine.num_predictions == world["drafts"]
    spec, stats = _batched(engine, world["prompts"])
    assert spec == world["reference"]
    assert all(len(s.per_position_acceptance) == world["drafts"] for s in stats)
    if draft == "trained":
        tau = sum(s.committed for s in stats) / sum(s.verifications for s in stats)
        assert tau > 1.5  # multi-token acceptance really exercised
        accepted = {n for s in stats for row in s.round_accepted for n in row}
        assert world["drafts"] in accepted  # whole blocks accepted, the last token too


def test_fewer_verified_drafts_and_the_specforge_export_are_lossless(world):
    engine = _engine(world, "trained")
    spec, stats = _batched(engine, world["prompts"][:4], num_draft_tokens=3)
    assert spec == world["reference"][:4]
    top = world["drafts"]
    with pytest.raises(GenerationInputError, match=rf"num_draft_tokens={top + 1} must be in "
                       rf"1..{top}"):
        engine.generate(world["prompts"][:1], max_new_tokens=4, num_draft_tokens=top + 1)
    imported = _engine(world, "sf")
    assert imported.draft.config.method == "domino"
    prompts = world["prompts"][:4]
    assert _batched(imported, prompts)[0] == world["reference"][:4]
    sampled = [e.generate(prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, chat=False,
                          seed=3).token_ids for e in (engine, imported)]
    assert sampled[0] == sampled[1]


def test_each_round_drafts_what_the_trained_network_decodes(world):
    """Round by round, the engine's drafts are the argmax of the training forward at that
    round's anchor, the GRU teacher-forced on the drafts before each token."""
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
    p = world["drafts"]
    first = BLOCK - p
    assert len(rounds) > 2
    for position, anchor, drafted in rounds:
        assert seq[position] == anchor
        ids = torch.tensor([seq + [0] * (BLOCK + 1)])
        context = torch.cat([feats, feats.new_zeros(BLOCK + 1, feats.shape[1])])[None]
        with torch.no_grad():
            out = draft(ids, context, torch.tensor([[position]]), use_flex=False)
            prev = torch.tensor([[[anchor, *drafted[:-1]]]])
            states = draft.domino_prev_states(prev)
            corrected = (torch.arange(1, p + 1) > draft.config.domino_prefix_len)[None, None]
            forced, _ = draft.domino_logits(out.hidden[:, :, first:], states, corrected)
        assert forced[0, 0].argmax(-1).tolist() == drafted


@pytest.mark.parametrize("shift", [False, True])
def test_sampling_matches_the_target_distribution(tmp_path, shift):
    """First three sampled tokens over many seeded rows vs the target's exact marginals; the
    draft samples each token from its GRU-corrected top-K softmax given the tokens drafted
    before it, the q the rejection rule divides by."""
    assert_trained_method_samples_the_target_law(
        tmp_path, lambda hf: _domino(hf, 30, block_size=4, transfer_dim=8, message_size=8,
                                    domino_shift_label=shift),
        train_domino_briefly, f"domino shift={shift}")


def test_token_trees_and_ngram_hybrids_refuse_a_domino_draft(world):
    with pytest.raises(GenerationInputError, match=r"tree_paths=4 .*domino draft is served as "
                       r"a chain only"):
        _engine(world, "trained", tree_paths=4)
    with pytest.raises(GenerationInputError, match=r"ngram .*with a method: domino draft"):
        _engine(world, "trained", ngram=NgramConfig())


def test_warmup_and_adaptive_rounds(world):
    engine = _engine(world, "untrained", max_batch_size=2)
    engine.warmup(batch_sizes=[1, 2], temperature=0.7)
    out = engine.generate(world["prompts"][:2], max_new_tokens=6, chat=False, temperature=0.7)
    assert [len(t) for t in out.token_ids] == [6, 6]
    adaptive = _engine(world, "trained", adaptive=True)
    out, stats = _batched(adaptive, world["prompts"][:4])
    assert out == world["reference"][:4]
    assert set(stats[0].round_shapes) <= {"plain", "chain"}


@pytest.mark.slow
def test_the_compiled_steps_trace_a_domino_block_as_one_graph(world):
    """The CUDA path's steps (`fullgraph=True`, strict: no eager fallback) trace Domino's draft,
    the GRU walk included, greedy and sampling (dynamo with the eager backend, on a CPU); the
    tokens are the eager engine's."""
    prompts = world["prompts"][:2]
    settings = dict(max_new_tokens=12, chat=False)
    eager = _engine(world, "trained", max_batch_size=2)
    engine = _engine(world, "trained", max_batch_size=2, compile=True, compile_backend="eager",
                     strict_graphs=True)
    for temperature in (0.0, 0.8):
        expected = eager.generate(prompts, temperature=temperature, seed=2, **settings)
        compiled = engine.generate(prompts, temperature=temperature, seed=2, **settings)
        assert compiled.token_ids == expected.token_ids
    for step in (engine._draft_step, engine._draft_sample_step):
        assert step.compiled and step._compiled_keys  # ran compiled, no fallback
