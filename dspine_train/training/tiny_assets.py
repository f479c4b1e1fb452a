"""The `tiny` recipe's stand-ins for a real target and dataset, written on first use.

* `write_tiny_target`: a random Qwen3 (4 layers, H 64, V 512) saved with `save_pretrained`, so
  the trainer loads it through the same `from_pretrained` path as a real target. Its weights
  are initialised with a large spread so its next-token distributions are peaked (a near-
  uniform target would give the draft nothing to learn). A small byte-level BPE tokenizer with
  a chat template is saved with it (`write_tiny_tokenizer`, trained locally on a fixed text):
  like a real target it says which ids are in use, and the evaluation harness needs one.
* `write_synthetic_dataset`: conversations *sampled from that target* (as `data_prep`
  regenerates real responses with the target), with an unsupervised "prompt" prefix, saved as
  a DatasetDict with `train` and `eval` splits and the `input_ids` / `loss_mask` / `length`
  columns of a real tokenised dataset.

Both write into a temporary directory and rename it into place, so an interrupted run never
leaves a half-written asset behind.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ..checkpoint_io import build_dir, publish_dir

TINY_VOCAB = 512
# Ids >= TINY_USED_VOCAB are never generated: they play the tokenizer's unused ids, one of
# which is the draft's mask token (the tiny recipe uses 511).
TINY_USED_VOCAB = 500
PROMPT_TOKENS = 8

# Qwen-style turns; enough for `apply_chat_template(..., add_generation_prompt=True)`.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
# Byte-level BPE: 256 byte symbols + the special tokens + merges; stays below the ids the tiny
# recipe keeps unused (>= TINY_USED_VOCAB, one of them the mask token).
TOKENIZER_VOCAB = 384
_CORPUS = (
    "def add(a, b):\n    return a + b\n",
    "Complete the following Python function. Reply with the complete function in a single "
    "```python code block.",
    "The quick brown fox jumps over the lazy dog. How do I write a function that returns the "
    "n-th Fibonacci number? Explain what the code does, then show an example.",
    "for i in range(len(numbers)):\n    if numbers[i] > threshold:\n        result.append(i)\n",
)


def write_tiny_tokenizer(target_dir: Path) -> None:
    """Save a byte-level BPE tokenizer with a chat template into `target_dir` (once)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (target_dir / "tokenizer.json").is_file():
        return
    assert TOKENIZER_VOCAB <= TINY_USED_VOCAB  # ids the tiny target actually produces
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    core.train_from_iterator(list(_CORPUS) * 8, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, chat_template=CHAT_TEMPLATE)
    tmp = Path(tempfile.mkdtemp(dir=target_dir.parent, prefix=f".{target_dir.name}.tok."))
    try:
        tokenizer.save_pretrained(str(tmp))
        # tokenizer.json last: its presence marks the tokenizer as complete
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == "tokenizer.json"):
            shutil.move(str(item), target_dir / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# The width and head layout of every tiny Qwen3 (the tiny recipe's target, the tests' targets):
# H 64, 4 query heads and 2 key/value heads of 16, MLP 128.
TINY_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128)


def tiny_target_config(**overrides: Any) -> Qwen3Config:
    """The tiny target's architecture (4 layers, vocabulary `TINY_VOCAB`, a wide init that
    makes its next-token distributions peaked); `overrides` change any field."""
    fields = dict(TINY_SHAPE, num_hidden_layers=4, vocab_size=TINY_VOCAB,
                  max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False)
    return Qwen3Config(**{**fields, **overrides})


def write_tiny_target(path: str | Path, seed: int = 0) -> None:
    """Save a tiny random Qwen3 causal LM (safetensors) at `path` unless it already exists."""
    path = Path(path)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_target_config())
    tmp = build_dir(path)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        write_tiny_tokenizer(tmp)
        publish_dir(tmp, path)  # another process may have won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@torch.no_grad()
def _sample(
    model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, temperature: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Ancestral sampling with a KV cache, never emitting the unused ids (>= TINY_USED_VOCAB).

    A plain loop: `generate` costs several times more per step at this size.
    """
    out = model(prompts, use_cache=True)
    tokens = [prompts]
    for _ in range(new_tokens):
        logits = out.logits[:, -1].float() / temperature  # (N, V)
        logits[:, TINY_USED_VOCAB:] = -torch.inf
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # (N, 1)
        tokens.append(nxt)
        out = model(nxt, use_cache=True, **_returned_cache(out))
    return torch.cat(tokens, dim=1)


def _returned_cache(out) -> dict[str, object]:
    """The KV cache a forward returned, under the keyword the next forward takes it by: `cache`
    from transformers 5.24 on, `past_key_values` before (the lower bound, 5.18, names it so)."""
    if hasattr(out, "cache"):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


@torch.no_grad()
def write_synthetic_dataset(
    path: str | Path,
    target_path: str | Path,
    num_sequences: int,
    length: int,
    seed: int = 0,
    eval_share: float = 0.2,
    temperature: float = 0.7,
) -> None:
    """Sample `num_sequences` sequences of up to `length` tokens from the target at `target_path`.

    Each sequence starts with `PROMPT_TOKENS` random prompt tokens (loss_mask 0) followed by
    the target's sampled continuation (loss_mask 1), cut to a random length in
    [length/2, length] so length-grouped batching has something to group.
    """
    path = Path(path)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(str(target_path), use_safetensors=True).eval()
    prompts = torch.randint(0, TINY_USED_VOCAB, (num_sequences, PROMPT_TOKENS), generator=gen)
    threads = torch.get_num_threads()
    # At this size threading overhead dominates (25x slower with 2 threads on a busy machine).
    torch.set_num_threads(1)
    try:
        sequences = _sample(target, prompts, length - PROMPT_TOKENS, temperature, gen)  # (N, len)
    finally:
        torch.set_num_threads(threads)
    cut = torch.randint(length // 2, length + 1, (num_sequences,), generator=gen).tolist()
    rows = {"input_ids": [], "loss_mask": [], "length": []}
    for seq, n in zip(sequences.tolist(), cut):
        rows["input_ids"].append(seq[:n])
        rows["loss_mask"].append([0] * PROMPT_TOKENS + [1] * (n - PROMPT_TOKENS))
        rows["length"].append(n)
    full = datasets.Dataset.from_dict(rows)
    num_eval = max(1, int(num_sequences * eval_share))
    splits = datasets.DatasetDict(
        train=full.select(range(num_eval, num_sequences)),
        eval=full.select(range(num_eval)),
    )
    tmp = build_dir(path)
    try:
        splits.save_to_disk(str(tmp))
        publish_dir(tmp, path)  # another process may have won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
