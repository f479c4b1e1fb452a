"""Tokenised training data: loading, checking, length-grouped batching and resumable streaming.

A dataset is a `datasets` Arrow directory (`save_to_disk`) with one row per conversation:
`input_ids` (list[int]), `loss_mask` (list[int], 1 where the token is a target response token)
and `length` (int). `data_prep` writes them; `load_token_dataset` checks them.

Batching is a pure function of (seed, epoch): the same run always sees the same batches, and a
position in the stream is one integer, the number of global micro-batches consumed. Process
`r` of `W` takes global batch `p + r` at stream position `p`, so every process sees a disjoint
1/W of the batches and resuming only needs that integer (see `BatchStream`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch

from .errors import TrainingError

REQUIRED_COLUMNS = ("input_ids", "loss_mask", "length")


def load_token_dataset(path: str, split: str, role: str) -> datasets.Dataset:
    """Load and check one split; `role` ("data.train_path", ...) names the field in errors.

    `path` is a `save_to_disk` directory holding a Dataset, or a DatasetDict with `split`.
    """
    root = Path(path)
    if not root.exists():
        raise TrainingError(f"{role}: no dataset at {path!r} (run data_prep first)")
    where = f"{path!r}"
    if (root / "dataset_dict.json").exists():
        splits = split_names(path)
        if split not in splits:
            raise TrainingError(
                f"{role}: {path!r} has splits {splits}, not {split!r} "
                f"(set the matching *_split field)"
            )
        root, where = root / split, f"{path!r} (split {split!r})"
    state = root / "state.json"
    # `save_to_disk` writes an empty dataset without data files, and `load_from_disk` then
    # fails deep inside `datasets`: recognise it first.
    if state.exists() and not json.loads(state.read_text()).get("_data_files"):
        raise TrainingError(f"{role}: dataset {where} is empty")
    try:
        loaded = datasets.load_from_disk(str(root))
    except (FileNotFoundError, ValueError) as err:
        raise TrainingError(f"{role}: {where} is not a `datasets` directory: {err}") from err
    missing = [c for c in REQUIRED_COLUMNS if c not in loaded.column_names]
    if missing:
        raise TrainingError(
            f"{role}: dataset {where} lacks column(s) {missing}; it has "
            f"{loaded.column_names}, a training dataset needs {list(REQUIRED_COLUMNS)}"
        )
    if len(loaded) == 0:
        raise TrainingError(f"{role}: dataset {where} is empty")
    return loaded


def split_names(path: str) -> list[str]:
    """Splits of a DatasetDict directory ([] for a plain Dataset or a missing path)."""
    index = Path(path) / "dataset_dict.json"
    if not index.exists():
        return []
    return list(json.loads(index.read_text())["splits"])


@dataclass
class Batch:
    """One padded micro-batch (right padding).

    input_ids, attention_mask, loss_mask: (b, S) long; rows: (b,) dataset row indices.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rows: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        """The same batch on `device`."""
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.input_ids, self.attention_mask, self.loss_mask, self.rows)))

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the batch."""
        return int(self.attention_mask.sum())


def epoch_batches(
    lengths: np.ndarray,
    batch_size: int,
    epoch: int,
    seed: int,
    group_by_length: bool,
    group_size: int,
) -> list[list[int]]:
    """The micro-batches of one epoch, as lists of row indices; deterministic in (seed, epoch).

    With length grouping the shuffled rows are cut into groups of `batch_size * group_size`,
    each group is sorted by length (longest first) and cut into batches, and the batch order is
    shuffled again: batches hold similar lengths (little padding) yet arrive in random order.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    if group_by_length:
        span = batch_size * group_size
        groups = [order[i : i + span] for i in range(0, len(order), span)]
        order = np.concatenate([g[np.argsort(-lengths[g], kind="stable")] for g in groups])
    batches = [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]
    if group_by_length:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def evaluation_plan(
    lengths: np.ndarray, batch_size: int, num_anchors: int, max_blocks: int, seed: int
) -> list[list[int]]:
    """The held-out batches evaluated: one length-grouped epoch, cut to about `max_blocks`
    blocks (`batch_size * num_anchors` per batch, at least one batch)."""
    plan = epoch_batches(lengths, batch_size, 0, seed, True, 8)
    return plan[: max(1, math.ceil(max_blocks / (batch_size * num_anchors)))]


class TokenBatches:
    """Turns row indices of a token dataset into padded `Batch`es, checking the token ids."""

    def __init__(self, dataset: datasets.Dataset, max_length: int, vocab_size: int, role: str) -> None:
        self.dataset = dataset
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.role = role
        self.lengths = np.minimum(np.asarray(dataset["length"], dtype=np.int64), max_length)

    def __len__(self) -> int:
        return len(self.dataset)

    def collate(self, rows: list[int]) -> Batch:
        """Rows -> a right-padded batch cut to `max_length` (padding: id 0, masks 0)."""
        records = self.dataset[rows]
        width = max(min(len(ids), self.max_length) for ids in records["input_ids"])
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        loss_mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (ids, mask) in enumerate(zip(records["input_ids"], records["loss_mask"])):
            if len(ids) != len(mask):
                raise TrainingError(
                    f"{self.role}: row {rows[i]} has {len(ids)} input_ids but {len(mask)} "
                    "loss_mask entries"
                )
            n = min(len(ids), self.max_length)
            input_ids[i, :n] = torch.as_tensor(ids[:n], dtype=torch.long)
            attention[i, :n] = 1
            loss_mask[i, :n] = torch.as_tensor(mask[:n], dtype=torch.long)
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            bad = rows[int(((input_ids < 0) | (input_ids >= self.vocab_size)).any(1).nonzero()[0])]
            raise TrainingError(
                f"{self.role}: row {bad} holds token ids outside the target vocabulary "
                f"0..{self.vocab_size - 1}: the data was tokenised for another target"
            )
        return Batch(input_ids, attention, loss_mask, torch.as_tensor(rows, dtype=torch.long))


class BatchStream:
    """An endless, resumable stream of this process's micro-batches over many epochs.

    Global micro-batch `g` is batch `g % per_epoch` of epoch `g // per_epoch`. At stream
    position `p` (global batches consumed so far) process `rank` of `world` takes global batch
    `p + rank`; one micro-step advances the position by `world`.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        seed: int,
        group_by_length: bool,
        group_size: int,
        rank: int,
        world: int,
    ) -> None:
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.group_by_length = group_by_length
        self.group_size = group_size
        self.rank = rank
        self.world = world
        self._epoch = -1
        self._batches: list[list[int]] = []
        self.batches_per_epoch = -(-len(lengths) // batch_size)

    def _epoch_plan(self, epoch: int) -> list[list[int]]:
        if epoch != self._epoch:
            self._batches = epoch_batches(
                self.lengths, self.batch_size, epoch, self.seed, self.group_by_length,
                self.group_size,
            )
            self._epoch = epoch
        return self._batches

    def global_batch(self, index: int) -> list[int]:
        """Row indices of global micro-batch `index`."""
        epoch, i = divmod(index, self.batches_per_epoch)
        return self._epoch_plan(epoch)[i]

    def iterate(self, position: int) -> Iterator[tuple[int, list[int]]]:
        """Yield (global batch index, rows) for this process from stream `position` on."""
        while True:
            index = position + self.rank
            yield index, self.global_batch(index)
            position += self.world

    def epoch_of(self, position: int) -> float:
        """Epochs completed at stream `position` (fractional)."""
        return position / self.batches_per_epoch


def check_supervised(dataset: datasets.Dataset, role: str, where: str) -> None:
    """Refuse token data without one anchor (two consecutive supervised tokens) to train on.

    `role` names the setting ("data.train_path"), `where` the data (path and split) in the
    `TrainingError`; without this check the first step fails deep in the objective.
    """
    for table in dataset.with_format("arrow").iter(batch_size=4096):
        for chunk in table.column("loss_mask").chunks:
            mask = np.asarray(chunk.flatten(), dtype=bool)
            ends = np.cumsum(np.asarray(chunk.value_lengths()))  # a row's end is no anchor pair
            pairs = mask[:-1] & mask[1:]
            pairs[ends[:-1][ends[:-1] > 0] - 1] = False
            if pairs.any():
                return
    raise TrainingError(f"{role}: no row of {where} has two consecutive supervised tokens "
                        "(loss_mask 1): nothing to train on; check the loss masks of the data")


def check_token_absent(dataset: datasets.Dataset, token_id: int, role: str, where: str,
                       name: str) -> None:
    """Refuse token data in which `token_id` occurs (the draft's mask token must never be a
    real input: the draft could not tell a masked slot from that token).

    One vectorised pass over the Arrow column; `name` says what the id is in the
    `TrainingError` ("model.mask_token_id 128002 ('<|reserved_special_token_0|>')").
    """
    row = 0
    for table in dataset.with_format("arrow").iter(batch_size=65536):
        for chunk in table.column("input_ids").chunks:
            hits = np.flatnonzero(np.asarray(chunk.flatten()) == token_id)
            if hits.size:
                offsets = np.asarray(chunk.offsets)
                offsets = offsets - offsets[0]  # a sliced chunk's offsets start past 0
                bad = row + int(np.searchsorted(offsets, hits[0], side="right")) - 1
                raise TrainingError(
                    f"{role}: {name} occurs in row {bad} of {where}; the mask token must never "
                    "occur in the data (set model.mask_token_id to another reserved token)"
                )
            row += len(chunk)
