"""The ablation's one table, in three forms: markdown, JSON and a PNG chart.

Input is the list of per-variant rows `collect_row` builds (training record + evaluation) and a
`meta` dict (command, git commit, settings). Engine results are `BenchResult`s of the evaluation
harness as plain dicts (`dataclasses.asdict`), so the JSON holds everything the harness measured.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402

# Loss terms reported as "final" (mean over the logged windows of the last tenth of training).
FINAL_TERMS = ("loss", "backbone_ce", "backbone_l1", "refine_ce", "alignment",
               "token_ce_intermediate", "top1_acc", "candidate_coverage")
FINAL_SHARE = 0.1


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


def _bench_key(result: dict[str, Any]) -> str:
    return f"{result['bench']} T={result['temperature']:g}"


def bench_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The (bench, temperature) columns, in the order the harness produced them."""
    keys: list[str] = []
    for row in rows:
        for result in row["engine"]:
            if _bench_key(result) not in keys:
                keys.append(_bench_key(result))
    return keys


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _engine_by_key(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {_bench_key(r): r for r in row["engine"]}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
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
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        losses = row["final_losses"]
        engine = _engine_by_key(row)
        taus = [engine[k]["tau"] for k in keys if k in engine]
        sim = _fmt(row["simulated"]["tau"]) if row["simulated"] else "-"
        if row["simulated"] and row["simulated"].get("tau_se") is not None:
            sim += f" ± {_fmt(row['simulated']['tau_se'], 3)}"
        trained = "yes" if row["trained"] else f"no ({row['reuse']}'s weights)"
        minutes = _fmt(row["train_wall_s"] / 60, 1) if row["trained"] and row["train_wall_s"] \
            else "-"
        if row["trained"] and row.get("resumed_from_step"):
            minutes += f" (resumed at step {row['resumed_from_step']})"
        cells = [f"`{row['variant']}`", trained, minutes, _fmt(losses.get("loss")),
                 _fmt(losses.get("backbone_ce")), _fmt(losses.get("top1_acc")), sim,
                 *[_fmt(engine[k]["tau"]) if k in engine else "-" for k in keys],
                 _fmt(sum(taus) / len(taus) if taus else None)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Variants:", ""]
    for row in rows:
        switches = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in row["switches"].items())
        lines.append(f"- `{row['variant']}`: {row['description']}"
                     + (f" ({switches})" if switches else ""))

    paired = [row for row in rows if row.get("paired_vs_dspine")]
    if paired:
        lines += ["", "Simulated tau minus `dspine`'s, paired on the same held-out blocks "
                  "(± SE over blocks; clustered by row in brackets):", ""]
        for row in paired:
            p = row["paired_vs_dspine"]
            lines.append(f"- `{row['variant']}`: {p['diff']:+.4f} ± {p['se']:.4f} "
                         f"({p['se_row']:.4f}) on {p['blocks']} blocks")

    lines += ["", "## Per-position acceptance (engine)", "",
              "Share of verifications in which drafted token k was accepted (k = 1, 2, ...).", ""]
    lines += ["| variant | setting | per position |", "|---|---|---|"]
    for row in rows:
        for key, result in _engine_by_key(row).items():
            rates = " ".join(f"{p:.2f}" for p in result["per_position"])
            lines.append(f"| `{row['variant']}` | {key} | {rates} |")
    sim_rows = [row for row in rows if row["simulated"]]
    if sim_rows:
        lines += ["", "Simulated (trainer evaluation), share of blocks whose first k drafts were "
                  "all accepted:", "", "| variant | per position |", "|---|---|"]
        for row in sim_rows:
            rates = " ".join(f"{p:.2f}" for p in row["simulated"]["per_position"])
            lines.append(f"| `{row['variant']}` | {rates} |")

    lines += ["", "## Speed and losslessness (engine, this machine)", "",
              "| variant | setting | tokens/s spec | tokens/s AR | speedup | draft ms/step | "
              "verify ms/step | lossless |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for key, r in _engine_by_key(row).items():
            lossless = {True: "yes", False: "**NO**", None: "-"}[r.get("lossless")]
            lines.append(
                f"| `{row['variant']}` | {key} | {_fmt(r['tokens_per_s_spec'], 1)} | "
                f"{_fmt(r.get('tokens_per_s_ar'), 1)} | {_fmt(r.get('speedup'), 2)} | "
                f"{_fmt(r['draft_ms_per_step'], 1)} | {_fmt(r['verify_ms_per_step'], 1)} | "
                f"{lossless} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: tau per variant (simulated and each engine setting). Right: engine per-position
    acceptance per variant at the first setting of each benchmark at temperature 0."""
    keys = bench_keys(rows)
    columns = ["sim. tau", *keys]
    fig, (ax_tau, ax_pos) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        engine = _engine_by_key(row)
        values = [row["simulated"]["tau"] if row["simulated"] else 0.0]
        values += [engine[k]["tau"] if k in engine else 0.0 for k in keys]
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(columns))]
        ax_tau.bar(xs, values, width, label=row["variant"])
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
                        color=f"C{i}", label=f"{row['variant']} {key}")
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


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], stem: Path) -> list[Path]:
    """`<stem>.md`, `<stem>.json` and `<stem>.png`; returns the paths.

    The extensions are appended, so a stem with dots of its own ("qwen2.5") keeps them.
    """
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ext) for ext in (".md", ".json", ".png")]
    paths[0].write_text(markdown(rows, meta))
    paths[1].write_text(json.dumps({"meta": meta, "variants": rows}, indent=2) + "\n")
    plot(rows, paths[2])
    return paths
