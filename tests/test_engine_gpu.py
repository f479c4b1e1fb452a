"""CUDA path of the engine: graphed steps, bf16. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import build_tiny_target, hf_greedy, tiny_draft

from dspine_train.engine import Engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6, eos_token_id=None
    )
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31]]
    return root, hf, prompts


def test_cuda_graphs_greedy_matches_eager_and_transformers(files):
    root, hf, prompts = files
    reference = [hf_greedy(hf, p, 16) for p in prompts]
    kwargs = dict(
        device="cuda", dtype=torch.float32, max_batch_size=4, max_seq_len=64, eos_token_ids=[]
    )
    graphed = Engine.from_pretrained(root / "target", root / "draft", cuda_graphs=True, **kwargs)
    eager = Engine.from_pretrained(root / "target", root / "draft", cuda_graphs=False, **kwargs)
    for engine in (graphed, eager):
        assert engine.generate_ar(prompts, max_new_tokens=16).token_ids == reference
        assert engine.generate(prompts, max_new_tokens=16).token_ids == reference
    assert graphed._target_step.enabled and graphed._target_step._steps
    # A second call replays the captured graphs with new inputs.
    assert graphed.generate(prompts[::-1], max_new_tokens=16).token_ids == reference[::-1]


def test_bf16_speculative_equals_bf16_plain_decoding(files):
    root, _, prompts = files
    engine = Engine.from_pretrained(
        root / "target",
        root / "draft",
        device="cuda",
        dtype=torch.bfloat16,
        max_batch_size=4,
        max_seq_len=64,
        eos_token_ids=[],
    )
    ar = engine.generate_ar(prompts, max_new_tokens=16)
    spec = engine.generate(prompts, max_new_tokens=16)
    assert spec.token_ids == ar.token_ids
    sampled = engine.generate(prompts, max_new_tokens=8, temperature=1.0, seed=3)
    assert all(len(t) == 8 for t in sampled.token_ids)
