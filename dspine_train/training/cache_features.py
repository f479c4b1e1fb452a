"""Cache the frozen target's features to disk, for training without the target online.

Runs the target once over the recipe's train (and eval) split and writes the context features
(hidden states at the draft's target layers), the final hidden state of every token and the
top-`data.target_topk` of the target's next-token distribution, sharded, under
`data.offline_features_dir`, in the format `offline_features` (beside it) defines and reads.
The size estimate is printed before anything is written. Same recipe and overrides as training:

    python -m dspine_train.training.cache_features recipe=tiny \\
        data.offline_features_dir=artifacts/tiny_features
    python train.py recipe=tiny data.offline_features_dir=artifacts/tiny_features

Single process; the cache is ~(n + 1) x H x 2 bytes per token in bf16 (~40 KB for Qwen3-8B).

`data.offline_features_dir` must not overlap an input (the datasets, the target, the token
table: equal, inside or containing) and, when it exists, must be a directory this tool wrote
(marker `.data_prep.cache_features`, the name it has always had) or empty; anything else is
refused by name. It is locked
for the run (a second run into it is refused, naming the first), built beside itself (in
`.NAME.partial`) and swapped in whole, so a failure (a full disk: one line) leaves the old cache
intact. A stopped or failed run keeps its partial build (finished shards, and every 5 minutes
the rows of the shard being filled): the same command resumes it from the next row, and the
cache equals an uninterrupted run's (other inputs or settings discard it). The cache
records the fingerprints of the target and of the token data (see `offline_features`), which
training checks.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from dspine_train.checkpoint_io import clean_dead_builds, replace_dir, write_json_atomic
from dspine_train.cli_errors import existing_output, os_error_line, write_os_error
from dspine_train.cpu_bf16 import (
    FLOAT32_NOTICE,
    Bf16Matmul,
    bf16_matmuls,
    resolve_bf16_matmul,
)
from dspine_train.output_lock import OutputLockedError, lock_output
from dspine_train.owned_dir import (
    OwnedDirError,
    check_no_overlap,
    check_replaceable,
    write_marker,
)
from dspine_train.training.config import (
    ConfigError,
    TrainConfig,
    register_configs,
    to_train_config,
)
from dspine_train.training.data import TokenBatches
from dspine_train.training.errors import TrainingError
from dspine_train.training.inputs import check_inputs
from dspine_train.training.offline_features import (
    INDEX_FILE,
    cache_identity,
    estimate_cache_bytes,
    resume_key,
    write_split_resumable,
)
from dspine_train.training.recipe_help import RECIPES_DIR, exit_on_help
from dspine_train.training.target import TargetFeatureExtractor, load_target, target_head_weights

register_configs()
RECIPES = str(RECIPES_DIR)
# Caches written before the tool moved into the training package carry this marker: keeping the
# name lets a new run replace them.
MARKER = ".data_prep.cache_features"
TOOL = "dspine_train.training.cache_features"
PLAN_FILE = "plan.json"  # what a partial build is of: each split's resume key
SHARD_TOKENS = 1 << 20  # tokens per shard file


def _inputs(config: TrainConfig) -> dict[str, list[str]]:
    """The inputs the cache must not overlap, by config key."""
    m, d = config.model, config.data
    return {"data.train_path": [d.train_path], "data.eval_path": [d.eval_path or ""],
            "model.target_path": [m.target_path],
            "model.token_table_path": [m.token_table_path or ""]}


def check_output_dir(root: Path, config: TrainConfig) -> None:
    """Refuse a `data.offline_features_dir` overlapping an input or holding foreign files."""
    check_replaceable(root, "data.offline_features_dir", MARKER, TOOL, _inputs(config),
                      is_legacy=_is_legacy_cache)


def partial_dir(root: Path) -> Path:
    """Where the cache of `root` is built, and kept between a stopped run and its rerun."""
    return root.parent / f".{root.name}.partial"


def _read_plan(build: Path) -> object:
    try:
        return json.loads((build / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_legacy_cache(root: Path) -> bool:
    """A cache written before the marker existed: split directories with an index, only."""
    return all((entry / INDEX_FILE).is_file() for entry in root.iterdir())


def cache_features(cfg: DictConfig) -> list[Path]:
    """Write the feature cache of every split the recipe trains and evaluates on."""
    config = to_train_config(cfg)
    d = config.data
    if not d.offline_features_dir:
        raise ConfigError("data.offline_features_dir: set where the feature cache goes")
    root = Path(d.offline_features_dir)
    # an output over an input is refused before even the lock file is written beside it
    check_no_overlap(root, "data.offline_features_dir", TOOL, _inputs(config))
    with lock_output(root, "data.offline_features_dir"):  # one run per cache
        return _cache_features_locked(config, root)


def _cache_features_locked(config: TrainConfig, root: Path) -> list[Path]:
    """`cache_features` once `root` is locked."""
    m, d = config.model, config.data
    check_output_dir(root, config)
    # the trainer's own input checks: same target layers, same splits (each with an anchor to
    # train on), same errors
    inputs = check_inputs(config)
    target_config = inputs.target_config
    layer_ids = inputs.draft_config.target_layer_ids
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    splits = [(d.train_split, inputs.train, "data.train_path")]
    if inputs.eval is not None:
        splits.append((d.eval_split, inputs.eval, "data.eval_path"))
    datasets = [
        (split, TokenBatches(dataset, d.max_length, target_config.vocab_size, role))
        for split, dataset, role in splits
    ]
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(m.target_dtype,
                                                                       torch.float32)
    for split, batches in datasets:
        size = estimate_cache_bytes(int(batches.lengths.sum()), len(layer_ids),
                                    target_config.hidden_size, dtype)
        print(f"split {split!r}: {len(batches)} rows, {int(batches.lengths.sum()):,} tokens -> "
              f"about {size / 2**20:,.1f} MiB of features")
    target = load_target(m.target_path, m.target_dtype, device, m.trust_remote_code)
    extract = TargetFeatureExtractor(target, layer_ids)
    # the target's distribution, computed once here instead of in every training step; the
    # head is cast to float32 once (`target_topk` computes in float32: the same values)
    topk = ((target_head_weights(target)[1].float(), d.target_topk) if d.target_topk > 0
            else None)
    # The whole cache (every split) is built beside `root` and swapped in at once: a failure
    # (a full disk) on the last split leaves the old cache whole, not half new. The build is
    # kept when the run stops or fails, and the next run with the same inputs resumes it.
    clean_dead_builds(root)
    build = partial_dir(root)
    identities = {split: cache_identity(m.target_path, layer_ids, d.max_length, batches)
                  for split, batches in datasets}
    # how the target's bf16 products ran decides the cached values too (`cpu_bf16.py`)
    matmul = (resolve_bf16_matmul(config.cpu_bf16_matmul, device) if dtype == torch.bfloat16
              else Bf16Matmul.native)  # a float32 or float16 target runs no bf16 product
    if matmul == Bf16Matmul.float32:
        print(f"the target's {FLOAT32_NOTICE}")
    plan = {split: {**resume_key(identity, max(1, d.batch_size), SHARD_TOKENS, topk),
                    "bf16_matmul": matmul.value}
            for split, identity in identities.items()}
    if build.exists() and not (build / MARKER).is_file() and any(build.iterdir()):
        raise OwnedDirError(f"data.offline_features_dir: {build}, where this cache is built, "
                            "holds files this tool did not write; move them away")
    if build.exists() and _read_plan(build) != plan:
        print(f"discarding {build}: a partial cache of other inputs or settings")
        shutil.rmtree(build)
    elif build.exists():
        print(f"resuming the partial cache in {build}")
    build.mkdir(parents=True, exist_ok=True)
    write_marker(build, MARKER, TOOL)
    write_json_atomic(build / PLAN_FILE, plan)
    for split, batches in datasets:
        if (build / split / INDEX_FILE).is_file():
            print(f"split {split!r}: already cached in {build / split}")
            continue
        with bf16_matmuls(matmul, device):
            kept = write_split_resumable(build / split, batches, extract, identities[split],
                                         device, batch_size=max(1, d.batch_size),
                                         shard_tokens=SHARD_TOKENS, topk=topk)
        if kept:
            print(f"split {split!r}: resumed after {kept} of {len(batches)} rows")
    (build / PLAN_FILE).unlink()
    replace_dir(build, root)
    written = [root / split for split, _ in datasets]
    for out in written:
        print(f"wrote {out}")
    return written


@hydra.main(config_path=RECIPES, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point; bad input exits 1 with the message."""
    root = cfg.data.offline_features_dir
    kept = root if root and existing_output(root) else None  # before anything is written
    try:
        cache_features(cfg)
    except (ConfigError, TrainingError, OwnedDirError, OutputLockedError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except Exception as err:  # a full disk: safetensors' error wraps the OS error
        os_error = write_os_error(err)
        if os_error is None:
            raise
        where = f"data.offline_features_dir {root}"
        line = os_error_line(os_error, where, kept)
        if partial_dir(Path(root)).is_dir():
            line += (f"; the features cached so far are kept in {partial_dir(Path(root))}: "
                     "rerun to resume, or delete it")
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    exit_on_help(__doc__)  # before Hydra, which needs a recipe to compose its help
    main()
