"""Regeneration through a real OpenAI-compatible HTTP server on 127.0.0.1 (started here)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from _data_helpers import FakeChatServer, chat_row, write_jsonl
from hydra import compose, initialize_config_dir

from data_prep.backends.http import HttpBackend, completions_url
from data_prep.config import REPO_ROOT, HttpBackendConfig, SamplingConfig, to_data_config
from data_prep.regenerate import REPORT_FILE, run_regeneration
from data_prep.schema import DataError
from data_prep.shards import shard_paths


def http_data(inputs, output_dir, urls, *extra):
    overrides = ["data.source.builtin=null", f"data.source.paths=[{inputs}]",
                 "data.source.heldout_fraction=0",
                 "data.regenerate.backend=http", f"data.regenerate.http.urls=[{','.join(urls)}]",
                 f"data.regenerate.output_dir={output_dir}", "data.regenerate.http.timeout_s=0.5",
                 "data.regenerate.http.max_retries=2", "data.regenerate.http.backoff_s=0.01",
                 "data.regenerate.http.max_in_flight=4", "data.regenerate.shard_size=2", *extra]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base="1.3"):
        return to_data_config(compose(config_name="data_prep_job", overrides=overrides).data)


def read_shards(output_dir):
    rows = [json.loads(line) for path in shard_paths(output_dir)
            for line in path.read_text().splitlines()]
    return {row["id"]: row for row in rows}, [row["id"] for row in rows]


def faults(content, attempt):
    if content == "flaky" and attempt < 2:
        return "500"
    if content == "slow" and attempt == 0:
        return "stall"
    if content == "down":
        return "500"
    if content == "rejected":
        return "400"
    return None


def test_retries_failures_and_accounting(tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", [
        chat_row("multi", "first", "original answer", "second", "original answer 2"),
        {"id": "prompt", "messages": [{"role": "user", "content": "just a prompt"}]},
        chat_row("flaky", "flaky", "x"),
        chat_row("slow", "slow", "x"),
        chat_row("down", "down", "x"),
        chat_row("rejected", "rejected", "x"),
        {"id": "robot", "messages": [{"role": "robot", "content": "beep"}]},
        "{not json",
    ])
    with FakeChatServer(faults, stall_s=1.5) as server:
        report = run_regeneration(http_data(inputs, tmp_path / "out", [server.url],
                                            "data.regenerate.sampling.enable_thinking=false",
                                            "data.regenerate.sampling.max_new_tokens=77"))

    assert report["input"] == 8
    assert (report["done"], report["failed"], report["skipped"], report["pending"]) == (4, 2, 2, 0)
    failed = {row["id"]: (row["reason"], row["detail"]) for row in report["failed_rows"]}
    assert failed["down"][0] == "http_500" and "gave up after 3 attempts" in failed["down"][1]
    assert failed["rejected"][0] == "http_400" and "injected 400" in failed["rejected"][1]
    assert server.attempts["rejected"] == 1  # a 4xx is not retried
    assert server.attempts["flaky"] == 3 and server.attempts["slow"] == 2
    assert {row["reason"] for row in report["skipped_rows"]} == {"unknown_role", "malformed_json"}
    assert json.loads((tmp_path / "out" / REPORT_FILE).read_text()) == report

    rows, order = read_shards(tmp_path / "out")
    assert sorted(order) == ["flaky", "multi", "prompt", "slow"]
    # Turn by turn: the second request carries the target's own first answer.
    assert rows["multi"]["messages"] == [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "reply 0 to first"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "reply 1 to second"}]
    assert rows["prompt"]["messages"][-1] == {"role": "assistant",
                                              "content": "reply 0 to just a prompt"}
    assert all(body["chat_template_kwargs"] == {"enable_thinking": False}
               for body in server.requests)
    assert all(body["max_tokens"] == 77 and body["temperature"] == 0.0
               for body in server.requests)


def test_round_robin_over_servers_and_resume_refuses_other_settings(tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl",
                         [chat_row(f"r{i}", f"q{i}", "a") for i in range(10)])
    with FakeChatServer() as first, FakeChatServer() as second:
        data = http_data(inputs, tmp_path / "out", [first.url, second.url])
        report = run_regeneration(data)
        assert len(first.requests) == len(second.requests) == 5
        assert report["done"] == 10
        again = run_regeneration(data)  # everything is already done: no new requests
        assert again["already_done"] == 10 and again["done_this_run"] == 0
        assert len(first.requests) + len(second.requests) == 10
        other = http_data(inputs, tmp_path / "out", [first.url],
                          "data.regenerate.sampling.temperature=0.7")
        with pytest.raises(DataError, match="temperature"):
            run_regeneration(other)


def test_workers_share_one_pool_of_keep_alive_connections():
    """24 conversations of 3 turns at once: 24 connections for 72 requests, none waiting.

    24 is above httpx's default of 20 kept-alive connections, so a pool not sized to
    ``max_in_flight`` reconnects; one too small makes the first turns wait for a connection
    and the barrier (all 24 first turns on the server together) break.
    """
    workers = 24
    rows = [chat_row(f"r{i}", f"first {i}", "a", f"second {i}", "b", f"third {i}", "c")
            for i in range(workers)]
    together = threading.Barrier(workers, timeout=20)

    def first_turns_together(content, attempt):
        if content.startswith("first"):
            together.wait()
        return None

    config = HttpBackendConfig(max_in_flight=workers, timeout_s=30, max_retries=0)
    with FakeChatServer(first_turns_together) as server:
        config.urls = [server.url]
        outcomes = list(HttpBackend(config, SamplingConfig()).regenerate(rows))
    assert [o.error for o in outcomes] == [None] * workers and not together.broken
    assert len(server.requests) == 3 * workers and server.peak_in_flight == workers
    assert server.connections == workers  # urllib opened one per request: 72


def _refused_url():
    """A loopback URL where nothing listens (the port was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_resets_garbage_and_refused_connections_are_retried_then_named():
    def faults(content, attempt):
        return {"reset once": "reset" if attempt == 0 else None,
                "garbage once": "garbage" if attempt == 0 else None,
                "always reset": "reset", "always garbage": "garbage"}.get(content)

    rows = [chat_row(name.replace(" ", "-"), name, "x")
            for name in ("reset once", "garbage once", "always reset", "always garbage")]
    dead = _refused_url()
    with FakeChatServer(faults) as server:
        config = HttpBackendConfig(urls=[server.url], timeout_s=5, max_retries=1, backoff_s=0.01)
        outcomes = {o.id: o for o in HttpBackend(config, SamplingConfig()).regenerate(rows)}
        assert outcomes["reset-once"].error is None and outcomes["garbage-once"].error is None
        assert server.attempts["reset once"] == server.attempts["garbage once"] == 2
        reset, garbage = outcomes["always-reset"].error, outcomes["always-garbage"].error
        assert reset.startswith(f"connection_error: {server.url}/v1/chat/completions: ")
        assert garbage.startswith(f"bad_response: {server.url}/v1/chat/completions: ")
        assert "gave up after 2 attempts" in reset and "gave up after 2 attempts" in garbage

        # A server that refuses connections: the next attempt goes to the other one.
        config = HttpBackendConfig(urls=[dead, server.url], max_in_flight=1, timeout_s=5,
                                   max_retries=1, backoff_s=0.01)
        outcome, = HttpBackend(config, SamplingConfig()).regenerate([chat_row("r", "q", "a")])
        assert outcome.error is None and server.attempts["q"] == 1
    config = HttpBackendConfig(urls=[dead], timeout_s=5, max_retries=0)
    outcome, = HttpBackend(config, SamplingConfig()).regenerate([chat_row("r", "q", "a")])
    assert outcome.error.startswith(f"connection_error: {dead}/v1/chat/completions: ")


def test_reasoning_content_is_put_back_as_think_block():
    payload = json.dumps({"choices": [{"finish_reason": "length", "message": {
        "content": "\nThe answer.", "reasoning_content": "Let me see.\n"}}],
        "usage": {"completion_tokens": 9}}).encode()
    reply = HttpBackend._parse(payload)
    assert reply.text == "<think>\nLet me see.\n</think>\n\nThe answer."
    assert reply.truncated and reply.completion_tokens == 9
    assert completions_url("http://h:1/") == "http://h:1/v1/chat/completions"
    assert completions_url("http://h:1/v1") == "http://h:1/v1/chat/completions"
    backend = HttpBackend(HttpBackendConfig(urls=["http://h:1"]), SamplingConfig(temperature=1.0))
    seeds = {json.loads(backend._body([], f"row{i}"))["seed"] for i in range(5)}
    assert len(seeds) == 5  # per-row seeds, stable across processes (not Python's hash)
    assert json.loads(backend._body([], "row0"))["seed"] == json.loads(
        HttpBackend(HttpBackendConfig(), SamplingConfig(temperature=1.0))._body([], "row0"))["seed"]


def _start_cli(inputs, output_dir, url):
    command = [sys.executable, "-m", "data_prep.regenerate", "data.source.builtin=null",
               "data.source.heldout_fraction=0",
               f"data.source.paths=[{inputs}]", "data.regenerate.backend=http",
               f"data.regenerate.http.urls=[{url}]", f"data.regenerate.output_dir={output_dir}",
               "data.regenerate.http.max_in_flight=2", "data.regenerate.shard_size=3",
               f"hydra.run.dir={output_dir.parent / 'hydra'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # A shell runs background jobs with SIGINT ignored, and a child inherits that: give the CLI
    # the default disposition, so Python turns the Ctrl-C below into KeyboardInterrupt.
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_shards(output_dir, count, process, timeout=60.0):
    deadline = time.monotonic() + timeout
    while len(shard_paths(output_dir)) < count:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)


def test_kill_and_interrupt_then_resume_loses_and_duplicates_nothing(tmp_path):
    ids = [f"row-{i:03d}" for i in range(60)]
    inputs = write_jsonl(tmp_path / "in.jsonl", [chat_row(i, f"question {i}", "a") for i in ids])
    out = tmp_path / "out"
    with FakeChatServer(delay_s=0.1) as server:
        process = _start_cli(inputs, out, server.url)
        _wait_for_shards(out, 2, process)
        process.kill()  # kill -9: no chance to flush
        process.wait()
        after_kill = len(read_shards(out)[1])
        assert 6 <= after_kill < 60

        process = _start_cli(inputs, out, server.url)
        _wait_for_shards(out, len(shard_paths(out)) + 2, process)
        process.send_signal(signal.SIGINT)  # Ctrl-C: finished rows are flushed
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 130, stderr
        report = json.loads((out / REPORT_FILE).read_text())
        assert report["interrupted"] and report["already_done"] == after_kill
        assert report["done"] + report["failed"] + report["skipped"] + report["pending"] == 60

        process = _start_cli(inputs, out, server.url)
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
    assert "input 60 = done 60" in stdout
    rows, order = read_shards(out)
    assert sorted(order) == ids  # every row exactly once
    assert all(rows[i]["messages"][-1]["content"] == f"reply 0 to question {i}" for i in ids)
    assert not list(out.glob("*.tmp"))
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["done"] == 60 and report["already_done"] > after_kill
