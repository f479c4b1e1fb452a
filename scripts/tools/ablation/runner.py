"""The studies' runner: one shared feature cache, one `train.py` run per variant, evaluation.

Layout of a study directory `<out>/` (the ablation's; the training study adds its plan, archive
and report: `study`):

    features/                 the target's offline features, computed once, read by every run
    token_table.safetensors   the ablation's token table, built once (it depends only on the
                              target); the study's runs build their own
    <variant>/                a `train.py` output dir (metrics.jsonl, hydra/config.yaml, final/)
        request.json          the exact `train.py` arguments this directory was trained with
        sessions.json         wall time of every training session (a killed one included)
        final/                the exported draft (a derived variant: the source's weights with
                              its `model.<field>` overrides written into config.json)
        evaluation.json       the ablation's evaluation: simulated + engine-measured acceptance
        result.json           the study's final evaluation (`evaluate_final`)

A rerun skips every finished stage: the cache when its index exists, a variant whose export
exists (after checking it was trained with the same arguments), an evaluation recorded for the
same weights and settings; an interrupted training resumes from its last checkpoint. Training
runs as a subprocess per variant, so each starts from a fresh process (DeepSpeed state,
allocator, threads) exactly as a user's `python train.py` would.
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

from .records import Evaluation, Session
from .variants import Variant, variant_named

FEATURES_DIR = "features"
TOKEN_TABLE = "token_table.safetensors"
REQUEST_FILE = "request.json"
EVALUATION_FILE = "evaluation.json"
RESULT_FILE = "result.json"
SESSIONS_FILE = "sessions.json"
BLOCKS_FILE = "simulated_blocks.npz"  # per-block results of the simulated evaluation
EVERY_BLOCK = 10**9  # eval.max_blocks that no held-out split reaches: every block
RUN_CONFIG = Path("hydra") / "config.yaml"
# train.py arguments that say when to checkpoint, not what is trained: the trainer lets them
# change on resume (`checkpointing.RESUME_MAY_CHANGE`) and a run resumes exactly
# (tests/test_train_run.py), so they are left out when a run folder's arguments are compared
CHECKPOINT_ARGUMENTS = ("checkpoint.every=", "checkpoint.keep_last=", "checkpoint.resume_from=")


class StudyError(RuntimeError):
    """A stage of a study failed, a variant is misdefined, or a directory belongs to another
    setting; the message names it."""


@dataclass
class StudySettings:
    """What every variant of a study shares: recipe, data, budget, seed and the evaluation.

    The defaults are the training study's (`scripts/study.py`); the ablation
    (`scripts/ablate.py`) evaluates once at the end on every held-out block, checkpoints every
    quarter and shares one token table.

    Attributes:
        out_dir: the study directory (see the module docstring).
        recipe: the `train.py` recipe every variant starts from.
        steps: optimizer steps of every trained variant.
        seed: the seed of every run (draft init, data order, anchors, replacement draws).
        overrides: Hydra overrides shared by every run and by the feature cache (target, data,
            batch size, anchors, ...), applied after the recipe and before a variant's own.
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
        token_table: one token table every run shares (built by the first); None: each run
            builds its own (the SpecForge variant's token codes have another width).
        eval_every: optimizer steps between the trainer's evaluations (0: once, at the end).
        eval_max_blocks: blocks of the trainer's evaluations: a fixed uniform draw of the
            held-out blocks, the same for every variant and step (`EVERY_BLOCK`: all).
        checkpoint_every: optimizer steps between checkpoints (what a kill loses at most).
        final_max_blocks: blocks of the study's final evaluation (0: every held-out block; else
            a fixed uniform draw of that many, when there are more).
        plan_steps: steps of the short run that measures each variant's s/step.
        report_stem: the study report's path without suffix (default `<out_dir>/report`).
        command: the command line recorded in the report.
        archive_dir: where the study archives finished variants (`study`; default
            `<out_dir>/archive`).
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
    token_table: Path | None = None
    eval_every: int = 250
    eval_max_blocks: int = 4096
    checkpoint_every: int = 250
    final_max_blocks: int = 16384
    plan_steps: int = 4
    report_stem: Path | None = None
    command: str = ""
    archive_dir: Path | None = None

    @property
    def features_dir(self) -> Path:
        """The shared offline feature cache."""
        return self.features_override or self.out_dir / FEATURES_DIR

    @property
    def report_path(self) -> Path:
        """The study report's path without suffix."""
        return self.report_stem or self.out_dir / "report"

    @property
    def archive(self) -> Path:
        """The archive of finished study variants."""
        return self.archive_dir or self.out_dir / "archive"

    def archived_dir(self, variant: Variant) -> Path:
        """A variant's directory in the archive."""
        return self.archive / variant.name

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
        """The `train.py` arguments of a trained variant (its overrides come last and win)."""
        return [
            *self.shared_overrides(),
            f"output_dir={self.run_dir(variant)}",
            f"model.token_table_path={self.token_table or 'null'}",
            f"optim.max_steps={self.steps}",
            f"eval.every={self.eval_every}",
            # on every held-out block (paired across variants, with SEs: `block_metrics`)
            "eval.every_block=true",
            f"eval.max_blocks={self.eval_max_blocks}",
            # an interrupted variant resumes from its last checkpoint instead of restarting
            f"checkpoint.every={self.checkpoint_every}",
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


def ensure_features(settings: StudySettings) -> None:
    """Compute the target's features once into the shared cache (skipped when present)."""
    if (settings.features_dir / "train" / "index.json").is_file():
        print(f"[ablate] feature cache: reusing {settings.features_dir}")
        return
    print(f"[ablate] feature cache: running the target once -> {settings.features_dir}")
    run_logged([sys.executable, "-m", "dspine_train.training.cache_features",
                *settings.shared_overrides(),
                f"hydra.run.dir={settings.out_dir / '.hydra_cache_features'}"],
               settings.out_dir / "cache_features.log", "caching the target features",
               error=StudyError)


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
    One whose `request.json` records other arguments is refused naming what differs; the
    checkpoint schedule (`CHECKPOINT_ARGUMENTS`) may differ, so a run started checkpointing
    every 250 steps resumes checkpointing every 100. `StudyError` in one line, before anything
    is written.
    """
    if not written_here(run_dir):
        raise StudyError(
            f"{run_dir}: holds files this runner did not write (no {REQUEST_FILE} recording its "
            "train.py arguments), e.g. another training run; it is never reused or deleted: "
            "move it away or use another --out")
    recorded = _read_request(run_dir)
    if recorded is None:
        return
    old, new = trained_arguments(recorded), trained_arguments(arguments)
    if old != new:
        raise StudyError(
            f"{run_dir} was trained with other arguments ({REQUEST_FILE} differs: "
            f"{_differences(old, new)}); delete it or use another --out")


def trained_arguments(arguments: Sequence[str]) -> list[str]:
    """`arguments` without the checkpoint schedule (`CHECKPOINT_ARGUMENTS`)."""
    return [a for a in arguments if not a.startswith(CHECKPOINT_ARGUMENTS)]


def claim_run_dir(run_dir: Path, arguments: Sequence[str]) -> None:
    """`check_run_dir`, then record `arguments` in the directory's `request.json` (created
    with the directory, before anything else is written into it)."""
    check_run_dir(run_dir, arguments)
    if not (run_dir / REQUEST_FILE).is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / REQUEST_FILE).write_text(json.dumps({"train_arguments": list(arguments)},
                                                       indent=2))


def resume_step(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0 when none)."""
    from dspine_train.training.checkpointing import STATE_FILE, complete_checkpoints

    done = complete_checkpoints(run_dir / "checkpoints")
    return int(json.loads((done[-1] / STATE_FILE).read_text())["step"]) if done else 0


def sessions(run_dir: Path) -> list[Session]:
    """The training sessions of a run (`sessions.json`)."""
    path = run_dir / SESSIONS_FILE
    return ([Session.from_json(item) for item in json.loads(path.read_text())]
            if path.is_file() else [])


def _write_sessions(run_dir: Path, records: list[Session]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SESSIONS_FILE).write_text(json.dumps([s.to_json() for s in records], indent=2))


def training_wall_s(run_dir: Path) -> float:
    """Wall time of every training session of a run; a killed session (no end recorded)
    counts until its metrics file was last written."""
    total = 0.0
    metrics = run_dir / "metrics.jsonl"
    records = sessions(run_dir)
    for index, session in enumerate(records):
        end = session.end
        if end is None and index + 1 < len(records):  # killed, then resumed: at most until
            end = records[index + 1].start  # the next session started
        elif end is None and metrics.is_file():
            end = max(session.start, metrics.stat().st_mtime)
        total += (end or session.start) - session.start
    return total


def train_variant(
    settings: StudySettings, variant: Variant, echo: bool = True, side_by_side: int = 1
) -> bool:
    """Train one variant with `train.py` unless its export exists; True when it trained.

    A directory trained with other arguments, or holding another run (no `request.json`), is
    refused (`check_run_dir`: never silently reused or overwritten); its `request.json` is
    written first. An interrupted run resumes from its last checkpoint
    (`checkpoint.resume_from=latest`). Every session's wall time is recorded in
    `sessions.json`, a killed one's too; the last session's in `timing.json`. `echo=False`
    keeps the run's output in its log only; `side_by_side` (how many trainings share the
    machine) is recorded with the wall time.
    """
    run_dir, arguments = settings.run_dir(variant), settings.train_arguments(variant)
    claim_run_dir(run_dir, arguments)
    if (settings.export_dir(variant) / "config.json").is_file():
        print(f"[ablate] {variant.name}: export exists, skipping training")
        return False
    resumed = resume_step(run_dir)
    print(f"[ablate] {variant.name}: training {settings.steps} steps ({variant.description})"
          + (f", resuming at step {resumed}" if resumed else ""))
    records = sessions(run_dir)
    metrics = run_dir / "metrics.jsonl"
    for session in records:
        if session.end is None:  # killed: it ran until its last metrics line, which the
            # resumed run is about to rewrite
            last = metrics.stat().st_mtime if metrics.is_file() else session.start
            session.end, session.killed = max(session.start, last), True
    records.append(Session(time.time()))
    _write_sessions(run_dir, records)
    start = time.perf_counter()
    run_logged([sys.executable, "train.py", *arguments], run_dir / "train.log",
               f"training {variant.name}", echo=echo, error=StudyError)
    records[-1].end = time.time()
    _write_sessions(run_dir, records)
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
        raise StudyError(f"{source}: no exported draft to derive from")
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


def derived_request(settings: StudySettings, variant: Variant) -> list[str]:
    """What a derived variant's folder is made from, recorded as its `request.json`: the
    source variant's export and the overrides written into it."""
    return [f"derived_from={settings.export_dir(_source(variant))}", *variant.hydra_overrides()]


def prepare_variants(settings: StudySettings, variants: Sequence[Variant], jobs: int = 1) -> None:
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
        source = settings.export_dir(_source(variant))
        claim_run_dir(settings.run_dir(variant), derived_request(settings, variant))
        # Cheap (hard links + one small JSON), so always redone: it follows the source's weights.
        switches = variant.switches()
        derive_export(source, settings.export_dir(variant), switches)
        print(f"[ablate] {variant.name}: derived from {source} with {switches}")


def _source(variant: Variant) -> Variant:
    """The variant whose weights `variant` decodes (itself when trained)."""
    if variant.trained:
        return variant
    try:
        return variant_named(variant.reuse)
    except ValueError as err:
        raise StudyError(f"variant {variant.name}: {err}") from err


def source_run_dir(settings: StudySettings, variant: Variant) -> Path:
    """The directory of the training run behind a variant's weights."""
    return settings.run_dir(_source(variant))


def evaluate_variant(
    settings: StudySettings, variant: Variant, engine_eval: Callable[[Path], list[dict]]
) -> Evaluation:
    """Simulated and engine-measured acceptance of the variant's export, at the run's own
    evaluation settings (cached in `evaluation.json` for the same weights and request).

    `engine_eval(draft_dir) -> list[dict]` runs the evaluation harness on one export; it is
    injected so the caller decides how the target is loaded and shared between variants.
    """
    from .simulated import load_run_config, simulated_acceptance

    path = settings.run_dir(variant) / EVALUATION_FILE
    request = settings.evaluation_request()
    export = settings.export_dir(variant)
    weights_stamp = os.stat(export / "model.safetensors").st_mtime_ns
    if path.is_file():
        cached = Evaluation.from_json(json.loads(path.read_text()))
        if cached.request == request and cached.weights_mtime_ns == weights_stamp:
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
    result = Evaluation(weights_stamp, simulated, engine, time.perf_counter() - start, request)
    path.write_text(json.dumps(result.to_json(), indent=2))
    return result


def finished_result(settings: StudySettings, variant: Variant) -> Evaluation | None:
    """The variant's final evaluation (`evaluate_final`), when it exists for the current
    export."""
    path = settings.run_dir(variant) / RESULT_FILE
    weights = settings.export_dir(variant) / "model.safetensors"
    if not (path.is_file() and weights.is_file()):
        return None
    result = Evaluation.from_json(json.loads(path.read_text()))
    return result if result.weights_mtime_ns == weights.stat().st_mtime_ns else None


def evaluate_final(settings: StudySettings, variant: Variant,
                   engine_eval: Callable[[Path], list[dict]]) -> Evaluation:
    """The study's final evaluation: simulated tau on `final_max_blocks` held-out blocks and
    engine tau on held-out prompts (none when `limit` is 0); written to `result.json`."""
    from .simulated import load_run_config, simulated_acceptance

    run_dir = settings.run_dir(variant)
    export = settings.export_dir(variant)
    config = load_run_config(run_dir / RUN_CONFIG)
    start = time.perf_counter()
    blocks = simulated_acceptance(export, config, max_blocks=settings.final_max_blocks)
    if not isinstance(blocks, BlockResults):
        raise StudyError(f"{variant.name}: the run has no held-out split to evaluate "
                         "(data.eval_path / eval_split)")
    blocks.save(run_dir / BLOCKS_FILE)
    simulated_s = time.perf_counter() - start
    start = time.perf_counter()
    engine = engine_eval(export) if settings.limit > 0 else []
    result = Evaluation((export / "model.safetensors").stat().st_mtime_ns,
                        blocks.summary() | {"wall_s": simulated_s}, engine,
                        time.perf_counter() - start, settings.evaluation_request())
    (run_dir / RESULT_FILE).write_text(json.dumps(result.to_json(), indent=2, default=str))
    return result


def harness_evaluator(target: str, settings: StudySettings,
                      ar_cache: dict | None = None) -> Callable[[Path], list[dict]]:
    """`export_dir -> [BenchResult as dict]`: the evaluation harness on one draft export.

    `ar_cache`: shared by the calls of one process on one machine, so plain decoding (which
    does not depend on the draft) runs once per benchmark (`harness.evaluate`).

    A failure (bad benchmark, incompatible draft, a prompt the caches cannot hold) becomes an
    `StudyError` naming the export.
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
            raise StudyError(f"evaluating {export_dir}: {err}") from err
        return [asdict(r) for r in results]
    return run
