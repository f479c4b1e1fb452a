"""The study's wall-time plan: each variant's s/step, measured on a few steps before training.

`<out>/plan/<variant>/` holds the short run of each unfinished variant (the study's own: its
`request.json`; a folder without it is refused, never deleted), `<out>/plan.json` the measured
rates, and the plan printed before training multiplies them by the steps left.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scripts.tools.child_runs import run_logged

from .runner import (
    REQUEST_FILE,
    StudyError,
    StudySettings,
    claim_run_dir,
    resume_step,
    written_here,
)
from .variants import Variant

PLAN_FILE = "plan.json"

TQDM_RATE = re.compile(r"(\d+(?:\.\d+)?)(s/step|step/s|s/it|it/s)")


def seconds_per_step(log_text: str) -> float | None:
    """The last rate tqdm printed for the training bar in a `train.py` log, as s/step."""
    rates = [m for line in log_text.replace("\r", "\n").splitlines() if line.startswith("train")
             for m in TQDM_RATE.finditer(line)]
    if not rates:
        return None
    value, unit = float(rates[-1].group(1)), rates[-1].group(2)
    return value if unit.startswith("s/") else 1.0 / max(value, 1e-9)


def plan_dir(settings: StudySettings, variant: Variant) -> Path:
    """The scratch run that measures a variant's step time (`measure_plan`)."""
    return settings.out_dir / "plan" / variant.name


def check_plan_dir(settings: StudySettings, variant: Variant) -> None:
    """Refuse a plan folder the study did not write: the study replaces its own plan runs
    (they hold its `request.json`), never another folder."""
    run_dir = plan_dir(settings, variant)
    if not written_here(run_dir):
        raise StudyError(f"{run_dir}: holds files the study did not write (no {REQUEST_FILE}); "
                         "the study replaces only its own step-time runs there: move it away "
                         "or use another --out")


def measure_plan(settings: StudySettings, variants: Sequence[Variant],
                 finished: Callable[[Variant], bool]) -> dict[str, Any]:
    """s/step of each unfinished variant from `plan_steps` steps (cached in plan.json)."""
    path = settings.out_dir / PLAN_FILE
    plan = json.loads(path.read_text()) if path.is_file() else {}
    for variant in variants:
        measured = plan.get(variant.name, {}).get("s_per_step") is not None
        if measured or finished(variant) or settings.plan_steps <= 0:
            continue
        run_dir = plan_dir(settings, variant)
        check_plan_dir(settings, variant)
        shutil.rmtree(run_dir, ignore_errors=True)  # the study's own earlier plan run
        arguments = [a for a in settings.train_arguments(variant)
                     if not a.startswith(("output_dir=", "checkpoint.resume_from=",
                                          "eval.max_blocks="))]
        arguments += [f"output_dir={run_dir}", f"optim.max_steps={settings.plan_steps}",
                      "eval.max_blocks=8", "checkpoint.every=0"]
        claim_run_dir(run_dir, arguments)  # marks the folder as the study's
        start = time.perf_counter()
        run_logged([sys.executable, "train.py", *arguments], run_dir / "train.log",
                   f"measuring {variant.name}'s step time", echo=False, error=StudyError)
        wall = time.perf_counter() - start
        rate = seconds_per_step((run_dir / "train.log").read_text(errors="replace"))
        # without a bar (a changed trainer), the whole run's wall time is an upper bound
        source = "training bar" if rate is not None else "run wall time / steps (upper bound)"
        plan[variant.name] = {"s_per_step": rate or wall / settings.plan_steps,
                              "from": source, "steps": settings.plan_steps, "run_wall_s": wall}
        path.write_text(json.dumps(plan, indent=2))
    return plan


def plan_lines(settings: StudySettings, variants: Sequence[Variant],
               plan: dict[str, Any]) -> list[str]:
    """The wall-time plan printed before training."""
    lines = [f"wall-time plan: {settings.steps} steps per variant, evaluation every "
             f"{settings.eval_every} steps on {settings.eval_max_blocks} held-out blocks "
             "(evaluation and the final engine run come on top)"]
    total = 0.0
    for variant in variants:
        rate = plan.get(variant.name, {}).get("s_per_step")
        if rate is None:
            lines.append(f"  {variant.name:<24} finished or not measured")
            continue
        remaining = settings.steps - resume_step(settings.run_dir(variant))
        hours = rate * remaining / 3600
        total += hours
        lines.append(f"  {variant.name:<24} {rate:6.2f} s/step x {remaining} steps left -> "
                     f"{hours:5.2f} h of training")
    lines.append(f"  total training: {total:.2f} h")
    return lines
