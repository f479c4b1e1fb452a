"""Metrics on rank 0: one JSON line per logged step in `metrics.jsonl`, and Weights & Biases;
`progress_line` is the readable line the trainer prints for each logged step (tokens/s and
s/step among it).

wandb runs offline unless `WANDB_API_KEY` is set or `WANDB_MODE` says otherwise, so a run on
a machine without credentials never blocks on a login; `wandb sync` uploads it later.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends metric lines; a no-op on non-main processes."""

    def __init__(
        self,
        output_dir: Path,
        enabled: bool,
        use_wandb: bool,
        project: str,
        run_name: str,
        run_config: dict[str, Any],
        resume_step: int,
    ) -> None:
        self.enabled = enabled
        self.path = output_dir / METRICS_FILE
        self._wandb = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self._drop_after(resume_step)
        if use_wandb:
            os.environ.setdefault(
                "WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline"
            )
            import wandb  # deferred: a slow import that most test runs skip

            self._wandb = wandb.init(
                project=project, name=run_name, dir=str(output_dir), config=run_config,
                resume="allow",
            )

    def _drop_after(self, step: int) -> None:
        """Forget lines past `step`: after a resume those steps are run (and logged) again."""
        if not self.path.exists():
            return
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(f"{ln}\n" for ln in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` at optimizer step `step`."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        """Finish the wandb run."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All lines of a `metrics.jsonl` file."""
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# The metrics `progress_line` shows, in order, with their formats (others stay in the file).
PROGRESS_FIELDS = (("loss", "loss {:.4f}"), ("backbone_ce", "ce {:.3f}"),
                   ("top1_acc", "acc {:.3f}"), ("tokens_per_s", "{:.0f} tokens/s"),
                   ("s_per_step", "{:.2f} s/step"), ("lr", "lr {:.2e}"))


def progress_line(step: int, total_steps: int, row: dict[str, float]) -> str:
    """One readable line for a logged step: `step 5/150 | loss ... | 812 tokens/s | 3.40 s/step`
    (what a log file keeps besides the progress bar)."""
    parts = [f"step {step}/{total_steps}"]
    parts += [fmt.format(row[key]) for key, fmt in PROGRESS_FIELDS if key in row]
    return " | ".join(parts)
