"""Bad input is refused with a clear message before any generation; the engine stays light."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _engine_helpers import build_tiny_target, build_tokenizer

from dspine_train.engine import (
    CheckpointError,
    Engine,
    GenerationInputError,
    IncompatibleDraftError,
)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def target(tmp_path):
    """A tiny 6-layer Qwen3 target with a 200-token tokenizer; returns (dir, hf model)."""
    path = tmp_path / "target"
    hf = build_tiny_target(path, "qwen3", num_hidden_layers=6)
    build_tokenizer(path, vocab_size=200)
    return path, hf


def _save_draft(tmp_path, hf_config, name="draft", used_vocab_size=200, **fields):
    from dspine_train.modeling import DSpineConfig, DSpineDraftModel

    base = dict(num_layers=2, block_size=4, transfer_dim=8, message_size=8, candidate_k=4)
    base.update(fields)
    config = DSpineConfig.from_target(hf_config, used_vocab_size=used_vocab_size, **base)
    DSpineDraftModel(config).save_pretrained(tmp_path / name)
    return tmp_path / name


def test_draft_for_another_target_is_rejected(tmp_path, target):
    path, hf = target
    wider = build_tiny_target(tmp_path / "wide", "qwen3", hidden_size=96, num_hidden_layers=6)
    draft = _save_draft(tmp_path, wider.config, "wide_draft")
    with pytest.raises(IncompatibleDraftError, match="hidden_size: draft 96, target 64"):
        Engine.from_pretrained(path, draft)

    bigger_vocab = build_tiny_target(
        tmp_path / "vocab", "qwen3", vocab_size=300, num_hidden_layers=6
    )
    draft = _save_draft(tmp_path, bigger_vocab.config, "vocab_draft")
    with pytest.raises(IncompatibleDraftError, match="vocab_size: draft 300, target 256"):
        Engine.from_pretrained(path, draft)

    deeper = build_tiny_target(tmp_path / "deep", "qwen3", num_hidden_layers=12)
    draft = _save_draft(tmp_path, deeper.config, "deep_draft")
    with pytest.raises(IncompatibleDraftError, match=r"target_layer_ids \[9\] are beyond"):
        Engine.from_pretrained(path, draft)

    draft = _save_draft(tmp_path, hf.config, "tok_draft", used_vocab_size=150)
    with pytest.raises(
        IncompatibleDraftError, match="tokenizer of 150 tokens, this tokenizer has 200"
    ):
        Engine.from_pretrained(path, draft)


def test_truncated_or_corrupted_draft_is_rejected(tmp_path, target):
    path, hf = target
    draft = _save_draft(tmp_path, hf.config)
    weights = draft / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors: not a valid safetensors"):
        Engine.from_pretrained(path, draft)
    weights.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        Engine.from_pretrained(path, draft)
    weights.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Engine.from_pretrained(path, draft)


def test_bad_requests_fail_before_generation(tmp_path, target):
    path, hf = target
    engine = Engine.from_pretrained(
        path, _save_draft(tmp_path, hf.config), max_seq_len=40, max_batch_size=2
    )
    cases = [
        (([[1, 2], []],), {}, "prompt 1 is empty"),
        (([],), {}, "no prompts given"),
        (("   ",), {"chat": False}, "prompt 0 is empty"),
        (("w1 w2",), {"chat": True}, "no chat template"),
        (([[1, 2, 3]],), {"max_new_tokens": 40}, "needs 47 cache positions.*max_seq_len=40"),
        (([[1, 2, 3]] * 3,), {}, "exceed the engine's max_batch_size=2"),
        (([[1, 999]],), {}, "outside the vocabulary"),
        (([[1, 2]],), {"num_draft_tokens": 4}, "num_draft_tokens=4 must be in 1..3"),
        (([[1, 2]],), {"top_p": 0.0}, "top_p in \\(0, 1\\]"),
    ]
    for args, kwargs, message in cases:
        kwargs.setdefault("max_new_tokens", 8)
        with pytest.raises(GenerationInputError, match=message):
            engine.generate(*args, **kwargs)
    # Nothing above left the engine in a bad state.
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=4).token_ids[0]) == 4


def test_engine_without_draft_serves_plain_decoding_only(target):
    path, _ = target
    engine = Engine.from_pretrained(path, max_seq_len=32)
    assert len(engine.generate_ar("w3 w4", max_new_tokens=5, chat=False).token_ids[0]) == 5
    with pytest.raises(GenerationInputError, match="no draft"):
        engine.generate([[1, 2]])


def test_importing_the_engine_loads_no_training_stack():
    code = (
        "import sys, json, dspine_train.engine\n"
        "heavy = ('hydra', 'deepspeed', 'accelerate', 'datasets', 'dspine_train.training')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_serving_a_draft_loads_no_training_code(tmp_path, target):
    """Loading a draft and generating pulls in no hydra / deepspeed / datasets / trainer code.

    accelerate is not checked here: transformers' `PreTrainedModel`, the draft's base class,
    imports it on its own whenever it is installed.
    """
    path, hf = target
    draft = _save_draft(tmp_path, hf.config)
    code = (
        "import sys, json\n"
        "from dspine_train.engine import Engine\n"
        f"engine = Engine.from_pretrained({str(path)!r}, {str(draft)!r})\n"
        "out = engine.generate([[5, 6, 7]], max_new_tokens=4, chat=False)\n"
        "assert len(out.token_ids[0]) > 0\n"
        "heavy = ('hydra', 'deepspeed', 'datasets', 'dspine_train.training', 'dspine_train.objective')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
