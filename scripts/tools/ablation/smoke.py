"""Assets of the ablation's smoke mode: the tiny random target, its tokenizer, its data.

The evaluation harness measures drafts on chat prompts, so the tiny target needs a tokenizer
with a chat template whose ids fit its 512-token vocabulary: the one `write_tiny_target`
saves with it (`tiny_assets.write_tiny_tokenizer`), so the target loads through the same
`from_pretrained` paths as a real one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspine_train.training.tiny_assets import (
    write_synthetic_dataset,
    write_tiny_target,
    write_tiny_tokenizer,
)


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
