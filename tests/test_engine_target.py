"""The engine's compact target against transformers: logits, hidden-state features, caches."""

from __future__ import annotations

import json

import pytest
import torch
from _engine_helpers import build_tiny_target, hf_features
from safetensors.torch import load_file, save_file

from dspine_train.engine import CheckpointError, load_target

LAYERS = [0, 2, 3]  # includes the last layer, whose HF entry is the normed final state


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls on a shared 2-core machine: extra BLAS threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(model, tokens: list[list[int]]):
    """Forward right-padded new tokens of a ragged batch at the current cache lengths."""
    width = max(len(t) for t in tokens)
    ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
    out = model(ids, kv_len=int(model.cache.lengths.max()) + width)
    return model.logits(out.hidden), out.features


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "family,overrides",
    [("qwen3", {}), ("qwen2", {}), ("llama", {}), ("llama", {"rope_parameters": LLAMA3_ROPE})],
    ids=["qwen3", "qwen2", "llama", "llama-llama3-rope"],
)
def test_prefill_and_ragged_decode_match_transformers(tmp_path, family, overrides):
    hf = build_tiny_target(tmp_path, family, **overrides)
    model = load_target(tmp_path)
    model.set_feature_layers(LAYERS)
    model.setup(max_batch_size=4, max_seq_len=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    model.cache.reset(3)

    # Prefill a ragged batch, then two ragged rounds of new tokens, one of them rolled back.
    seqs = [list(p) for p in prompts]
    chunks = [prompts]
    chunks.append([torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 1, 2)])
    chunks.append([torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 4, 2)])
    for step, chunk in enumerate(chunks):
        logits, feats = _run(model, chunk)
        if step > 0:
            seqs = [s + c for s, c in zip(seqs, chunk)]
        for b, seq in enumerate(seqs):
            ref_logits, ref_feats = hf_features(hf, seq, LAYERS)
            n = len(chunk[b])
            torch.testing.assert_close(logits[b, :n], ref_logits[-n:], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(feats[b, :n], ref_feats[-n:], atol=2e-5, rtol=1e-4)
        advance = torch.tensor([len(c) for c in chunk])
        if step == 1:
            # Roll back all but the first new token of each sequence (rejected drafts).
            advance = torch.ones(3, dtype=torch.long)
            seqs = [s[: len(s) - len(c) + 1] for s, c in zip(seqs, chunk)]
        model.cache.crop(model.cache.lengths[:3] + advance)


def test_tied_embeddings_and_sharded_checkpoint(tmp_path):
    hf = build_tiny_target(tmp_path / "tied", "qwen3", tie_word_embeddings=True)
    model = load_target(tmp_path / "tied")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # Split the same weights into two shards with an index, as large checkpoints are saved.
    state = load_file(str(tmp_path / "tied" / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "tied" / "config.json").read_text())
    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    for name, names in halves.items():
        save_file({k: state[k] for k in names}, str(sharded / name))
    index = {"weight_map": {k: name for name, names in halves.items() for k in names}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded_model = load_target(sharded)

    ids = [5, 17, 42, 7]
    for m in (model, sharded_model):
        m.setup(1, 16)
        m.cache.reset(1)
        logits = m.logits(m(torch.tensor([ids]), kv_len=4).hidden)[0]
        torch.testing.assert_close(logits, hf_features(hf, ids, [0])[0], atol=2e-5, rtol=1e-4)


def test_bf16_weights_load_as_requested_dtype(tmp_path):
    hf = build_tiny_target(tmp_path, "qwen2")
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_target(tmp_path, dtype=torch.float32)
    assert model.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight.float())


def test_truncated_and_corrupted_weights_are_rejected(tmp_path):
    build_tiny_target(tmp_path, "qwen3")
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: not a valid safetensors"):
        load_target(tmp_path)
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        load_target(tmp_path)


def test_missing_tensor_and_unsupported_family_are_named(tmp_path):
    build_tiny_target(tmp_path, "qwen3")
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj"):
        load_target(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type='gpt2' is not supported"):
        load_target(tmp_path)
