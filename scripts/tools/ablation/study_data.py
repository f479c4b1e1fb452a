"""The study's data : prompts, the target's answers, token data, held-out sets.

Layout of a study data directory `<data>/` (`artifacts/study/data` by default):

    prompts/train.jsonl        single-turn training prompts: ShareGPT train part + HumanEval train
    prompts/heldout.jsonl      single-turn held-out prompts (never trained on), both sources
    bench/humaneval.jsonl      held-out HumanEval prompts, one `{"id", "messages"}` a line: the
    bench/sharegpt.jsonl       engine evaluation reads them (`data_prep.benchmarks.load_benchmark`)
    split.json                 every split setting and the ids of each part
    regenerated/{train,heldout}/  the target's greedy answers (resumable JSONL shards)
    tokenized/{train,heldout}/    chat template + loss masks of each part (eval_fraction 0)
    tokenized/study/           one DatasetDict: `train` = the train part, `eval` = the held-out
                               part; the trainer and the feature cache read this one
    meta.json                  settings (dtype of the regeneration included) and wall time of
                               every stage

The target's answers are the expensive part of the data and a working session keeps
nothing but what is committed, so each finished part is also packed into an *answers archive*
(`<answers_dir>/<part>.jsonl.gz` + `manifest.json`, committed under `docs/results/`). A later
run on a fresh checkout restores the answers from it instead of regenerating them, after
checking that the target (its assembly record), the generation settings and the prompt ids
are the same.

Held-out splits: HumanEval holds out `humaneval_heldout_fraction` (0.62: ~100 of 164 tasks) by
the data pipeline's stable id hash; ShareGPT keeps its data recipe's split (0.01, seed 0). Both
use the salt `heldout` and seed 0 of `recipes/data/default_target_*.yaml`, and a larger
fraction holds out a superset, so the demo's builtin benchmarks (HumanEval 0.25) are held out
here too. Each stage skips itself when done (regeneration resumes row by row).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dspine_train.checkpoint_io import write_json_atomic


@dataclass
class StudyDataSettings:
    """What the study's data is made of.

    Attributes:
        data_dir: the study data directory (module docstring).
        target: the target model directory (answers every prompt).
        sharegpt_train: ShareGPT training prompts (stable subset of the train part).
        sharegpt_heldout: ShareGPT held-out prompts regenerated (simulated tau, engine eval).
        humaneval_heldout_fraction: share of the HumanEval tasks held out (all are used).
        max_prompt_chars: leave out longer prompts (CPU time grows with length).
        max_new_tokens: tokens the target generates per answer (greedy).
        regen_dtype: dtype of the target during regeneration; bfloat16 decodes ~6x faster
            than float32 on an avx512_bf16 CPU (measured 2026-12-02), answers are greedy.
        regen_batch_size: answers generated together.
        max_length: tokens per tokenised row (longer rows keep their start).
        seed: the split seed (the data recipes' 0).
        answers_dir: the answers archive (module docstring); None: neither packed nor restored.
    """

    data_dir: Path
    target: Path
    sharegpt_train: int = 1000
    sharegpt_heldout: int = 128
    humaneval_heldout_fraction: float = 0.62
    max_prompt_chars: int = 1500
    max_new_tokens: int = 256
    regen_dtype: str = "bfloat16"
    regen_batch_size: int = 16
    max_length: int = 1024
    seed: int = 0
    answers_dir: Path | None = None

    def path(self, *parts: str) -> Path:
        """A path under the data directory."""
        return self.data_dir.joinpath(*parts)

    @property
    def train_dataset(self) -> Path:
        """The DatasetDict the trainer reads (`train` and held-out `eval`)."""
        return self.path("tokenized", "study")

    def bench_files(self) -> dict[str, Path]:
        """The held-out prompt files of the engine evaluation, by benchmark name."""
        return {name: self.path("bench", f"{name}.jsonl") for name in ("humaneval", "sharegpt")}


PARTS = ("train", "heldout")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    from dspine_train.checkpoint_io import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _read_meta(settings: StudyDataSettings) -> dict[str, Any]:
    try:
        return json.loads(settings.path("meta.json").read_text())
    except (OSError, ValueError):
        return {}


def _record_stage(settings: StudyDataSettings, stage: str, record: dict[str, Any]) -> None:
    """Write a finished stage (with its wall time) into meta.json."""
    meta = _read_meta(settings)
    meta["settings"] = {k: str(v) if isinstance(v, Path) else v
                        for k, v in asdict(settings).items()}
    meta.setdefault("stages", {})[stage] = record
    write_json_atomic(settings.path("meta.json"), meta, default=str)


def _timed(settings: StudyDataSettings, stage: str,
           work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a stage, recording its result and wall time (a resumed stage adds up its runs)."""
    start = time.time()
    previous = _read_meta(settings).get("stages", {}).get(stage, {})

    def record(result: dict[str, Any]) -> dict[str, Any]:
        seconds = round(time.time() - start, 1)
        result["wall_s"] = seconds
        result["wall_s_total"] = round(previous.get("wall_s_total", 0.0) + seconds, 1)
        _record_stage(settings, stage, result)
        return result

    try:
        return record(work())
    except BaseException:  # killed or failed: keep the time spent, the next run resumes
        record({"incomplete": True})
        raise


def make_prompts(settings: StudyDataSettings) -> dict[str, Any]:
    """Write prompts/{train,heldout}.jsonl, bench/*.jsonl and split.json (stable, idempotent)."""
    from data_prep.benchmarks import builtin_source, prompt_chars, prompt_messages
    from data_prep.config import BuiltinSource, SourceConfig, SourcePart
    from data_prep.sources import load_source, stable_subset

    sources = {
        "humaneval": SourceConfig(builtin=BuiltinSource.humaneval, seed=settings.seed,
                                  heldout_fraction=settings.humaneval_heldout_fraction),
        "sharegpt": builtin_source("sharegpt"),
    }
    counts = {"humaneval": {"train": None, "heldout": None},
              "sharegpt": {"train": settings.sharegpt_train, "heldout": settings.sharegpt_heldout}}
    parts: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": []}
    split: dict[str, Any] = {}
    for name, base in sources.items():
        split[name] = {"heldout_fraction": base.heldout_fraction, "split_seed": base.seed,
                       "split_salt": "heldout", "max_prompt_chars": settings.max_prompt_chars}
        for part in PARTS:
            config = SourceConfig(builtin=base.builtin, heldout_fraction=base.heldout_fraction,
                                  seed=base.seed, part=SourcePart(part))
            rows = [{"id": r["id"], "messages": prompt_messages(r)}
                    for r in load_source(config).rows]
            rows = [r for r in rows if prompt_chars(r["messages"]) <= settings.max_prompt_chars]
            picked = stable_subset(rows, counts[name][part], settings.seed)  # type: ignore[arg-type]
            parts[part].extend(picked)
            split[name][part] = {"eligible": len(rows), "used": len(picked),
                                 "ids": [r["id"] for r in picked]}
            if part == "heldout":
                _write_jsonl(settings.bench_files()[name], picked)
    train_ids = {r["id"] for r in parts["train"]}
    leaked = [r["id"] for r in parts["heldout"] if r["id"] in train_ids]
    if leaked:  # cannot happen with one hash per source; checked because it would void the study
        raise RuntimeError(f"held-out prompts also in train: {leaked[:5]}")
    for part in PARTS:
        _write_jsonl(settings.path("prompts", f"{part}.jsonl"), parts[part])
    write_json_atomic(settings.path("split.json"), split)
    return {name: {part: split[name][part]["used"] for part in PARTS} for name in split}


def regenerate(settings: StudyDataSettings, part: str) -> dict[str, Any]:
    """The target answers every prompt of `part` greedily (resumes: done rows are skipped)."""
    from data_prep.regenerate import run_regeneration, summary_line

    report = run_regeneration(greedy_job(settings, part))
    print(summary_line(report), flush=True)
    if report["pending"] or report["failed"]:
        raise RuntimeError(f"regeneration of {part} is incomplete: {summary_line(report)}; "
                           "rerun to resume")
    return {k: report[k] for k in ("input", "done", "failed", "skipped", "completion_tokens",
                                   "done_this_run")} | {"dtype": settings.regen_dtype}


ANSWERS_MANIFEST = "manifest.json"


def target_identity(target: Path) -> dict[str, Any]:
    """What identifies the target's weights: the embedded target's assembly record (the GGUF's
    sha256, conversion version and dtype), else its config.json's architecture and sizes."""
    assembly = target / "assembly.json"
    if assembly.is_file():
        record = json.loads(assembly.read_text())
        return {k: record.get(k) for k in ("gguf_sha256", "conversion_version", "dtype")}
    config = json.loads((target / "config.json").read_text())
    return {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers",
                                       "vocab_size", "torch_dtype")}


def _generation_settings(recorded: dict[str, Any]) -> dict[str, Any]:
    """The parts of a `regenerate_settings.json` that decide the answers (not the model's path)."""
    return {k: v for k, v in recorded.items() if k != "model"}


def _row_ids(jsonl: str) -> list[str]:
    """The `id` of every row of a JSONL text."""
    return [json.loads(line)["id"] for line in jsonl.splitlines() if line.strip()]


def _prompt_ids(settings: StudyDataSettings, part: str) -> list[str]:
    return _row_ids(settings.path("prompts", f"{part}.jsonl").read_text())


def archive_answers(settings: StudyDataSettings, part: str, stage: dict[str, Any]) -> Path | None:
    """Pack a finished part's answers into the archive (skipped when it holds them already).

    Returns the written file, or None when there is no archive or it holds the part.
    """
    import gzip
    import hashlib

    from data_prep.regenerate import SETTINGS_FILE
    from data_prep.shards import shard_paths

    if settings.answers_dir is None:
        return None
    manifest_path = settings.answers_dir / ANSWERS_MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if part in manifest.get("parts", {}):
        return None
    source = settings.path("regenerated", part)
    text = "".join(path.read_text(encoding="utf-8") for path in shard_paths(source))
    rows = _row_ids(text)
    if sorted(rows) != sorted(_prompt_ids(settings, part)):
        raise RuntimeError(f"{source}: the answers do not cover prompts/{part}.jsonl exactly "
                           f"({len(rows)} answers); not archived")
    raw = text.encode("utf-8")
    target = settings.answers_dir / f"{part}.jsonl.gz"
    from dspine_train.checkpoint_io import write_bytes_atomic

    write_bytes_atomic(target, gzip.compress(raw, compresslevel=9, mtime=0))
    recorded = json.loads((source / SETTINGS_FILE).read_text())
    manifest.setdefault("target", target_identity(settings.target))
    manifest.setdefault("parts", {})[part] = {
        "file": target.name, "rows": len(rows), "sha256": hashlib.sha256(raw).hexdigest(),
        "generation": _generation_settings(recorded),
        "stage": {k: v for k, v in stage.items() if k != "restored_from"}}
    write_json_atomic(manifest_path, manifest)
    return target


def restore_answers(settings: StudyDataSettings, part: str) -> dict[str, Any] | None:
    """Unpack a part's answers from the archive into `regenerated/<part>/` instead of
    generating them; None when there is no archive entry or answers exist there already.

    Raises `RuntimeError` naming the archive and what differs (another target, other
    generation settings, other prompts, a corrupt file): nothing is written then.
    """
    import gzip
    import hashlib

    from data_prep.backends import backend_identity
    from data_prep.regenerate import SETTINGS_FILE
    from data_prep.shards import SHARD_PREFIX, SHARD_SUFFIX, shard_paths

    if settings.answers_dir is None:
        return None
    manifest_path = settings.answers_dir / ANSWERS_MANIFEST
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    entry = manifest.get("parts", {}).get(part)
    output = settings.path("regenerated", part)
    if entry is None or shard_paths(output):
        return None
    where = f"answers archive {manifest_path}"
    if manifest.get("target") != target_identity(settings.target):
        raise RuntimeError(f"{where}: made with another target ({manifest.get('target')}; "
                           f"{settings.target}: {target_identity(settings.target)})")
    job = greedy_job(settings, part)
    current = json.loads(json.dumps({**backend_identity(job.regenerate),
                                     "sampling": asdict(job.regenerate.sampling)}, default=str))
    if entry["generation"] != _generation_settings(current):
        raise RuntimeError(f"{where}: {part} was generated with {entry['generation']}, this run "
                           f"asks for {_generation_settings(current)}")
    raw = gzip.decompress((settings.answers_dir / entry["file"]).read_bytes())
    if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise RuntimeError(f"{where}: {entry['file']} does not match its sha256")
    text = raw.decode("utf-8")
    ids, prompts = _row_ids(text), _prompt_ids(settings, part)
    if sorted(ids) != sorted(prompts):
        raise RuntimeError(f"{where}: {part} answers {len(ids)} prompts, not exactly the "
                           f"{len(prompts)} of prompts/{part}.jsonl")
    from dspine_train.checkpoint_io import write_text_atomic

    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / SETTINGS_FILE, current)
    write_text_atomic(output / f"{SHARD_PREFIX}00000{SHARD_SUFFIX}", text)
    return dict(entry["stage"], restored_from=str(settings.answers_dir / entry["file"]))


def greedy_job(settings: StudyDataSettings, part: str) -> Any:
    """The regeneration job of a part (`data_prep.regenerate.greedy_local_job`)."""
    from data_prep.regenerate import greedy_local_job

    return greedy_local_job(
        settings.path("prompts", f"{part}.jsonl"), settings.target,
        settings.path("regenerated", part), max_new_tokens=settings.max_new_tokens,
        batch_size=settings.regen_batch_size, dtype=settings.regen_dtype, shard_size=64)


def tokenize(settings: StudyDataSettings) -> dict[str, Any]:
    """Tokenise both parts; assemble `tokenized/study` (train part -> `train`, held-out -> `eval`)."""
    from datasets import DatasetDict, load_from_disk
    from transformers import AutoTokenizer

    from data_prep.shards import shard_paths
    from data_prep.tokenize import MARKER, REPORT_FILE, SPLITS_FILE, TOOL, tokenize_files
    from dspine_train.checkpoint_io import build_dir, clean_dead_builds, replace_dir
    from dspine_train.owned_dir import write_marker

    tokenizer = AutoTokenizer.from_pretrained(str(settings.target))
    reports = {}
    for part in PARTS:
        reports[part] = tokenize_files(shard_paths(settings.path("regenerated", part)), tokenizer,
                                       settings.path("tokenized", part),
                                       max_length=settings.max_length, eval_fraction=0.0,
                                       seed=settings.seed)
    study = settings.train_dataset
    clean_dead_builds(study)
    build = build_dir(study)
    try:
        DatasetDict({
            "train": load_from_disk(str(settings.path("tokenized", "train")))["train"],
            "eval": load_from_disk(str(settings.path("tokenized", "heldout")))["train"],
        }).save_to_disk(str(build))
        ids = {split: json.loads(settings.path("tokenized", part, SPLITS_FILE).read_text())["train"]
               for split, part in (("train", "train"), ("eval", "heldout"))}
        (build / SPLITS_FILE).write_text(json.dumps(ids) + "\n")
        # the trainer copies the chat-template record of this report into the export
        report = dict(reports["train"], eval_rows=reports["heldout"]["train_rows"],
                      heldout_report=reports["heldout"])
        (build / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n")
        write_marker(build, MARKER, TOOL)
        replace_dir(build, study)
    finally:
        import shutil

        shutil.rmtree(build, ignore_errors=True)
    return {part: {k: reports[part][k] for k in ("kept", "dropped", "tokens", "supervised_tokens")}
            for part in PARTS}


def prepare(settings: StudyDataSettings, *, stages: tuple[str, ...] = ("prompts", "regenerate",
                                                                        "tokenize")) -> None:
    """Run the data stages in order; each is skipped when meta.json records it as done."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    done = {name for name, record in _read_meta(settings).get("stages", {}).items()
            if not record.get("incomplete")}
    if "prompts" in stages and "prompts" not in done:
        print("study data: prompts", _timed(settings, "prompts", lambda: make_prompts(settings)),
              flush=True)
    if "regenerate" in stages:
        for part in ("heldout", "train"):  # held-out first: the evaluation needs it soonest
            stage = f"regenerate_{part}"
            if stage in done:
                result = _read_meta(settings)["stages"][stage]
            elif (result := restore_answers(settings, part)) is not None:
                _record_stage(settings, stage, result)
                print(f"study data: {stage} restored from {result['restored_from']}", flush=True)
            else:
                result = _timed(settings, stage, lambda p=part: regenerate(settings, p))
                print(f"study data: {stage}", result, flush=True)
            if (packed := archive_answers(settings, part, result)) is not None:
                print(f"study data: {stage} packed into {packed} (commit it)", flush=True)
    if "tokenize" in stages and "tokenize" not in done:
        print("study data: tokenize", _timed(settings, "tokenize", lambda: tokenize(settings)),
              flush=True)


def cache_features(settings: StudyDataSettings, overrides: list[str], features_dir: Path) -> None:
    """The target's features of the study data, once (`python -m
    dspine_train.training.cache_features` with the study's shared `train.py` overrides); skipped
    when the cache is complete."""
    from scripts.tools.child_runs import run_logged

    from .runner import StudyError

    if (features_dir / "train" / "index.json").is_file() and \
            (features_dir / "eval" / "index.json").is_file():
        print(f"study data: features exist in {features_dir}, skipping", flush=True)
        return

    def work() -> dict[str, Any]:
        run_logged([sys.executable, "-m", "dspine_train.training.cache_features", *overrides,
                    f"data.offline_features_dir={features_dir}",
                    f"hydra.run.dir={features_dir.parent / '.hydra_cache_features'}"],
                   features_dir.parent / "cache_features.log", "caching the target features",
                   error=StudyError)
        return {"dir": str(features_dir), "overrides": overrides,
                "bytes": sum(p.stat().st_size for p in features_dir.rglob("*") if p.is_file())}

    print("study data: features", _timed(settings, "features", work), flush=True)
