"""Offline target features: a sharded on-disk cache and the reader the trainer uses.

Layout of one split's cache, `<offline_features_dir>/<split>/`:

    index.json            target, layer ids, max_length, dtype, rows, the fingerprints of the
                          target and of the token data, and the shard table
    shard_00000.safetensors
        context       (T, n*H)  hidden states at the target layers, T = tokens in the shard
        final_hidden  (T, H)    the target's final normed hidden state
        topk_ids      (T, k)    int32, the k most likely next tokens of the target at each token
        topk_probs    (T, k)    float32, their probabilities (only when `target_topk` k > 0)
        target_lse    (T, 1)    float32, the logsumexp of the target's logits (idem)
        offsets       (R + 1,)  row r of the shard is tokens offsets[r]:offsets[r+1]

The top-k is the target's distribution computed once here, so a training step does not
project every slot's state through the V x H head again (`dspine_train.vocab_loss`); a cache
without it (older, or `data.target_topk: 0`) trains on the exact distribution projected from
`final_hidden`.

Rows are stored in dataset order, cut to `max_length`, without padding. Sizes are large
(positions x (n+1) x H x 2 bytes in bf16, ~40 KB per token for Qwen3-8B), so
`estimate_cache_bytes` is printed before anything is written.

A cache is tied to what it was made from (`CacheIdentity`, built by `cache_identity`): the
target's fingerprint (its config and, per weight file, name, size and a hash of sampled
chunks) and the token data's fingerprint (a hash of every row's input ids). Training refuses
a cache whose fingerprints differ from its own inputs and names both sides.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..checkpoint_io import (
    WeightsError,
    build_dir,
    clean_dead_builds,
    open_safetensors,
    replace_dir,
    write_json_atomic,
)
from ..owned_dir import check_replaceable
from ..vocab_loss import target_topk
from .data import TokenBatches
from .errors import TrainingError
from .target import TargetFeatures

INDEX_FILE = "index.json"
# a split being built: the shards saved so far (`write_split_resumable`)
PROGRESS_FILE = "progress.json"
# Config keys that do not change what the target computes (where it was saved from, by which
# transformers release), left out of its fingerprint.
_UNFINGERPRINTED_CONFIG_KEYS = ("_name_or_path", "transformers_version")
_SAMPLES_PER_FILE, _SAMPLE_BYTES = 16, 1 << 16


def estimate_cache_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of a cache holding `num_tokens` positions: tokens x (n + 1) x H x element size."""
    return num_tokens * (num_layers + 1) * hidden_size * torch.empty((), dtype=dtype).element_size()


def target_fingerprint(path: str | Path) -> str:
    """sha256 of a target's config and weight files (name, size, sampled chunks).

    Reading every weight would take minutes for an 8B target; 16 chunks of 64 KiB spread over
    each file tell apart two fine-tunes of one base, whose sizes and headers are equal.
    """
    root = Path(path)
    digest = hashlib.sha256()
    config_path = root / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        for key in _UNFINGERPRINTED_CONFIG_KEYS:
            config.pop(key, None)
        digest.update(json.dumps(config, sort_keys=True).encode())
    for file in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            for i in range(_SAMPLES_PER_FILE):
                handle.seek(max(0, size - _SAMPLE_BYTES) * i // (_SAMPLES_PER_FILE - 1))
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def data_fingerprint(dataset: datasets.Dataset) -> str:
    """sha256 of every row's `input_ids` (as int64, row by row): the same ids, the same hash.

    Independent of the dtype the ids are stored in and of the run that tokenised them, so a
    re-tokenisation of the same data keeps its cache valid.
    """
    digest = hashlib.sha256()
    for table in dataset.with_format("arrow").iter(batch_size=4096):
        for chunk in table.column("input_ids").chunks:
            digest.update(np.asarray(chunk.value_lengths(), dtype=np.int64).tobytes())
            digest.update(np.asarray(chunk.flatten(), dtype=np.int64).tobytes())
    return digest.hexdigest()


@dataclass
class CacheIdentity:
    """What a cache was made from; training refuses a cache that does not match its recipe.

    `target_path` and `data_source` say where the inputs were (for messages; the same target
    may live at another path on this machine); the fingerprints say what they were.
    """

    target_path: str
    target_layer_ids: list[int]
    max_length: int
    num_rows: int
    target_fingerprint: str = ""
    data_source: str = ""
    data_fingerprint: str = ""


def cache_identity(target_path: str, target_layer_ids: Sequence[int], max_length: int,
                   batches: TokenBatches) -> CacheIdentity:
    """The identity of a cache of `batches` made with the target at `target_path`."""
    files = batches.dataset.cache_files
    where = str(Path(files[0]["filename"]).parent) if files else "an in-memory dataset"
    return CacheIdentity(target_path, list(target_layer_ids), max_length, len(batches),
                         target_fingerprint(target_path), f"{batches.role} {where}",
                         data_fingerprint(batches.dataset))


def write_feature_cache(
    out_dir: Path,
    batches: TokenBatches,
    extract: Callable[[torch.Tensor, torch.Tensor], TargetFeatures],
    identity: CacheIdentity,
    device: torch.device,
    batch_size: int = 8,
    shard_tokens: int = 1 << 20,
    topk: tuple[torch.Tensor, int] | None = None,
) -> None:
    """Run the target over every row of `batches` and write the sharded cache to `out_dir`.

    `topk` (lm_head weight (V, H), k): also store the top-k of the target's distribution.

    Written into a hidden sibling and swapped in at the end, so a cache directory is always
    whole; an existing `out_dir` is replaced only when it is a feature cache (or empty).
    """
    check_replaceable(out_dir, "data.offline_features_dir", INDEX_FILE,
                      "dspine_train.training.cache_features", {})
    clean_dead_builds(out_dir)
    tmp = build_dir(out_dir)
    try:
        writer = _ShardWriter(tmp, shard_tokens)
        writer.write(batches, extract, identity, device, batch_size, topk)
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resume_key(identity: CacheIdentity, batch_size: int, shard_tokens: int,
               topk: tuple[torch.Tensor, int] | None) -> dict[str, object]:
    """What decides a split's shards: a partial build made with another key is not resumed."""
    key = {**identity.__dict__, "batch_size": batch_size, "shard_tokens": shard_tokens,
           "target_topk": topk[1] if topk is not None else 0}
    return json.loads(json.dumps(key))  # as it reads back from the progress file


def write_split_resumable(
    split_dir: Path,
    batches: TokenBatches,
    extract: Callable[[torch.Tensor, torch.Tensor], TargetFeatures],
    identity: CacheIdentity,
    device: torch.device,
    batch_size: int = 8,
    shard_tokens: int = 1 << 20,
    topk: tuple[torch.Tensor, int] | None = None,
    save_every_s: float = 300.0,
) -> int:
    """Write one split's cache into `split_dir`, resuming what an earlier, stopped run saved.

    Finished shards are saved whole (written aside, renamed in) before `progress.json` lists
    them; the rows of the shard being filled are saved too, as a chunk of the rows since the last
    save, every `save_every_s` seconds. So a kill loses at most that long, however large a shard
    is. A rerun with the same `resume_key` keeps the listed files, reloads the saved rows and goes
    on from the first row after them, with the same batches: every file then equals an
    uninterrupted run's. Another key (other inputs or settings) starts over. The progress file
    and the chunks are removed once `index.json` is written. Returns the rows kept from before.
    """
    key = resume_key(identity, batch_size, shard_tokens, topk)
    progress_path = split_dir / PROGRESS_FILE
    state = json.loads(progress_path.read_text()) if progress_path.is_file() else None
    if state is None or state.get("key") != key:
        shutil.rmtree(split_dir, ignore_errors=True)
        state = {"key": key, **_new_state()}
    split_dir.mkdir(parents=True, exist_ok=True)
    listed = {s["file"] for s in state["shards"] + state["chunks"]} | {PROGRESS_FILE}
    for stray in split_dir.iterdir():  # the file a kill interrupted
        if stray.name not in listed:
            stray.unlink()
    writer = _ShardWriter(split_dir, shard_tokens, state,
                          lambda: write_json_atomic(progress_path, state))
    kept = writer.next_row
    writer.write(batches, extract, identity, device, batch_size, topk, save_every_s)
    progress_path.unlink()
    return kept


def _new_state() -> dict[str, Any]:
    """A `_ShardWriter` state with nothing written yet."""
    return {"dtype": None, "shards": [], "chunks": []}


_FEATURE_NAMES = ("context", "final_hidden", "topk_ids", "topk_probs", "target_lse")


def _pack(rows: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    """Rows of features as one file's tensors: each feature concatenated, plus the offsets."""
    lengths = torch.tensor([0] + [row[0].shape[0] for row in rows])
    tensors = {key: torch.cat([row[i] for row in rows]).contiguous()
               for i, key in enumerate(_FEATURE_NAMES[: len(rows[0])])}
    return {**tensors, "offsets": torch.cumsum(lengths, 0)}


def _unpack(tensors: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """The rows `_pack` packed, in order."""
    offsets = tensors["offsets"].tolist()
    names = [key for key in _FEATURE_NAMES if key in tensors]
    return [tuple(tensors[key][a:b] for key in names) for a, b in zip(offsets, offsets[1:])]


class _ShardWriter:
    """Fills shards of `shard_tokens` rows' worth, cut at batch boundaries, in `out`.

    `state` ({"dtype", "shards", "chunks"}: the finished shards and the saved rows of the one being
    filled) is where a stopped run left off; `save_state` (None: not resumable) records it after
    every file is written. A resumed run starts at a batch boundary (every file ends at one), so
    its batches, and with them every stored value and the shards' cut, are an uninterrupted run's.
    """

    def __init__(self, out: Path, shard_tokens: int, state: dict[str, Any] | None = None,
                 save_state: Callable[[], None] | None = None) -> None:
        self.out, self.shard_tokens, self.save_state = out, shard_tokens, save_state
        self.state = state if state is not None else _new_state()
        self.pending: list[tuple[torch.Tensor, ...]] = []
        for chunk in self.state["chunks"]:
            self.pending += _unpack(load_file(str(out / chunk["file"])))
        self.saved = len(self.pending)  # pending rows already in a chunk
        self.pending_tokens = sum(row[0].shape[0] for row in self.pending)
        self.next_row = (sum(int(s["num_rows"]) for s in self.state["shards"])
                         + len(self.pending))

    def _save(self, name: str, rows: list[tuple[torch.Tensor, ...]]) -> None:
        aside = self.out / f"{name}.partial"
        save_file(_pack(rows), str(aside))
        aside.rename(self.out / name)

    def flush(self) -> None:
        """Save the pending rows as the next shard (and drop the chunks they were saved in)."""
        if not self.pending:
            return
        shards = self.state["shards"]
        name = f"shard_{len(shards):05d}.safetensors"
        self._save(name, self.pending)
        shards.append({"file": name, "first_row": self.next_row - len(self.pending),
                       "num_rows": len(self.pending)})
        chunks, self.state["chunks"] = self.state["chunks"], []
        if self.save_state is not None:
            self.save_state()
        for chunk in chunks:
            (self.out / chunk["file"]).unlink()
        self.pending, self.pending_tokens, self.saved = [], 0, 0

    def save_pending(self) -> None:
        """Save the pending rows not in a chunk yet as one more chunk."""
        if self.save_state is None or self.saved == len(self.pending):
            return
        chunks = self.state["chunks"]
        name = f"chunk_{len(self.state['shards']):05d}_{len(chunks):05d}.safetensors"
        self._save(name, self.pending[self.saved :])
        chunks.append({"file": name, "num_rows": len(self.pending) - self.saved})
        self.saved = len(self.pending)
        self.save_state()

    def write(self, batches: TokenBatches,
              extract: Callable[[torch.Tensor, torch.Tensor], TargetFeatures],
              identity: CacheIdentity, device: torch.device, batch_size: int,
              topk: tuple[torch.Tensor, int] | None, save_every_s: float = 300.0) -> None:
        """Every row from `next_row` on, then the last shard and the index."""
        total = len(batches)
        last_save = time.monotonic()
        for start in tqdm(range(self.next_row, total, batch_size), desc="caching target features",
                          unit="batch", initial=self.next_row // batch_size,
                          total=-(-total // batch_size)):
            batch = batches.collate(list(range(start, min(start + batch_size, total))))
            batch = batch.to(device)
            feats = extract(batch.input_ids, batch.attention_mask)
            self.state["dtype"] = str(feats.context.dtype).removeprefix("torch.")
            for i, n in enumerate(batch.attention_mask.sum(1).tolist()):
                row = (feats.context[i, :n].cpu(), feats.final_hidden[i, :n].cpu())
                if topk is not None:
                    row += tuple(t.cpu() for t in target_topk(feats.final_hidden[i, :n], *topk))
                self.pending.append(row)
                self.pending_tokens += n
            self.next_row = min(start + batch_size, total)
            if self.pending_tokens >= self.shard_tokens:
                self.flush()
            elif time.monotonic() - last_save >= save_every_s:
                self.save_pending()
                last_save = time.monotonic()
        self.flush()
        index = {**identity.__dict__, "dtype": str(self.state["dtype"]),
                 "target_topk": topk[1] if topk is not None else 0,
                 "shards": self.state["shards"]}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))


class OfflineFeatures:
    """Reads cached features of dataset rows back as padded (b, S, .) batches."""

    def __init__(self, cache_dir: Path, expected: CacheIdentity) -> None:
        index_path = cache_dir / INDEX_FILE
        if not index_path.is_file():
            raise TrainingError(
                f"data.offline_features_dir: no feature cache at {cache_dir} (run "
                "`python -m dspine_train.training.cache_features` with the same recipe first)"
            )
        self.index = json.loads(index_path.read_text())
        _check_fingerprints(cache_dir, self.index, expected)
        for key, want in expected.__dict__.items():
            if key in ("target_path", "data_source", "target_fingerprint", "data_fingerprint"):
                continue  # where the inputs live may differ; the fingerprints are checked above
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
            try:
                handle = open_safetensors(self.dir / shard["file"])
            except WeightsError as err:
                raise TrainingError(
                    f"data.offline_features_dir: {err}; recreate the cache with "
                    "`python -m dspine_train.training.cache_features`") from None
            self._handles[shard["file"]] = handle
        return handle, row - shard["first_row"]

    @property
    def target_topk(self) -> int:
        """k of the stored top-k target distribution; 0 when the cache has none."""
        return int(self.index.get("target_topk", 0))

    def features(self, rows: list[int], width: int, with_topk: bool = True) -> TargetFeatures:
        """Features of `rows`, right-padded with zeros to `width` positions (with the stored
        top-k target distribution when the cache has one and `with_topk`)."""
        names = ["context", "final_hidden"]
        if with_topk and self.target_topk > 0:
            names += ["topk_ids", "topk_probs", "target_lse"]
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for row in rows:
            handle, local = self._shard(row)
            offsets = handle.get_slice("offsets")[local : local + 2]
            lo, hi = int(offsets[0]), int(offsets[1])
            for name in names:
                parts[name].append(handle.get_slice(name)[lo:hi])
        padded = {}
        for name, values in parts.items():
            out = values[0].new_zeros(len(rows), width, values[0].shape[-1])
            for i, v in enumerate(values):
                out[i, : v.shape[0]] = v
            padded[name] = out
        return TargetFeatures(**padded)


def _check_fingerprints(cache_dir: Path, index: dict, expected: CacheIdentity) -> None:
    """Refuse a cache made from another target or other token data, naming both sides."""
    where = f"data.offline_features_dir: {cache_dir}"
    recreate = ("recreate the cache (python -m dspine_train.training.cache_features with this "
                "recipe)")
    if expected.target_fingerprint and "target_fingerprint" not in index:
        raise TrainingError(f"{where} records no fingerprints (made by an older version); "
                            f"{recreate}")
    if index.get("target_fingerprint") != expected.target_fingerprint:
        raise TrainingError(
            f"{where} was cached from the target {index.get('target_path')!r} (fingerprint "
            f"{str(index.get('target_fingerprint'))[:16]}), but model.target_path "
            f"{expected.target_path!r} has fingerprint {expected.target_fingerprint[:16]}: "
            f"another target (config or weights differ); {recreate}")
    if index.get("data_fingerprint") != expected.data_fingerprint:
        raise TrainingError(
            f"{where} was cached from {index.get('data_source')} (ids fingerprint "
            f"{str(index.get('data_fingerprint'))[:16]}), but {expected.data_source} has ids "
            f"fingerprint {expected.data_fingerprint[:16]}: other token data; {recreate}")
