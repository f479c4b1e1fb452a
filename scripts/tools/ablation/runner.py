"""Running the ablation: one shared feature cache, one `train.py` run per variant, evaluation.

Layout of an ablation directory `<out>/`:

    features/                 the target's offline features, computed once, read by every run
    token_table.safetensors   the token table, built once (it depends only on the target)
    <variant>/                a `train.py` output dir (metrics.jsonl, hydra/config.yaml, final/)
        request.json          the exact `train.py` arguments this directory was trained with
        final/                the exported draft (a derived variant: the source's weights with
                              its switches written into config.json)
        evaluation.json       simulated + engine-measured acceptance, with the settings used

A rerun skips every finished stage: the cache when its index exists, a variant whose export
exists (after checking it was trained with the same arguments), an evaluation whose recorded
settings match. Training runs as a subprocess per variant, so each starts from a fresh process
(DeepSpeed state, allocator, threads) exactly as a user's `python train.py` would.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dspine_train.checkpoint_io import build_dir, clean_dead_builds, replace_dir
from dspine_train.evaluation.block_metrics import BlockResults
from scripts.tools.child_runs import run_logged

from .variants import Variant

FEATURES_DIR = "features"
TOKEN_TABLE = "token_table.safetensors"
REQUEST_FILE = "request.json"
EVALUATION_FILE = "evaluation.json"
BLOCKS_FILE = "simulated_blocks.npz"
EVERY_BLOCK = 10**9  # eval.max_blocks that no held-out split reaches: every block  # per-block results of the simulated evaluation
RUN_CONFIG = Path("hydra") / "config.yaml"


class AblationError(RuntimeError):
    """A stage of the ablation failed or its directory belongs to another setting."""


@dataclass
class AblationSettings:
    """What every variant shares: recipe, data, budget, seed and the evaluation.

    Attributes:
        out_dir: the ablation directory (see the module docstring).
        recipe: the `train.py` recipe every variant starts from.
        steps: optimizer steps of every trained variant.
        seed: the seed of every run (draft init, data order, anchors, replacement draws).
        overrides: Hydra overrides shared by every run and by the feature cache (target, data,
            batch size, anchors, ...), applied after the recipe and before a variant's switches.
        benches: benchmarks of the evaluation harness.
        temperatures: sampling temperatures of the engine evaluation.
        limit: prompts per benchmark.
        max_new_tokens: new tokens per prompt.
        num_draft_tokens: drafted tokens the target verifies per round (None: block size - 1).
        measure_ar: also run plain decoding (tokens/s, speedup, lossless check) per variant.
        eval_batch_size: prompts the engine decodes together (tau does not depend on it;
            tokens/s is then batched throughput, not single-sequence latency).
        eval_seed: seed of the prompt choice and of sampling in the engine evaluation.
        max_prompt_chars: benchmark prompts longer than this are left out (harness setting).
        features_override: an existing feature cache of the same data and recipe to read
            instead of `<out_dir>/features` (e.g. the demo's).
    """

    out_dir: Path
    recipe: str
    steps: int
    seed: int = 0
    overrides: list[str] = field(default_factory=list)
    benches: list[str] = field(default_factory=lambda: ["humaneval", "sharegpt"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    limit: int = 8
    max_new_tokens: int = 64
    num_draft_tokens: int | None = None
    measure_ar: bool = False
    eval_batch_size: int = 1
    eval_seed: int = 0
    max_prompt_chars: int | None = 2000
    features_override: Path | None = None

    @property
    def features_dir(self) -> Path:
        """The shared offline feature cache."""
        return self.features_override or self.out_dir / FEATURES_DIR

    def run_dir(self, variant: Variant) -> Path:
        """The variant's `train.py` output directory."""
        return self.out_dir / variant.name

    def export_dir(self, variant: Variant) -> Path:
        """The variant's exported draft."""
        return self.run_dir(variant) / "final"

    def shared_overrides(self) -> list[str]:
        """Overrides of every run and of the feature cache: recipe, seed, cache, user settings."""
        return [
            f"recipe={self.recipe}",
            f"seed={self.seed}",
            f"data.offline_features_dir={self.features_dir}",
            *self.overrides,
        ]

    def train_arguments(self, variant: Variant) -> list[str]:
        """The `train.py` arguments of a trained variant (its switches come last and win)."""
        return [
            *self.shared_overrides(),
            f"output_dir={self.run_dir(variant)}",
            f"model.token_table_path={self.out_dir / TOKEN_TABLE}",
            f"optim.max_steps={self.steps}",
            # evaluate once, at the end (the simulated tau of the table); checkpoint at the end
            # and every quarter, so an interrupted variant resumes instead of restarting
            "eval.every=0",
            # on every held-out block (paired across variants, with SEs: `block_metrics`)
            "eval.every_block=true",
            f"eval.max_blocks={EVERY_BLOCK}",
            f"checkpoint.every={max(1, self.steps // 4)}",
            "checkpoint.keep_last=1",
            "checkpoint.resume_from=latest",
            "logging.wandb=false",
            *variant.hydra_overrides(),
        ]

    def evaluation_request(self) -> dict[str, Any]:
        """The engine-evaluation settings recorded with (and checked against) each result."""
        return {k: getattr(self, k) for k in ("benches", "temperatures", "limit",
                                                "max_new_tokens", "num_draft_tokens",
                                                "measure_ar", "eval_batch_size", "eval_seed",
                                                "max_prompt_chars")}


def ensure_features(settings: AblationSettings) -> None:
    """Compute the target's features once into the shared cache (skipped when present)."""
    if (settings.features_dir / "train" / "index.json").is_file():
        print(f"[ablate] feature cache: reusing {settings.features_dir}")
        return
    print(f"[ablate] feature cache: running the target once -> {settings.features_dir}")
    run_logged([sys.executable, "-m", "dspine_train.training.cache_features",
                *settings.shared_overrides(),
                f"hydra.run.dir={settings.out_dir / '.hydra_cache_features'}"],
               settings.out_dir / "cache_features.log", "caching the target features",
               error=AblationError)


def _read_request(run_dir: Path) -> list[str] | None:
    path = run_dir / REQUEST_FILE
    return json.loads(path.read_text())["train_arguments"] if path.is_file() else None


def written_here(directory: Path) -> bool:
    """Whether the runner may use (and replace) `directory`: absent, an empty folder, or one
    holding its `request.json` (written before anything else goes in)."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        return False
    return (not directory.exists() or not any(directory.iterdir())
            or (directory / REQUEST_FILE).is_file())


def _differences(recorded: Sequence[str], arguments: Sequence[str]) -> str:
    """What differs between two `train.py` argument lists, as `key: old -> new`."""

    def pairs(items: Sequence[str]) -> dict[str, str]:
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in items)

    old, new = pairs(recorded), pairs(arguments)
    changed = [f"{key}: {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
               for key in [*old, *(k for k in new if k not in old)] if old.get(key) != new.get(key)]
    return "; ".join(changed) or "the same arguments in another order"


def check_run_dir(run_dir: Path, arguments: Sequence[str]) -> None:
    """Refuse a run directory that is not this runner's run of `arguments`.

    A directory holding anything without the runner's `request.json` is another run (a demo
    run, a hand-made folder): it is never reused as a variant's result, replaced or deleted.
    One whose `request.json` records other arguments is refused naming what differs.
    `AblationError` in one line, before anything is written.
    """
    if not written_here(run_dir):
        raise AblationError(
            f"{run_dir}: holds files this runner did not write (no {REQUEST_FILE} recording its "
            "train.py arguments), e.g. another training run; it is never reused or deleted: "
            "move it away or use another --out")
    recorded = _read_request(run_dir)
    if recorded is not None and recorded != list(arguments):
        raise AblationError(
            f"{run_dir} was trained with other arguments ({REQUEST_FILE} differs: "
            f"{_differences(recorded, arguments)}); delete it or use another --out")


def claim_run_dir(run_dir: Path, arguments: Sequence[str]) -> None:
    """`check_run_dir`, then record `arguments` in the directory's `request.json` (created
    with the directory, before anything else is written into it)."""
    check_run_dir(run_dir, arguments)
    if not (run_dir / REQUEST_FILE).is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / REQUEST_FILE).write_text(json.dumps({"train_arguments": list(arguments)},
                                                       indent=2))


def train_variant(
    settings: AblationSettings, variant: Variant, echo: bool = True, side_by_side: int = 1
) -> bool:
    """Train one variant with `train.py` unless its export exists; True when it trained.

    A directory trained with other arguments, or holding another run (no `request.json`), is
    refused (`check_run_dir`: never silently reused or overwritten). `echo=False` keeps the
    run's output in its log only; `side_by_side` (how many trainings share the machine) is
    recorded with the wall time.
    """
    run_dir, arguments = settings.run_dir(variant), settings.train_arguments(variant)
    claim_run_dir(run_dir, arguments)
    if (settings.export_dir(variant) / "config.json").is_file():
        print(f"[ablate] {variant.name}: export exists, skipping training")
        return False
    from dspine_train.training.checkpointing import STATE_FILE, complete_checkpoints

    # An interrupted run resumes from its last checkpoint (`checkpoint.resume_from=latest`).
    done = complete_checkpoints(run_dir / "checkpoints")
    resumed = json.loads((done[-1] / STATE_FILE).read_text())["step"] if done else 0
    print(f"[ablate] {variant.name}: training {settings.steps} steps ({variant.description})"
          + (f", resuming at step {resumed}" if resumed else ""))
    start = time.perf_counter()
    run_logged([sys.executable, "train.py", *arguments], run_dir / "train.log",
               f"training {variant.name}", echo=echo, error=AblationError)
    # the wall time of this session: the steps from `resumed_from_step` on
    timing = {"train_wall_s": time.perf_counter() - start, "resumed_from_step": resumed,
              "side_by_side": side_by_side, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    print(f"[ablate] {variant.name}: trained in {timing['train_wall_s']:.0f} s")
    (run_dir / "timing.json").write_text(json.dumps(timing, indent=2))
    return True


def derive_export(source: Path, destination: Path, switches: dict[str, Any]) -> None:
    """`destination`: the export at `source` with `switches` written into its config.json.

    Weights are hard-linked (copied where links are impossible); written to a temporary
    directory and swapped in, so the destination is always a whole export, never missing.
    """
    if not (source / "config.json").is_file():
        raise AblationError(f"{source}: no exported draft to derive from")
    clean_dead_builds(destination)
    tmp = build_dir(destination)
    try:
        for item in source.iterdir():
            if item.is_file() and item.name != "config.json":
                try:
                    os.link(item, tmp / item.name)
                except OSError:
                    shutil.copy2(item, tmp / item.name)
        config = json.loads((source / "config.json").read_text())
        config.update(switches)
        block = config.get("dspine_config")  # the format's derived copy (`dspine_train.formats`)
        if isinstance(block, dict):
            block.update({k: v for k, v in switches.items() if k in block})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, destination)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def derived_request(settings: AblationSettings, variant: Variant) -> list[str]:
    """What a derived variant's folder is made from, recorded as its `request.json`: the
    source variant's export and the switches written into it."""
    return [f"derived_from={settings.export_dir(_variant_named(variant.reuse))}",
            *variant.hydra_overrides()]


def prepare_variants(settings: AblationSettings, variants: Sequence[Variant], jobs: int = 1) -> None:
    """Train the trained variants (`jobs` at a time), then derive the others' exports.

    Every variant's folder is checked first (`check_run_dir`): one holding another run, or
    made with other arguments, is refused before anything trains. With `jobs` > 1 the runs'
    output goes to their logs only; the wall times of runs that shared the machine are not
    comparable, and the table says how many ran at once.
    """
    for variant in variants:
        check_run_dir(settings.run_dir(variant), settings.train_arguments(variant)
                      if variant.trained else derived_request(settings, variant))
    trained = [v for v in variants if v.trained]
    if jobs <= 1:
        for variant in trained:
            train_variant(settings, variant)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            # list(): re-raise the first failure here
            list(pool.map(lambda v: train_variant(settings, v, False, jobs), trained))
    for variant in variants:
        if variant.trained:
            continue
        source = settings.export_dir(_variant_named(variant.reuse))
        claim_run_dir(settings.run_dir(variant), derived_request(settings, variant))
        # Cheap (hard links + one small JSON), so always redone: it follows the source's weights.
        derive_export(source, settings.export_dir(variant), variant.switches)
        print(f"[ablate] {variant.name}: derived from {source} with {variant.switches}")


def _variant_named(name: str | None) -> Variant:
    from .variants import VARIANTS

    if name not in VARIANTS:
        raise AblationError(f"unknown variant {name!r}")
    return VARIANTS[name]


def source_run_dir(settings: AblationSettings, variant: Variant) -> Path:
    """The directory of the training run behind a variant's weights."""
    return settings.run_dir(_variant_named(variant.reuse) if variant.reuse else variant)


def evaluate_variant(
    settings: AblationSettings, variant: Variant, engine_eval: Callable[[Path], list[dict]]
) -> dict[str, Any]:
    """Simulated and engine-measured acceptance of the variant's export (cached on disk).

    `engine_eval(draft_dir) -> list[dict]` runs the evaluation harness on one export; it is
    injected so the caller decides how the target is loaded and shared between variants.
    """
    from .simulated import load_run_config, simulated_acceptance

    path = settings.run_dir(variant) / EVALUATION_FILE
    request = settings.evaluation_request()
    export = settings.export_dir(variant)
    weights_stamp = os.stat(export / "model.safetensors").st_mtime_ns
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("request") == request and cached.get("weights_mtime_ns") == weights_stamp:
            print(f"[ablate] {variant.name}: evaluation exists, skipping")
            return cached
    print(f"[ablate] {variant.name}: evaluating")
    config = load_run_config(source_run_dir(settings, variant) / RUN_CONFIG)
    start = time.perf_counter()
    stats = simulated_acceptance(export, config)
    simulated = None if stats is None else {
        "tau": stats.tau, "per_position": stats.position_rates(), "blocks": stats.blocks,
        "wall_s": time.perf_counter() - start,
    }
    if isinstance(stats, BlockResults):  # per block: SEs, and the records for paired diffs
        simulated.update(tau_se=stats.tau_se, tau_se_row=stats.tau_se_row)
        stats.save(settings.run_dir(variant) / BLOCKS_FILE)
    start = time.perf_counter()
    engine = engine_eval(export)
    result = {"request": request, "weights_mtime_ns": weights_stamp, "simulated": simulated,
              "engine": engine, "engine_wall_s": time.perf_counter() - start}
    path.write_text(json.dumps(result, indent=2))
    return result


def harness_evaluator(target: str, settings: AblationSettings,
                      ar_cache: dict | None = None) -> Callable[[Path], list[dict]]:
    """`export_dir -> [BenchResult as dict]`: the evaluation harness on one draft export.

    `ar_cache`: shared by the calls of one process on one machine, so plain decoding (which
    does not depend on the draft) runs once per benchmark (`harness.evaluate`).

    A failure (bad benchmark, incompatible draft, a prompt the caches cannot hold) becomes an
    `AblationError` naming the export.
    """
    from data_prep.benchmarks import load_benchmark
    from dspine_train.engine import CheckpointError, GenerationInputError, IncompatibleDraftError
    from dspine_train.evaluation import harness

    def run(export_dir: Path) -> list[dict]:
        try:
            benches = [load_benchmark(name, limit=settings.limit, seed=settings.eval_seed,
                                      max_prompt_chars=settings.max_prompt_chars)
                       for name in settings.benches]
            results = harness.evaluate(
                target, str(export_dir), benches, settings.temperatures,
                max_new_tokens=settings.max_new_tokens,
                num_draft_tokens=settings.num_draft_tokens, measure_ar=settings.measure_ar,
                seed=settings.eval_seed, batch_size=settings.eval_batch_size,
                ar_cache=ar_cache,
            )
        except (harness.BenchmarkError, CheckpointError, IncompatibleDraftError,
                GenerationInputError, ValueError) as err:
            raise AblationError(f"evaluating {export_dir}: {err}") from err
        return [asdict(r) for r in results]
    return run


def settings_record(settings: AblationSettings) -> dict[str, Any]:
    """The settings as JSON-ready values."""
    return {key: str(value) if isinstance(value, Path) else value
            for key, value in asdict(settings).items()}


def collect_row(
    settings: AblationSettings, variant: Variant, evaluation: dict[str, Any]
) -> dict[str, Any]:
    """One table row: the variant, the budget its weights were trained with (read back from
    the run's own saved config), its final losses and its evaluation."""
    from dspine_train.training.tracking import read_metrics

    from .report import final_losses
    from .simulated import load_run_config

    run_dir = source_run_dir(settings, variant)
    config = load_run_config(run_dir / RUN_CONFIG)
    history = read_metrics(run_dir / "metrics.jsonl")
    trainer_tau = [row["eval/tau"] for row in history if "eval/tau" in row]
    timing_path = run_dir / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    return {
        "variant": variant.name,
        "description": variant.description,
        "switches": variant.switches,
        "trained": variant.trained,
        "reuse": variant.reuse,
        "run": {
            "dir": str(run_dir),
            "recipe": config.name,
            "steps": config.optim.max_steps,
            "seed": config.seed,
            "train_path": config.data.train_path,
            "offline_features_dir": config.data.offline_features_dir,
            "batch_size": config.data.batch_size,
            "num_anchors": config.data.num_anchors,
            "max_length": config.data.max_length,
            "lr": config.optim.lr,
            "precision": config.precision.value,
        },
        "train_wall_s": timing.get("train_wall_s"),
        "resumed_from_step": timing.get("resumed_from_step", 0),
        "final_losses": final_losses(history, config.optim.max_steps),
        # the trainer evaluated the source variant's decode, not a derived one's
        "trainer_sim_tau": trainer_tau[-1] if trainer_tau and variant.trained else None,
        "simulated": evaluation["simulated"],
        "paired_vs_dspine": _paired_vs_dspine(settings, variant),
        "engine": evaluation["engine"],
    }


def _paired_vs_dspine(settings: AblationSettings, variant: Variant) -> dict[str, float] | None:
    """The variant's simulated tau minus `dspine`'s on the same held-out blocks, with SEs."""
    from dspine_train.evaluation.block_metrics import paired_difference

    mine = settings.run_dir(variant) / BLOCKS_FILE
    reference = settings.out_dir / "dspine" / BLOCKS_FILE
    if variant.name == "dspine" or not (mine.is_file() and reference.is_file()):
        return None
    try:
        return paired_difference(BlockResults.load(mine), BlockResults.load(reference))
    except ValueError:  # other blocks (another block size): no paired figure
        return None


BUDGET_KEYS = ("steps", "seed", "train_path", "offline_features_dir", "batch_size",
               "num_anchors", "max_length", "lr", "precision")


def same_budget(rows: list[dict[str, Any]]) -> bool:
    """Whether every row's weights were trained with the same data, budget and seed."""
    budgets = {tuple(row["run"][k] for k in BUDGET_KEYS) for row in rows}
    return len(budgets) == 1


def config_differences(settings: AblationSettings, variants: Sequence[Variant]) -> list[str]:
    """Keys of the trained runs' saved configs that differ, besides the variants' switches.

    Empty when the runs are identical except for what the ablation changes on purpose (a
    recipe edited between two runs would show up here).
    """
    from omegaconf import OmegaConf

    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for key, value in node.items():
                out.update(flat(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: node}

    trained = [v for v in variants if v.trained]
    switched = {f"model.{k}" for v in trained for k in v.switches}
    configs = []
    for variant in trained:
        config = flat(OmegaConf.to_container(OmegaConf.load(settings.run_dir(variant) / RUN_CONFIG)))
        for key in ["output_dir", *switched]:
            config.pop(key, None)
        configs.append(config)
    keys = sorted({k for c in configs for k in c})
    return [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
