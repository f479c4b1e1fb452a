"""What both studies' reports share: the one markdown table formatter, the one writer of
`<stem>.{md,json,png}`, number formatting, the final loss terms and the provenance lines
(git commit, data summary).

The reports themselves: `ablation_report` (the ablation's table) and `study_report` (the
training study's report with learning curves).
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Loss terms reported as "final" (mean over the logged windows of the last tenth of training).
FINAL_TERMS = ("loss", "backbone_ce", "backbone_l1", "refine_ce", "alignment",
               "token_ce_intermediate", "top1_acc", "candidate_coverage")
FINAL_SHARE = 0.1


def fmt(value: Any, digits: int = 3) -> str:
    """A figure with `digits` decimals; "-" for a missing one (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table: the header, its rule, one line per row (cells as given)."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def write_report(stem: Path, text: str, payload: dict[str, Any],
                 plot: Callable[[Path], None]) -> list[Path]:
    """`<stem>.md` (`text`), `<stem>.json` (`payload`) and `<stem>.png` (`plot(path)`), each
    whole or not at all; returns the paths.

    The extensions are appended, so a stem with dots of its own ("qwen2.5") keeps them.
    """
    from dspine_train.checkpoint_io import write_text_atomic

    stem.parent.mkdir(parents=True, exist_ok=True)
    md, js, png = (stem.with_name(stem.name + suffix) for suffix in (".md", ".json", ".png"))
    write_text_atomic(md, text)
    write_text_atomic(js, json.dumps(payload, indent=2, default=str) + "\n")
    plot(png)
    return [md, js, png]


def final_losses(history: list[dict[str, Any]], total_steps: int) -> dict[str, float]:
    """Mean of each logged training term over the last `FINAL_SHARE` of the steps.

    Each logged row is already a mean over its window of steps; at least the last row counts.
    """
    train = [row for row in history if "loss" in row]
    if not train:
        return {}
    tail = [row for row in train if row["step"] > (1 - FINAL_SHARE) * total_steps] or train[-1:]
    out = {"from_step": tail[0]["step"], "to_step": tail[-1]["step"]}
    for term in FINAL_TERMS:
        values = [row[term] for row in tail if term in row]
        if values:
            out[term] = sum(values) / len(values)
    return out


def git_commit(repo: Path) -> tuple[str, bool]:
    """HEAD's commit and whether the working tree differs from it (read-only git calls)."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True,
                              check=False).stdout.strip()
    return git("rev-parse", "HEAD") or "unknown", bool(git("status", "--porcelain"))


def data_summary(path: str) -> str:
    """Rows and tokens of each split of a tokenised dataset directory."""
    import datasets

    from dspine_train.training.data import split_names

    splits = split_names(path)
    if not splits:
        return "a single split"
    parts = []
    for split in splits:
        ds = datasets.load_from_disk(str(Path(path) / split))
        parts.append(f"{split}: {len(ds)} rows, {sum(ds['length']):,} tokens")
    return "; ".join(parts)
