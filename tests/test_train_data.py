"""Trainer building blocks without DeepSpeed: batching, dataset checks, acceptance, checkpoints,
the DeepSpeed JSON, offline features (same loss as online) and input checks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from dspine_train.evaluation.block_metrics import accepted_prefix, block_counts, stats_from_counts
from dspine_train.objective import sample_anchors
from dspine_train.training.checkpointing import (
    STATE_FILE,
    checkpoint_name,
    complete_checkpoints,
    prune_checkpoints,
)
from dspine_train.training.config import TrainConfig
from dspine_train.training.data import (
    BatchStream,
    TokenBatches,
    epoch_batches,
    load_token_dataset,
)
from dspine_train.training.distributed import deepspeed_config
from dspine_train.training.draft_builder import (
    build_draft,
    draft_config_for,
    load_or_build_token_table,
)
from dspine_train.training.draft_step import DraftStep
from dspine_train.training.errors import TrainingError
from dspine_train.training.inputs import check_inputs
from dspine_train.training.offline_features import (
    CacheIdentity,
    OfflineFeatures,
    write_feature_cache,
    write_split_resumable,
)
from dspine_train.training.target import (
    TargetFeatureExtractor,
    load_target,
    load_target_config,
    read_embedding_and_head,
    target_head_weights,
)
from tests._train_helpers import single_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def _config(assets: dict[str, Path], tmp_path: Path, **model: object) -> TrainConfig:
    """A TrainConfig like the tiny recipe's, on the session assets."""
    cfg = TrainConfig(name="unit", output_dir=str(tmp_path / "out"))
    cfg.model.target_path = str(assets["target"])
    cfg.model.mask_token_id = 511
    cfg.model.num_layers = 2
    cfg.model.block_size = 8
    cfg.model.target_layer_ids = [1, 2]
    cfg.model.transfer_dim = 16
    cfg.model.message_size = 16
    cfg.model.candidate_k = 4
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.data.train_path = str(assets["data"])
    cfg.data.max_length = 64
    cfg.data.num_anchors = 8
    return cfg


# ---------------------------------------------------------------------------- batching
def test_epoch_batches_cover_every_row_once_and_group_lengths() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 1000, size=257)
    grouped = epoch_batches(lengths, 8, epoch=0, seed=1, group_by_length=True, group_size=8)
    plain = epoch_batches(lengths, 8, epoch=0, seed=1, group_by_length=False, group_size=8)
    for batches in (grouped, plain):
        rows = sorted(r for b in batches for r in b)
        assert rows == list(range(257))

    def padding(batches: list[list[int]]) -> int:
        return sum(int(lengths[b].max()) * len(b) - int(lengths[b].sum()) for b in batches)

    assert padding(grouped) < padding(plain) / 3
    assert grouped == epoch_batches(lengths, 8, epoch=0, seed=1, group_by_length=True,
                                    group_size=8)
    assert grouped != epoch_batches(lengths, 8, epoch=1, seed=1, group_by_length=True,
                                    group_size=8)


def test_batch_stream_shards_processes_and_resumes_from_a_position() -> None:
    lengths = np.arange(1, 41)
    streams = [BatchStream(lengths, 4, 0, True, 2, rank, 2) for rank in range(2)]
    taken = [[next(it) for _ in range(15)] for it in (s.iterate(0) for s in streams)]
    indices = [[i for i, _ in t] for t in taken]
    assert indices[0] == list(range(0, 30, 2)) and indices[1] == list(range(1, 30, 2))
    # 15 micro-steps x 2 processes = 30 batches = 3 epochs of 10: every epoch seen whole
    epoch0 = sorted(r for t in taken for i, rows in t if i < 10 for r in rows)
    assert epoch0 == list(range(40))
    resumed = streams[1].iterate(12)  # after 6 micro-steps
    assert [next(resumed)[0] for _ in range(3)] == [13, 15, 17]
    assert streams[1].global_batch(13) == taken[1][6][1]


def _token_dataset(path: Path, **columns: list) -> str:
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return str(path)


def test_dataset_checks_name_the_problem(tmp_path: Path) -> None:
    missing = _token_dataset(tmp_path / "a", input_ids=[[1, 2, 3]], length=[3])
    with pytest.raises(TrainingError, match=r"lacks column\(s\) \['loss_mask'\]"):
        load_token_dataset(missing, "train", "data.train_path")
    empty = _token_dataset(tmp_path / "b", input_ids=[[1]], loss_mask=[[1]], length=[1])
    datasets.load_from_disk(empty).select([]).save_to_disk(str(tmp_path / "c"))
    with pytest.raises(TrainingError, match="is empty"):
        load_token_dataset(str(tmp_path / "c"), "train", "data.train_path")
    with pytest.raises(TrainingError, match="no dataset at"):
        load_token_dataset(str(tmp_path / "nope"), "train", "data.train_path")
    datasets.DatasetDict(train=datasets.load_from_disk(empty)).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(TrainingError, match=r"has splits \['train'\], not 'eval'"):
        load_token_dataset(str(tmp_path / "d"), "eval", "data.eval_path")


def test_collate_pads_cuts_and_rejects_foreign_token_ids(tmp_path: Path) -> None:
    path = _token_dataset(
        tmp_path / "ds",
        input_ids=[[5, 6, 7, 8, 9, 10], [1, 2], [3, 900]],
        loss_mask=[[0, 0, 1, 1, 1, 1], [0, 1], [0, 1]],
        length=[6, 2, 2],
    )
    batches = TokenBatches(load_token_dataset(path, "train", "x"), max_length=4,
                           vocab_size=512, role="data.train_path")
    batch = batches.collate([0, 1])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert batches.lengths.tolist() == [4, 2, 2]
    with pytest.raises(TrainingError, match="row 2 holds token ids outside"):
        batches.collate([1, 2])


# ---------------------------------------------------------------------------- acceptance
def test_acceptance_counts_leading_slots_the_target_would_emit() -> None:
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 0, 8],   # third slot wrong: 2 accepted
                          [5, 6, 7, 8],   # all right, but the data leaves greedy at slot 3
                          [1, 6, 7, 8]])  # first slot wrong: 0 accepted
    data = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 8]])
    supervised = torch.ones(3, 4, dtype=torch.bool)
    prefix = accepted_prefix(draft, target, data, supervised)
    assert prefix.sum(-1).tolist() == [2, 2, 0]
    stats = stats_from_counts(block_counts(prefix, torch.tensor([True, True, False])))
    assert stats.blocks == 2 and stats.accepted == 4
    assert stats.tau == pytest.approx(3.0)
    assert stats.position_rates() == [1.0, 1.0, 0.0, 0.0]
    cut = accepted_prefix(draft[:1], target[:1], data[:1], torch.tensor([[1, 0, 1, 1]]).bool())
    assert cut.sum().item() == 1  # supervision ends at slot 2: nothing after it counts


def test_logged_acceptance_of_hand_built_blocks_across_processes() -> None:
    """Known outcomes -> known metrics: accepted prefixes 3 and 0 on one process, 1 and a
    padding block on another, summed as the all-reduce does: 3 blocks, 4 accepted slots."""
    def prefixes(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths])

    rank0 = block_counts(prefixes([3, 0]), torch.tensor([True, True]))
    rank1 = block_counts(prefixes([1, 4]), torch.tensor([True, False]))  # padding: not counted
    metrics = stats_from_counts(rank0 + rank1).as_metrics()
    assert metrics == pytest.approx({
        "eval/tau": 1 + 4 / 3, "eval/blocks": 3.0, "eval/accept_pos1": 2 / 3,
        "eval/accept_pos2": 1 / 3, "eval/accept_pos3": 1 / 3, "eval/accept_pos4": 0.0})


# ---------------------------------------------------------------------------- checkpoints
def test_prune_keeps_the_newest_and_the_best(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        (tmp_path / checkpoint_name(step)).mkdir()
        (tmp_path / checkpoint_name(step) / STATE_FILE).write_text("{}")
    (tmp_path / checkpoint_name(60)).mkdir()  # no state file: incomplete, never listed
    (tmp_path / f".tmp_{checkpoint_name(70)}").mkdir()
    prune_checkpoints(tmp_path, keep_last=2, best_step=20)
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        checkpoint_name(20), checkpoint_name(40), checkpoint_name(50)]
    assert not (tmp_path / f".tmp_{checkpoint_name(70)}").exists()


def test_deepspeed_json_takes_its_numbers_from_the_schema() -> None:
    cfg = TrainConfig()
    cfg.data.batch_size, cfg.optim.grad_accum_steps, cfg.optim.max_grad_norm = 3, 4, 0.5
    ds = deepspeed_config(cfg)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["stage"] == 2
    cfg.deepspeed.stage, cfg.deepspeed.config_file = 3, "deepspeed/zero3.json"
    zero = deepspeed_config(cfg)["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    cfg.deepspeed.config_file = "deepspeed/zero2.json"
    with pytest.raises(TrainingError, match="deepspeed.stage is 3"):
        deepspeed_config(cfg)


# ---------------------------------------------------------------------------- input checks
def test_target_draft_mismatch_stops_before_any_work(tiny_assets, tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match=r"model.target_layer_ids: \[3\] outside 0..2"):
        check_inputs(_config(tiny_assets, tmp_path, target_layer_ids=[1, 3]))
    with pytest.raises(TrainingError, match="mask_token_id"):
        check_inputs(_config(tiny_assets, tmp_path, mask_token_id=600))
    with pytest.raises(TrainingError, match="transfer_dim"):
        check_inputs(_config(tiny_assets, tmp_path, transfer_dim=100))
    inputs = check_inputs(_config(tiny_assets, tmp_path))
    assert inputs.eval is not None and len(inputs.train) == 128


def test_token_table_of_another_shape_is_refused(tiny_assets, tmp_path: Path) -> None:
    _, head = read_embedding_and_head(str(tiny_assets["target"]))
    path = tmp_path / "table.safetensors"
    table = load_or_build_token_table(path, head, 16, True, lambda: None)
    assert table.codes.shape == (512, 16) and path.exists()
    with pytest.raises(TrainingError, match="r=16; this target and recipe need"):
        load_or_build_token_table(path, head, 8, True, lambda: None)


# ---------------------------------------------------------------------------- offline features
def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("shard_tokens", [1500, 1 << 20], ids=["several_shards", "one_shard"])
def test_a_stopped_feature_cache_resumes_into_the_uninterrupted_cache(shard_tokens: int,
                                                                      tiny_assets,
                                                                      tmp_path: Path) -> None:
    """A run stopped on its 4th batch (here: the extractor fails), with the half-written file a
    kill leaves, resumes after the rows it saved (finished shards, and the chunks of the shard
    being filled, saved here after every batch): every file then equals an uninterrupted run's,
    byte for byte, and only the rows after the saved ones are computed again."""
    cfg = _config(tiny_assets, tmp_path)
    target = load_target(cfg.model.target_path, "float32", torch.device("cpu"))
    batches = TokenBatches(datasets.load_from_disk(str(tiny_assets["data"]))["train"], 64, 512,
                           "data.train_path")
    extract = TargetFeatureExtractor(target, [1, 2])
    identity = CacheIdentity(cfg.model.target_path, [1, 2], 64, len(batches))
    head = (target_head_weights(target)[1].float(), 4)
    settings = {"batch_size": 16, "shard_tokens": shard_tokens, "topk": head}
    whole = tmp_path / "whole"
    write_feature_cache(whole, batches, extract, identity, torch.device("cpu"), **settings)
    shards = len(json.loads((whole / "index.json").read_text())["shards"])
    assert shards >= 3 if shard_tokens == 1500 else shards == 1

    calls: list[int] = []
    stop_at = [4]

    class Stopped(Exception):
        pass

    def stops_on_a_batch(*args: torch.Tensor):
        calls.append(1)
        if len(calls) == stop_at[0]:
            raise Stopped
        return extract(*args)

    split = tmp_path / "resumed"
    with pytest.raises(Stopped):
        write_split_resumable(split, batches, stops_on_a_batch, identity, torch.device("cpu"),
                              save_every_s=0, **settings)
    progress = json.loads((split / "progress.json").read_text())
    saved = sum(s["num_rows"] for s in progress["shards"] + progress["chunks"])
    assert saved == 3 * 16 and progress["chunks"]  # 3 batches, the last ones in chunks
    assert not (split / "index.json").exists()
    (split / "chunk_00009_00000.safetensors.partial").write_bytes(b"half")

    calls.clear()
    stop_at[0] = 0  # no stop
    kept = write_split_resumable(split, batches, stops_on_a_batch, identity,
                                 torch.device("cpu"), save_every_s=0, **settings)
    assert kept == saved
    assert len(calls) == -(-(len(batches) - saved) // 16)  # only the rows after the saved ones
    assert _files(split) == _files(whole)

    # other settings do not resume: the partial build is discarded, the cache is rebuilt whole
    calls.clear()
    stop_at[0] = 4
    with pytest.raises(Stopped):
        write_split_resumable(split / "x", batches, stops_on_a_batch, identity,
                              torch.device("cpu"), save_every_s=0, **settings)
    other = {**settings, "batch_size": 8}
    assert write_split_resumable(split / "x", batches, extract, identity, torch.device("cpu"),
                                 **other) == 0
    write_feature_cache(tmp_path / "whole2", batches, extract, identity, torch.device("cpu"),
                        **other)
    assert _files(split / "x") == _files(tmp_path / "whole2")


def test_offline_features_give_the_online_loss(tiny_assets, tmp_path: Path) -> None:
    cfg = _config(tiny_assets, tmp_path)
    target = load_target(cfg.model.target_path, "float32", torch.device("cpu"))
    target_config = load_target_config(cfg.model.target_path)
    draft_config = draft_config_for(cfg.model, target_config, None)
    embed, head = target_head_weights(target)
    table = load_or_build_token_table(tmp_path / "t.safetensors", head, 16, True, lambda: None)
    draft = build_draft(cfg.model, draft_config, table, target_config, seed=0)
    draft.bind_target(embed, head)
    with torch.no_grad():  # a non-trivial injection, so every input path matters
        for p in draft.injection.parameters():
            p.add_(0.05 * torch.randn_like(p))
    step = DraftStep(draft)
    batches = TokenBatches(datasets.load_from_disk(str(tiny_assets["data"]))["train"], 64, 512,
                           "data.train_path")
    extract = TargetFeatureExtractor(target, [1, 2])
    cache_dir = tmp_path / "features"
    identity = CacheIdentity(cfg.model.target_path, [1, 2], 64, len(batches))
    write_feature_cache(cache_dir, batches, extract, identity, torch.device("cpu"), batch_size=16)
    assert json.loads((cache_dir / "index.json").read_text())["num_rows"] == len(batches)

    batch = batches.collate([3, 50, 7, 99])
    anchors, mask = sample_anchors(batch.loss_mask, 8, 8, torch.Generator().manual_seed(0))
    replace = torch.tensor([[True] * 4 + [False] * 4] * 4)
    online = extract(batch.input_ids, batch.attention_mask)
    offline = OfflineFeatures(cache_dir, identity).features(batch.rows.tolist(),
                                                            batch.input_ids.shape[1])
    losses = [
        step(batch.input_ids, f.context, f.final_hidden, batch.loss_mask, anchors, mask, replace,
             step=3, total_steps=24)[0]
        for f in (online, offline)
    ]
    assert torch.isfinite(losses[0])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(TrainingError, match="max_length=64, this recipe needs 32"):
        OfflineFeatures(cache_dir, CacheIdentity(cfg.model.target_path, [1, 2], 32,
                                                 len(batches)))
