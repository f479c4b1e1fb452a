"""Regenerate every assistant turn of the configured prompts with the target.

    python -m data_prep.regenerate data=default_target_humaneval
    python -m data_prep.regenerate data=qwen3_sharegpt_http \
        data.regenerate.http.urls='[http://a:30000,http://b:30000]'

Output directory ``data.regenerate.output_dir``:

    part-NNNNN.jsonl          finished rows in the normalised schema, written atomically
    regenerate_settings.json  backend, model and sampling the shards were made with
    regenerate_report.json    accounting of the last run

Resume: rerun the same command after Ctrl-C or ``kill -9``.  Rows whose ids are in the shards
are skipped, everything else (including rows that failed last time) is redone; a run with
different model or sampling settings refuses the directory.  Accounting, in the report and
printed at the end: ``done + failed + skipped (+ pending if interrupted) == input``, where input
is every row read (the selected rows plus invalid ones), and every failed or skipped row is
listed with its reason.  Exit status: 0 all rows done or skipped, 2 some failed (rerun to
retry them), 1 bad config or input, 130 interrupted.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig
from tqdm.auto import tqdm

from data_prep.backends import Backend, backend_identity, build_backend
from data_prep.config import (
    RECIPES_PATH,
    DataConfig,
    LocalBackendConfig,
    RegenerateConfig,
    SamplingConfig,
    SourceConfig,
    SourcePart,
    to_data_config,
)
from data_prep.schema import DataError
from data_prep.shards import (
    ShardWriter,
    exclusive_lock,
    read_done_ids,
    remove_partial_shards,
)
from data_prep.sources import SourceRows, load_source
from dspine_train.checkpoint_io import write_text_atomic
from dspine_train.cli_errors import os_error_line

SETTINGS_FILE = "regenerate_settings.json"
REPORT_FILE = "regenerate_report.json"
EXIT_FAILED_ROWS = 2
EXIT_INTERRUPTED = 130


def _check_settings(output_dir: Path, settings: dict[str, Any]) -> None:
    """Record the generation settings, or refuse a directory made with other ones."""
    path = output_dir / SETTINGS_FILE
    if not path.exists():
        write_text_atomic(path, json.dumps(settings, indent=2, default=str) + "\n")
        return
    recorded = json.loads(path.read_text())
    current = json.loads(json.dumps(settings, default=str))
    changed = [f"{key}: {recorded.get(key)!r} -> {current[key]!r}"
               for key in current if key in recorded and recorded[key] != current[key]]
    if changed:
        raise DataError(f"{output_dir} holds rows generated with other settings "
                        f"({'; '.join(changed)}); use another output_dir or delete it")
    # A setting recorded only by newer versions (the local dtype) is unknown for a directory an
    # older version started: said once, then recorded, so later resumes are checked.
    if missing := [key for key in current if key not in recorded]:
        print(f"note: {path} did not record {', '.join(missing)}; recording this run's "
              f"({', '.join(f'{k}={current[k]!r}' for k in missing)})", file=sys.stderr)
        write_text_atomic(path, json.dumps({**recorded, **current}, indent=2) + "\n")


def run_regeneration(data: DataConfig, backend: Backend | None = None) -> dict[str, Any]:
    """Regenerate the rows of ``data.source`` into ``data.regenerate.output_dir``.

    Returns the report (also written to the output directory).  The backend is only built
    when some row is left to do, so rerunning a finished job is instant.  A KeyboardInterrupt
    (or any other exception) still flushes finished rows and writes an ``interrupted`` report
    before it propagates.
    """
    output_dir = Path(data.regenerate.output_dir)
    source = load_source(data.source)
    if not source.rows:
        # nothing to do is not success: an empty file or a wrong path pattern must not pass
        raise DataError(f"data.source: no row to regenerate (counts: {source.counts}; "
                        f"skipped: {sorted({row.reason for row in source.skipped})})")
    output_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(output_dir):
        return _regenerate_locked(data, source, backend, output_dir)


def _regenerate_locked(data: DataConfig, source: SourceRows, backend: Backend | None,
                       output_dir: Path) -> dict[str, Any]:
    config = data.regenerate
    _check_settings(output_dir, {**backend_identity(config), "sampling": asdict(config.sampling)})
    remove_partial_shards(output_dir)
    done_ids = read_done_ids(output_dir)
    todo = [row for row in source.rows if row["id"] not in done_ids]
    already_done = len(source.rows) - len(todo)
    if todo and backend is None:
        backend = build_backend(config)

    writer = ShardWriter(output_dir, config.shard_size, config.flush_interval_s)
    failed: list[dict[str, str]] = []
    tokens = 0
    start = time.perf_counter()
    interrupted = False
    bar = tqdm(total=len(todo), unit="row", desc="regenerate", dynamic_ncols=True)
    try:
        for outcome in backend.regenerate(todo) if todo else ():  # type: ignore[union-attr]
            if outcome.error is not None:
                reason, _, detail = outcome.error.partition(": ")
                failed.append({"id": outcome.id, "reason": reason, "detail": detail})
            else:
                writer.add(outcome.row)  # type: ignore[arg-type]
                tokens += outcome.completion_tokens
            bar.update(1)
            elapsed = time.perf_counter() - start
            bar.set_postfix(failed=len(failed), tok_s=f"{tokens / max(elapsed, 1e-9):.1f}",
                            refresh=False)
    except BaseException:  # Ctrl-C or a backend crash: still save finished rows and account
        interrupted = True
        raise
    finally:
        bar.close()
        writer.flush()
        done_now = writer.rows_written
        report = {
            "input": len(source.rows) + len(source.skipped),
            "done": already_done + done_now,
            "failed": len(failed),
            "skipped": len(source.skipped),
            "pending": len(todo) - done_now - len(failed),
            "done_this_run": done_now,
            "already_done": already_done,
            "interrupted": interrupted,
            "completion_tokens": tokens,
            "seconds": round(time.perf_counter() - start, 2),
            "source": source.counts,
            "failed_rows": failed,
            "skipped_rows": [row.to_json() for row in source.skipped],
        }
        write_text_atomic(output_dir / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    return report


def greedy_local_job(prompts: str | Path, target: str | Path, output_dir: str | Path, *,
                     max_new_tokens: int, batch_size: int, dtype: str = "auto",
                     shard_size: int = 32) -> DataConfig:
    """The job of a target on this machine answering every prompt of one JSONL file greedily
    (the demo's and the study's data: greedy, so the trainer's simulated tau is exact); the
    output is flushed every minute, so a killed run resumes with little lost."""
    return DataConfig(
        source=SourceConfig(paths=[str(prompts)], part=SourcePart.all),
        regenerate=RegenerateConfig(
            local=LocalBackendConfig(model_path=str(target), dtype=dtype, batch_size=batch_size),
            sampling=SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens),
            output_dir=str(output_dir), shard_size=shard_size, flush_interval_s=60.0))


def summary_line(report: dict[str, Any]) -> str:
    """One line of accounting for the console."""
    line = (f"input {report['input']} = done {report['done']} (this run {report['done_this_run']}) "
            f"+ failed {report['failed']} + skipped {report['skipped']}")
    if report["pending"]:
        line += f" + pending {report['pending']}"
    return line + f"; {report['completion_tokens']} tokens in {report['seconds']} s"


@hydra.main(version_base="1.3", config_path=RECIPES_PATH, config_name="data_prep_job")
def main(cfg: DictConfig) -> None:
    """CLI: regenerate, print the accounting, exit with the status the module doc lists."""
    try:
        data = to_data_config(cfg.data)
        report = run_regeneration(data)
    except (DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except OSError as error:
        where = f"data.regenerate.output_dir {cfg.data.regenerate.output_dir}"
        print(f"error: {os_error_line(error, where)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished rows are saved in {cfg.data.regenerate.output_dir}, "
              f"rerun the same command to resume", file=sys.stderr)
        # Do not wait for HTTP requests still on the wire: their rows are redone on resume.
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)
    print(summary_line(report))
    reasons: dict[str, int] = {}
    for row in report["failed_rows"] + report["skipped_rows"]:
        reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
    if reasons:
        print("failed/skipped by reason: "
              + ", ".join(f"{key} {count}" for key, count in sorted(reasons.items())))
    print(f"report: {Path(data.regenerate.output_dir) / REPORT_FILE}")
    if report["failed"]:
        sys.exit(EXIT_FAILED_ROWS)


if __name__ == "__main__":
    main()
