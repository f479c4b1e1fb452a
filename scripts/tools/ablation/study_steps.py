"""`python scripts/study.py steps`: one training step of each study variant, side by side.

The report's train wall time is measured in the session that trained each variant, and
sessions run on machines of different speed, so it cannot say which variant trains faster.
This times every variant's real step (its draft, objective, precision and pruned vocabulary
as `train.py` builds them; forward, objective, backward, AdamW) in one process, the variants
alternating step by step on the same batches of the study's training data and features, so
that every variant sees the same machine load; the ratios to the reference are the measurement.
Evaluation, checkpoints and data loading are not timed.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dspine_train.training.config import compose_train_config

from .runner import StudyError, StudySettings
from .variants import REFERENCE, Variant


def _variant_step(settings: StudySettings, variant: Variant, work_dir: Path,
                  batches: int, embed: torch.Tensor, head: torch.Tensor,
                  extract: Callable[[Any, list[int]], Any] | None = None
                  ) -> tuple[Any, list[Any]]:
    """The variant's step (`PathStep` on the trainer's path) and its first `batches` batches;
    `embed`, `head`: the target's, read once for every variant; `extract`: the batches'
    features from the target in this process (None: from the feature cache). Token tables are
    built once per transfer width in `work_dir`."""
    from dspine_train.training.draft_builder import build_draft, load_or_build_token_table
    from dspine_train.training.draft_vocab import prune_draft_vocab, tokenizer_or_none
    from dspine_train.training.inputs import check_inputs
    from scripts.tools.bench.step_bench import PathStep, StepPath, first_batches

    arguments = [a for a in settings.train_arguments(variant) if not a.startswith("output_dir=")]
    config = compose_train_config(*arguments, f"output_dir={work_dir / variant.name}")
    torch.manual_seed(config.seed)
    inputs = check_inputs(config)
    dim = inputs.draft_config.transfer_dim
    table = load_or_build_token_table(work_dir / f"token_table_r{dim}.safetensors", head, dim,
                                      True, lambda: None)
    draft = build_draft(config.model, inputs.draft_config, table, inputs.target_config,
                        config.seed)
    if draft.config.draft_vocab_size is not None:
        prune_draft_vocab(draft, inputs.train, inputs.eval,
                          tokenizer_or_none(config.model.target_path))
    draft.bind_target(embed, head)
    items, _ = first_batches(config, inputs.train, draft, batches, head, extract)
    path = StepPath(reference=False, topk=config.data.target_topk > 0,
                    bf16=config.precision.value == "bf16")
    step = PathStep(path, draft, embed, head, config.logits_chunk_size, config.optim.lr)
    return step, items


def _features_in_process(config: Any) -> Callable[[Any, list[int]], Any]:
    """(batch, target layer ids) -> the batch's target features, the target (at
    `model.target_path`, in `model.target_dtype`) run here once per distinct batch and layers:
    what the feature cache would hold, for a study whose cache is not built."""
    from dspine_train.training.target import TargetFeatureExtractor, load_target

    m = config.model
    target = load_target(m.target_path, m.target_dtype, torch.device("cpu"), m.trust_remote_code)
    made: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}

    def extract(batch: Any, layers: list[int]) -> Any:
        key = (tuple(batch.rows.tolist()), tuple(layers))
        if key not in made:
            made[key] = TargetFeatureExtractor(target, list(layers))(batch.input_ids,
                                                                    batch.attention_mask)
        return made[key]

    return extract


def time_steps(settings: StudySettings, variants: Sequence[Variant], work_dir: Path,
               batches: int = 3, iters: int = 6,
               progress: Any = print, cached_features: bool = True) -> dict[str, Any]:
    """Step times of `variants`, interleaved (see the module docstring). Each variant's time
    is the mean over the batches of its fastest step on that batch (the least disturbed);
    `ratio` is that time over the reference's (> 1: slower than the reference). Without
    `cached_features` the timed batches' features come from the target, run here untimed."""
    from dspine_train.cpu_bf16 import bf16_matmuls
    from dspine_train.training.target import read_embedding_and_head

    if not 1 <= batches <= iters:
        raise StudyError(f"--batches {batches}, --iters {iters}: time every batch at least "
                         "once (1 <= batches <= iters)")
    first = compose_train_config(*settings.train_arguments(variants[0]))
    embed, head = read_embedding_and_head(first.model.target_path)
    work_dir.mkdir(parents=True, exist_ok=True)
    extract = None
    if not cached_features:
        progress("no feature cache: the timed batches' features come from the target, untimed")
        extract = _features_in_process(first)
    steps, items = {}, {}
    for variant in variants:
        progress(f"building {variant.name}'s step")
        steps[variant.name], items[variant.name] = _variant_step(
            settings, variant, work_dir, batches, embed, head, extract)
    rows = {name: [item[0].rows.tolist() for item in batch] for name, batch in items.items()}
    if any(r != next(iter(rows.values())) for r in rows.values()):
        raise StudyError(f"the variants' first batches differ ({rows}); the step times would "
                         "not be comparable")
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(batches)] for name in steps}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 products as `train.py` runs them here (`TrainConfig.cpu_bf16_matmul`)
    with bf16_matmuls(first.cpu_bf16_matmul, device) as matmul:
        for name, step in steps.items():  # warm-up: one step of each
            step(items[name][0])
        for i in range(iters):
            progress(f"round {i + 1}/{iters}")
            for name, step in steps.items():
                start = time.perf_counter()
                step(items[name][i % batches])
                times[name][i % batches].append(time.perf_counter() - start)
    best = {name: statistics.mean(min(ts) for ts in per_batch)
            for name, per_batch in times.items()}
    reference = REFERENCE if REFERENCE in best else next(iter(best))
    return {
        "reference": reference, "batches": batches, "iters": iters,
        "rows": next(iter(rows.values())),
        "features": "feature cache" if cached_features else "target run in process",
        "torch_threads": torch.get_num_threads(), "machine": platform.platform(),
        "processor": platform.processor(), "bf16_matmul": matmul.value,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "variants": {name: {"method": steps[name].draft.config.method,
                            "precision": str(steps[name].draft.dtype).removeprefix("torch."),
                            "draft_vocab_size": steps[name].draft.config.draft_vocab_size,
                            "step_s": best[name],
                            "step_s_median": statistics.median(
                                t for ts in times[name] for t in ts),
                            "ratio": best[name] / best[reference],
                            "steps_s": [t for ts in times[name] for t in ts]}
                     for name in steps},
    }


def write_step_times(result: dict[str, Any], path: Path) -> Path:
    """Write `result` to `path` (whole or not at all), replacing an earlier run: ratios hold
    within one run only."""
    from dspine_train.checkpoint_io import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=2) + "\n")
    return path
