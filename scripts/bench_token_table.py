"""Time and peak memory of building the token table (METHOD 2.1) at Qwen3-8B's head shape.

Builds a random low-rank-plus-noise head matrix (151936 x 4096 float32 by default, fixed seed),
runs ``build_token_table`` with the chunked covariance method, and reports wall time and peak
resident memory relative to the matrix size. Optionally compares against scikit-learn's PCA on a
slice of the rows. Goal on a 2-core CPU: under 60 s, peak RSS under 3x the matrix.

    python scripts/bench_token_table.py                       # full size, ~2.5 GB matrix
    python scripts/bench_token_table.py --vocab 20000 --hidden 512 --rank 128 --sklearn-rows 0

Prints a table and writes JSON (``--out``, default bench_results/token_table.json).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import dspine_train.token_table as token_table
from dspine_train.token_table import DEFAULT_CHUNK_SIZE, build_token_table

GIB = 1024**3


def _status_bytes(field: str) -> int:
    """A ``kB`` field (VmRSS, VmHWM) of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} field")


class PeakRSS:
    """Peak resident set size over a ``with`` block.

    Resets the kernel's high-water mark (VmHWM) on entry where allowed and also samples VmRSS
    from a background thread, since tracemalloc does not see torch's allocations.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_bytes("VmRSS"))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRSS:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # "5" resets VmHWM to the current RSS
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self.peak = _status_bytes("VmRSS")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._hwm_reset:
            self.peak = max(self.peak, _status_bytes("VmHWM"))


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# Phases of the covariance build, by the private function that runs each. The covariance pass
# includes the eigendecomposition; the table reports the Gram pass as the difference.
PHASES = {
    "covariance_pass": "_covariance_basis",
    "eigh": "_top_eigenpairs",
    "codes_pass": "_project",
}


@contextlib.contextmanager
def phase_timer() -> Iterator[dict[str, dict[str, float]]]:
    """Record wall and CPU seconds of each phase of ``build_token_table`` while active."""
    timings: dict[str, dict[str, float]] = {}
    originals = {name: getattr(token_table, attr) for name, attr in PHASES.items()}

    def timed(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> object:
            wall, cpu = time.perf_counter(), _cpu_seconds()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = timings.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0})
                entry["wall_s"] += time.perf_counter() - wall
                entry["cpu_s"] += _cpu_seconds() - cpu

        return wrapper

    for name, attr in PHASES.items():
        setattr(token_table, attr, timed(name, originals[name]))
    try:
        yield timings
    finally:
        for name, attr in PHASES.items():
            setattr(token_table, attr, originals[name])


def make_head(
    vocab: int,
    hidden: int,
    signal_rank: int,
    noise_share: float,
    seed: int,
    chunk_size: int = 16384,
) -> torch.Tensor:
    """Random (vocab, hidden) float32 head: shared offset + rank-``signal_rank`` signal + noise.

    ``noise_share`` is the noise's expected share of a row's squared norm (before the offset).
    Built in row chunks so no temporary of the full size exists next to the result.
    """
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(signal_rank, hidden, generator=gen) / hidden**0.5  # (k, H)
    # Signal rows have squared norm ~ signal_rank; pick the noise scale for the requested share.
    noise_std = (signal_rank * noise_share / (1.0 - noise_share) / hidden) ** 0.5
    offset = torch.randn(hidden, generator=gen) * (0.5 * signal_rank / hidden) ** 0.5
    weight = torch.empty(vocab, hidden)
    for start in range(0, vocab, chunk_size):
        rows = weight[start : start + chunk_size]  # (c, H) view
        coeffs = torch.randn(rows.shape[0], signal_rank, generator=gen)  # (c, k)
        torch.randn(rows.shape, generator=gen, out=rows).mul_(noise_std)
        rows.addmm_(coeffs, basis).add_(offset)
    return weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=1024, help="transfer_dim r")
    parser.add_argument("--signal-rank", type=int, default=64)
    parser.add_argument("--noise-share", type=float, default=0.1)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sklearn-rows",
        type=int,
        default=32768,
        help="also compare with sklearn PCA on this many rows (0: skip)",
    )
    parser.add_argument("--out", default="bench_results/token_table.json")
    args = parser.parse_args()

    rss_start = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    weight = make_head(args.vocab, args.hidden, args.signal_rank, args.noise_share, args.seed)
    make_s = time.perf_counter() - t0
    matrix_bytes = weight.numel() * weight.element_size()
    rss_before = _status_bytes("VmRSS")
    load_before = os.getloadavg()[0]

    with PeakRSS() as peak, phase_timer() as phases:
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        table = build_token_table(weight, args.rank, chunk_size=args.chunk_size)
        build_s, build_cpu_s = time.perf_counter() - t0, _cpu_seconds() - cpu0
    codes_bytes = table.codes.numel() * table.codes.element_size()

    results: dict[str, object] = {
        "vocab": args.vocab,
        "hidden": args.hidden,
        "rank": args.rank,
        "signal_rank": args.signal_rank,
        "noise_share": args.noise_share,
        "chunk_size": args.chunk_size,
        "matrix_gib": matrix_bytes / GIB,
        "codes_gib": codes_bytes / GIB,
        "make_matrix_s": make_s,
        "build_s": build_s,
        "build_cpu_s": build_cpu_s,
        "gram_pass_s": phases["covariance_pass"]["wall_s"] - phases["eigh"]["wall_s"],
        "gram_pass_cpu_s": phases["covariance_pass"]["cpu_s"] - phases["eigh"]["cpu_s"],
        "eigh_s": phases["eigh"]["wall_s"],
        "eigh_cpu_s": phases["eigh"]["cpu_s"],
        "codes_pass_s": phases["codes_pass"]["wall_s"],
        "codes_pass_cpu_s": phases["codes_pass"]["cpu_s"],
        "rss_start_gib": rss_start / GIB,
        "rss_before_build_gib": rss_before / GIB,
        "peak_rss_gib": peak.peak / GIB,
        "peak_rss_over_matrix": peak.peak / matrix_bytes,
        "build_extra_over_matrix": (peak.peak - rss_before) / matrix_bytes,
        "explained_variance_ratio": float(table.metadata["explained_variance_ratio"]),
        "goal_time_ok": build_s < 60.0,
        "goal_memory_ok": peak.peak < 3 * matrix_bytes,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_1min_before_build": load_before,
        "loadavg_1min_after_build": os.getloadavg()[0],
    }
    del table

    if args.sklearn_rows > 0:
        rows = min(args.sklearn_rows, args.vocab)
        rank = min(args.rank, args.hidden, rows - 1)
        part = weight[:rows]
        timings = {}
        tables = {}
        for method in ("covariance", "pca"):
            t0 = time.perf_counter()
            tables[method] = build_token_table(
                part, rank, method=method, chunk_size=args.chunk_size
            )
            timings[method] = time.perf_counter() - t0
        cov, pca = tables["covariance"], tables["pca"]
        results["sklearn_slice"] = {
            "rows": rows,
            "rank": rank,
            "covariance_s": timings["covariance"],
            "pca_s": timings["pca"],
            # Directions past the signal rank span a near-degenerate noise subspace, so compare
            # eigenvalues and the signal-rank code coordinates rather than every direction.
            "eigenvalue_max_rel_diff": float(
                ((cov.eigenvalues - pca.eigenvalues).abs() / cov.eigenvalues).max()
            ),
            "signal_directions_max_abs_diff": float(
                (cov.directions[:, : args.signal_rank] - pca.directions[:, : args.signal_rank])
                .abs()
                .max()
            ),
        }

    print(f"\ntoken table bench: {args.vocab} x {args.hidden} float32 -> r = {args.rank}")
    print(f"{'metric':<34} {'value':>14}")
    print("-" * 49)
    for key, value in results.items():
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                print(f"{key + '.' + sub_key:<34} {_fmt(sub_value):>14}")
        else:
            print(f"{key:<34} {_fmt(value):>14}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    main()
