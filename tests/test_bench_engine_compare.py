"""`scripts/bench_engine.py --compare`: every decoding mode side by side, on a tiny target."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _engine_helpers import build_tiny_target, build_tokenizer, tiny_draft

from dspine_train.engine.cli import add_engine_arguments
from scripts.tools.bench.hf_reference import Decoded
from scripts.tools.bench.side_by_side import (
    MODE_NAMES,
    Mode,
    Totals,
    add_compare_arguments,
    compare_argument_problem,
    make_rows,
)

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
# Repeats itself, so an earlier n-gram continues the answer: prompt lookup accepts tokens.
REPETITIVE = "w1 w2 w3 w4 w5 w1 w2 w3 w4 w5 w1 w2 w3"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    hf = build_tiny_target(root / "target", "qwen3", eos_token_id=None, head_scale=4.0)
    tok = build_tokenizer(root / "target", vocab_size=200)
    # A chat template, so held-out style benchmark files (chat messages) can be encoded.
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(root / "target")
    tiny_draft(hf, 200).save_pretrained(root / "draft")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": REPETITIVE}) + "\n"
                                        + '"w7 w8 w9 w7 w8 w9 w7 w8"\n')
    (root / "heldout.jsonl").write_text(json.dumps({"prompt": "w4 w5 w6 w4 w5 w6 w4"}) + "\n")
    return root


def bench_command(files: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "scripts" / "bench_engine.py"), "--compare",
        "--target", str(files / "target"), "--draft", str(files / "draft"),
        "--prompts", str(files / "prompts.jsonl"), "--bench", str(files / "heldout.jsonl"),
        "--max-new-tokens", "16", "--max-seq-len", "64", "--rounds", "1",
        "--compare-tree-paths", "2", "--output", str(out), *extra,
    ]


def test_compare_runs_every_mode_on_every_benchmark(files):
    out = files / "compare.json"
    done = subprocess.run(bench_command(files, out), capture_output=True, text=True, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("| benchmark | mode | T | tau | SE | tok/s | x plain | x HF plain | lossless |"
            in done.stdout)
    report = json.loads(out.read_text())
    assert report["skipped_modes"] == {}
    ran = list(MODE_NAMES)
    greedy = [r for r in report["rows"] if r["temperature"] == 0]
    # one row per mode and benchmark
    assert sorted((r["bench"], r["mode"]) for r in greedy) == sorted(
        (b, m) for b in ("prompts", "heldout") for m in ran)
    assert report["benchmarks"]["prompts"]["num_prompts"] == 2
    for row in greedy:  # every mode gives plain decoding's tokens, the engine's and HF's alike
        assert row["lossless"] and row["same_as_hf_plain"], row
        assert row["speedup"] > 0 and row["speedup_vs_hf_plain"] > 0
    for name in ("HF prompt lookup", "n-gram"):
        row = next(r for r in greedy if r["mode"] == name and r["bench"] == "prompts")
        # it accepted candidates: fewer target forwards (prefills included) than new tokens
        assert row["verifications"] + row["num_prompts"] < row["new_tokens"], row
        assert row["tau"] > 1.0
    plain = [r for r in greedy if r["mode"] in ("HF plain", "engine plain")]
    assert all(r["tau"] == 1.0 for r in plain)
    # the sampling pass: tau of every mode but plain decoding, nothing compared token by token
    sampled = [r for r in report["rows"] if r["temperature"] > 0]
    assert sorted((r["bench"], r["mode"]) for r in sampled) == sorted(
        (b, m) for b in ("prompts", "heldout") for m in ran if not m.endswith("plain"))
    assert all(r["lossless"] is None and r["tau"] >= 1.0 for r in sampled)
    assert all(r["tau_se"] is not None for r in report["rows"] if r["bench"] == "prompts")
    assert all(r["tau_se"] is None for r in report["rows"] if r["bench"] == "heldout")  # 1 prompt


def test_sampling_rounds_draw_anew_and_tau_carries_a_prompt_clustered_se(tmp_path):
    """Each (sampling round, prompt) gets its own seed; tau is the ratio of the sums and its
    SE the delta-method one over the prompts' sums (rounds of a prompt pooled)."""
    from scripts.tools.bench import side_by_side
    from scripts.tools.bench.prompt_log import PromptLog

    seeds = []
    per_seed = {0: (4, 2), 1: (6, 3), 2: (3, 3), 3: (9, 3)}  # seed -> (verified, forwards)

    def run(ids, temperature, seed):
        seeds.append(seed)
        verified, forwards = per_seed.get(seed, (1, 1))
        return Decoded([7] * verified, forwards, verified, 0.1)

    modes = [Mode("n-gram", "engine", run)]
    log = PromptLog(tmp_path / "log.jsonl", {})
    benches = [("b", [[1, 2], [3, 4]], {})]
    ran, totals = side_by_side.run_pass(modes, benches, 1.0, 2, 0, {}, log)
    assert seeds[1:] == [0, 1, 2, 3]  # after the warm-up: round 0's prompts, then round 1's
    t = totals[("b", "n-gram")]
    assert t.per_prompt == {0: [4 + 3, 2 + 3], 1: [6 + 9, 3 + 3]}
    tau = (7 + 15) / (5 + 6)
    spread = (7 - tau * 5) ** 2 + (15 - tau * 6) ** 2
    assert t.tau_se() == pytest.approx((2 * spread) ** 0.5 / 11)
    row = make_rows(totals, ran, benches, 1.0, 2)[0]
    assert row.tau == pytest.approx(tau) and row.tau_se == pytest.approx(t.tau_se())
    assert row.rounds == 2


def test_compare_rejects_an_unknown_mode_before_loading(files):
    out = files / "bad.json"
    done = subprocess.run(bench_command(files, out, "--compare-modes", "HF plain,warp"),
                          capture_output=True, text=True, env=ENV)
    assert done.returncode == 2
    assert "--compare-modes: unknown mode(s) ['warp']" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--sampling-rounds", "0"], "--sampling-rounds must be >= 1, got 0"),
    (["--prompt-lookup-tokens", "0"], "--prompt-lookup-tokens must be >= 1"),
    (["--compare-tree-paths", "1", "--compare-tree-nodes", "9"], "needs --compare-tree-paths > 1"),
    (["--compare-temperature", "nan"], "--compare-temperature must be a finite number >= 0"),
    (["--ngram-min-n", "4", "--ngram-max-n", "2"], "--ngram-min-n"),
    (["--compare-modes", "n-gram,plain"], "unknown mode(s) ['plain']"),
])
def test_compare_flags_are_checked_by_name(argv, message):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, prompts_required=False)
    add_compare_arguments(parser)
    args = parser.parse_args(["--target", "t", "--compare", *argv])
    assert message in compare_argument_problem(args)
    assert compare_argument_problem(parser.parse_args(["--target", "t", "--compare"])) is None


def test_rows_compare_each_mode_with_its_own_plain_decoding():
    """Speed-ups over the family's plain decoding and over HF plain; a differing output is
    named by prompt and token."""
    def mode(name, family, plain=False):
        return Mode(name, family, lambda ids, t, s: None, plain=plain)

    modes = [mode("HF plain", "hf", True), mode("HF prompt lookup", "hf"),
             mode("engine plain", "engine", True), mode("DSpine chain", "engine")]
    runs = {"HF plain": ([[1, 2, 3]], 2, 2, 3.0), "HF prompt lookup": ([[1, 2, 3]], 1, 2, 1.0),
            "engine plain": ([[1, 2, 3]], 2, 2, 1.5), "DSpine chain": ([[1, 2, 4]], 1, 2, 1.0)}
    totals = {}
    for name, (outputs, verifications, verified, seconds) in runs.items():
        t = totals[("b", name)] = Totals()
        for tokens in outputs:
            t.add(Decoded(tokens, verifications, verified, seconds), first_round=True)
    rows = {r.mode: r for r in make_rows(totals, modes, [("b", [[0]], {})], 0.0, 1)}
    assert rows["HF prompt lookup"].speedup == pytest.approx(3.0)
    assert rows["HF prompt lookup"].tau == 2.0 and rows["HF prompt lookup"].lossless
    assert rows["engine plain"].speedup == 1.0
    assert rows["engine plain"].speedup_vs_hf_plain == pytest.approx(2.0)
    chain = rows["DSpine chain"]
    assert chain.speedup == pytest.approx(1.5) and chain.speedup_vs_hf_plain == pytest.approx(3.0)
    assert chain.lossless is False and chain.first_difference == [0, 2]


def test_a_rerun_reads_every_prompt_from_the_log(files):
    """The same command again decodes nothing: the report is rebuilt from the per-prompt log
    (the same figures to the last digit, timings included); other settings are refused."""
    out = files / "resume.json"
    first = subprocess.run(bench_command(files, out, "--compare-temperature", "0"),
                           capture_output=True, text=True, env=ENV)
    assert first.returncode == 0, first.stderr[-2000:]
    log = files / "resume.prompts.jsonl"
    records = log.read_text().splitlines()
    assert len(records) == 1 + 3  # the settings, then 2 + 1 prompts of one greedy pass
    rows = json.loads(out.read_text())["rows"]
    again = subprocess.run(bench_command(files, out, "--compare-temperature", "0"),
                           capture_output=True, text=True, env=ENV)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "3 of 3 prompt passes read from" in again.stdout
    assert "to decode" not in again.stdout
    assert log.read_text().splitlines() == records
    assert json.loads(out.read_text())["rows"] == rows

    changed = subprocess.run(bench_command(files, files / "other.json", "--compare-temperature",
                                           "0", "--max-new-tokens", "8", "--compare-log",
                                           str(log)), capture_output=True, text=True, env=ENV)
    assert changed.returncode == 2
    assert str(log) in changed.stderr and "max_new_tokens: 16 there, 8 now" in changed.stderr
    assert "Traceback" not in changed.stderr and not (files / "other.json").exists()


def test_the_log_resumes_after_a_torn_last_line(tmp_path):
    """A kill mid-write leaves half a line: that prompt is decoded again, the rest is kept."""
    from scripts.tools.bench.prompt_log import PromptLog, PromptLogError

    path = tmp_path / "run.prompts.jsonl"
    log = PromptLog(path, {"seed": 0})
    log.append((0.0, 0, "b", 0), {"m": Decoded([1, 2], 1, 1, 0.5)})
    log.append((0.0, 0, "b", 1), {"m": Decoded([3], 1, 0, 0.25)})
    path.write_text(path.read_text()[:-20])  # the second record cut short
    again = PromptLog(path, {"seed": 0})
    assert again.get((0.0, 0, "b", 0)) == {"m": Decoded([1, 2], 1, 1, 0.5)}
    assert again.get((0.0, 0, "b", 1)) is None
    assert len(path.read_text().splitlines()) == 2  # the torn line is gone
    path.write_text(path.read_text() + "not json\n" + path.read_text().splitlines()[1] + "\n")
    with pytest.raises(PromptLogError, match="line 3 is not a prompt record"):
        PromptLog(path, {"seed": 0})
