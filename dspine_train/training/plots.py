"""The end-of-run figure: loss curves and per-position acceptance, as a PNG (matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: training nodes have no display
import matplotlib.pyplot as plt  # noqa: E402

LOSS_TERMS = ("loss", "backbone_ce", "backbone_l1", "refine_ce", "refine_l1", "alignment",
              "confidence_bce", "backbone_kl", "selector_ce")


def plot_training(
    history: list[dict[str, Any]], position_rates: list[float] | None, path: Path
) -> Path:
    """Left: each logged loss term against the step. Right: the share of evaluated blocks whose
    first k drafted tokens were all accepted (k = 1..B-1, DSpark 1..B), from the last evaluation."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    train = [row for row in history if "loss" in row]
    for term in LOSS_TERMS:
        points = [(row["step"], row[term]) for row in train if term in row]
        if points:
            steps, values = zip(*points)
            ax_loss.plot(steps, values, label=term, linewidth=1.5 if term == "loss" else 1.0)
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("value")
    ax_loss.set_title("training loss terms")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    if position_rates:
        ks = list(range(1, len(position_rates) + 1))
        ax_acc.bar(ks, position_rates, color="tab:green")
        ax_acc.set_ylim(0, 1)
        tau = [row["eval/tau"] for row in history if "eval/tau" in row]
        title = "accepted prefix by block position"
        ax_acc.set_title(f"{title} (tau {tau[-1]:.2f})" if tau else title)
    else:
        ax_acc.set_title("no evaluation ran")
    ax_acc.set_xlabel("drafted position k")
    ax_acc.set_ylabel("share of blocks with slots 1..k accepted")
    ax_acc.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
