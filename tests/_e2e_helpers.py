"""Shared pieces of the end-to-end and harness tests: a tiny chat target and prompt files.

The target is a tiny random Qwen3 with a word-level tokenizer that has Qwen's special tokens
and a ChatML chat template, saved with `save_pretrained`, so every stage (regeneration, the
chat template, token table, trainer, engine) loads it through its real code path. Its
vocabulary has a few ids past the tokenizer's, one of which becomes the draft's mask token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tests._data_helpers import QWEN3_TEMPLATE, word_level_tokenizer

WORDS = [f"w{i}" for i in range(120)] + ["def", "return", "(", ")", ":", "print", "sum", "list"]
SPARE_IDS = 8  # vocabulary rows no token uses (the draft takes the first as its mask id)
NUM_LAYERS = 6  # two draft layers read target layers 1 and 3 (METHOD 1: round(1 + i*(L-4)))


def build_chat_target(path: Path, seed: int = 0, initializer_range: float = 0.3) -> Path:
    """Save the tiny chat target (model + tokenizer + generation config) to `path`."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = word_level_tokenizer(QWEN3_TEMPLATE, WORDS)
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=len(tokenizer) + SPARE_IDS, max_position_embeddings=512,
        # A wide init makes next-token distributions peaked, as a trained model's are; a
        # near-uniform target would leave greedy decoding at the mercy of rounding.
        initializer_range=initializer_range, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_prompts(path: Path, count: int, seed: int, *, key: str = "prompt") -> Path:
    """A JSONL file of `count` prompts of 3-8 random words, with ids `p<seed>-<i>`."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        row = {"id": f"p{seed}-{i}"}
        row.update({"prompt": text} if key == "prompt" else
                   {"messages": [{"role": "user", "content": text}]})
        rows.append(row)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
