"""The trainer's simulated acceptance (`Trainer.evaluate`) for an exported draft, offline.

A decode-time variant (e.g. `transition_cache: false` on trained weights) has no training run
of its own, so no trainer evaluation. This re-runs the trainer's end-of-run evaluation - the
same held-out batches, the same anchor draws, the same decode (`DraftStep`), through the one
evaluation loop `evaluation.held_out.simulated_acceptance_counts` - on any exported draft,
reading the target features from the offline cache. For a trained variant it reproduces the
trainer's own number, which the ablation records as a check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from dspine_train.evaluation.block_metrics import AcceptanceStats, BlockResults, stats_from_counts
from dspine_train.evaluation.held_out import (
    every_block_plan,
    simulated_acceptance_counts,
    simulated_block_accepts,
)
from dspine_train.modeling import DSpineDraftModel
from dspine_train.training.config import TrainConfig, validate_config
from dspine_train.training.data import (
    TokenBatches,
    evaluation_plan,
    load_token_dataset,
    split_names,
)
from dspine_train.training.draft_step import DraftStep
from dspine_train.training.offline_features import OfflineFeatures, cache_identity
from dspine_train.training.target import read_embedding_and_head


def load_run_config(path: Path) -> TrainConfig:
    """The resolved config a `train.py` run saved (`<output_dir>/hydra/config.yaml`), typed."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no saved run config (is this a train.py output dir?)")
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    config = OmegaConf.to_object(merged)
    assert isinstance(config, TrainConfig)  # merged onto the structured schema above
    validate_config(config)
    return config


@torch.no_grad()
def simulated_acceptance(draft_dir: Path, config: TrainConfig, *, max_blocks: int | None = None,
                         ) -> AcceptanceStats | BlockResults | None:
    """`Trainer.evaluate` on the draft exported at `draft_dir`, with `config`'s data and seed.

    Returns None when the run has no held-out split (the trainer evaluates nothing then).
    Needs `config.data.offline_features_dir` (the target itself is not loaded). With
    `eval.every_block` the result is per block (`BlockResults`), on `max_blocks` blocks
    (None: the run's `eval.max_blocks`; 0: every held-out block; else a fixed uniform draw).
    """
    d = config.data
    eval_path = d.eval_path or d.train_path
    if not (d.eval_path or d.eval_split in split_names(d.train_path)):
        return None
    if not d.offline_features_dir:
        raise ValueError("data.offline_features_dir: the simulated evaluation reads cached "
                         "target features; this run trained with the target online")
    dtype = torch.bfloat16 if config.precision.value == "bf16" else torch.float32
    draft = DSpineDraftModel.from_pretrained(str(draft_dir)).to(dtype).eval()
    embed, head = read_embedding_and_head(config.model.target_path)
    draft.bind_target(embed.to(dtype), head.to(dtype))
    step = DraftStep(draft, config.logits_chunk_size)

    batches = TokenBatches(load_token_dataset(eval_path, d.eval_split, "data.eval_path"),
                           d.max_length, draft.config.vocab_size, "data.eval_path")
    cache = OfflineFeatures(
        Path(d.offline_features_dir) / d.eval_split,
        cache_identity(config.model.target_path, list(draft.config.target_layer_ids),
                       d.max_length, batches),
    )

    def features(batch: Any) -> Any:  # as the trainer feeds them (the cache's dtype, no cast)
        return cache.features(batch.rows.tolist(), batch.input_ids.shape[1])

    if config.eval.every_block:
        blocks = every_block_plan(batches.dataset["loss_mask"], d.max_length,
                                  config.eval.batch_size, config.eval.num_anchors,
                                  config.eval.max_blocks if max_blocks is None
                                  else max_blocks or None, config.seed)
        accepted = simulated_block_accepts(step, batches, blocks, features)
        return BlockResults(blocks.rows, blocks.anchors, accepted.round().long().numpy(),
                            draft.config.block_size, draft.config.num_predictions)
    plan = evaluation_plan(batches.lengths, config.eval.batch_size, config.eval.num_anchors,
                           config.eval.max_blocks, config.seed)
    total = simulated_acceptance_counts(
        step, batches, plan, features,
        seed=config.seed, num_anchors=config.eval.num_anchors,
        block_size=draft.config.block_size,
    )
    return stats_from_counts(total)
