"""The training study's report: markdown, JSON and a PNG of the learning curves.

Input: one record per finished variant (`study.variant_record`) and a `meta` dict (command,
commit, machine, plan, data). Every figure with an error carries the standard error over
blocks and, in brackets, the one clustered by held-out row; differences to the reference
(`dspine`) are paired on the same blocks (`evaluation.block_metrics.paired_difference`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402

from .records import StudyRecord  # noqa: E402
from .report import fmt as _f  # noqa: E402
from .report import table, write_report  # noqa: E402

# The study's aim: DSpine's held-out simulated tau and its ratio to the DFlash baseline.
AIM_TAU = 1.6
AIM_RATIO = 1.25


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.2f} h"


def engine_summary(engine: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Greedy engine figures per benchmark: tau, prompts, tokens and the lossless check."""
    out = {}
    for row in engine:
        if row.get("temperature", 0.0) != 0.0:
            continue
        out[row.get("bench", "?")] = {k: row.get(k) for k in (
            "tau", "num_prompts", "new_tokens", "lossless", "speedup", "tokens_per_s_spec")}
    return out


def _outside(paired: dict[str, Any]) -> str:
    """Whether a paired difference lies outside one clustered standard error."""
    se = paired.get("se_row")
    if se is None or (isinstance(se, float) and math.isnan(se)):
        se = paired.get("se")
    if se is None or (isinstance(se, float) and math.isnan(se)):
        return "-"
    return "yes" if abs(paired["diff"]) > se else "no"


def aim_lines(records: list[StudyRecord]) -> list[str]:
    """Mechanical reading of the aim (tau >= 1.6 and >= 1.25 x DFlash) and of each part."""
    by = {r.variant: r for r in records}
    lines = []
    if "dspine" in by:
        tau = by["dspine"].simulated["tau"]
        lines.append(f"- DSpine held-out simulated tau {_f(tau)} "
                     f"({'meets' if tau >= AIM_TAU else 'misses'} the aim of {AIM_TAU}).")
        if "dflash" in by:
            ratio = tau / by["dflash"].simulated["tau"]
            lines.append(f"- DSpine / DFlash = {_f(ratio)} "
                         f"({'meets' if ratio >= AIM_RATIO else 'misses'} the aim of "
                         f"{AIM_RATIO}x).")
    for r in records:
        paired = r.paired_vs_reference
        if paired and "diff" in paired:
            lines.append(f"- {r.variant} - dspine: {paired['diff']:+.4f} ± "
                         f"{_f(paired['se'], 4)} ({_f(paired['se_row'], 4)} by row) on "
                         f"{paired['blocks']} shared blocks; outside one clustered SE: "
                         f"{_outside(paired)}.")
    return lines


def _padded(cells: list[str], width: int) -> list[str]:
    """`cells` filled with "-" to `width` columns: a DSpark block drafts one more token than
    the others' (B against B-1), so its row is one position longer."""
    return cells + ["-"] * (width - len(cells))


def conditional_acceptance(rates: list[float]) -> list[float]:
    """P(draft k accepted | drafts 1..k-1 accepted) from the shares of blocks accepting the
    first k drafts (NaN where no block got that far)."""
    return [rate / prev if prev > 0 else math.nan
            for prev, rate in zip([1.0, *rates[:-1]], rates)]


def target_title(target: str | Path) -> str:
    """The target as the report's title names it: the embedded target by the GGUF file it is
    assembled from and its dtype (its `assembly.json`), another by its directory's name."""
    assembly = Path(target) / "assembly.json"
    if assembly.is_file():
        record = json.loads(assembly.read_text())
        return f"the embedded target ({record.get('gguf_name')}, {record.get('dtype')})"
    return Path(target).name


def step_lines(steps: dict[str, Any]) -> list[str]:
    """The table of `study.py steps`: each variant's step time and its ratio to the
    reference's, all from one interleaved run."""
    return table(["variant", "s/step (best per batch)", "median", f"x {steps['reference']}"],
                 [[name, f"{row['step_s']:.2f}", f"{row['step_s_median']:.2f}",
                   f"{row['ratio']:.2f}"] for name, row in steps["variants"].items()])


def _final_cells(r: StudyRecord) -> list[str]:
    """A row of the final table: simulated tau, its paired difference, losses, engine."""
    s = r.simulated
    paired = r.paired_vs_reference or {}
    diff = (f"{paired['diff']:+.4f} ± {_f(paired['se'], 4)} ({_f(paired['se_row'], 4)})"
            if "diff" in paired else "reference" if r.variant == "dspine" else "-")
    engine = engine_summary(r.engine or [])
    engine_tau = ", ".join(f"{b} {_f(e['tau'])}" for b, e in engine.items()) or "-"
    lossless = ("yes" if engine and all(e["lossless"] for e in engine.values())
                else "-" if not engine or any(e["lossless"] is None for e in engine.values())
                else "NO")
    losses = r.final_losses or {}
    return [r.variant, r.steps, _hours(r.train_wall_s), s["blocks"],
            f"{_f(s['tau'])} ± {_f(s['tau_se'], 4)} ({_f(s['tau_se_row'], 4)})",
            _f(s["tau"] - 1.0), diff,
            _outside(paired) if paired else "-", _f(losses.get("candidate_coverage")),
            _f(losses.get("loss")), engine_tau, lossless]


def _curve_cells(r: StudyRecord, p: dict[str, Any]) -> list[str]:
    """A row of the learning curves: one periodic evaluation of one variant."""
    train = p.get("train") or {}
    pc = (r.paired_curve or {}).get(str(p["step"]))
    diff = f"{pc['diff']:+.4f} ± {_f(pc['se_row'], 4)}" if pc else "-"
    return [r.variant, p["step"],
            f"{_f(p.get('tau'))} ± {_f(p.get('tau_se'), 4)} ({_f(p.get('tau_se_row'), 4)})",
            diff, _f(train.get("candidate_coverage")), _f(train.get("loss"))]


def _provenance_cells(name: str, r: StudyRecord | None, plan: dict[str, Any]) -> list[str]:
    """A row of the wall-time table; a variant not finished yet has only its plan."""
    session = (r.session if r else None) or {}
    rate = session.get("s_per_step_plan") or (plan.get(name) or {}).get("s_per_step")
    commit = (session.get("commit") or "-")[:10]
    digest = (session.get("features_digest") or "")[:8]
    return [name, (r.precision if r else None) or "-", _f(rate, 2),
            _hours(r.train_wall_s if r else None), r.sessions if r else "-",
            _hours(r.engine_wall_s if r else None), f"`{commit}`",
            session.get("date") or "not yet", _cpu(session.get("machine") or {}),
            f"`{digest}`" if digest else "-"]


def _cpu(machine: dict[str, Any]) -> str:
    """The CPU a row ran on, and how its bf16 products ran where not natively."""
    cpu = machine.get("cpu") or "-"
    if machine.get("bf16_matmul") == "float32":
        cpu += " (bf16 products in float32)"
    return cpu


def markdown(records: list[StudyRecord], meta: dict[str, Any],
             findings: str | None = None, steps: dict[str, Any] | None = None) -> str:
    """The report as markdown: setting, final table, per-position acceptance, curves, and
    `findings` (the hand-written reading, kept beside the archive) after the mechanical one;
    `steps`: the side-by-side step times (`study.py steps`)."""
    target = meta.get("target", "")
    title = meta.get("target_title") or Path(target).name or "the target"
    lines = [f"# Training study on {title} ({meta.get('date', '')})",
             "",
             f"- target: `{target}`",
             f"- command: `{meta.get('command', '')}`",
             f"- commit: `{meta.get('commit', '')}`" + (" (working tree differs)"
                                                      if meta.get("dirty") else ""),
             f"- machine: {json.dumps(meta.get('machine', {}))}"]
    data = meta.get("data") or {}
    if data:
        lines.append(f"- data: `{data.get('train_path')}` ({data.get('splits')})")
        settings = ((data.get("meta") or {}).get("settings") or {})
        if settings:
            lines.append(f"- regeneration: greedy, up to {settings.get('max_new_tokens')} new "
                         f"tokens, target in {settings.get('regen_dtype')} "
                         f"(batch {settings.get('regen_batch_size')})")
        for stage, record in ((data.get("meta") or {}).get("stages") or {}).items():
            lines.append(f"  - data stage {stage}: {_hours(record.get('wall_s_total'))}")
    settings = meta.get("settings") or {}
    if settings:
        final = settings.get("final_max_blocks")
        lines.append(f"- budget: {settings.get('steps')} steps, seed {settings.get('seed')}; "
                     f"evaluation every {settings.get('eval_every')} steps on a fixed uniform "
                     f"draw of {settings.get('eval_max_blocks')} held-out blocks; final "
                     f"evaluation on " + ("every held-out block" if str(final) == "0" else
                                         f"up to {final} held-out blocks (uniform draw)"))
    lines += ["- tau ± SE over blocks (SE clustered by held-out row in brackets); paired "
              "differences are per block on the same blocks as the reference `dspine`.", ""]

    lines += ["## Final results", ""]
    lines += table(["variant", "steps", "train wall", "blocks", "simulated tau",
                    "accepted drafts / block", "vs dspine (paired)", "outside 1 SE", "coverage", "loss",
                    "engine tau (greedy)", "lossless"], [_final_cells(r) for r in records])
    lines += ["", "## Acceptance per position (held-out, share of blocks accepting the first k "
              "drafts)", ""]
    width = max((len(r.simulated["acceptance_by_position"]) for r in records), default=0)
    head = ["variant", *(f"k={k}" for k in range(1, width + 1))]
    for caption, per_position in (
            (None, lambda rates: rates),
            ("Conditional acceptance: the share of blocks accepting draft k among those that "
             "accepted the first k-1 (where the chain breaks).", conditional_acceptance)):
        lines += ([caption, ""] if caption else [])
        lines += table(head, [[r.variant, *_padded(list(map(_f, per_position(
            r.simulated["acceptance_by_position"]))), width)] for r in records])
        lines.append("")
    lines += ["## Learning curves (periodic evaluation on a fixed uniform draw of "
              "held-out blocks)", ""]
    lines += table(["variant", "step", "tau ± SE (by row)", "vs dspine (paired)",
                    "coverage (train)", "loss (train)"],
                   [_curve_cells(r, p) for r in records for p in r.curve])
    lines += ["", "## What the numbers say", "", *aim_lines(records), "",
              "Each paired difference is the mean over the same held-out blocks of (variant's "
              "accepted drafts - dspine's); a part contributes measurably only where that "
              "difference lies outside its clustered standard error.", ""]
    if findings:
        lines += ["## Findings (hand-written from the figures above)", "",
                  findings.strip(), ""]
    plan = meta.get("plan") or {}
    by = {r.variant: r for r in records}
    # every row of the study: finished, planned in this piece, or still to come
    names = list(dict.fromkeys([*by, *plan, *(meta.get("study_variants") or [])]))
    if names:
        lines += ["## Wall time and provenance of each variant", ""]
        lines += table(["variant", "precision", "s/step (plan)", "train wall", "sessions",
                        "engine eval", "commit", "piece started", "CPU", "features"],
                       [_provenance_cells(name, by.get(name), plan) for name in names])
        lines += ["", "The train wall time is measured in the session that trained the variant; "
                  "sessions do not all run on equally fast machines, so it compares variants "
                  "only roughly. The features column is the digest of the feature cache the "
                  "row trained on (`study.features_digest`): the bf16 target's features are "
                  "rebuilt in each session, and bf16 matrix products differ in their last bits "
                  "between CPUs (native or emulated bf16, other kernels), so rows with different "
                  "digests trained on features that differ at that precision. "
                  + ("The step times below, measured side by side, are the "
                                      "comparison." if steps else "`python scripts/study.py "
                                      "steps` measures the step times side by side."), ""]
    if steps:
        lines += ["## Step time side by side", "",
                  f"One training step of each variant (forward, objective, backward, AdamW; "
                  f"`train.py`'s draft, precision and vocabulary), the variants alternating "
                  f"step by step on the same {steps['batches']} training batches in one process "
                  f"({steps['iters']} timed steps each, {steps['torch_threads']} torch threads, "
                  f"{steps['date']}, commit `{str(steps.get('commit', '-'))[:10]}`): "
                  f"`{steps.get('command', 'study.py steps')}`.", "", *step_lines(steps), ""]
    return "\n".join(lines)


def plot(records: list[StudyRecord], path: Path) -> None:
    """Learning curves (tau vs step, error bars = clustered SE) and final per-position
    acceptance, one line per variant."""
    fig, (curves, positions) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in records:
        points = r.curve or []
        if points:
            steps = [p["step"] for p in points]
            taus = [p.get("tau") for p in points]
            errors = [p.get("tau_se_row") or p.get("tau_se") or 0.0 for p in points]
            errors = [0.0 if e is None or math.isnan(e) else e for e in errors]
            curves.errorbar(steps, taus, yerr=errors, marker="o", capsize=3, label=r.variant)
        rates = r.simulated["acceptance_by_position"]
        positions.plot(range(1, len(rates) + 1), rates, marker="o", label=r.variant)
    curves.set(xlabel="optimizer step", ylabel="simulated tau (held-out)",
               title="learning curves (± SE clustered by row)")
    positions.set(xlabel="drafted position k", ylabel="share of blocks accepting k",
                  title="final acceptance per position (final evaluation)")
    for axis in (curves, positions):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_study_report(records: list[StudyRecord], meta: dict[str, Any],
                       stem: Path, findings: Path | None = None,
                       step_times: Path | None = None) -> list[Path]:
    """Write `<stem>.md`, `<stem>.json` and `<stem>.png`; return their paths. `findings`: a
    markdown file of hand-written findings, copied into the report when it exists (the report
    is rewritten after every piece of the study, so the reading lives in its own file).
    `step_times`: the JSON of `study.py steps`, shown when it exists."""
    text = findings.read_text() if findings is not None and findings.is_file() else None
    steps = (json.loads(step_times.read_text())
             if step_times is not None and step_times.is_file() else None)
    return write_report(stem, markdown(records, meta, text, steps) + "\n",
                        {"meta": meta, "variants": [r.to_json() for r in records]},
                        lambda path: plot(records, path))
