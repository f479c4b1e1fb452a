"""The bf16 check of `README.md`: paired simulated tau of two drafts on the trainer's blocks.

    python docs/results/fast_step/paired_check.py RUN_A/final RUN_B/final FEATURES_DIR

Evaluates both drafts on the demo recipe's evaluation plan (same batches, same anchors as the
trainer's evaluation) and prints each tau with its SE and the paired difference with its SE
and a per-row clustered SE. A record of the check, not a tool (issue 16's study adds paired
evaluation to the trainer).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

# the repository root, for the `scripts` package (run as a script from anywhere)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from dspine_train.evaluation.held_out import EVAL_SEED_OFFSET  # noqa: E402
from dspine_train.formats import load_draft  # noqa: E402
from dspine_train.objective import batch_generator, sample_anchors  # noqa: E402
from dspine_train.training.config import compose_train_config  # noqa: E402
from dspine_train.training.data import TokenBatches, evaluation_plan  # noqa: E402
from dspine_train.training.draft_step import DraftStep  # noqa: E402
from dspine_train.training.inputs import check_inputs  # noqa: E402
from dspine_train.training.offline_features import OfflineFeatures, cache_identity  # noqa: E402
from dspine_train.training.target import read_embedding_and_head  # noqa: E402

ART = "artifacts"


def main() -> None:
    first, second, features = sys.argv[1:4]
    cfg = compose_train_config(
        "recipe=qwen2.5_coder_0.5b", f"model.target_path={ART}/default_target",
        f"model.token_table_path={ART}/demo/token_table.safetensors",
        f"data.train_path={ART}/demo/data/tokenized", f"data.offline_features_dir={features}")
    inputs = check_inputs(cfg)
    embed, head = read_embedding_and_head(cfg.model.target_path)
    batches = TokenBatches(inputs.eval, cfg.data.max_length, inputs.draft_config.vocab_size,
                           "data.eval_path")
    layers = list(inputs.draft_config.target_layer_ids)
    cache = OfflineFeatures(Path(features) / cfg.data.eval_split,
                            cache_identity(cfg.model.target_path, layers, cfg.data.max_length,
                                           batches))
    plan = evaluation_plan(batches.lengths, cfg.eval.batch_size, cfg.eval.num_anchors,
                           cfg.eval.max_blocks, cfg.seed)
    steps = []
    for path in (first, second):
        draft = load_draft(path).float().eval()
        draft.bind_target(embed, head)
        steps.append(DraftStep(draft))
    per: list[list[torch.Tensor]] = [[], []]
    rows = []
    with torch.no_grad():
        for i, entry in enumerate(plan):
            batch = batches.collate(entry)
            feats = cache.features(batch.rows.tolist(), batch.input_ids.shape[1],
                                   with_topk=False)
            gen = batch_generator(cfg.seed + EVAL_SEED_OFFSET, i)
            anchors, mask = sample_anchors(batch.loss_mask, cfg.eval.num_anchors,
                                           inputs.draft_config.block_size, gen)
            keep = mask.reshape(-1)
            for j, step in enumerate(steps):
                prefix = step.accepted_prefixes(batch.input_ids, feats.context.float(),
                                                feats.final_hidden.float(), batch.loss_mask,
                                                anchors, mask)
                per[j].append((1 + prefix.sum(-1))[keep])
            rows.append(batch.rows[:, None].expand(-1, anchors.shape[1]).reshape(-1)[keep])
    taus = [torch.cat(p) for p in per]
    row_ids = torch.cat(rows).tolist()
    for path, tau in zip((first, second), taus):
        print(f"{path}: tau {tau.mean():.4f} (SE {tau.std() / math.sqrt(tau.numel()):.4f}, "
              f"{tau.numel()} blocks)")
    diff = taus[0] - taus[1]
    n, mean = diff.numel(), float(diff.mean())
    by_row: dict[int, list[float]] = {}
    for row, value in zip(row_ids, diff.tolist()):
        by_row.setdefault(row, []).append(value)
    clustered = math.sqrt(sum((sum(v) - len(v) * mean) ** 2 for v in by_row.values())) / n
    print(f"paired difference (first - second): {mean:+.4f} (SE {diff.std() / math.sqrt(n):.4f},"
          f" row-clustered SE {clustered:.4f})")


if __name__ == "__main__":
    main()
