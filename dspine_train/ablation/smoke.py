"""Assets of the ablation's smoke mode: the tiny random target, a tokenizer for it, its data.

The evaluation harness measures drafts on chat prompts, so the tiny target needs a tokenizer
with a chat template whose ids fit its 512-token vocabulary. `write_tiny_tokenizer` trains a
byte-level BPE of a few hundred tokens on a fixed text, locally (no download), and saves it
next to the tiny target, which then loads through the same `from_pretrained` paths as a real one.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from ..training.tiny_assets import TINY_USED_VOCAB, write_synthetic_dataset, write_tiny_target

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


def write_smoke_assets(root: Path) -> tuple[Path, Path]:
    """The tiny target (with tokenizer) and a dataset sampled from it, under `root`; each
    written once. Returns (target dir, data dir)."""
    target, data = root / "target", root / "data"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only costs
    try:
        write_tiny_target(target, seed=0)
        write_tiny_tokenizer(target)
        write_synthetic_dataset(data, target, num_sequences=96, length=48, seed=0)
    finally:
        torch.set_num_threads(threads)
    return target, data
