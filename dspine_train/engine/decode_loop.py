"""The decoding loop of `Engine.generate` / `Engine.generate_ar`: prefill, rounds, commits.

A call encodes and checks its prompts, prefills them, then runs rounds until every sequence is
done. Each round takes a shape (`engine.round_planner`: a plain step, the n-gram branch, the
draft's chain or tree, or both), verifies it in one target forward, reads the acceptance to the
host once (stop strings, budgets, bookkeeping: `round_results`) and commits on the device with
the engine's commit step. Plain decoding is the same loop with one token per round.

The functions take the `Engine` whose caches, steps and settings they use; the engine holds
the state, this module the order in which a call drives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dspine_train.engine.acceptance import Acceptance, greedy_accept, rejection_accept
from dspine_train.engine.errors import GenerationInputError
from dspine_train.engine.ngram import NgramIndex, pack_proposals
from dspine_train.engine.prompts import Prompts, SequenceState, encode_prompts
from dspine_train.engine.request_checks import check_request
from dspine_train.engine.round_planner import RoundPlanner, RoundShape
from dspine_train.engine.round_results import ProposalLedger, record_round
from dspine_train.engine.sampling import Sampler, next_tokens, target_probs
from dspine_train.engine.stats import GenerationStats, StepTimer

if TYPE_CHECKING:
    from dspine_train.engine.engine import Engine


@dataclass
class GenerationResult:
    """Output of `Engine.generate` / `Engine.generate_ar`, one entry per prompt.

    `token_ids` are the new tokens only (an EOS that ended a sequence is included, as in HF
    `generate`); `finish_reasons` are "eos", "stop" or "length" (or "cancelled", a row its
    `on_tokens` callback ended); `texts` is None without a tokenizer.
    """

    token_ids: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]
    stats: GenerationStats


# Called with (row, its new tokens) as a round commits them; True ends that row now.
OnTokens = Callable[[int, list[int]], bool | None]
MaxNewTokens = int | Sequence[int]
Stops = Sequence[str] | Sequence[Sequence[str]]


def per_row(
    num_rows: int, max_new_tokens: MaxNewTokens, stop: Stops
) -> tuple[list[int], list[list[str]]]:
    """Each row's token budget and stop strings: one value for every row, or one per row.

    `stop` is shared when its items are strings, per row when they are lists of strings."""
    if isinstance(max_new_tokens, int):
        budgets = [max_new_tokens] * num_rows
    else:
        budgets = [int(n) for n in max_new_tokens]
        if len(budgets) != num_rows:
            raise GenerationInputError(
                f"max_new_tokens has {len(budgets)} values for {num_rows} prompts")
    if isinstance(stop, str):
        raise GenerationInputError(f"stop must be a list of strings, got the string {stop!r}")
    if all(isinstance(s, str) for s in stop):
        return budgets, [list(stop)] * num_rows
    if any(isinstance(s, str) for s in stop):
        raise GenerationInputError(
            "stop mixes strings and lists: give one list for every row or one list per row")
    stops = [list(s) for s in stop]
    if len(stops) != num_rows or not all(isinstance(x, str) for s in stops for x in s):
        raise GenerationInputError(
            f"per-row stop must be {num_rows} lists of strings (one per prompt)")
    return budgets, stops


def run(
    engine: Engine,
    prompts: Prompts,
    max_new_tokens: MaxNewTokens,
    temperature: float,
    top_p: float,
    chat: bool,
    stop: Stops,
    num_draft_tokens: int,
    seed: int,
    speculative: bool,
    on_tokens: OnTokens | None = None,
) -> GenerationResult:
    """One `generate` (`speculative`, g = `num_draft_tokens`) or `generate_ar` call.

    `max_new_tokens` and `stop` are shared by every row or given per row (`per_row`).
    `on_tokens(row, tokens)`, if given, is called with each row's new tokens as they are
    committed (the prefill's token, then each round's, after its bookkeeping: stop strings,
    EOS and budget already applied); returning True ends that row at once (finish reason
    "cancelled"). It adds no device sync: the round's tokens are on the host already."""
    ids = encode_prompts(
        prompts, engine.tokenizer, chat=chat, vocab_size=engine.target.config.vocab_size,
        chat_template_kwargs=engine.chat_template_kwargs,
    )
    budgets, stops, shapes = check_call(
        engine, ids, max_new_tokens, temperature, top_p, stop, num_draft_tokens, speculative)
    with_draft = engine.draft is not None and speculative
    stats = GenerationStats(mode="speculative" if speculative else "autoregressive")
    stats.num_sequences, stats.prompt_tokens = len(ids), sum(len(p) for p in ids)
    stats.accepted_at = [0] * max((engine._depth(s) for s in shapes), default=0)
    stats.round_accepted = [[] for _ in ids]
    tree_nodes = engine._tree_budget(num_draft_tokens) if with_draft else None
    if tree_nodes is not None:
        stats.tree_paths, stats.tree_nodes = engine.tree_paths, tree_nodes
    planner = None
    if shapes:
        costs = None
        if engine.adaptive and len(shapes) > 1:  # measured once per (batch, g), untimed
            costs = engine.calibrate(len(ids), num_draft_tokens)
        planner = RoundPlanner(shapes, costs, engine.adaptive, engine.planner_memory)
    ledger = ProposalLedger(planner, len(ids)) if planner and planner.adaptive else None
    sampler = Sampler(temperature, top_p, torch.Generator(engine.device).manual_seed(seed))
    timer = StepTimer(engine.device)
    states = [SequenceState(n, s, engine.tokenizer) for n, s in zip(budgets, stops)]
    capture_before = engine._capture_seconds()
    start = time.perf_counter()

    with torch.inference_mode():
        with timer.section("prefill"):
            anchors = prefill(engine, ids, sampler, with_draft=with_draft)
        first = anchors.tolist()  # deliberate sync: the first token decides EOS/stop/budget
        running = engine._running[: len(ids)]
        running.fill_(True)
        for b, (state, token) in enumerate(zip(states, first, strict=True)):
            state.extend([token], ends_with_eos=token in engine.eos_token_ids)
            if on_tokens is not None and on_tokens(b, [token]) and not state.done:
                state.finish_reason = "cancelled"
            if state.done:
                running[b] = False  # a scalar fill: no host-to-device copy
        engine._active[: len(ids)].copy_(running)
        committed = [len(p) for p in ids]  # host mirror of the target cache lengths
        indexes = None
        if engine.ngram is not None and speculative:
            indexes = [NgramIndex(engine.ngram, p + s.tokens) for p, s in zip(ids, states)]

        while not all(s.done for s in states):
            live = [b for b, s in enumerate(states) if not s.done]
            longest = max(committed[b] for b in live)
            proposals = None
            if indexes is not None:
                found = time.perf_counter()
                proposals = [([], 0) if states[b].done else index.propose()
                             for b, index in enumerate(indexes)]
                stats.ngram_s += time.perf_counter() - found
            shape = RoundShape("plain", 0)
            if planner is not None:
                found_for = [proposals[b] if proposals else ([], 0) for b in live]
                shape = planner.choose([n for _, n in found_for], [len(p) for p, _ in found_for])
            acc, features, drafted = round_of(
                engine, shape, anchors, longest, proposals, sampler, timer
            )
            rows = engine._reader.read(acc, drafted)
            starts = [len(s.tokens) for s in states]  # where this round's tokens begin
            for b in record_round(rows, states, committed, stats):
                running[b] = False
            if on_tokens is not None:
                for b in live:
                    new = states[b].tokens[starts[b]:]
                    if new and on_tokens(b, new) and not states[b].done:
                        states[b].finish_reason = "cancelled"
                        running[b] = False
            if ledger is not None:
                for b in live:
                    if proposals is not None and proposals[b][1] > 0:
                        ledger.propose(b, starts[b], "ngram", proposals[b][1], proposals[b][0])
                    if drafted is not None:
                        ledger.propose(b, starts[b], "draft", 0, rows[b].drafted)
                    ledger.settle(b, states[b])
            if indexes is not None:
                for b in live:
                    seen = len(indexes[b].tokens) - len(ids[b])
                    indexes[b].extend(states[b].tokens[seen:])
            stats.steps += 1
            stats.nodes_verified += shape.nodes
            # Commit on the device: the anchor and the accepted drafts now have valid target
            # K/V and features; the rejected tail is dropped by not counting it. Rows that
            # are done go back to length 0 so their idle writes stay inside the caches.
            commit_inputs = (acc.num_accepted, features) if with_draft else (acc.num_accepted,)
            engine._commit_step.prepare(*commit_inputs)
            engine._commit_step(*commit_inputs)
            anchors = acc.tokens.gather(1, acc.num_accepted[:, None]).squeeze(1)

        times = timer.totals()
    stats.capture_s = engine._capture_seconds() - capture_before
    stats.total_s = time.perf_counter() - start - stats.capture_s
    stats.prefill_s = times.get("prefill", 0.0)
    stats.draft_s = times.get("draft", 0.0)
    stats.verify_s = times.get("verify", 0.0)
    stats.new_tokens = sum(len(s.tokens) for s in states)
    if planner is not None:
        stats.round_shapes = dict(planner.chosen)
    texts = None
    if engine.tokenizer is not None:
        texts = [engine.tokenizer.decode(s.tokens, skip_special_tokens=True) for s in states]
    return GenerationResult(
        token_ids=[s.tokens for s in states],
        texts=texts,
        finish_reasons=[s.finish_reason or "length" for s in states],
        stats=stats,
    )


def check_call(
    engine: Engine,
    ids: Sequence[Sequence[int]],
    max_new_tokens: MaxNewTokens,
    temperature: float,
    top_p: float,
    stop: Stops,
    num_draft_tokens: int,
    speculative: bool,
) -> tuple[list[int], list[list[str]], list[RoundShape]]:
    """Check a call on encoded prompts before any forward; its per-row budgets and stop
    strings and the round shapes it may take."""
    budgets, stops = per_row(len(ids), max_new_tokens, stop)
    shapes = engine.round_shapes(num_draft_tokens) if speculative else []
    check_request(
        [list(p) for p in ids], budgets, temperature, top_p, stops, shapes,
        max_batch_size=engine.max_batch_size, has_tokenizer=engine.tokenizer is not None,
        max_seq_len=engine.max_seq_len, positions=engine.target.config.max_position_embeddings,
        tree=_cache_settings(engine),
    )
    return budgets, stops, shapes


def _cache_settings(engine: Engine) -> str:
    """The settings that size a round's room in the caches, as an error names them."""
    tree = f"tree_paths={engine.tree_paths}, tree_nodes={engine.tree_nodes}"
    flags = "--tree-paths / --tree-nodes"
    if engine.ngram is not None:
        tree, flags = f"{tree}, ngram tokens={engine.ngram.num_tokens}", f"{flags} / --ngram-tokens"
    return f"{tree}; CLI: {flags}"


def prefill(
    engine: Engine, ids: list[list[int]], sampler: Sampler, with_draft: bool
) -> torch.Tensor:
    """Run the prompts (right-padded), commit them, return the first new token `(B,)`."""
    batch, longest = len(ids), max(len(p) for p in ids)
    lengths = torch.tensor([len(p) for p in ids], device=engine.device)
    # Right-padded (B, longest); the padding lands past each committed length.
    padded = torch.tensor([p + [0] * (longest - len(p)) for p in ids], device=engine.device)
    engine.target.cache.reset(batch)
    out = engine.target(padded, kv_len=longest, prefill=True)  # lengths are all 0 after reset
    last = out.hidden[torch.arange(batch, device=engine.device), lengths - 1]  # (B, H)
    first = next_tokens(
        engine.target.logits(last), sampler.temperature, sampler.top_p, sampler.generator
    )
    engine.target.cache.crop(lengths)
    if with_draft:
        engine.draft_cache = engine._draft_cache_for(batch)
        engine.draft.crop_context(engine.draft_cache, torch.zeros_like(lengths))
        engine.draft.append_context(engine.draft_cache, out.features, lengths)
    return first


def round_of(
    engine: Engine,
    shape: RoundShape,
    anchors: torch.Tensor,
    longest: int,
    proposals: list[tuple[list[int], int]] | None,
    sampler: Sampler,
    timer: StepTimer,
) -> tuple[Acceptance, torch.Tensor | None, torch.Tensor | None]:
    """One round of `shape`: the `Acceptance`, the accepted tokens' features (None
    without a draft) and the draft's chain tokens `(B, g)` (None where it did not run)."""
    if shape.ngram and not shape.drafts:  # the n-gram branch alone: a chain of its first tokens
        assert proposals is not None
        given, _ = pack_proposals([p for p, _ in proposals], shape.nodes, engine.device)
        return chain_round(engine, anchors, longest, 0, sampler, timer, given)
    if not shape.tree:
        return chain_round(engine, anchors, longest, shape.draft_depth, sampler, timer)
    ngram = None
    if shape.ngram:
        assert proposals is not None and engine.ngram is not None
        ngram = pack_proposals([p for p, _ in proposals], engine.ngram.num_tokens, engine.device)
    budget = dict(paths=engine.tree_paths, nodes=shape.nodes, depth=shape.draft_depth)
    acc, features, tree_tokens = engine._tree.run_round(
        anchors,
        budget,
        engine._bucket(longest + engine.block_size, engine._draft_capacity()),
        engine._bucket(longest + shape.nodes + 1, engine.max_seq_len),
        (sampler.temperature, sampler.top_p, sampler.generator, sampler.scale),
        timer,
        ngram,
    )
    drafted = tree_tokens[:, 1 : shape.draft_depth + 1] if shape.drafts else None
    return acc, features, drafted


def chain_round(
    engine: Engine,
    anchors: torch.Tensor,
    longest: int,
    num_draft_tokens: int,
    sampler: Sampler,
    timer: StepTimer,
    given: torch.Tensor | None = None,
) -> tuple[Acceptance, torch.Tensor | None, torch.Tensor | None]:
    """Draft (if g > 0), verify `[anchor, d_1..d_g]`, accept. Plain decoding is g = 0.

    `given (B, k)`: tokens proposed without the draft (the n-gram branch; rows with a shorter
    proposal padded), verified as a chain in the draft's place: each is a proposal of
    probability 1, so sampling's acceptance keeps the target's distribution. `longest` is the
    longest committed length of the rows still running (the others sit at length 0); it picks
    the kv buckets of both steps. Returns as `round_of`.
    """
    draft_tokens = anchors[:, None][:, :0] if given is None else given  # (B, 0) or (B, k)
    draft_q = candidates = None
    if given is not None:
        draft_q = torch.ones(given.shape + (1,), device=given.device)  # q(d) = 1: deterministic
        candidates = given[:, :, None]
    if num_draft_tokens > 0:
        draft_kv = engine._bucket(longest + engine.block_size, engine._draft_capacity())
        step, inputs = engine._chain.step_inputs(anchors, sampler)
        step.prepare(*inputs, kv_len=draft_kv)  # capture outside the timing
        with timer.section("draft"):
            draft_tokens, draft_q, candidates = engine._chain.propose(
                step, inputs, num_draft_tokens, draft_kv
            )
    block = torch.cat([anchors[:, None], draft_tokens], dim=1)  # (B, g + 1)
    kv_len = engine._bucket(longest + block.shape[1], engine.max_seq_len)
    engine._target_step.prepare(block, kv_len=kv_len)
    with timer.section("verify"):
        features, logits = engine._target_step(block, kv_len=kv_len)
    drafted = draft_tokens if num_draft_tokens > 0 else None
    if sampler.temperature <= 0.0:
        return greedy_accept(draft_tokens, logits), features, drafted
    probs = target_probs(logits, sampler.temperature, sampler.top_p)
    if draft_q is None:
        # Plain sampling is rejection sampling with nothing drafted: the bonus is a draw from p.
        draft_q = probs[:, :0, :1]
        candidates = draft_tokens[:, :, None]  # (B, 0, 1)
    accept = rejection_accept(
        draft_tokens, draft_q, probs, sampler.generator, candidates=candidates
    )
    return accept, features, drafted
