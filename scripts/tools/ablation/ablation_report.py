"""The ablation's one table, in three forms: markdown, JSON and a PNG chart.

Input is the list of typed rows `ablation_rows.collect_row` builds (training record +
evaluation) and a `meta` dict (command, git commit, settings). Engine results are
`BenchResult`s of the evaluation harness as JSON objects, so the JSON holds everything the
harness measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402

from .records import AblationRow  # noqa: E402
from .report import FINAL_SHARE, fmt, table, write_report  # noqa: E402


def _bench_key(result: dict[str, Any]) -> str:
    return f"{result['bench']} T={result['temperature']:g}"


def bench_keys(rows: list[AblationRow]) -> list[str]:
    """The (bench, temperature) columns, in the order the harness produced them."""
    keys: list[str] = []
    for row in rows:
        for result in row.engine:
            if _bench_key(result) not in keys:
                keys.append(_bench_key(result))
    return keys


def _engine_by_key(row: AblationRow) -> dict[str, dict[str, Any]]:
    return {_bench_key(r): r for r in row.engine}


def _main_cells(row: AblationRow, keys: list[str]) -> list[str]:
    """A row of the main table: training, losses, simulated and engine tau."""
    losses = row.final_losses
    engine = _engine_by_key(row)
    taus = [engine[k]["tau"] for k in keys if k in engine]
    sim = fmt(row.simulated["tau"]) if row.simulated else "-"
    if row.simulated and row.simulated.get("tau_se") is not None:
        sim += f" ± {fmt(row.simulated['tau_se'], 3)}"
    trained = "yes" if row.trained else f"no ({row.reuse}'s weights)"
    minutes = fmt(row.train_wall_s / 60, 1) if row.trained and row.train_wall_s else "-"
    if row.trained and row.resumed_from_step:
        minutes += f" (resumed at step {row.resumed_from_step})"
    return [f"`{row.variant}`", trained, minutes, fmt(losses.get("loss")),
            fmt(losses.get("backbone_ce")), fmt(losses.get("top1_acc")), sim,
            *[fmt(engine[k]["tau"]) if k in engine else "-" for k in keys],
            fmt(sum(taus) / len(taus) if taus else None)]


def markdown(rows: list[AblationRow], meta: dict[str, Any]) -> str:
    """The report: setting, the main table (losses, simulated and engine tau), per-position
    acceptance and the timing table."""
    keys = bench_keys(rows)
    s = meta["settings"]
    lines = [
        f"# {meta['title']}",
        "",
        f"- command: `{meta['command']}`",
        f"- git commit: `{meta['git_commit']}`" + (" (with uncommitted changes)"
                                                   if meta.get("git_dirty") else ""),
        f"- date: {meta['date']}; machine: {meta['machine']}",
        f"- target: `{meta['target']}`; recipe `{s['recipe']}`; draft: {meta['draft']}",
        f"- data: `{meta['train_path']}` ({meta['data_summary']}); target features computed once "
        f"into `{meta['features_dir']}` and shared by every run",
        f"- budget, identical for every trained variant: {s['steps']} steps x batch "
        f"{meta['batch_size']} x {meta['num_anchors']} anchors per sequence, max length "
        f"{meta['max_length']}, lr {meta['lr']}, seed {s['seed']}"
        + ("; the runs' saved configs differ only in the variants' switches"
           if meta["same_budget"] else " - **NOT identical across runs**: "
           + ", ".join(meta.get("config_differences") or ["see the JSON"])),
        f"- engine evaluation: {s['limit']} held-out prompts per benchmark, "
        f"{s['max_new_tokens']} new tokens, verifying "
        f"{s['num_draft_tokens'] or 'block_size - 1'} drafted tokens per round, "
        f"{s['eval_batch_size']} prompt(s) decoded together",
        "",
        "tau = tokens committed per target verification (accepted drafts + 1 bonus). "
        "*top-1*: the draft's top-1 accuracy on its training blocks (final window). "
        "*sim. tau* is the trainer's simulated acceptance on every block of the held-out split "
        "of the training data (greedy, teacher-forced context), ± its SE over blocks; the other tau columns are measured by the engine "
        "on held-out benchmark prompts. Final losses: mean over the logged windows of the last "
        f"{int(FINAL_SHARE * 100)}% of steps; *final loss* sums each variant's own terms, so "
        "compare *backbone CE* across rows.",
        "",
    ]
    head = ["variant", "trained", "train min", "final loss", "backbone CE", "top-1", "sim. tau",
            *keys, "mean tau"]
    lines += table(head, [_main_cells(row, keys) for row in rows])
    lines += ["", "Variants:", ""]
    for row in rows:
        switches = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in row.switches.items())
        lines.append(f"- `{row.variant}`: {row.description}"
                     + (f" ({switches})" if switches else ""))

    paired = [row for row in rows if row.paired_vs_dspine]
    if paired:
        lines += ["", "Simulated tau minus `dspine`'s, paired on the same held-out blocks "
                  "(± SE over blocks; clustered by row in brackets):", ""]
        for row in paired:
            p = row.paired_vs_dspine
            lines.append(f"- `{row.variant}`: {p['diff']:+.4f} ± {p['se']:.4f} "
                         f"({p['se_row']:.4f}) on {p['blocks']} blocks")

    lines += ["", "## Per-position acceptance (engine)", "",
              "Share of verifications in which drafted token k was accepted (k = 1, 2, ...).", ""]
    lines += table(["variant", "setting", "per position"],
                   [[f"`{row.variant}`", key, " ".join(f"{p:.2f}" for p in r["per_position"])]
                    for row in rows for key, r in _engine_by_key(row).items()])
    sim_rows = [row for row in rows if row.simulated]
    if sim_rows:
        lines += ["", "Simulated (trainer evaluation), share of blocks whose first k drafts were "
                  "all accepted:", ""]
        lines += table(["variant", "per position"],
                       [[f"`{row.variant}`",
                         " ".join(f"{p:.2f}" for p in row.simulated["per_position"])]
                        for row in sim_rows])

    lossless = {True: "yes", False: "**NO**", None: "-"}
    lines += ["", "## Speed and losslessness (engine, this machine)", ""]
    lines += table(["variant", "setting", "tokens/s spec", "tokens/s AR", "speedup",
                    "draft ms/step", "verify ms/step", "lossless"],
                   [[f"`{row.variant}`", key, fmt(r["tokens_per_s_spec"], 1),
                     fmt(r.get("tokens_per_s_ar"), 1), fmt(r.get("speedup"), 2),
                     fmt(r["draft_ms_per_step"], 1), fmt(r["verify_ms_per_step"], 1),
                     lossless[r.get("lossless")]]
                    for row in rows for key, r in _engine_by_key(row).items()])
    return "\n".join(lines) + "\n"


def plot(rows: list[AblationRow], path: Path) -> None:
    """Left: tau per variant (simulated and each engine setting). Right: engine per-position
    acceptance per variant at the first setting of each benchmark at temperature 0."""
    keys = bench_keys(rows)
    columns = ["sim. tau", *keys]
    fig, (ax_tau, ax_pos) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        engine = _engine_by_key(row)
        values = [row.simulated["tau"] if row.simulated else 0.0]
        values += [engine[k]["tau"] if k in engine else 0.0 for k in keys]
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(columns))]
        ax_tau.bar(xs, values, width, label=row.variant)
    ax_tau.set_xticks(range(len(columns)), columns, rotation=20, fontsize=8)
    ax_tau.set_ylabel("tau (tokens per verification)")
    ax_tau.set_ylim(bottom=1.0)
    ax_tau.set_title("acceptance length")
    ax_tau.grid(alpha=0.3, axis="y")
    ax_tau.legend(fontsize=8)
    greedy = [k for k in keys if k.endswith("T=0")] or keys[:1]
    styles = ["-", "--", ":", "-."]
    for i, row in enumerate(rows):
        engine = _engine_by_key(row)
        for j, key in enumerate(greedy):
            if key not in engine:
                continue
            rates = engine[key]["per_position"]
            ax_pos.plot(range(1, len(rates) + 1), rates, styles[j % len(styles)], marker="o",
                        color=f"C{i}", label=f"{row.variant} {key}")
    ax_pos.set_xlabel("drafted position k")
    ax_pos.set_ylabel("share of verifications accepting token k")
    ax_pos.set_ylim(0, 1)
    ax_pos.set_title("per-position acceptance (engine, greedy)")
    ax_pos.grid(alpha=0.3)
    ax_pos.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_ablation_report(rows: list[AblationRow], meta: dict[str, Any], stem: Path
                          ) -> list[Path]:
    """`<stem>.md`, `<stem>.json` and `<stem>.png`; returns the paths."""
    return write_report(stem, markdown(rows, meta),
                        {"meta": meta, "variants": [row.to_json() for row in rows]},
                        lambda path: plot(rows, path))
