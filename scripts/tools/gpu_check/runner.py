"""The GPU check's runner: every section in turn, one JSON and one markdown report.

Command line: `scripts/gpu_check.py`; sections and what they assert: the package docstring.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspine_train.markdown_table import markdown_table
from scripts.tools.gpu_check.context import REPO, Check, Figures, Skip
from scripts.tools.gpu_check.decoding import section_exactness, section_real_shapes
from scripts.tools.gpu_check.environment import section_environment, section_gpu_tests
from scripts.tools.gpu_check.memory import section_memory
from scripts.tools.gpu_check.timing import section_timings

SECTIONS: list[tuple[str, Callable[[Check, Figures], None]]] = [
    ("environment", section_environment),
    ("gpu_tests", section_gpu_tests),
    ("exactness", section_exactness),
    ("real_shapes", section_real_shapes),
    ("timings", section_timings),
    ("memory", section_memory),
]


def run_section(name: str, fn: Callable[[Check, Figures], None], ck: Check, deadline: float) -> dict:
    """Run one section; failures and exceptions are recorded, never raised."""
    fig = Figures()
    start = time.perf_counter()
    if start > deadline:
        return dict(status="skipped", reason="over the time budget", seconds=0.0)
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        fn(ck, fig)
        status = "failed" if fig.get("failed_checks") else "ok"
    except Skip as reason:
        status, fig["reason"] = "skipped", str(reason)
    except Exception as err:  # noqa: BLE001 - one section's failure must not stop the others
        status = "failed"
        fig["error"] = f"{type(err).__name__}: {err}"
        fig["traceback"] = traceback.format_exc().strip().splitlines()[-12:]
    seconds = time.perf_counter() - start
    print(f"[gpu_check] {name}: {status} ({seconds:.1f} s)", flush=True)
    return dict(status=status, seconds=round(seconds, 2), **fig)


def markdown(report: dict) -> str:
    """A readable summary: one table row per section, then each section's figures (nested dicts
    as dotted keys, lists of records as tables)."""
    lines = [f"# GPU check ({report['device']}{', tiny' if report['tiny'] else ''})", "",
             f"{report['started']}, {report['total_s']:.0f} s in all. "
             f"Command: `{report['command']}`", ""]
    lines += markdown_table(["section", "status", "seconds"],
                            [(name, sec["status"], sec["seconds"])
                             for name, sec in report["sections"].items()], align="llr")
    for name, sec in report["sections"].items():
        lines += ["", f"## {name}: {sec['status']}", ""]
        body = {k: v for k, v in sec.items() if k not in ("status", "seconds")}
        lines += _markdown_figures("", body)
    return "\n".join(lines) + "\n"


def _markdown_figures(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        out = []
        for key, sub in value.items():
            out += _markdown_figures(f"{prefix}.{key}" if prefix else str(key), sub)
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        columns = list(dict.fromkeys(k for row in value for k in row))
        cells = [[_short(row.get(c, "")) for c in columns] for row in value]
        return [f"- **{prefix}**:", "", *markdown_table(columns, cells, indent="  "), ""]
    return [f"- **{prefix}**: {_short(value)}"]


def _short(value: Any) -> str:
    """A figure as markdown text: floats to 4 significant digits, the rest as JSON."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    text = json.dumps(value, default=lambda v: f"{v:.4g}" if isinstance(v, float) else str(v))
    return f"`{text}`"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes everywhere (CI on CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default artifacts/gpu_check/<device>[_tiny])")
    parser.add_argument("--iters", type=int, default=0,
                        help="timing iterations (default 50 on CUDA, 3 on CPU)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="sections not started within this many seconds are skipped")
    parser.add_argument("--pytest-timeout", type=float, default=480.0)
    parser.add_argument("--only", nargs="*", default=None, help="run only these sections")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = sorted(set(args.only or []) - {name for name, _ in SECTIONS})
    if unknown:
        print(f"error: --only {unknown}: no such section (sections: "
              f"{', '.join(name for name, _ in SECTIONS)})", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device (use --device cpu --tiny)",
              file=sys.stderr)
        return 2
    out = args.out or REPO / "artifacts" / "gpu_check" / (args.device + ("_tiny" if args.tiny else ""))
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report: dict[str, Any] = dict(
        device=args.device, tiny=args.tiny, started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command="python scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        budget_s=args.budget_s, sections={},
    )
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ck = Check(args, Path(tmp))
        deadline = start + args.budget_s
        for name, fn in SECTIONS:
            if args.only and name not in args.only:
                continue
            report["sections"][name] = run_section(name, fn, ck, deadline)
    report["total_s"] = time.perf_counter() - start
    failed = [n for n, s in report["sections"].items() if s["status"] == "failed"]
    report["failed_sections"] = failed
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"[gpu_check] wrote {out / 'gpu_check.json'} and gpu_check.md; "
          f"{'failed: ' + ', '.join(failed) if failed else 'all sections ok or skipped'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
