"""The DSpine training loop: online (or cached) target features -> draft -> objective -> DeepSpeed.

One optimizer step = `grad_accum_steps` micro-batches on each of the W processes. Per micro-batch:
the frozen target yields the context features and its final hidden state, anchors are sampled
(METHOD 1), a share of blocks gets true predecessor codes (the replacement curriculum, METHOD 2.2),
all blocks run in one draft forward and `dspine_loss` (METHOD 2.3; a DSpark draft:
`dspark_loss`) is backpropagated through DeepSpeed, which also accumulates, clips, steps the
optimizer and the warmup + cosine schedule.

Everything random in a step is drawn from a generator seeded by (seed, global batch index), and
the data position is one integer, so a resumed run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from ..cpu_bf16 import FLOAT32_NOTICE, Bf16Matmul, bf16_matmuls
from ..evaluation.block_metrics import AcceptanceStats, BlockResults, stats_from_counts
from ..evaluation.held_out import (
    BlockPlan,
    every_block_plan,
    simulated_acceptance_counts,
    simulated_block_accepts,
)
from ..modeling.attention_masks import default_use_flex, training_attention_path
from ..modeling.compiled_flex import check_flex_usable
from ..objective import batch_generator, sample_anchors
from .checkpointing import CheckpointManager, TrainState
from .config import TrainConfig
from .curriculum import replacement_mask, replacement_share
from .data import Batch, BatchStream, TokenBatches, evaluation_plan
from .distributed import build_accelerator, without_zero3_init
from .draft_builder import build_draft, load_or_build_token_table
from .draft_step import DraftStep
from .draft_vocab import prune_draft_vocab, tokenizer_or_none
from .errors import TrainingError
from .hub_push import check_push_ready, push_final_export
from .initialisation import from_dflash
from .inputs import check_inputs
from .offline_features import OfflineFeatures, cache_identity
from .optimizer import build_optimizer
from .plots import plot_training
from .run_export import check_export_dirs, export_draft
from .run_lock import lock_run_outputs, release_run_outputs
from .target import (
    TargetFeatureExtractor,
    TargetFeatures,
    embedding_scale,
    load_target,
    read_embedding_and_head,
    target_head_weights,
)
from .tracking import MetricsLog, progress_line, read_metrics

# Host syncs a training micro-batch makes itself (the device-faithful harness counts them,
# tests/test_device_faithful.py): the objective's indices of the supervised slots, and the
# finite-loss check every process agrees on before backward. The libraries below add theirs
# (docs/GPU.md): transformers' padding-mask check when an online target's batch is padded,
# DeepSpeed's gradient-norm checks at an accumulation boundary.
MICRO_BATCH_SYNCS = 2


@dataclass
class TrainResult:
    """What a finished run produced."""

    output_dir: Path
    final_export: Path
    best_export: Path | None
    steps: int
    best_tau: float | None
    world_size: int
    is_main: bool
    hub_commit: str | None = None  # the commit URL of `export.push_to_hub`'s upload


class Trainer:
    """Builds everything a run needs from a `TrainConfig`, then `train()` runs it."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.started = time.perf_counter()
        # Everything that can be wrong with the inputs is checked before any process group,
        # weights or DeepSpeed exist.
        check_push_ready(config.export)
        self.inputs = check_inputs(config)
        self.accelerator = acc = build_accelerator(config)
        self.is_main = acc.is_main_process
        self.world = acc.num_processes
        self.rank = acc.process_index
        # One run per output directory, locked before anything below writes or prunes there.
        self._locked = lock_run_outputs(config, acc)
        try:
            self._setup_run()
        except BaseException:
            release_run_outputs(self._locked)
            raise

    def _setup_run(self) -> None:
        """Everything `__init__` builds once the output directories are locked."""
        config, acc = self.config, self.accelerator
        check_export_dirs(self.output_dir)  # final/ and best/ are replaced at the end
        # The checkpoint directory is checked before any weights exist: a fresh run must not
        # prune another run's checkpoints, a resume must find this run's (`checkpointing`).
        ckpt_root = Path(config.checkpoint.dir or self.output_dir / "checkpoints")
        self.checkpoints = CheckpointManager(ckpt_root, config.checkpoint.keep_last, acc,
                                             _flat_config(config))
        self.resume_path = None
        if config.checkpoint.resume_from:
            self.resume_path = self.checkpoints.resolve(config.checkpoint.resume_from)
        if self.resume_path is None:
            self.checkpoints.check_fresh()
        else:
            self.checkpoints.check_resumable(self.resume_path)
        set_seed(config.seed)
        with without_zero3_init(acc):
            self._setup_model()
        self._setup_data()
        self._setup_optimization()
        self.state = TrainState(total_steps=self.total_steps, world_size=self.world,
                                grad_accum_steps=config.optim.grad_accum_steps)
        if self.resume_path is not None:
            self._resume(self.resume_path)
        elif config.checkpoint.resume_from and self.is_main:
            print(f"checkpoint.resume_from=latest: no checkpoint in {self.checkpoints.root}, "
                  "starting fresh")

    # ------------------------------------------------------------------ setup
    def _setup_model(self) -> None:
        cfg, acc, inputs = self.config, self.accelerator, self.inputs
        m = cfg.model
        self.offline = cfg.data.offline_features_dir is not None
        if self.offline:  # the target body is not needed: only its embedding and head
            self.extract = None
            embed, head = read_embedding_and_head(m.target_path)
            embed, head = (w.to(acc.device) for w in (embed, head))
        else:
            target = load_target(m.target_path, m.target_dtype, acc.device, m.trust_remote_code)
            embed, head = target_head_weights(target)
            scale = embedding_scale(target)
            if abs(scale - inputs.draft_config.embed_scale) > 1e-6 * scale:
                raise TrainingError(
                    f"model.target_path: the target scales its input embeddings by {scale}, "
                    f"the draft by embed_scale={inputs.draft_config.embed_scale} "
                    f"(model_type {inputs.draft_config.target_model_type!r})")
            self.extract = TargetFeatureExtractor(target, inputs.draft_config.target_layer_ids)
        # The online target's distillation distribution: its top-k per position (the same form
        # a feature cache stores), unless `data.target_topk: 0` asks for the exact one per slot.
        self.target_head = head
        # DSpark's and DFlash2's objectives read the exact distribution from the final state (as
        # DeepSpec's and speculators' do); Domino's reads none (label CE only).
        self.uses_topk = not (inputs.draft_config.anchor_predicts
                              or inputs.draft_config.method in ("domino", "dflash2"))
        self.online_topk = (not self.offline and inputs.draft_config.distill
                            and cfg.data.target_topk > 0 and self.uses_topk)
        default_table = self.output_dir / "token_table.safetensors"
        self.token_table_path = Path(m.token_table_path or default_table)
        table = load_or_build_token_table(
            self.token_table_path, head, inputs.draft_config.transfer_dim, self.is_main,
            acc.wait_for_everyone,
        )
        draft = build_draft(m, inputs.draft_config, table, inputs.target_config, cfg.seed,
                            log=print if self.is_main else None)
        if draft.config.draft_vocab_size is not None and (
                not m.init_from or from_dflash.dflash_checkpoint(m.init_from) is not None):
            line = prune_draft_vocab(draft, inputs.train, inputs.eval,
                                     tokenizer_or_none(m.target_path))
            if self.is_main:
                print(line)
        if self.is_main and from_dflash.dflash_checkpoint(m.init_from) is not None:
            print(from_dflash.describe(draft.config, m.init_from))
        self.draft_config = draft.config
        dtype = torch.bfloat16 if cfg.precision.value == "bf16" else torch.float32
        draft.to(device=acc.device, dtype=dtype)
        draft.bind_target(embed.to(dtype), head.to(dtype))
        self.step_module = DraftStep(draft, cfg.logits_chunk_size)
        if default_use_flex(acc.device):  # stop before any step when the fused kernel cannot run
            check_flex_usable(acc.device, needs_grad=True)

    def _setup_data(self) -> None:
        cfg, inputs = self.config, self.inputs
        d = cfg.data
        vocab = self.draft_config.vocab_size
        self.train_batches = TokenBatches(inputs.train, d.max_length, vocab, "data.train_path")
        self.stream = BatchStream(
            self.train_batches.lengths, d.batch_size, cfg.seed, d.group_by_length,
            d.length_group_size, self.rank, self.world,
        )
        self.eval_batches = None
        if inputs.eval is not None:
            self.eval_batches = TokenBatches(inputs.eval, d.max_length, vocab, "data.eval_path")
            per_batch = cfg.eval.batch_size * cfg.eval.num_anchors
            if cfg.eval.every_block:
                self.eval_plan = every_block_plan(
                    self.eval_batches.dataset["loss_mask"], d.max_length, cfg.eval.batch_size,
                    cfg.eval.num_anchors, cfg.eval.max_blocks, cfg.seed)
            else:
                self.eval_plan = evaluation_plan(self.eval_batches.lengths, cfg.eval.batch_size,
                                                 cfg.eval.num_anchors, cfg.eval.max_blocks,
                                                 cfg.seed)
            chunk = max(1, cfg.logits_chunk_size // self.draft_config.num_predictions)
            self.eval_chunks = math.ceil(per_batch / chunk)
        self.train_cache = self.eval_cache = None
        if self.offline:
            root = Path(d.offline_features_dir)
            layers = list(self.draft_config.target_layer_ids)
            self.train_cache = OfflineFeatures(
                root / d.train_split, cache_identity(cfg.model.target_path, layers, d.max_length,
                                                     self.train_batches))
            if self.eval_batches is not None:
                self.eval_cache = OfflineFeatures(
                    root / d.eval_split, cache_identity(cfg.model.target_path, layers,
                                                        d.max_length, self.eval_batches))

    def _setup_optimization(self) -> None:
        cfg, acc = self.config, self.accelerator
        o = cfg.optim
        per_step = self.world * o.grad_accum_steps
        if o.max_steps > 0:
            self.total_steps = o.max_steps
        else:
            self.total_steps = int(o.epochs * self.stream.batches_per_epoch) // per_step
        if self.total_steps < 1:
            raise TrainingError(
                f"data.train_path: {len(self.train_batches)} sequences make "
                f"{self.stream.batches_per_epoch} batches per epoch, fewer than one optimizer "
                f"step consumes ({self.world} processes x {o.grad_accum_steps} accumulation steps)"
            )
        optimizer = build_optimizer(self.step_module, o)
        scheduler = get_cosine_schedule_with_warmup(
            optimizer, math.ceil(o.warmup_ratio * self.total_steps), self.total_steps
        )
        self.engine, self.optimizer, self.scheduler = acc.prepare(
            self.step_module, optimizer, scheduler
        )

    def _resume(self, path: Path) -> None:
        state = self.checkpoints.load(path)
        if self.total_steps < state.step:
            raise TrainingError(
                f"optim.max_steps / optim.epochs: this run has {self.total_steps} steps, the "
                f"checkpoint {path} is at step {state.step} already"
            )
        if state.total_steps != self.total_steps and self.is_main:
            # More steps may be asked on resume: the schedule continues on the new length.
            print(f"note: the run now has {self.total_steps} steps (the checkpoint's had "
                  f"{state.total_steps}); the warmup + cosine schedule continues from step "
                  f"{state.step} for the new length")
        state.total_steps = self.total_steps
        state.world_size, state.grad_accum_steps = self.world, self.config.optim.grad_accum_steps
        self.state = state
        if self.is_main:
            print(f"resumed from {path} at step {state.step}")

    # ------------------------------------------------------------------ one micro-batch
    def _features(self, batch: Batch, cache: OfflineFeatures | None,
                  with_topk: bool = True, device_batch: Batch | None = None) -> TargetFeatures:
        """The target's features of `batch`: read from the cache by its rows (read on the host
        when `batch` is the host copy), or computed by the online target on `device_batch`
        (default: `batch` itself)."""
        if cache is None:
            on_device = device_batch if device_batch is not None else batch
            mask = on_device.attention_mask
            if device_batch is not None and bool(batch.attention_mask.all()):
                # No padding (read on the host): the target runs causal without a mask, which
                # spares transformers' own device read of the mask (the same states).
                mask = None
            return self.extract(on_device.input_ids, mask)
        feats = cache.features(batch.rows.tolist(), batch.input_ids.shape[1],
                               with_topk=with_topk and self.config.data.target_topk > 0)
        return feats.to(self.accelerator.device)

    def _target_distribution(self) -> str:
        """How the distillation target is obtained, for the run's first lines."""
        if self.online_topk:
            return (f"top-{self.config.data.target_topk} + remainder, projected once per "
                    "position from the online target")
        if not self.uses_topk and self.draft_config.method == "domino":
            return "none (Domino's objective: label CE only)"
        if not self.uses_topk:
            return (f"exact, projected through the target's head every step "
                    f"({self.draft_config.method}'s objective)")
        k = self.train_cache.target_topk if self.train_cache is not None else 0
        if k and self.config.data.target_topk > 0:
            return f"top-{k} + remainder, cached once per token (data.offline_features_dir)"
        why = "online target" if self.train_cache is None else (
            "data.target_topk: 0" if k else "the feature cache stores none (made before "
            "data.target_topk existed, or with 0)")
        return f"exact, projected through the target's head every step ({why})"

    def _anchors(
        self, batch: Batch, generator: torch.Generator, num_anchors: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Anchors drawn on the host (`batch` is the host copy; a CPU generator), then moved."""
        anchors, mask = sample_anchors(batch.loss_mask.cpu(), num_anchors,
                                       self.draft_config.block_size, generator)
        device = self.accelerator.device
        return anchors.to(device), mask.to(device)

    def _check_finite(self, loss: torch.Tensor, step: int, index: int) -> None:
        """Stop every process before a non-finite loss reaches the weights."""
        finite = torch.isfinite(loss.detach()).float().reshape(1)
        # Deliberate host sync: all processes must agree before anyone calls backward.
        if self.accelerator.reduce(finite, "sum").item() < self.world:
            latest = self.checkpoints.latest()
            raise TrainingError(
                f"non-finite loss ({loss.item()}) at step {step + 1} on global batch {index} "
                f"of data.train_path (lower optim.lr or check the data); the last good "
                f"checkpoint is {latest or 'none (none was written yet)'}"
            )

    def _micro_batch(self, index: int, rows: list[int]) -> tuple[dict[str, torch.Tensor], int]:
        """Global batch `index` (dataset `rows`): target features, anchors, the draft's forward
        and objective, the finite check and backward. Returns the detached metrics (on the
        device) and the batch's real tokens.

        Host syncs: `MICRO_BATCH_SYNCS` (the objective's selection of supervised slots and the
        finite check); the token count and the cache rows are read on the host side.
        """
        cfg, acc, state = self.config, self.accelerator, self.state
        host_batch = self.train_batches.collate(rows)
        batch = host_batch.to(acc.device)
        feats = self._features(host_batch, self.train_cache, with_topk=self.uses_topk,
                               device_batch=batch)
        if self.online_topk:  # once per position, not once per (overlapping) block slot
            feats = feats.with_topk(self.target_head, cfg.data.target_topk)
        gen = batch_generator(cfg.seed, index)
        anchors, anchor_mask = self._anchors(host_batch, gen, cfg.data.num_anchors)
        replace, _ = replacement_mask(self.draft_config, state.step, self.total_steps,
                                      anchors.shape, gen)
        replace = replace.to(acc.device)
        with acc.accumulate(self.engine):
            loss, metrics = self.engine(
                batch.input_ids, feats.context, feats.final_hidden, batch.loss_mask,
                anchors, anchor_mask, replace, step=state.step,
                total_steps=self.total_steps, target_topk=feats.topk,
            )
            self._check_finite(loss, state.step, index)
            acc.backward(loss)
        return metrics, host_batch.num_tokens

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainResult:
        """Run to `total_steps`, evaluating, checkpointing, logging; export and plot at the end.
        The output directories stay locked until it returns."""
        try:
            return self._train()
        finally:
            release_run_outputs(self._locked)
            self._locked = []

    def _train(self) -> TrainResult:
        cfg, acc, state = self.config, self.accelerator, self.state
        log = MetricsLog(
            self.output_dir, self.is_main, cfg.logging.wandb, cfg.logging.project,
            cfg.logging.run_name or cfg.name, _flat_config(cfg), resume_step=state.step,
        )
        if self.is_main:
            print(f"training {cfg.name}: {self.total_steps} steps on {self.world} process(es), "
                  f"ZeRO-{cfg.deepspeed.stage}, {_count(self.step_module):,} draft parameters, "
                  f"online target: {not self.offline}")
            print(f"target distribution: {self._target_distribution()}")
            # the draft's forward picks its attention by device (`default_use_flex`)
            print(f"draft attention on {acc.device}: "
                  f"{training_attention_path(default_use_flex(acc.device))}")
        bar = tqdm(total=self.total_steps, initial=state.step, desc="train", unit="step",
                   disable=not (self.is_main and cfg.logging.progress_bar), dynamic_ncols=True)
        stream = self.stream.iterate(state.position)
        sums: dict[str, torch.Tensor] = {}
        micro_count, tokens, last_log = 0, 0, time.perf_counter()
        last_log_step = state.step
        self.engine.train()
        last_stats: AcceptanceStats | BlockResults | None = None
        seen: list[int] = []  # global batch indices this process trained on (this session)
        while state.step < self.total_steps:
            p_replace = replacement_share(self.draft_config, state.step, self.total_steps)
            for _ in range(cfg.optim.grad_accum_steps):
                index, rows = next(stream)
                seen.append(index)
                metrics, num_tokens = self._micro_batch(index, rows)
                state.position += self.world
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value.detach().float()
                micro_count += 1
                tokens += num_tokens
            # DeepSpeed stepped the optimizer at the accumulation boundary (in backward); the
            # schedule is the trainer's own LambdaLR, stepped once per optimizer step.
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
            self.scheduler.step()
            state.step += 1
            bar.update(1)

            if state.step % cfg.logging.log_every == 0 or state.step == self.total_steps:
                row = self._reduce_metrics(sums, micro_count, tokens, last_log,
                                           state.step - last_log_step)
                row["lr"] = lr
                row["replacement_p"] = p_replace
                row["epoch"] = self.stream.epoch_of(state.position)
                log.log(state.step, row)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                s_step=f"{row['s_per_step']:.2f}")
                if self.is_main:  # one readable line per logged step (logs/train.log)
                    tqdm.write(progress_line(state.step, self.total_steps, row), file=sys.stdout)
                    sys.stdout.flush()
                sums, micro_count, tokens, last_log = {}, 0, 0, time.perf_counter()
                last_log_step = state.step

            final = state.step == self.total_steps
            new_best = False
            paused = time.perf_counter()  # evaluation and checkpoints do not count as steps
            if self.eval_batches is not None and (
                final or (cfg.eval.every and state.step % cfg.eval.every == 0)
            ):
                last_stats = self.evaluate()
                log.log(state.step, last_stats.as_metrics())
                if state.best_tau is None or last_stats.tau > state.best_tau:
                    state.best_tau, state.best_step, new_best = last_stats.tau, state.step, True
                    self._export(self.output_dir / "best", last_stats)
            periodic = cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0
            if final or periodic or (new_best and cfg.checkpoint.every):
                self.checkpoints.save(state)
            last_log += time.perf_counter() - paused
        bar.close()

        self._export(self.output_dir / "final", last_stats)
        if self.is_main:
            plot_training(read_metrics(log.path),
                          last_stats.position_rates() if last_stats else None,
                          self.output_dir / "training_curves.png")
        log.close()
        best = self.output_dir / "best" if state.best_step is not None else None
        self._write_rank_report(seen)
        commit = None
        if cfg.export.push_to_hub is not None and self.is_main:
            # Last: a failed upload (TrainingError) leaves every output of the run in place.
            print(f"uploading {self.output_dir / 'final'} to {cfg.export.push_to_hub} "
                  f"({'private' if cfg.export.push_private else 'public'} if created)")
            commit = push_final_export(self.output_dir / "final", cfg.export)
            print(f"uploaded to {cfg.export.push_to_hub}: {commit}")
        return TrainResult(self.output_dir, self.output_dir / "final", best, state.step,
                           state.best_tau, self.world, self.is_main, commit)

    def _write_rank_report(self, seen: list[int]) -> None:
        """`ranks/rank<r>.json`: this process's share of the data and a digest of its weights.

        Lets anyone check a distributed run: the processes saw disjoint batches and, under
        ZeRO-2 (replicated parameters), hold bit-identical weights.
        """
        digest = None
        if self.config.deepspeed.stage == 2:
            sha = hashlib.sha256()
            for name, param in sorted(self.accelerator.unwrap_model(self.engine).named_parameters()):
                sha.update(name.encode())
                sha.update(param.detach().float().cpu().numpy().tobytes())
            digest = sha.hexdigest()
        report = {"rank": self.rank, "world_size": self.world, "global_batches": seen,
                  "parameter_sha256": digest}
        path = self.output_dir / "ranks" / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report))

    def _reduce_metrics(
        self, sums: dict[str, torch.Tensor], count: int, tokens: int, since: float, steps: int
    ) -> dict[str, float]:
        """Mean of each metric over micro-batches and processes, plus global tokens/s and the
        wall seconds per optimizer step over the `steps` steps since the last log (training
        time: the evaluations and checkpoints in between are left out)."""
        keys = sorted(sums)
        packed = torch.stack([sums[k] for k in keys] + [torch.tensor(float(tokens))
                                                           .to(self.accelerator.device)])
        packed = self.accelerator.reduce(packed.to(self.accelerator.device), "sum").cpu()
        row = {k: float(v) / (count * self.world) for k, v in zip(keys, packed[:-1])}
        elapsed = time.perf_counter() - since
        row["tokens_per_s"] = float(packed[-1]) / max(elapsed, 1e-9)
        row["s_per_step"] = elapsed / max(steps, 1)
        return row

    @torch.no_grad()
    def evaluate(self) -> AcceptanceStats | BlockResults:
        """Simulated acceptance on the eval plan, every process a share (see `evaluation`);
        with `eval.every_block` per block, saved under `<output_dir>/eval_blocks/`."""
        cfg, acc = self.config, self.accelerator
        self.engine.eval()
        if isinstance(self.eval_plan, BlockPlan):
            accepted = simulated_block_accepts(
                self.engine, self.eval_batches, self.eval_plan,
                lambda batch: self._features(batch, self.eval_cache), device=acc.device,
                rank=self.rank, world_size=self.world, eval_chunks=self.eval_chunks)
            accepted = acc.reduce(accepted, "sum").cpu()
            self.engine.train()
            results = BlockResults(self.eval_plan.rows, self.eval_plan.anchors,
                                   accepted.round().long().numpy(), self.draft_config.block_size,
                                   self.draft_config.num_predictions)
            if self.is_main:
                results.save(self.output_dir / "eval_blocks" / f"step{self.state.step:07d}.npz")
            return results
        total = simulated_acceptance_counts(
            self.engine, self.eval_batches, self.eval_plan,
            lambda batch: self._features(batch, self.eval_cache, with_topk=False), seed=cfg.seed,
            num_anchors=cfg.eval.num_anchors, block_size=self.draft_config.block_size,
            device=acc.device, rank=self.rank, world_size=self.world,
            eval_chunks=self.eval_chunks,
        )
        total = acc.reduce(total, "sum")
        self.engine.train()
        return stats_from_counts(total.cpu())

    def _export(self, out_dir: Path, stats: AcceptanceStats | BlockResults | None) -> None:
        info = {
            "recipe": self.config.name,
            "step": self.state.step,
            "target": self.config.model.target_path,
            "data": self.config.data.train_path,
            "dataset": self.config.data.train_path,  # the model card's name for it
            "budget": self._budget(),
            "tau": stats.tau if stats else None,
            "acceptance_by_position": stats.position_rates() if stats else None,
        }
        if isinstance(stats, BlockResults):
            info.update(tau_se=stats.tau_se, tau_se_row=stats.tau_se_row, blocks=stats.blocks)
        export_draft(self.accelerator, self.engine, out_dir, self.token_table_path, info,
                     fmt=self.config.export.format.value, eval_results=self._eval_results(stats))

    def _budget(self) -> dict[str, Any]:
        """What the draft was trained on so far: optimizer steps, sequences and real tokens
        drawn (exact, from the stream position: every global batch of every process), epochs,
        the global batch, and this session's wall time (a resumed run names where it resumed)."""
        position, per_epoch = self.state.position, self.stream.batches_per_epoch
        lengths = self.train_batches.lengths  # (N,) tokens per row after the max_length cut
        full, partial = divmod(position, per_epoch)
        sequences, tokens = full * len(lengths), full * int(lengths.sum())
        for index in range(full * per_epoch, position):  # the epoch under way
            rows = self.stream.global_batch(index)
            sequences, tokens = sequences + len(rows), tokens + int(lengths[rows].sum())
        o = self.config.optim
        budget: dict[str, Any] = {
            "optimizer_steps": self.state.step,
            "sequences_seen": sequences,
            "tokens_seen": tokens,
            "epochs": round(self.stream.epoch_of(position), 4),
            "global_batch_sequences": self.config.data.batch_size * self.world * o.grad_accum_steps,
            "processes": self.world,
            "wall_time_s": round(time.perf_counter() - self.started, 1),
        }
        if self.resume_path is not None:
            budget["wall_time_note"] = f"this session only (resumed at {self.resume_path.name})"
        return budget

    def _eval_results(self, stats: AcceptanceStats | BlockResults | None) -> dict[str, Any] | None:
        """eval_results.json: the simulated acceptance on the held-out split, as the model card
        reads it; None when the run measured none (no eval data, or no block evaluated)."""
        if stats is None or not math.isfinite(stats.tau):
            return None
        results: dict[str, Any] = {
            "acceptance_length": stats.tau,
            "acceptance_length_per_position": stats.position_rates(),
            "evaluation": "simulated on the held-out split: each drafted block checked "
                          "against the target's greedy tokens (temperature 0)",
            "step": self.state.step,
        }
        if isinstance(stats, BlockResults):
            results.update(blocks=stats.blocks, acceptance_length_se=stats.tau_se,
                           acceptance_length_se_by_row=stats.tau_se_row)
        else:
            results["blocks"] = int(stats.blocks)
        return results


def _count(module: torch.nn.Module) -> int:
    # ZeRO-3 leaves each process a shard; `ds_numel` keeps the full size.
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def _flat_config(config: TrainConfig) -> dict:
    """The config as plain nested dicts (enums as their values), for wandb."""
    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return getattr(value, "value", value)
    return plain(asdict(config))


def run_training(config: TrainConfig) -> TrainResult:
    """Build a `Trainer` for `config` and train, bf16 products on a CPU as
    `config.cpu_bf16_matmul` says (`cpu_bf16.py`; nothing changes on another device)."""
    trainer = Trainer(config)
    bf16 = config.precision.value == "bf16" or config.model.target_dtype == "bfloat16"
    setting = config.cpu_bf16_matmul if bf16 else Bf16Matmul.native  # no bf16 product to run
    with bf16_matmuls(setting, trainer.accelerator.device) as matmul:
        if matmul == Bf16Matmul.float32:
            print(FLOAT32_NOTICE)
        return trainer.train()
