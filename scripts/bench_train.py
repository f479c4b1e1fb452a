"""Training-step cost of DSpine's injection: draft tokens/s and peak memory, DSpine vs DFlash.

Builds one random Qwen3 target and one fixed batch (target features computed once, not timed),
then times the draft's training step - forward, the full DSpine objective and backward - for
the same draft with `injection: true` (DSpine) and `injection: false` (plain DFlash), on the
same batch and anchors. "Draft tokens" are block slots (sequences x anchors x block size).
The DSpine overhead ratio is DSpine step time / DFlash step time; the goal is <= 1.10x.
With `--methods` the variants are instead every method's own draft and objective (DSpine,
DFlash, DSpark, DFlash2, Domino, each its preset), timed the same way, as ratios to DSpine's.

    python scripts/bench_train.py                      # CPU-sized default
    python scripts/bench_train.py --methods            # the five methods' steps side by side
    python scripts/bench_train.py --hidden 1024 --layers 3 --seq 2048 --anchors 128 --device cuda

Step times (best of --iters) come with the two variants' steps alternating in one process (both see the
same machine load); peak memory is measured per variant in its own subprocess, so neither
inherits the other's allocator cache.
Peak memory: CUDA `max_memory_allocated` above the inputs on a GPU; on a CPU the peak resident
set size above the level before the first step, sampled every millisecond. Prints a table and
writes JSON (`--out`, default bench_results/train.json).

With `--recipe NAME` it instead times a recipe's real training step (its draft, target head,
token table, offline features and batches; Hydra overrides with `--set key=value`), the old
path and the new ones side by side, interleaved step by step on the same batches, each step
forward + objective + backward + AdamW step:

    old          the objective through autograd + activation checkpointing, the target's
                 distribution projected from its final state in every step (the code before
                 `vocab_loss`), the recipe's precision
    fused        gradient-in-forward vocabulary terms (`vocab_loss`), exact target distribution
    fused+topk   ... and the target's top-k distribution as the feature cache stores it
                 (`data.target_topk`; computed here from the cached final states, untimed, when
                 the cache predates it)
    +pruned      ... with a pruned draft vocabulary (`draft_vocab_size`, `--draft-vocab`),
                 selected from the recipe's training data; its held-out outside share printed
    +bf16        ... with the draft in bfloat16 (`precision: bf16`)

and prints each path's ratio to `old`, where the time of one step goes (`step_profile`), the
objective's change from the top-k target, and (`--plan`) the multiply-add split of any
recipe's shapes (e.g. `--recipe qwen3_8b --plan`, too large to run on a CPU).

    python scripts/bench_train.py --recipe qwen2.5_coder_0.5b --out bench_results/demo_step.json
    python scripts/bench_train.py --recipe qwen3_8b --plan
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

from dspine_train import DSpineConfig, DSpineDraftModel  # noqa: E402
from dspine_train.engine.stats import StepTimer  # noqa: E402
from dspine_train.objective import sample_anchors  # noqa: E402
from dspine_train.token_table import build_token_table  # noqa: E402
from dspine_train.training.draft_step import DraftStep  # noqa: E402
from dspine_train.training.target import TargetFeatureExtractor, target_head_weights  # noqa: E402

GOAL = 1.10
# name -> the draft's settings: DSpine's step against the same draft without injection
VARIANTS = {"dflash": {"injection": False}, "dspine": {"injection": True}}
# `--methods`: every method's own draft and objective (its preset), DSpine the reference
METHODS = {name: {"method": name} for name in ("dspine", "dflash", "dspark", "dflash2", "domino")}


@dataclass
class VariantTiming:
    """One variant's step: times over the interleaved steps, size and peak memory."""

    step_ms: float  # the best (minimum) step
    step_ms_median: float
    draft_tokens_per_s: float  # drafted slots per second at the best step
    step_ms_all: list[float]
    parameters: int
    peak_memory_mib: float = 0.0  # measured afterwards, in a fresh process


def _rss() -> int:
    """Current resident set size in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _RssPeak:
    """Highest RSS above the starting level while the block runs (a 1 ms sampling thread)."""

    def __enter__(self) -> _RssPeak:
        self.start, self.peak, self._stop = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss() - self.start)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss() - self.start)


def _build(args: argparse.Namespace, device: torch.device):
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    target = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=args.hidden, num_hidden_layers=args.target_layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=64, intermediate_size=3 * args.hidden,
        vocab_size=args.vocab, max_position_embeddings=args.seq + 64,
    )).eval().to(device)
    target.requires_grad_(False)
    embed, head = target_head_weights(target)
    table = build_token_table(head.float().cpu(), args.transfer_dim)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab - 1, (args.batch, args.seq), generator=gen)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, : args.seq // 8] = 0  # a prompt
    anchors, anchor_mask = sample_anchors(loss_mask, args.anchors, args.block, gen)
    layer_ids = [1 + i * (args.target_layers - 3) // max(1, args.layers - 1)
                 for i in range(args.layers)]
    extract = TargetFeatureExtractor(target, layer_ids)
    input_ids, loss_mask = input_ids.to(device), loss_mask.to(device)
    feats = extract(input_ids, torch.ones_like(input_ids))
    batch = (input_ids, feats.context, feats.final_hidden, loss_mask, anchors.to(device),
             anchor_mask.to(device))
    return target, embed, head, table, layer_ids, batch


def _variants(args: argparse.Namespace) -> dict[str, dict]:
    """The variants timed: DSpine with and without injection, or (`--methods`) every method."""
    return METHODS if args.methods else VARIANTS


def _make_step(args, device, target, embed, head, table, layer_ids, batch, settings: dict):
    """One training step (forward, full objective, backward) of a fresh draft with `settings`
    (its `DSpineConfig` fields), and its size."""
    torch.manual_seed(0)
    config = DSpineConfig.from_target(
        target.config, used_vocab_size=args.vocab - 1, num_layers=args.layers,
        block_size=args.block, target_layer_ids=layer_ids, transfer_dim=args.transfer_dim,
        message_size=args.message_size, candidate_k=args.candidate_k, **settings,
    )
    draft = DSpineDraftModel(config).to(device)
    draft.init_token_table(table)
    draft.bind_target(embed, head)
    step = DraftStep(draft)
    # the replacement curriculum at its start: half the blocks hear the true predecessor
    replace = torch.rand(batch[4].shape, generator=torch.Generator().manual_seed(1)) < 0.5
    replace = replace.to(device)

    def one_step() -> None:
        loss, _ = step(*batch, replace, step=10, total_steps=100)
        loss.backward()
        draft.zero_grad(set_to_none=True)

    return one_step, sum(p.numel() for p in draft.parameters())


def _peak_memory(args, device, built, settings: dict) -> float:
    """Peak memory (MiB) of warm-up + timed steps of one variant (run in a worker process)."""
    one_step, _ = _make_step(args, device, *built, settings=settings)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with _RssPeak() as rss:
        for _ in range(args.warmup + args.iters):
            one_step()
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else rss.peak
    return peak / 2**20


def _interleaved_times(args, device, built) -> dict[str, VariantTiming]:
    """Best and median step time per variant, the variants' steps alternating on one batch.

    Alternating step by step exposes both variants to the same machine load; the ratio uses the
    best (minimum) time of each, the estimate least disturbed by other processes (as timeit).
    """
    steps = {name: _make_step(args, device, *built, settings=settings)
             for name, settings in _variants(args).items()}
    for _ in range(args.warmup):
        for one_step, _ in steps.values():
            one_step()
    timer = StepTimer(device)
    for _ in range(args.iters):
        for name, (one_step, _) in steps.items():
            with timer.section(name):
                one_step()
    times = timer.samples()
    slots = built[-1][0].shape[0] * built[-1][4].shape[1] * args.block
    return {name: VariantTiming(step_ms=min(ts) * 1e3, step_ms_median=statistics.median(ts) * 1e3,
                                draft_tokens_per_s=slots / min(ts),
                                step_ms_all=[t * 1e3 for t in ts], parameters=steps[name][1])
            for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Defaults keep the published 8B proportions (r = H/4, message = H/8) at a CPU size.
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--target-layers", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2, help="draft layers")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--transfer-dim", type=int, default=128)
    parser.add_argument("--message-size", type=int, default=64)
    parser.add_argument("--candidate-k", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench_results/train.json")
    parser.add_argument("--methods", action="store_true",
                        help="time every method's own step (dspine, dflash, dspark, dflash2, "
                        "domino: its draft and objective) side by side, ratios to dspine")
    parser.add_argument("--variant", choices=sorted({*VARIANTS, *METHODS}),
                        help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--recipe", help="time this recipe's real step, old vs new paths")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override of the recipe (repeatable)")
    parser.add_argument("--batches", type=int, default=3,
                        help="--recipe: the first N batches of the training stream, cycled")
    parser.add_argument("--paths",
                        default="old,fused,fused+topk,fused+topk+pruned,fused+topk+bf16",
                        help="--recipe: the step paths compared, comma-separated")
    parser.add_argument("--draft-vocab", type=int, default=32768,
                        help="--recipe: draft_vocab_size of the +pruned paths")
    parser.add_argument("--plan", action="store_true",
                        help="--recipe: print the multiply-add split of its shapes, run nothing")
    args = parser.parse_args()
    if args.recipe:
        from scripts.tools.bench.step_bench import run_recipe_bench

        run_recipe_bench(args)
        return
    device = torch.device(args.device)

    if args.variant:  # worker: peak memory of one variant, JSON on the last line
        built = _build(args, device)
        settings = _variants(args)[args.variant]
        print(json.dumps({"peak_memory_mib": _peak_memory(args, device, built, settings)}))
        return
    results = _interleaved_times(args, device, _build(args, device))
    for name in _variants(args):  # memory in fresh processes: none inherits another's caches
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"{name} worker failed:\n{proc.stderr[-3000:]}")
        results[name].peak_memory_mib = json.loads(proc.stdout.strip().splitlines()[-1])[
            "peak_memory_mib"]
    ratio = results["dspine"].step_ms / results["dflash"].step_ms
    to_dspine = {name: r.step_ms / results["dspine"].step_ms for name, r in results.items()}
    print(f"training step, {args.batch} x {args.seq} tokens, {args.anchors} anchors x block "
          f"{args.block}, H={args.hidden}, V={args.vocab}, {args.layers} draft layers, "
          f"{args.device}")
    print(f"{'variant':<8} {'best ms':>9} {'median ms':>10} {'x dspine':>9} {'draft tok/s':>12} "
          f"{'peak MiB':>9} {'params':>11}")
    for name, r in results.items():
        print(f"{name:<8} {r.step_ms:>9.1f} {r.step_ms_median:>10.1f} {to_dspine[name]:>9.2f} "
              f"{r.draft_tokens_per_s:>12,.0f} {r.peak_memory_mib:>9.1f} {r.parameters:>11,}")
    if args.methods:
        print("each method's own draft and objective (`--methods`); dflash here is the method, "
              "not DSpine without injection")
    else:
        verdict = "meets" if ratio <= GOAL else "misses"
        print(f"DSpine overhead: {ratio:.3f}x best step time ({verdict} the <= {GOAL:.2f}x goal)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "results": {name: asdict(r) for name, r in results.items()},
                               "overhead_ratio": None if args.methods else ratio,
                               "ratio_to_dspine": to_dspine, "goal": GOAL,
                               "machine": platform.platform(),
                               "torch_threads": torch.get_num_threads()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
