"""What a verify of T tokens costs the target on this machine, by kernel: `F.linear` against
the weight-first product (`modeling.few_rows`), side by side in one run.

Loads the target (default: the demo's embedded Qwen2.5-Coder-0.5B), fills its cache with a
`--context`-token prefix, then times one target forward plus its logits over T new tokens for
each T, alternating the two kernels (`--repeats` interleaved pairs, median), and checks that
both give the same argmax per row (and how far their logits differ). Prints a table of seconds
and of the cost relative to one plain decoding step, and writes JSON.

    python scripts/bench_verify_rows.py                                # the demo's target
    python scripts/bench_verify_rows.py --rows 1,2,4,8 --threads 2 --out bench_results/v.json

Run it on an idle machine: the figures are ratios measured in one run, not absolute speeds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dspine_train.engine import load_target  # noqa: E402
from dspine_train.markdown_table import markdown_table  # noqa: E402
from dspine_train.modeling.few_rows import set_weight_first_rows  # noqa: E402


@dataclass
class RowCost:
    """One T: median seconds of a forward + logits with each kernel, and their agreement."""

    rows: int
    linear_s: float
    weight_first_s: float
    argmax_equal: bool
    max_abs_logit_diff: float


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(REPO / "artifacts" / "default_target"),
                        help="HF target directory (default: the demo's embedded target)")
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16",
                        help="comma-separated token counts T per verify")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved pairs per T")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", default=str(REPO / "bench_results" / "verify_rows.json"),
                        help="JSON output path")
    return parser


def parse_rows(text: str) -> list[int]:
    try:
        rows = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise SystemExit(f"--rows: expected comma-separated integers, got {text!r}") from err
    if not rows or min(rows) < 1:
        raise SystemExit(f"--rows: every T must be >= 1, got {text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = parse_rows(args.rows)
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"--target {args.target}: no config.json (run `make demo` first, or "
                         "name an HF model directory)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = load_target(args.target)
    vocab = target.config.vocab_size
    target.setup(1, args.context + max(rows) + 8)
    prefix = torch.randint(0, vocab, (1, args.context))
    target(prefix, prefill=True)
    target.cache.lengths[:1] = args.context
    kv_len = args.context + max(rows)

    def verify(tokens: torch.Tensor, weight_first: int) -> tuple[float, torch.Tensor]:
        set_weight_first_rows(target, weight_first)
        start = time.perf_counter()
        logits = target.logits(target(tokens, kv_len=kv_len).hidden)
        return time.perf_counter() - start, logits

    results = []
    widest = max(rows)
    for count in rows:
        tokens = torch.randint(0, vocab, (1, count))
        verify(tokens, 0), verify(tokens, widest)  # warm both paths
        linear, weight_first = [], []
        for _ in range(args.repeats):
            seconds, plain_logits = verify(tokens, 0)
            linear.append(seconds)
            seconds, first_logits = verify(tokens, widest)
            weight_first.append(seconds)
        results.append(RowCost(
            rows=count, linear_s=statistics.median(linear),
            weight_first_s=statistics.median(weight_first),
            argmax_equal=bool(torch.equal(plain_logits.argmax(-1), first_logits.argmax(-1))),
            max_abs_logit_diff=float((plain_logits - first_logits).abs().max())))
    base = results[0].linear_s if results[0].rows == 1 else None
    header = ["T", "F.linear s", "weight-first s", "weight-first / linear", "argmax equal",
              "max |dlogit|"]
    if base is not None:
        header[3:3] = ["linear / plain step", "weight-first / plain step"]
    table = []
    for r in results:
        row = [r.rows, f"{r.linear_s:.4f}", f"{r.weight_first_s:.4f}"]
        if base is not None:
            row += [f"{r.linear_s / base:.2f}", f"{r.weight_first_s / base:.2f}"]
        row += [f"{r.weight_first_s / r.linear_s:.2f}", r.argmax_equal,
                f"{r.max_abs_logit_diff:.1e}"]
        table.append(row)
    print("\n".join(markdown_table(header, table)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "target": args.target, "context": args.context, "repeats": args.repeats,
        "threads": args.threads, "torch": torch.__version__, "machine": platform.processor()
        or platform.machine(), "results": [asdict(r) for r in results]}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
