"""Engine steps: kv-length buckets, device-side bookkeeping, inference mode, warmup, capture policy."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import build_tiny_target, hf_greedy, tiny_draft

from dspine_train.engine import Engine, GenerationInputError
from dspine_train.engine.cuda_graphs import GraphCaptureError, StepCache

NEW = 10
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    hf = build_tiny_target(root / "target", "qwen3", head_scale=4.0, eos_token_id=None)
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    reference = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return root, reference


def _engine(world, **kwargs) -> Engine:
    root, _ = world
    kwargs.setdefault("max_batch_size", 4)
    kwargs.setdefault("max_seq_len", 64)
    return Engine.from_pretrained(root / "target", root / "draft", eos_token_ids=[], **kwargs)


def _spy_draft(engine: Engine) -> list[tuple[int | None, bool]]:
    """Record (kv_len, inference mode) of every draft forward."""
    calls: list[tuple[int | None, bool]] = []
    forward = engine.draft.draft_forward

    def spy(cache, anchors, kv_len=None):
        calls.append((kv_len, torch.is_inference_mode_enabled()))
        return forward(cache, anchors, kv_len)

    engine.draft.draft_forward = spy
    return calls


def test_small_kv_buckets_stay_lossless_and_the_draft_attends_a_bucket(world):
    _, reference = world
    engine = _engine(world, kv_bucket_size=8)
    assert engine.kv_buckets() == [8, 16, 24, 32, 40, 48, 56, 64]
    calls = _spy_draft(engine)
    assert engine.generate(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference
    assert engine.generate_ar(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference
    kv_lens = [kv for kv, _ in calls]
    # The first round: the longest prompt (5) + a block of 8 -> 13 -> bucket 16, not capacity.
    assert kv_lens[0] == 16
    assert all(kv is not None and kv % 8 == 0 for kv in kv_lens)
    assert all(inference for _, inference in calls), "the loop must run under inference_mode"


def test_rounds_make_no_host_to_device_tensors(world, monkeypatch):
    engine = _engine(world)
    made = []
    original = torch.tensor

    def counting(*args, **kwargs):
        made.append(kwargs.get("device"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    counts = []
    for method, new in (("generate_ar", 1), ("generate_ar", NEW), ("generate", NEW)):
        made.clear()
        result = getattr(engine, method)(PROMPTS, max_new_tokens=new, chat=False)
        assert result.stats.steps == new - 1 or method == "generate"
        counts.append(len(made))
    # Only the prefill builds tensors from host lists (prompt ids, lengths): not one per round.
    assert counts == [2, 2, 2]


def test_warmup_checks_its_arguments_and_leaves_the_engine_clean(world):
    _, reference = world
    engine = _engine(world, kv_bucket_size=16)
    for bad in (
        dict(batch_sizes=[0]),
        dict(batch_sizes=[5]),
        dict(num_draft_tokens=[8]),
        dict(kv_buckets=[20]),
        dict(kv_buckets=[128]),
    ):
        with pytest.raises(GenerationInputError):
            engine.warmup(**bad)
    report = engine.warmup(batch_sizes=[1, 4], num_draft_tokens=[0, 3, 7], kv_buckets=[16, 64])
    assert report["graphs"] == 0  # nothing is captured on a CPU
    assert engine.generate(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference
    assert engine.generate_ar(PROMPTS, max_new_tokens=NEW, chat=False).token_ids == reference


def _breaks_the_graph(x: torch.Tensor) -> tuple[torch.Tensor]:
    y = x * 2
    torch._dynamo.graph_break()
    return (y + 1,)


def test_a_failed_compile_raises_when_strict_and_falls_back_loudly_otherwise():
    x = torch.arange(4.0)
    strict = StepCache(_breaks_the_graph, "probe", graphs=False, compile=True, strict=True,
                       compile_backend="eager")
    with pytest.raises(GraphCaptureError, match="probe step"):
        strict(x)
    lenient = StepCache(_breaks_the_graph, "probe", graphs=False, compile=True,
                        compile_backend="eager")
    with pytest.warns(RuntimeWarning, match="probe step failed"):
        (out,) = lenient(x)
    torch.testing.assert_close(out, x * 2 + 1)
    assert not lenient.compiled


@pytest.mark.slow
def test_compiled_steps_trace_as_one_graph_and_stay_lossless(world):
    """`fullgraph=True` on the verify, draft and commit steps (dynamo with the eager backend:
    the trace is what CUDA compiles, without generating kernels on a CPU)."""
    _, reference = world
    engine = _engine(world, compile=True, compile_backend="eager", strict_graphs=True,
                     max_batch_size=2)
    spec = engine.generate(PROMPTS[:2], max_new_tokens=NEW, chat=False, num_draft_tokens=3)
    assert spec.token_ids == reference[:2]
    assert spec.stats.capture_s > 0
    assert engine.generate_ar(PROMPTS[:2], max_new_tokens=NEW, chat=False).token_ids == reference[:2]


def test_the_sampling_draft_is_a_compiled_step_with_a_sparse_q(world, monkeypatch):
    """At T > 0 the draft runs as its own compiled step (fullgraph, strict: a pure function of
    tensors, its randomness drawn ahead), draws what the eager step draws, and hands the
    acceptance a q over the K candidates of each slot, not a dense (B, g, V) one."""
    import dspine_train.engine.decode_loop as loop_module

    shapes = []
    accept = loop_module.rejection_accept

    def spy(draft_tokens, draft_probs, *args, **kwargs):
        shapes.append((tuple(draft_probs.shape), tuple(kwargs["candidates"].shape)))
        return accept(draft_tokens, draft_probs, *args, **kwargs)

    monkeypatch.setattr(loop_module, "rejection_accept", spy)
    settings = dict(max_new_tokens=NEW, chat=False, temperature=0.8, top_p=0.9, seed=3,
                    num_draft_tokens=3)
    eager = _engine(world, max_batch_size=2).generate(PROMPTS[:2], **settings)
    engine = _engine(world, compile=True, compile_backend="eager", strict_graphs=True,
                     max_batch_size=2)
    compiled = engine.generate(PROMPTS[:2], **settings)
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats.steps > 1
    step = engine._draft_sample_step
    assert step.compiled and step._compiled_keys  # it ran compiled (strict: no fallback)
    k = engine.draft.config.candidate_k
    assert set(shapes) == {((2, 3, k), (2, 3, k))} and k < engine.target.config.vocab_size


@pytest.mark.slow
def test_tree_acceptance_and_compaction_run_in_the_compiled_tree_step(world, monkeypatch):
    """Tree rounds accept and compact inside the compiled verify step (greedy and sampling),
    with the eager path's tokens; nothing of them runs eager."""
    import dspine_train.engine.tree_verify as tree_module

    settings = dict(max_new_tokens=NEW, chat=False, seed=4, num_draft_tokens=3)
    eager_engine = _engine(world, max_batch_size=2, tree_paths=3)
    eager = [eager_engine.generate(PROMPTS[:2], temperature=t, **settings) for t in (0.0, 0.8)]
    traced = []
    for name in ("greedy_tree_accept", "sampled_tree_accept", "compact_path"):
        original = getattr(tree_module, name)

        def only_compiled(*args, _fn=original, _name=name, **kwargs):
            if not torch.compiler.is_compiling():
                raise AssertionError(f"{_name} ran eager")
            traced.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(tree_module, name, only_compiled)
    engine = _engine(world, compile=True, compile_backend="eager", strict_graphs=True,
                     max_batch_size=2, tree_paths=3)
    for temperature, expected in zip((0.0, 0.8), eager, strict=True):
        compiled = engine.generate(PROMPTS[:2], temperature=temperature, **settings)
        assert compiled.token_ids == expected.token_ids
        assert compiled.stats.tree_paths == 3
    _, reference = world
    assert eager[0].token_ids == reference[:2]
    assert {"greedy_tree_accept", "sampled_tree_accept", "compact_path"} <= set(traced)


def test_warmup_runs_the_sampling_steps_when_asked(world):
    engine = _engine(world, tree_paths=2)
    calls = []
    for step in engine._steps():
        def counted(*args, _fn=step.fn, _name=step.name, **kwargs):
            calls.append((_name, len(args)))
            return _fn(*args, **kwargs)

        step.fn = counted
    engine.warmup(batch_sizes=[2], num_draft_tokens=[3], kv_buckets=[64])
    assert ("sampling draft", 3) not in calls
    calls.clear()
    engine.warmup(batch_sizes=[2], num_draft_tokens=[3], kv_buckets=[64], temperature=0.7,
                  top_p=0.9)
    # At every draft kv length the greedy draft is warmed up at, once (nothing to capture).
    assert calls.count(("sampling draft", 3)) == calls.count(("draft", 1)) > 0
    # The tree's verify step: greedy (the tree's 5 fields) and sampling (+ temperature, noise).
    assert ("tree verify", 5) in calls and ("tree verify", 7) in calls
    with pytest.raises(GenerationInputError, match="temperature"):
        engine.warmup(temperature=-1.0)
    settings = dict(max_new_tokens=NEW, chat=False, temperature=0.7, top_p=0.9, seed=1)
    assert engine.generate(PROMPTS, **settings).token_ids == (
        _engine(world, tree_paths=2).generate(PROMPTS, **settings).token_ids
    )
