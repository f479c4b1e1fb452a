"""Running the training study in resumable pieces.

Layout of a study directory `<out>/` (`artifacts/study/run` by default):

    features/                 the target's offline features of the study data, computed once
    plan.json                 s/step of each variant, measured on a few steps (`plan/<variant>/`)
    <variant>/                a `train.py` output dir: metrics.jsonl (loss terms, coverage, and
                              eval/tau with its SEs every `eval_every` steps), eval_blocks/
                              (per-block results of each evaluation), checkpoints/, final/
        request.json          the exact `train.py` arguments, written first: the folder is
                              reused only with it and for the same arguments (a folder without
                              it, e.g. another run, or a rerun with others is refused; the
                              study never deletes a folder it did not write, `plan/` included)
        sessions.json         wall time of every training session (a killed one included)
        result.json           the final evaluation: simulated tau on every held-out block,
                              engine tau on held-out prompts with the lossless check
    report.{md,json,png}      rewritten after every finished variant (also `--report-stem`)

The *archive* (`<out>/archive` by default; the real study's is committed under
`docs/results/`, because a working session keeps only what is committed) holds what the
report needs of each finished variant and nothing machine-specific:

    <archive>/<variant>/record.json          the report's record of the variant, with the
                                             request it answers (`study_request`)
    <archive>/<variant>/simulated_blocks.npz the final per-block results (paired differences)
    <archive>/<variant>/eval_blocks/*.npz    the per-block results of each periodic evaluation

A rerun skips archived variants (refusing one archived with another request), archives a
variant finished here but not archived yet (its `result.json` for the same export), resumes a
killed one from its last checkpoint (`checkpoint.resume_from=latest`: the trainer's exact
resume), and rewrites the report from every archived variant. Nothing here depends on the
study's size: the smoke run (`scripts/study.py run --smoke`) is the same code on a few steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspine_train.evaluation.block_metrics import BlockResults, paired_difference
from dspine_train.training.config import compose_train_config
from scripts.tools import REPO

from .records import Evaluation, StudyRecord
from .runner import (
    BLOCKS_FILE,
    RUN_CONFIG,
    StudyError,
    StudySettings,
    check_run_dir,
    ensure_features,
    evaluate_final,
    finished_result,
    harness_evaluator,
    sessions,
    train_variant,
    trained_arguments,
    training_wall_s,
)
from .study_plan import check_plan_dir, measure_plan, plan_lines
from .variants import REFERENCE, STUDY, VARIANTS, Variant

RECORD_FILE = "record.json"
FINDINGS_FILE = "findings.md"  # hand-written reading of the report, beside the archive
STEP_TIMES_FILE = "step_times.json"  # `study.py steps`, beside the archive
EVAL_BLOCKS_DIR = "eval_blocks"
# plain decoding of the engine evaluation's prompts, run once per process: it does not depend
# on the draft, and the variants of one session run alone on one machine
PLAIN_DECODING: dict = {}
# train.py arguments that name this machine's paths, not what is trained (left out of requests)
PATH_ARGUMENTS = ("output_dir=", "model.target_path=", "data.train_path=",
                  "data.offline_features_dir=")


# ------------------------------------------------------------------------- variant checks
def check_variant_overrides(settings: StudySettings, variants: Sequence[Variant]) -> None:
    """Compose every variant's config and derive its draft config, before anything trains.

    Raises `StudyError` naming the variant and the first problem (an override key the schema
    lacks, e.g. a setting not merged yet, or a value the draft refuses).
    """
    from dspine_train.training.inputs import draft_config_for
    from dspine_train.training.target import (
        load_target_config,
        load_target_tokenizer,
        used_vocab_size,
    )

    problems = []
    for variant in variants:
        try:
            config = compose_train_config(*settings.train_arguments(variant))
            m = config.model
            target = load_target_config(m.target_path, m.trust_remote_code)
            used = used_vocab_size(m.target_path, target.vocab_size, m.used_vocab_size)
            tokenizer = load_target_tokenizer(m.target_path) if used >= target.vocab_size else None
            draft_config_for(m, target, used, tokenizer)
        except Exception as err:  # noqa: BLE001 -- any failure is reported by variant name
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            problems.append(f"variant {variant.name} ({' '.join(variant.overrides)}): {first}")
    if problems:
        raise StudyError("the study cannot start, fix these variants first:\n  "
                         + "\n  ".join(problems))


# ------------------------------------------------------------------------- records
def curve(run_dir: Path) -> list[dict[str, Any]]:
    """The learning curve: each evaluation's metrics, with the training terms logged at or
    just before that step (loss terms, candidate coverage)."""
    from dspine_train.training.tracking import read_metrics

    history = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() \
        else []
    train = [row for row in history if "loss" in row]
    points = []
    for row in history:
        if "eval/tau" not in row:
            continue
        before = [t for t in train if t["step"] <= row["step"]]
        point = {k.removeprefix("eval/"): v for k, v in row.items()}
        if before:
            point["train"] = {k: v for k, v in before[-1].items() if k != "step"}
        points.append(point)
    return points


def paired_by_step(run_dir: Path, reference_dir: Path) -> dict[int, dict[str, float]]:
    """Paired difference to the reference at every evaluation both ran on the same blocks."""
    out = {}
    for path in sorted((run_dir / EVAL_BLOCKS_DIR).glob("step*.npz")):
        other = reference_dir / EVAL_BLOCKS_DIR / path.name
        if other.is_file():
            try:
                out[int(path.stem[4:])] = paired_difference(BlockResults.load(path),
                                                            BlockResults.load(other))
            except ValueError:
                continue  # other blocks (another block size): not paired
    return out


def variant_record(settings: StudySettings, variant: Variant,
                   result: Evaluation) -> StudyRecord:
    """Everything the report shows about one finished variant (paired differences are added
    from the archive when the report is written: `with_pairs`)."""
    from dspine_train.training.tracking import read_metrics

    from .report import final_losses
    from .simulated import load_run_config

    run_dir = settings.run_dir(variant)
    config = load_run_config(run_dir / RUN_CONFIG)
    history = read_metrics(run_dir / "metrics.jsonl")
    return StudyRecord(
        variant=variant.name, description=variant.description,
        overrides=list(variant.overrides),
        steps=config.optim.max_steps, seed=config.seed,
        batch_size=config.data.batch_size, precision=config.precision.value,
        block_size=BlockResults.load(run_dir / BLOCKS_FILE).block_size,  # DSpark drafts B
        train_wall_s=training_wall_s(run_dir), sessions=len(sessions(run_dir)),
        final_losses=final_losses(history, config.optim.max_steps),
        curve=curve(run_dir), simulated=result.simulated, engine=result.engine,
        engine_wall_s=result.engine_wall_s)


def with_pairs(archive: Path, record: StudyRecord) -> StudyRecord:
    """The record plus its paired differences to the reference (final blocks and every
    periodic evaluation), read from the per-block results in `archive`."""
    if record.variant == REFERENCE:
        return record
    own, reference = archive / record.variant, archive / REFERENCE
    if not (reference / BLOCKS_FILE).is_file():
        return record  # the reference is not finished yet
    try:
        paired = paired_difference(BlockResults.load(own / BLOCKS_FILE),
                                   BlockResults.load(reference / BLOCKS_FILE))
    except ValueError as err:
        paired = {"error": str(err)}
    return dataclasses.replace(record, paired_vs_reference=paired, paired_curve={
        str(k): v for k, v in paired_by_step(own, reference).items()})


# ------------------------------------------------------------------------- the archive
def study_request(settings: StudySettings, variant: Variant, data: str) -> dict[str, Any]:
    """What decides a variant's archived result, without this machine's paths: its `train.py`
    arguments, the final evaluation's settings and `data`, the study data's rows and tokens
    (`report.data_summary` of the training data)."""
    engine = dict(settings.evaluation_request())
    engine["benches"] = [Path(b).name for b in engine["benches"]]
    return {"train": result_arguments(settings.train_arguments(variant)),
            "final_max_blocks": settings.final_max_blocks, "engine": engine, "data": data}


def result_arguments(arguments: Sequence[str]) -> list[str]:
    """The `train.py` arguments that decide a variant's result: all but this machine's paths
    and the checkpoint schedule."""
    return [a for a in trained_arguments(arguments) if not a.startswith(PATH_ARGUMENTS)]


def archived_record(settings: StudySettings, variant: Variant,
                    request: dict[str, Any]) -> StudyRecord | None:
    """The variant's archived record, or None when it is not archived.

    Raises `StudyError` when it was archived for another request (naming what differs): its
    result would not be this study's.
    """
    path = settings.archived_dir(variant) / RECORD_FILE
    if not path.is_file():
        return None
    record = StudyRecord.from_json(json.loads(path.read_text()))
    archived = dict(record.request or {})
    if "train" in archived:  # archived before the checkpoint schedule was left out
        archived["train"] = result_arguments(archived["train"])
    if archived != request:
        changed = [f"{k}: {archived.get(k)!r} -> {request[k]!r}" for k in request
                   if archived.get(k) != request[k]]
        raise StudyError(f"{path}: {variant.name} was archived for another request "
                         f"({'; '.join(changed)}); run with that request, or delete "
                         f"{path.parent} to redo the variant")
    return record


def archive_variant(settings: StudySettings, variant: Variant, record: StudyRecord,
                    request: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Copy a finished variant's record and per-block results into the archive (the record
    last, so an interrupted copy leaves the variant unarchived)."""
    from dspine_train.checkpoint_io import write_json_atomic

    run_dir, target = settings.run_dir(variant), settings.archived_dir(variant)
    shutil.rmtree(target, ignore_errors=True)
    (target / EVAL_BLOCKS_DIR).mkdir(parents=True)
    shutil.copy2(run_dir / BLOCKS_FILE, target / BLOCKS_FILE)
    for path in sorted((run_dir / EVAL_BLOCKS_DIR).glob("step*.npz")):
        shutil.copy2(path, target / EVAL_BLOCKS_DIR / path.name)
    session = {k: meta.get(k) for k in ("commit", "dirty", "machine", "date", "command",
                                        "features_digest")}
    session["s_per_step_plan"] = meta.get("plan", {}).get(variant.name, {}).get("s_per_step")
    write_json_atomic(target / RECORD_FILE, dataclasses.replace(
        record, request=request, session=session).to_json(), default=str)
    return target


def features_digest(features_dir: Path, head_bytes: int = 64 << 20) -> str:
    """A fingerprint of the feature cache's content: sha256 over each split's index and the
    first `head_bytes` of each shard (the first rows' features). Recorded with every archived
    variant, so pieces of the study run in different sessions show whether their rebuilt
    caches hold the same values."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(features_dir.glob("*/*")):
        if path.name == "index.json" or path.suffix == ".safetensors":
            with open(path, "rb") as handle:
                digest.update(path.relative_to(features_dir).as_posix().encode())
                digest.update(handle.read(head_bytes))
    return digest.hexdigest()


def machine() -> dict[str, Any]:
    """The machine the study ran on, as the report records it."""
    import torch

    from dspine_train.cpu_bf16 import resolve_bf16_matmul

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "omp_num_threads":
            os.environ.get("OMP_NUM_THREADS"), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform(),
            # how this machine's bf16 products ran (`cpu_bf16_matmul=auto`, the study's setting)
            "bf16_matmul": resolve_bf16_matmul("auto", torch.device(
                "cuda" if torch.cuda.is_available() else "cpu")).value}


def data_meta(settings: StudySettings) -> dict[str, Any] | None:
    """The study data's meta.json (settings, regeneration dtype, stage wall times), if any."""
    from .report import data_summary

    config = compose_train_config(*settings.shared_overrides())
    meta_path = Path(config.data.train_path).parent.parent / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    return {"train_path": config.data.train_path, "splits": data_summary(config.data.train_path),
            "meta": meta}


def rewrite_report(archive: Path, stem: Path) -> list[Path]:
    """Rewrite the report `<stem>.{md,json,png}` from the archive alone (after editing the
    findings, or to check that the committed report is the archive's): every archived study
    variant in the report's order, under the header (`meta`) of the report's last piece.
    Nothing trains or evaluates; the request check is `run`'s."""
    from .study_report import target_title, write_study_report

    previous = stem.with_name(stem.name + ".json")
    if not previous.is_file():
        raise StudyError(f"{previous}: no report to rewrite; `study.py run` writes the first")
    meta = json.loads(previous.read_text())["meta"]
    meta["study_variants"] = study_variant_names([])
    if "target_title" not in meta and Path(meta.get("target", "")).is_dir():  # older pieces
        meta["target_title"] = target_title(meta["target"])
    records = [with_pairs(archive, StudyRecord.from_json(
        json.loads((archive / name / RECORD_FILE).read_text())))
               for name in STUDY.rows if (archive / name / RECORD_FILE).is_file()]
    if not records:
        raise StudyError(f"{archive}: no archived variant (no */{RECORD_FILE})")
    return write_study_report(records, meta, stem, archive.parent / FINDINGS_FILE,
                              archive.parent / STEP_TIMES_FILE)


# ------------------------------------------------------------------------- the study
def study_variant_names(variants: Sequence[Variant]) -> list[str]:
    """The study's rows in report order: every non-optional variant and the ones chosen."""
    chosen = {v.name for v in variants}
    return [name for name in STUDY.rows if name not in STUDY.optional or name in chosen]


def report_variants(settings: StudySettings, variants: Sequence[Variant]
                    ) -> list[Variant]:
    """The report's rows: the variants run now plus every other study variant already in the
    archive, in the report's order (a piece run with `--variants` keeps the earlier rows)."""
    chosen = {v.name: v for v in variants}
    rows = [chosen.get(name, VARIANTS[name]) for name in STUDY.rows]
    rows += [v for v in variants if v.name not in STUDY.rows]
    return [v for v in rows
            if v.name in chosen or (settings.archived_dir(v) / RECORD_FILE).is_file()]


def check_variant_dirs(settings: StudySettings, variants: Sequence[Variant]) -> None:
    """Before anything runs: every variant still to run (not archived) has no folder, or the
    study's own for the same `train.py` arguments (its `request.json`), and a plan folder the
    study wrote. A foreign folder (another run's export, metrics, ...) or another request is
    refused in one line naming the folder and what differs; nothing is reused or deleted."""
    for variant in variants:
        if (settings.archived_dir(variant) / RECORD_FILE).is_file():
            continue  # its result comes from the archive; the run folder is not read
        check_run_dir(settings.run_dir(variant), settings.train_arguments(variant))
        check_plan_dir(settings, variant)


def run_study(settings: StudySettings, variants: Sequence[Variant], *,
              target: str, stop_after: int | None = None) -> list[Path]:
    """Every variant in turn: plan, train (skip/resume), final evaluation, report.

    `stop_after`: stop after that many variants were finished in this session (a piece of
    the study that fits a session); the rest follow on the next run.
    """
    from .report import git_commit
    from .study_report import target_title, write_study_report

    check_variant_overrides(settings, variants)
    check_variant_dirs(settings, variants)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    ensure_features(settings)
    plan = measure_plan(settings, variants, lambda v: (
        (settings.archived_dir(v) / RECORD_FILE).is_file()
        or finished_result(settings, v) is not None))
    for line in plan_lines(settings, variants, plan):
        print(f"[study] {line}", flush=True)
    commit, dirty = git_commit(REPO)
    data = data_meta(settings)
    meta = {"target": target, "target_title": target_title(target),
            "command": settings.command, "commit": commit, "dirty": dirty,
            "machine": machine(), "settings": {k: str(v) for k, v in vars(settings).items()},
            "plan": plan, "data": data, "reference": REFERENCE,
            "features_digest": features_digest(settings.features_dir),
            "study_variants": study_variant_names(variants),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    done_now = 0
    written: list[Path] = []
    splits = (data or {}).get("splits", "")
    shown = report_variants(settings, variants)
    requests = {v.name: study_request(settings, v, splits) for v in shown}
    for variant in variants:
        request = requests[variant.name]
        if archived_record(settings, variant, request) is not None:
            print(f"[study] {variant.name}: archived in {settings.archived_dir(variant)}, "
                  "skipping", flush=True)
        else:
            # a result counts only in the study's own folder for this request
            check_run_dir(settings.run_dir(variant), settings.train_arguments(variant))
            result = finished_result(settings, variant)
            if result is None:
                train_variant(settings, variant)
                print(f"[study] {variant.name}: final evaluation", flush=True)
                result = evaluate_final(settings, variant, lambda export: harness_evaluator(
                    target, settings, PLAIN_DECODING)(export))
            done_now += 1
            where = archive_variant(settings, variant, variant_record(settings, variant, result),
                                    request, meta)
            print(f"[study] {variant.name}: archived in {where}", flush=True)
        # the report grows by each archived variant (in the variants' order)
        records = [with_pairs(settings.archive, r) for v in shown
                   if (r := archived_record(settings, v, requests[v.name])) is not None]
        written = write_study_report(records, meta, settings.report_path,
                                     settings.archive.parent / FINDINGS_FILE,
                                     settings.archive.parent / STEP_TIMES_FILE)
        print(f"[study] report: {settings.report_path}.md ({len(records)} variant(s))",
              flush=True)
        if stop_after is not None and done_now >= stop_after:
            print(f"[study] stopping after {done_now} variant(s) (--stop-after)")
            break
    return written
