"""`scripts/bench_train.py --recipe NAME`: a recipe's real training step, old path vs new paths.

Builds what the trainer builds for the recipe (draft, target head and embedding, token table,
offline features, the first batches of the training stream with their anchors and
replacement draws) and times one full step per path - forward, objective, backward, AdamW -
the paths alternating step by step on the same batches, so every path sees the same machine
load. Each path starts from the same draft weights. See the script's docstring for the paths.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dspine_train.engine.stats import StepTimer
from dspine_train.modeling import DSpineDraftModel
from dspine_train.objective import batch_generator, dspine_loss, sample_anchors
from dspine_train.training.config import TrainConfig, compose_train_config
from dspine_train.training.data import Batch, BatchStream, TokenBatches
from dspine_train.training.draft_builder import build_draft, load_or_build_token_table
from dspine_train.training.draft_step import DraftStep
from dspine_train.training.draft_vocab import prune_draft_vocab, tokenizer_or_none
from dspine_train.training.inputs import check_inputs
from dspine_train.training.memory_plan.for_recipe import plan_draft_config
from dspine_train.training.offline_features import OfflineFeatures, cache_identity
from dspine_train.training.target import TargetFeatures, read_embedding_and_head
from dspine_train.vocab_loss import target_topk
from scripts.tools.bench.reference_objective import ReferenceDraftStep

from .step_profile import PARTS, StepProfile, describe_plan, flop_plan


@dataclass(frozen=True)
class StepPath:
    """One way of making the step: the `reference` objective (`reference_objective`), cached
    `topk` target, `bf16` draft,
    `pruned` draft vocabulary (`--draft-vocab` ids)."""

    reference: bool
    topk: bool
    bf16: bool
    pruned: bool = False


PATHS = {
    "old": StepPath(reference=True, topk=False, bf16=False),
    "fused": StepPath(reference=False, topk=False, bf16=False),
    "fused+topk": StepPath(reference=False, topk=True, bf16=False),
    "fused+topk+pruned": StepPath(reference=False, topk=True, bf16=False, pruned=True),
    "fused+topk+bf16": StepPath(reference=False, topk=True, bf16=True),
    "fused+topk+bf16+pruned": StepPath(reference=False, topk=True, bf16=True, pruned=True),
}


def first_batches(config: TrainConfig, train, draft, count: int, head: torch.Tensor,  # noqa: ANN001
                  extract: Callable[[Batch, list[int]], TargetFeatures] | None = None):
    """The stream's first `count` micro-batches with features, anchors and replacement draws.

    The features are the cache's (`data.offline_features_dir`), or `extract(batch, the draft's
    target layers)`'s (the target run in this process, untimed) where it is given; the cache
    is then None."""
    d = config.data
    if extract is None and not d.offline_features_dir:
        raise SystemExit("--recipe: the recipe needs data.offline_features_dir (the bench reads "
                         "the cached target features; run "
                         "dspine_train.training.cache_features first)")
    batches = TokenBatches(train, d.max_length, draft.config.vocab_size, "data.train_path")
    layers = list(draft.config.target_layer_ids)
    cache = None if extract is not None else OfflineFeatures(
        Path(d.offline_features_dir) / d.train_split,
        cache_identity(config.model.target_path, layers, d.max_length, batches))
    stream = BatchStream(batches.lengths, d.batch_size, config.seed, d.group_by_length,
                         d.length_group_size, 0, 1)
    out = []
    for index, rows in stream.iterate(0):
        if len(out) == count:
            break
        batch = batches.collate(rows)
        feats = (extract(batch, layers) if extract is not None
                 else cache.features(batch.rows.tolist(), batch.input_ids.shape[1]))
        if feats.topk is None:  # what the cache pass stores now (untimed, as there)
            flat = feats.final_hidden.reshape(-1, feats.final_hidden.shape[-1])
            parts = target_topk(flat, head, max(1, d.target_topk))
            shape = feats.final_hidden.shape[:2]
            feats = TargetFeatures(feats.context, feats.final_hidden,
                                   *(t.view(*shape, -1) for t in parts))
        gen = batch_generator(config.seed, index)
        anchors, mask = sample_anchors(batch.loss_mask, d.num_anchors, draft.config.block_size,
                                      gen)
        replace = torch.rand(anchors.shape, generator=gen) < 0.5  # the curriculum's start
        out.append((batch, feats, anchors, mask, replace))
    return out, cache


class PathStep:
    """One path's draft copy, step module and optimizer; `__call__` runs one full step."""

    def __init__(self, path: StepPath, draft, embed, head, chunk: int, lr: float,  # noqa: ANN001
                 pruned=None) -> None:  # noqa: ANN001
        dtype = torch.bfloat16 if path.bf16 else torch.float32
        self.path = path
        self.draft = copy.deepcopy(pruned if path.pruned else draft).to(dtype)
        self.draft.bind_target(embed.to(dtype), head.to(dtype))
        self.step = (ReferenceDraftStep if path.reference else DraftStep)(self.draft, chunk)
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=lr, betas=(0.9, 0.95))

    def __call__(self, item, profile: StepProfile | None = None) -> float:  # noqa: ANN001
        batch, feats, anchors, mask, replace = item
        context = feats.context.to(self.draft.fc.weight.dtype)
        topk = feats.topk if self.path.topk else None
        loss, _ = self.step(batch.input_ids, context, feats.final_hidden, batch.loss_mask,
                            anchors, mask, replace, step=10, total_steps=150, target_topk=topk)
        if profile is None:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            with profile.part("backward (rest)"):
                loss.backward()
            with profile.part("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def _objective_change(draft: DSpineDraftModel, items: list[tuple], k: int) -> dict[str, float]:
    """|objective(top-k target) - objective(exact target)| over the batches, same weights."""
    diffs, remainders = [], []
    with torch.no_grad():
        for batch, feats, anchors, mask, replace in items:
            out = draft(batch.input_ids, feats.context, anchors, mask, replace)
            args = (draft, out, feats.final_hidden, batch.loss_mask, anchors, mask, 10, 150)
            exact, _ = dspine_loss(*args)
            cached, _ = dspine_loss(*args, target_topk=feats.topk)
            diffs.append(abs(float(cached - exact)))
            lm = batch.loss_mask.bool()
            remainders.append(float((1 - feats.topk_probs.sum(-1))[lm].mean()))
    return {"k": k, "max_abs_objective_change": max(diffs),
            "mean_remainder_mass": statistics.mean(remainders)}


def run_recipe_bench(args: argparse.Namespace) -> None:
    """Print and write (`args.out`) the side-by-side step times of the recipe's paths."""
    config = compose_train_config(f"recipe={args.recipe}", *args.set)
    if args.plan:
        _print_plan(config, args.draft_vocab)
        return
    torch.manual_seed(config.seed)
    inputs = check_inputs(config)
    embed, head = read_embedding_and_head(config.model.target_path)
    table_path = Path(config.model.token_table_path
                      or Path(config.output_dir) / "token_table.safetensors")
    table = load_or_build_token_table(table_path, head, inputs.draft_config.transfer_dim, True,
                                      lambda: None)  # as the trainer: built when missing
    draft = build_draft(config.model, inputs.draft_config, table, inputs.target_config,
                        config.seed)
    draft.bind_target(embed, head)
    items, cache = first_batches(config, inputs.train, draft, args.batches, head)
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        raise SystemExit(f"--paths: unknown {unknown}; choose among {list(PATHS)}")
    pruned, pruned_line = None, None
    if any(PATHS[name].pruned for name in names):
        pruned_config = copy.deepcopy(draft.config)
        pruned_config.draft_vocab_size = args.draft_vocab
        pruned = DSpineDraftModel(pruned_config)
        pruned.load_state_dict(draft.state_dict(), strict=False)  # the same weights, + d2t
        pruned_line = prune_draft_vocab(pruned, inputs.train, inputs.eval,
                                        tokenizer_or_none(config.model.target_path))
        print(pruned_line)
    steps = {name: PathStep(PATHS[name], draft, embed, head, config.logits_chunk_size,
                             config.optim.lr, pruned) for name in names}
    change = _objective_change(draft, items, int(items[0][1].topk_ids.shape[-1]))
    for step in steps.values():  # warm-up: one step of each path
        step(items[0])
    timer = StepTimer(torch.device("cpu"))  # the benchmark runs on CPU
    for i in range(args.iters):
        item = items[i % len(items)]
        for name, step in steps.items():
            with timer.section(name):
                step(item)
    times = timer.samples()
    profiles = {name: StepProfile() for name in steps}
    for item in items:  # one profiled step per path and batch, interleaved like the timing
        for name, step in steps.items():
            with profiles[name].patched(step.draft):
                step(item, profiles[name])
    breakdown = {name: profile.milliseconds(len(items)) for name, profile in profiles.items()}
    # a path's time over the batches: the sum of each batch's best step (least disturbed)
    best = {name: sum(min(ts[j::len(items)]) for j in range(min(len(items), args.iters)))
            for name, ts in times.items()}
    base = names[0]
    results = {name: {"step_ms": 1e3 * best[name] / min(len(items), args.iters),
                      "step_ms_median": 1e3 * statistics.median(ts),
                      "step_ms_all": [1e3 * t for t in ts],
                      "ratio_vs_" + base: best[base] / best[name],
                      "breakdown_ms": breakdown[name], "path": PATHS[name].__dict__}
               for name, ts in times.items()}
    _print_results(config, items, results, base, change, cache)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "recipe": args.recipe, "overrides": args.set, "iters": args.iters,
        "batches": [item[0].rows.tolist() for item in items], "results": results,
        "topk_objective_change": change, "pruned_vocabulary": pruned_line,
        "machine": platform.platform(),
        "processor": platform.processor(), "torch_threads": torch.get_num_threads(),
        "plan": _plan(config, args.draft_vocab)}, indent=2))
    print(f"wrote {out}")


def _print_results(config, items, results, base, change, cache) -> None:  # noqa: ANN001
    slots = [int(i[3].sum()) * (config.model.block_size or 0) for i in items]
    tokens = [int(i[0].attention_mask.sum()) for i in items]
    print(f"recipe {config.name}: {len(items)} batches of {config.data.batch_size} rows "
          f"({tokens} tokens, {[int(i[3].sum()) for i in items]} anchors), precision "
          f"{config.precision.value}, {torch.get_num_threads()} threads, cache top-k "
          f"{cache.target_topk or 'none (computed here)'}; slots per batch <= {slots}")
    print(f"{'path':<18} {'best ms':>9} {'median ms':>10} {'x ' + base:>10}")
    for name, r in results.items():
        print(f"{name:<18} {r['step_ms']:>9.0f} {r['step_ms_median']:>10.0f} "
              f"{r['ratio_vs_' + base]:>9.2f}x")
    print("where one step's time goes (ms, exclusive; mean over the batches):")
    width = 2 + max(len(name) for name in results)
    print(f"  {'part':<30}" + "".join(f"{name:>{width}}" for name in results))
    for part in PARTS:
        print(f"  {part:<30}" + "".join(f"{r['breakdown_ms'][part]:>{width}.0f}"
                                         for r in results.values()))
    print(f"top-{change['k']} target: objective changes by at most "
          f"{change['max_abs_objective_change']:.2e} (mean remainder mass "
          f"{change['mean_remainder_mass']:.2e} on supervised tokens)")


def _plan(config: TrainConfig, draft_vocab: int) -> dict:
    """The multiply-add split of the recipe's shapes: old path, new (top-k) path, and the new
    path with a pruned draft vocabulary of `draft_vocab` ids."""
    draft = plan_draft_config(config)
    d = config.data
    shapes = (draft, d.max_length, d.num_anchors, d.batch_size)
    new = {"target_distribution": False, "recompute": False}
    return {"old": flop_plan(*shapes), "new": flop_plan(*shapes, **new),
            f"new, pruned to {draft_vocab}": flop_plan(*shapes, vocab=draft_vocab, **new)}


def _print_plan(config: TrainConfig, draft_vocab: int) -> None:
    d = config.data
    plan = _plan(config, draft_vocab)
    for name, split in plan.items():
        print(f"{config.name} ({d.batch_size} x {d.max_length} tokens, {d.num_anchors} anchors),"
              f" {name} path: {sum(split.values()) / 1e9:,.0f} GMAC per micro-batch")
        print(describe_plan(split))
