"""Speculative output is the target's own: token-identical when greedy, same law when sampling."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import (
    SAMPLED_TOKENS,
    FeatureRecordingOracle,
    assert_sampled_like,
    build_tiny_target,
    build_tokenizer,
    exact_marginals,
    hf_features,
    hf_greedy,
    sample_rows,
    tiny_draft,
    train_draft_briefly,
)

from dspine_train.engine import Engine, GenerationInputError, load_target
from scripts.tools.bench.oracle_draft import OracleDraft, OracleDraftConfig

NEW = 24  # new tokens per prompt in the greedy tests


def _oracle(sequences: list[list[int]], corrupt: float, kind: type[OracleDraft] = OracleDraft):
    """An oracle draft (block 8) following `sequences`, a fixed share `corrupt` of its
    proposals changed; every acceptance pattern (none, some, all of a block) occurs."""
    config = OracleDraftConfig(block_size=8, target_layer_ids=[1, 3], vocab_size=256,
                               hidden_size=64)
    draft = kind(config, max_batch_size=len(sequences), max_length=96, corrupt=corrupt)
    draft.set_sequences(sequences)
    return draft


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target (6 layers) with tokenizer, prompts, HF greedy outputs, two drafts."""
    root = tmp_path_factory.mktemp("lossless")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6, eos_token_id=None
    )
    build_tokenizer(root / "target", vocab_size=200)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 11, (12,), generator=gen).tolist()
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]
    reference = [hf_greedy(hf, p, NEW) for p in prompts]

    tiny_draft(hf, 200).save_pretrained(root / "untrained")
    # Overfit briefly on the target's own continuations of the first prompts, so the real draft
    # gets many tokens accepted (every acceptance pattern occurs).
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts[:8]])
    trained = train_draft_briefly(tiny_draft(hf, 200), hf, sequences, steps=80, lr=1e-2)
    trained.save_pretrained(root / "trained")
    return {"root": root, "hf": hf, "prompts": prompts, "reference": reference}


def _engine(world, draft: str, **kwargs) -> Engine:
    root = world["root"]
    kwargs.setdefault("max_batch_size", 4)
    return Engine.from_pretrained(
        root / "target", root / draft, max_seq_len=96, eos_token_ids=[], **kwargs
    )


def _batched(engine: Engine, prompts, method: str, **kwargs):
    out, stats = [], []
    for i in range(0, len(prompts), 4):
        result = getattr(engine, method)(
            prompts[i : i + 4], max_new_tokens=NEW, chat=False, **kwargs
        )
        out += result.token_ids
        stats.append(result.stats)
    return out, stats


@pytest.mark.parametrize("draft", ["untrained", "trained"])
def test_greedy_speculative_equals_ar_and_transformers(world, draft):
    engine = _engine(world, draft)
    spec, stats = _batched(engine, world["prompts"], "generate")
    ar, _ = _batched(engine, world["prompts"], "generate_ar")
    assert ar == world["reference"]
    assert spec == world["reference"]
    tau = sum(s.committed for s in stats) / sum(s.verifications for s in stats)
    if draft == "trained":
        assert tau > 1.5  # the comparison above really exercised multi-token acceptance


def test_batch_equals_one_by_one(world):
    engine = _engine(world, "trained")
    batch = engine.generate(world["prompts"][:4], max_new_tokens=NEW, chat=False)
    for prompt, tokens in zip(world["prompts"][:4], batch.token_ids):
        alone = engine.generate([prompt], max_new_tokens=NEW, chat=False)
        assert alone.token_ids == [tokens]
        assert alone.finish_reasons == ["length"] and len(tokens) == NEW


@pytest.mark.parametrize("num_draft", [1, 3])
def test_fewer_verified_tokens_is_still_lossless(world, num_draft):
    engine = _engine(world, "trained")
    spec, stats = _batched(engine, world["prompts"][:8], "generate", num_draft_tokens=num_draft)
    assert spec == world["reference"][:8]
    assert all(len(s.per_position_acceptance) == num_draft for s in stats)


@pytest.mark.parametrize("corrupt", [0.0, 0.3])
def test_every_acceptance_pattern_commits_the_right_tokens(world, corrupt):
    """An oracle proposer (true continuation, some tokens corrupted): none/some/all accepted."""
    prompts = world["prompts"][:4]
    full = [p + r for p, r in zip(prompts, world["reference"][:4])]
    target = load_target(world["root"] / "target")
    engine = Engine(
        target, _oracle(full, corrupt), None, max_batch_size=4, max_seq_len=96
    )
    result = engine.generate(prompts, max_new_tokens=NEW)
    assert result.token_ids == world["reference"][:4]
    if corrupt == 0.0:
        # Every block fully accepted plus the bonus: 1 (prefill) + 8 + 8 + 8 = 25 committed, of
        # which the budget keeps 24: the last round counts 7 (its 7th draft stands as the bonus).
        assert result.stats.tau == pytest.approx(23 / 3)
        assert result.stats.per_position_acceptance == pytest.approx([1.0] * 6 + [2 / 3])


@pytest.mark.parametrize("max_new_tokens", [2, 5, 9, 10])
def test_tau_counts_the_tokens_kept_not_those_the_budget_cut(world, max_new_tokens):
    """A draft that is always right: a round commits 8 tokens, but a sequence keeps only what
    its budget allows, and tau / per-position acceptance count what was kept."""
    prompts = world["prompts"][:2]
    full = [p + r for p, r in zip(prompts, world["reference"][:2])]
    engine = Engine(load_target(world["root"] / "target"), _oracle(full, 0.0), None,
                    max_batch_size=2, max_seq_len=96)
    result = engine.generate(prompts, max_new_tokens=max_new_tokens)
    assert result.token_ids == [r[:max_new_tokens] for r in world["reference"][:2]]
    stats = result.stats
    kept = max_new_tokens - 1  # the prefill's token is not a verification's
    assert stats.committed == 2 * kept
    assert stats.tau == pytest.approx(2 * kept / stats.verifications) and stats.tau <= 8.0
    assert stats.tau == pytest.approx(1 + sum(stats.per_position_acceptance))
    if max_new_tokens <= 9:  # one round per sequence
        assert stats.verifications == 2 and stats.tau == kept
        assert stats.per_position_acceptance == [1.0] * (kept - 1) + [0.0] * (8 - kept)
    # What the draft achieved is still recorded as accepted by the target.
    assert all(rounds[0] == 7 for rounds in stats.round_accepted)


class ScriptedDraft(OracleDraft):
    """The true continuation with round i's first wrong token at slot `leading[i]` (7: none),
    so every round's acceptance is known in advance; `planned` records what each round got."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leading: list[int] = []  # the script, set by the test
        self.planned: list[int] = []

    def propose(self, cache, anchor_ids, temperature=0.0, generator=None, kv_len=None):
        proposal = super().propose(cache, anchor_ids, temperature, generator)
        first_wrong = self.leading[len(self.planned) % len(self.leading)]
        self.planned.append(first_wrong)
        tokens = proposal.tokens.clone()
        if first_wrong < tokens.shape[1]:
            tokens[:, first_wrong] = (tokens[:, first_wrong] + 1) % self.config.vocab_size
        return type(proposal)(tokens=tokens, q=None)


def test_acceptance_statistics_equal_a_scripted_outcome(world):
    """Hand-built rounds with known acceptance (0..7 tokens): tau and the per-position rates
    are the ones the script implies, not merely consistent with each other."""
    prompt = world["prompts"][0]
    full = prompt + hf_greedy(world["hf"], prompt, NEW + 8)  # the truth past the last block too
    leading = [7, 0, 3, 7, 1, 5, 2, 6]
    draft = _oracle([full], 0.0, ScriptedDraft)
    draft.leading = leading
    engine = Engine(load_target(world["root"] / "target"), draft, None, max_batch_size=1,
                    max_seq_len=96)
    result = engine.generate([prompt], max_new_tokens=NEW)
    assert result.token_ids == world["reference"][:1]
    # The first token comes from the prefill; each round then commits its accepted prefix plus
    # the bonus: 1 + (8 + 1 + 4 + 8 + 2) = 24 = NEW after five rounds.
    assert draft.planned == leading[:5]
    stats = result.stats
    assert stats.verifications == 5 and stats.committed == 23
    assert stats.tau == pytest.approx(23 / 5)
    # slot k is accepted in the rounds that accepted >= k of 7, 0, 3, 7, 1
    assert stats.per_position_acceptance == pytest.approx([4 / 5, 3 / 5, 3 / 5, 2 / 5, 2 / 5,
                                                           2 / 5, 2 / 5])


def test_eos_inside_a_block_stops_exactly_there(world):
    hf, prompts, reference = world["hf"], world["prompts"][:4], world["reference"][:4]
    eos = reference[0][9]  # a token the first sequence emits mid-way (maybe earlier too)
    expected = [hf_greedy(hf, p, NEW, eos=eos) for p in prompts]
    engine = Engine.from_pretrained(
        world["root"] / "target",
        world["root"] / "trained",
        max_batch_size=4,
        max_seq_len=96,
        eos_token_ids=[eos],
    )
    result = engine.generate(prompts, max_new_tokens=NEW, chat=False)
    assert result.token_ids == expected
    assert result.token_ids[0][-1] == eos and result.finish_reasons[0] == "eos"
    assert result.stats.tau > 1.0


def test_stop_string_ends_the_sequence_at_its_token(world):
    engine = _engine(world, "trained")
    prompt, reference = world["prompts"][1], world["reference"][1]
    text = engine.tokenizer.decode(prompt)
    stop = engine.tokenizer.decode(reference[6:8])  # two words: the stop spans a token boundary
    cut = next(k for k in range(1, NEW + 1) if stop in engine.tokenizer.decode(reference[:k]))
    result = engine.generate(text, max_new_tokens=NEW, chat=False, stop=[stop])
    assert result.token_ids == [reference[:cut]]
    assert result.finish_reasons == ["stop"] and stop in result.texts[0]


@pytest.mark.parametrize("transition_cache", [True, False])
def test_sampling_matches_the_target_distribution(tmp_path, transition_cache):
    """First three sampled tokens over many seeded rows vs the target's exact marginals (the
    draft samples by its transition-cache walk, or per slot from each slot's top-K)."""
    vocab, prompt, rows = 32, [3, 17, 8, 25], 600
    hf = build_tiny_target(
        tmp_path / "target",
        "qwen3",
        head_scale=6.0,
        vocab_size=vocab,
        num_hidden_layers=6,
        eos_token_id=None,
    )
    tiny_draft(hf, 30, transfer_dim=8, message_size=8,
               transition_cache=transition_cache).save_pretrained(tmp_path / "draft")
    exact = exact_marginals(hf, prompt, vocab, steps=SAMPLED_TOKENS)
    engine = Engine.from_pretrained(
        tmp_path / "target",
        tmp_path / "draft",
        max_batch_size=rows,
        max_seq_len=16,
        eos_token_ids=[],
    )
    for method in ("generate", "generate_ar"):
        tokens, results = sample_rows(engine, prompt, rows, method)  # (4 * rows, 3)
        assert_sampled_like(tokens, exact, method)
        if method == "generate":
            # Some drafts were accepted and some rejected: both branches shaped the samples.
            assert 1.0 < results[-1].stats.tau < 3.0


def test_draft_context_holds_the_target_features_of_every_committed_position(world):
    """The draft sees exactly the target's features of the committed prefix, none of rejects."""
    prompts = world["prompts"][:4]
    full = [p + r for p, r in zip(prompts, world["reference"][:4])]
    engine = Engine(
        load_target(world["root"] / "target"),
        _oracle(full, 0.3, FeatureRecordingOracle),
        None,
        max_batch_size=4,
        max_seq_len=96,
    )
    result = engine.generate(prompts, max_new_tokens=NEW)
    features = engine.draft_cache.features
    for b, (prompt, new) in enumerate(zip(prompts, result.token_ids)):
        # Every committed position but the last token (it has not been through the target).
        length = len(prompt) + len(new) - 1
        _, expected = hf_features(world["hf"], (prompt + new)[:length], [1, 3])
        torch.testing.assert_close(features[b, :length], expected, atol=2e-5, rtol=1e-4)


def test_sampling_is_reproducible_with_a_seed(world):
    engine = _engine(world, "trained")
    runs = [
        engine.generate(
            world["prompts"][:4],
            max_new_tokens=12,
            temperature=0.8,
            top_p=0.9,
            chat=False,
            seed=seed,
        ).token_ids
        for seed in (5, 5, 6)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_per_row_budgets_stops_and_the_token_callback(world):
    """Per-row `max_new_tokens` and `stop` give each row what it gets alone; `on_tokens` sees
    exactly the committed tokens, in order, and returning True ends that row ("cancelled")."""
    engine = _engine(world, "trained")
    prompts = world["prompts"][:4]
    tok = engine.tokenizer
    full = engine.generate(prompts, max_new_tokens=NEW, chat=False)
    row1 = full.token_ids[1]
    stop_at = next(p for p in range(3, NEW) if tok.decode(row1[p : p + 1])
                   and tok.decode(row1[p : p + 1]) not in tok.decode(row1[:p]))
    stop_word = tok.decode(row1[stop_at : stop_at + 1])  # first met at row 1's token stop_at
    budgets, stops = [3, NEW, 7, 11], [[], [stop_word], ["no such"], []]
    seen: dict[int, list[int]] = {b: [] for b in range(4)}

    def on_tokens(row, tokens):
        seen[row].extend(tokens)
        return row == 3 and len(seen[row]) >= 2  # cancel row 3 after its second token

    batch = engine.generate(prompts, max_new_tokens=budgets, chat=False, stop=stops,
                            on_tokens=on_tokens)
    for b in range(3):
        alone = engine.generate([prompts[b]], max_new_tokens=budgets[b], chat=False,
                                stop=stops[b])
        assert batch.token_ids[b] == alone.token_ids[0], b
        assert batch.finish_reasons[b] == alone.finish_reasons[0], b
        assert seen[b] == batch.token_ids[b], b
    assert batch.finish_reasons[:3] == ["length", "stop", "length"]
    assert batch.token_ids[1] == row1[: stop_at + 1]
    assert batch.finish_reasons[3] == "cancelled"
    assert seen[3] == batch.token_ids[3] and 2 <= len(batch.token_ids[3]) < 11
    assert batch.token_ids[3] == full.token_ids[3][: len(batch.token_ids[3])]
    with pytest.raises(GenerationInputError, match="2 values for 4 prompts"):
        engine.generate(prompts, max_new_tokens=[1, 2], chat=False)
    with pytest.raises(GenerationInputError, match="mixes strings and lists"):
        engine.generate(prompts, chat=False, stop=["a", ["b"]])
