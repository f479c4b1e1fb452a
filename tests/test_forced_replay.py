"""`bench_engine.py --compare --replay-sampled`: every point-mass mode replayed on the same
sampled answers (`scripts/tools/bench/forced_replay.py`)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_bench_engine_compare import ENV, bench_command, files  # noqa: F401 - the fixture

from scripts.tools.bench.forced_replay import (
    Answer,
    ForcedAnswer,
    ForcedAnswerProcessor,
    ReplayError,
    ReplayLog,
    ReplayTotals,
    paired_difference,
    replay_answers,
)
from scripts.tools.bench.hf_reference import Decoded

MODES = "HF prompt lookup,DSpine chain,n-gram,hybrid,hybrid tree,DSpine tree"
REPLAYED = ("HF prompt lookup", "n-gram", "hybrid", "hybrid tree", "DSpine tree")


def test_every_mode_replays_its_own_sampled_answers_to_the_forward(files):  # noqa: F811
    """A sampling pass (at T=0.1, near greedy: the repetitive prompt's answers copy it), then the
    replay: each replayed mode reproduces every answer (any mode's) and, on the answers it
    drew itself, exactly the forwards its live run took; the chain (rejection sampling against
    the draft's q) is not replayed. A rerun replays nothing again."""
    out = files / "replay.json"
    argv = bench_command(files, out, "--compare-modes", MODES, "--compare-temperature", "0.1",
                         "--replay-sampled")
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    replay = json.loads(out.read_text())["replay"]
    rows = {(r["bench"], r["mode"]): r for r in replay["rows"]}
    # 6 modes' answers per prompt: 2 prompts in "prompts", 1 in "heldout"
    assert replay["answers"] == 6 * 3
    assert sorted(rows) == sorted((b, m) for b in ("prompts", "heldout") for m in REPLAYED)
    for (bench, mode), row in rows.items():
        assert row["answers"] == 6 * (2 if bench == "prompts" else 1), row
        assert row["self_checks"] == (2 if bench == "prompts" else 1), row
        assert row["self_matches"] == row["self_checks"], row  # exact, to the forward
        assert row["tau"] >= 1.0
        if mode == "HF prompt lookup":
            assert row["vs"] is None and row["difference"] is None
        else:
            assert row["vs"] == "HF prompt lookup"
            mine = row["tau"] - rows[(bench, "HF prompt lookup")]["tau"]
            assert row["difference"] == pytest.approx(mine)
    # the repetitive prompts: copying accepts tokens on the common answers
    assert rows[("prompts", "n-gram")]["tau"] > 1.0, done.stdout[-3000:]
    assert "| benchmark | mode | answers | tau replayed |" in done.stdout
    log = files / "replay.prompts.replay.jsonl"
    assert len(log.read_text().splitlines()) == 6 * 3 * len(REPLAYED)

    again = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"({6 * 3 * len(REPLAYED)} replays already in" in again.stdout
    assert "replay: 10/" in done.stdout and "replay: 10/" not in again.stdout  # nothing replayed again
    assert json.loads(out.read_text())["replay"]["rows"] == replay["rows"]

    # one benchmark only; an unknown one is refused by name
    one = subprocess.run(argv[:-1] + ["--replay-sampled", "heldout"], capture_output=True,
                         text=True, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    rows_one = json.loads(out.read_text())["replay"]["rows"]
    assert rows_one == [r for r in replay["rows"] if r["bench"] == "heldout"]
    bad = subprocess.run(argv[:-1] + ["--replay-sampled", "heldout,nope"], capture_output=True,
                         text=True, env=ENV)
    assert bad.returncode == 2
    assert "--replay-sampled: unknown benchmark(s) ['nope']" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_forcing_lifts_the_answer_token_and_leaves_positions_past_it():
    forced = ForcedAnswer()
    forced.set([5, 6], [7, 8], torch.device("cpu"))  # next tokens: position 0 -> 6, 1 -> 7, 2 -> 8
    logits = torch.zeros(1, 4, 10)
    logits[..., 3] = 50.0  # the model's own argmax
    out = forced.force(logits, torch.tensor([[0, 1, 2, 3]]))
    assert out.argmax(-1).tolist() == [[6, 7, 8, 3]]  # position 3 is past the answer
    assert torch.equal(forced.force(logits[:, 0], torch.tensor([1])).argmax(-1), torch.tensor([7]))
    forced.clear()
    assert forced.force(logits, torch.tensor([[0, 1, 2, 3]])) is logits

    processor = ForcedAnswerProcessor(prompt_len=2, answer=[7, 8])
    scores = torch.zeros(1, 10)
    assert processor(torch.tensor([[5, 6, 7]]), scores).argmax(-1).item() == 8
    assert processor(torch.tensor([[5, 6, 7, 8]]), scores) is scores  # past the answer


def test_a_replay_that_leaves_the_answer_is_refused(tmp_path):
    answer = Answer("b", 0, 0, "n-gram", Decoded([1, 2, 3], 2, 3, 0.1))
    log = ReplayLog(tmp_path / "r.jsonl")
    with pytest.raises(ReplayError, match=r"n-gram replayed on b/0/0/n-gram did not reproduce.*2"):
        replay_answers({"n-gram": lambda ids, want: Decoded([1, 2, 9], 2, 3, 0.0)},
                       {"b": [[0]]}, [answer], log)
    assert not log.path.exists()  # nothing recorded
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ReplayError, match="bad.jsonl:1: not a replay record"):
        ReplayLog(tmp_path / "bad.jsonl")


def test_paired_difference_is_the_difference_of_ratios_with_a_prompt_clustered_se():
    a, b = ReplayTotals(), ReplayTotals()
    for prompt, (ta, fa, tb, fb) in enumerate([(8, 4, 6, 4), (9, 3, 9, 5), (4, 4, 4, 4)]):
        a.add(prompt, Decoded([], fa, ta, 0.0), None)
        b.add(prompt, Decoded([], fb, tb, 0.0), None)
    diff, se = paired_difference(a, b)
    assert diff == pytest.approx(21 / 11 - 19 / 13)
    assert a.tau == pytest.approx(21 / 11) and se > 0
    same, zero = paired_difference(a, a)
    assert same == 0.0 and zero == pytest.approx(0.0)
    # the delta method's per-prompt terms, summed in quadrature
    ta, tb = 21 / 11, 19 / 13
    z = [(8 - ta * 4) / 11 - (6 - tb * 4) / 13, (9 - ta * 3) / 11 - (9 - tb * 5) / 13,
         (4 - ta * 4) / 11 - (4 - tb * 4) / 13]
    assert se == pytest.approx((3 / 2 * sum(v * v for v in z)) ** 0.5)
