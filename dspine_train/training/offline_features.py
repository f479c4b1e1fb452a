"""Offline target features: a sharded on-disk cache and the reader the trainer uses.

Layout of one split's cache, `<offline_features_dir>/<split>/`:

    index.json            target, layer ids, max_length, dtype, rows and the shard table
    shard_00000.safetensors
        context       (T, n*H)  hidden states at the target layers, T = tokens in the shard
        final_hidden  (T, H)    the target's final normed hidden state
        offsets       (R + 1,)  row r of the shard is tokens offsets[r]:offsets[r+1]

Rows are stored in dataset order, cut to `max_length`, without padding. Sizes are large
(positions x (n+1) x H x 2 bytes in bf16, ~40 KB per token for Qwen3-8B), so
`estimate_cache_bytes` is printed before anything is written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .data import TokenBatches
from .errors import TrainingError
from .target import TargetFeatures

INDEX_FILE = "index.json"


def estimate_cache_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of a cache holding `num_tokens` positions: tokens x (n + 1) x H x element size."""
    return num_tokens * (num_layers + 1) * hidden_size * torch.empty((), dtype=dtype).element_size()


@dataclass
class CacheIdentity:
    """What a cache was made from; training refuses a cache that does not match its recipe."""

    target_path: str
    target_layer_ids: list[int]
    max_length: int
    num_rows: int


def write_feature_cache(
    out_dir: Path,
    batches: TokenBatches,
    extract: Callable[[torch.Tensor, torch.Tensor], TargetFeatures],
    identity: CacheIdentity,
    device: torch.device,
    batch_size: int = 8,
    shard_tokens: int = 1 << 20,
) -> None:
    """Run the target over every row of `batches` and write the sharded cache to `out_dir`.

    Written into `<out_dir>.tmp` and renamed at the end, so a cache directory is always whole.
    """
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, int | str]] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending_tokens, first_row, dtype = 0, 0, None

    def flush() -> None:
        nonlocal pending, pending_tokens, first_row
        if not pending:
            return
        lengths = torch.tensor([0] + [c.shape[0] for c, _ in pending])
        name = f"shard_{len(shards):05d}.safetensors"
        save_file(
            {
                "context": torch.cat([c for c, _ in pending]).contiguous(),
                "final_hidden": torch.cat([f for _, f in pending]).contiguous(),
                "offsets": torch.cumsum(lengths, 0),
            },
            str(tmp / name),
        )
        shards.append({"file": name, "first_row": first_row, "num_rows": len(pending)})
        first_row += len(pending)
        pending, pending_tokens = [], 0

    rows = list(range(len(batches)))
    for start in tqdm(range(0, len(rows), batch_size), desc="caching target features", unit="batch"):
        batch = batches.collate(rows[start : start + batch_size]).to(device)
        feats = extract(batch.input_ids, batch.attention_mask)
        dtype = feats.context.dtype
        for i, n in enumerate(batch.attention_mask.sum(1).tolist()):
            pending.append((feats.context[i, :n].cpu(), feats.final_hidden[i, :n].cpu()))
            pending_tokens += n
        if pending_tokens >= shard_tokens:
            flush()
    flush()
    index = {**identity.__dict__, "dtype": str(dtype).removeprefix("torch."), "shards": shards}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


class OfflineFeatures:
    """Reads cached features of dataset rows back as padded (b, S, .) batches."""

    def __init__(self, cache_dir: Path, expected: CacheIdentity) -> None:
        index_path = cache_dir / INDEX_FILE
        if not index_path.is_file():
            raise TrainingError(
                f"data.offline_features_dir: no feature cache at {cache_dir} (run "
                "`python -m data_prep.cache_features` with the same recipe first)"
            )
        self.index = json.loads(index_path.read_text())
        for key, want in expected.__dict__.items():
            if key == "target_path":
                continue  # the same target may live at another path on this machine
            if self.index.get(key) != want:
                raise TrainingError(
                    f"data.offline_features_dir: {cache_dir} was cached with {key}="
                    f"{self.index.get(key)!r}, this recipe needs {want!r}; recreate the cache"
                )
        self.dir = cache_dir
        self._starts = np.array([s["first_row"] for s in self.index["shards"]])
        self._handles: dict[str, object] = {}

    def _shard(self, row: int) -> tuple[object, int]:
        i = int(np.searchsorted(self._starts, row, side="right") - 1)
        shard = self.index["shards"][i]
        handle = self._handles.get(shard["file"])
        if handle is None:
            handle = safe_open(str(self.dir / shard["file"]), framework="pt")
            self._handles[shard["file"]] = handle
        return handle, row - shard["first_row"]

    def features(self, rows: list[int], width: int) -> TargetFeatures:
        """Features of `rows`, right-padded with zeros to `width` positions."""
        contexts, finals = [], []
        for row in rows:
            handle, local = self._shard(row)
            offsets = handle.get_slice("offsets")[local : local + 2]
            lo, hi = int(offsets[0]), int(offsets[1])
            contexts.append(handle.get_slice("context")[lo:hi])
            finals.append(handle.get_slice("final_hidden")[lo:hi])
        context = contexts[0].new_zeros(len(rows), width, contexts[0].shape[-1])
        final = finals[0].new_zeros(len(rows), width, finals[0].shape[-1])
        for i, (c, f) in enumerate(zip(contexts, finals)):
            context[i, : c.shape[0]] = c
            final[i, : f.shape[0]] = f
        return TargetFeatures(context=context, final_hidden=final)
