r"""Benchmark the OpenAI-compatible server at rising concurrency, with the `openai` client.

    python scripts/bench_serve.py --prompts prompts.txt -- --target TARGET_DIR --draft DRAFT_DIR \
        [--device cuda --dtype bfloat16 --max-batch-size 16 ...]
    python scripts/bench_serve.py --prompts prompts.txt --url http://127.0.0.1:8000

Without `--url` it starts `python -m dspine_train.serving` with the arguments after `--` on a
free loopback port, waits for `/health`, and stops it (SIGTERM) at the end. At each concurrency
(`--concurrency 1 2 4 8 16`) it sends `--requests` requests (default 4 x concurrency, at least
8), prompts taken in turn from the prompts file (`.jsonl` of `{"prompt": ...}` or one per
line), from that many client threads at once, greedy by default, chat completions unless
`--completions`. It prints a markdown table (requests/s, output tokens/s, latency p50/p90/p99,
mean acceptance length from each response's `usage.acceptance_length`) and writes the rows as
JSON (`--output`). One warm-up request runs first, untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages

from dspine_train.engine.prompts import read_prompts  # noqa: E402
from dspine_train.markdown_table import markdown_table  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def start_server(server_args: list[str], timeout_s: float) -> tuple[subprocess.Popen, str]:
    """`python -m dspine_train.serving SERVER_ARGS` on a free loopback port, once healthy."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "dspine_train.serving", *server_args, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"error: the server exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise SystemExit(f"error: the server was not healthy after {timeout_s:.0f} s")


def one_request(client: openai.OpenAI, model: str, prompt: str, args: argparse.Namespace
                ) -> dict[str, float | None]:
    """Send one request; its latency, output tokens and acceptance length."""
    start = time.perf_counter()
    common = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature)
    if args.completions:
        out = client.completions.create(prompt=prompt, **common)
    else:
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                             **common)
    latency = time.perf_counter() - start
    extra = out.usage.model_extra or {}
    return {"latency_s": latency, "completion_tokens": out.usage.completion_tokens,
            "acceptance_length": extra.get("acceptance_length")}


def run_level(client: openai.OpenAI, model: str, prompts: list[str], concurrency: int,
              requests: int, args: argparse.Namespace) -> dict[str, float]:
    """`requests` requests from `concurrency` threads; the level's row."""
    chosen = [prompts[i % len(prompts)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(client, model, p, args), chosen))
    wall = time.perf_counter() - start
    latencies = [r["latency_s"] for r in results]
    tokens = sum(r["completion_tokens"] for r in results)
    taus = [r["acceptance_length"] for r in results if r["acceptance_length"] is not None]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "wall_s": wall,
        "requests_per_s": requests / wall,
        "output_tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p90_s": percentile(latencies, 0.9),
        "latency_p99_s": percentile(latencies, 0.99),
        "mean_acceptance_length": sum(taus) / len(taus) if taus else None,
    }


def print_table(rows: list[dict[str, float]]) -> None:
    header = ["concurrency", "requests", "req/s", "out tok/s", "p50 s", "p90 s", "p99 s",
              "acceptance"]
    lines = markdown_table(header, [
        [r["concurrency"], r["requests"], f"{r['requests_per_s']:.2f}",
         f"{r['output_tokens_per_s']:.1f}", f"{r['latency_p50_s']:.3f}",
         f"{r['latency_p90_s']:.3f}", f"{r['latency_p99_s']:.3f}",
         "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"]
        for r in rows], align="r" * len(header))
    print("\n".join(lines))


def main() -> int:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="prompts file (.jsonl or one per line)")
    parser.add_argument("--url", default=None, help="a running server (else one is started)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per concurrency level (default: max(8, 4 x concurrency))")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--completions", action="store_true",
                        help="/v1/completions with the raw prompt (default: chat completions)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--output", default="bench_results/serve.json")
    args = parser.parse_args(own)
    if args.url is None and not server_args:
        parser.error("give --url, or the server's arguments after `--`")
    if any(c < 1 for c in args.concurrency) or args.max_tokens < 1:
        parser.error("--concurrency values and --max-tokens must be >= 1")
    prompts = read_prompts(args.prompts)

    process = None
    url = args.url
    if url is None:
        process, url = start_server(server_args, args.startup_timeout)
    try:
        client = openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="x", max_retries=0,
                               timeout=args.startup_timeout)
        model = client.models.list().data[0].id
        one_request(client, model, prompts[0], args)  # warm-up
        rows = []
        for concurrency in args.concurrency:
            requests = args.requests or max(8, 4 * concurrency)
            rows.append(run_level(client, model, prompts, concurrency, requests, args))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    print_table(rows)
    report = {
        "url": args.url, "server_args": server_args, "model": model, "host": platform.node(),
        "prompts": args.prompts, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "endpoint": "completions" if args.completions else "chat.completions", "runs": rows,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
