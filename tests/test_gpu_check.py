"""The GPU check script in its CPU mode (`--device cpu --tiny`): every section runs at tiny
shapes and writes real figures, so the script a GPU run depends on is itself tested in CI."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ["environment", "gpu_tests", "exactness", "real_shapes", "timings", "memory"]


def _load_script():
    """scripts/gpu_check.py as a module (its `main` is the runner's)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    code = _load_script().main(["--device", "cpu", "--tiny", "--out", str(out)])
    report = json.loads((out / "gpu_check.json").read_text())
    return code, report, (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_cpu_tiny_mode_runs_every_section_with_real_figures(cpu_report):
    code, report, md = cpu_report
    sections = report["sections"]
    assert list(sections) == SECTIONS
    assert code == 0, {n: s for n, s in sections.items() if s["status"] == "failed"}
    assert report["failed_sections"] == []
    statuses = {name: s["status"] for name, s in sections.items()}
    assert statuses == {**dict.fromkeys(SECTIONS, "ok"), "gpu_tests": "skipped"}
    assert "no CUDA" in sections["gpu_tests"]["reason"]

    env = sections["environment"]
    assert env["torch"] and env["transformers"] and env["device"] == "cpu"
    for call in ("prefill", "decode_rounds", "training_forward"):
        probe = env["attention"][call]
        assert probe["ops"], call  # the profiler saw the attention op of that call
        assert probe["backend"] not in ("none", "unknown"), probe

    exact = sections["exactness"]
    cases = exact["cases"]
    # batch 1 and ragged 4; plain + g in {3, 15} + two trees at g=15; graphs off only on CPU
    assert len(cases) == 10 and {c.get("g") for c in cases} == {None, 3, 15}
    assert sum(c["mode"] == "tree" for c in cases) == 4
    assert all(c["equal_transformers"] and c.get("equal_plain", True) for c in cases)
    assert exact["tau_max"] > 1.5

    real = sections["real_shapes"]
    parity = real["forward_vs_transformers"]
    assert parity["median_top2_margin"] > 1.0
    for path in ("prefill", "masked"):
        assert parity[path]["argmax_agreement"] == 1.0
        assert parity[path]["max_abs_diff"] < 0.1 * parity["median_top2_margin"]
    assert [c["g"] for c in real["lossless_oracle"]["cases"]] == [3, 15]
    assert all(c["equal_plain"] and c["tau"] > 1.0 for c in real["lossless_oracle"]["cases"])
    agreement = real["bf16_agreement"]  # engine's measurement (g3, g15) or the local one
    assert agreement and all(isinstance(run, dict) for run in agreement.values()), agreement
    for run in agreement.values():
        assert run["positions"] >= 16 and 0.0 <= run["rate"] <= 1.0
        assert run["agreements"] == run["positions"] - len(run["margins_at_disagreement"])

    timings = sections["timings"]
    ms = timings["ms"]
    assert set(ms) == {"plain_step", "verify_4", "verify_8", "verify_16", "draft_step", "commit"}
    assert all(v > 0 and math.isfinite(v) for v in ms.values())
    assert set(timings["speedup_estimate"]) == {"g3", "g7", "g15"}
    assert set(timings["speedup_estimate"]["g15"]) == {"tau3", "tau4", "tau5", "tau6"}

    step = sections["memory"]["training_step"]
    assert step["recipe"] == "tiny" and step["draft_parameters"] > 0
    assert 0 < step["predicted_gib"] < step["plan_total_gib"]
    assert math.isfinite(step["loss"])
    assert "not measurable on CPU" in step["measured_gib"]

    for name in SECTIONS:
        assert f"## {name}: {sections[name]['status']}" in md
    assert "| exactness | ok |" in md


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    from scripts.tools.gpu_check import runner as script

    def boom(check, fig):
        fig["before_the_error"] = 1
        raise RuntimeError("kernel exploded")

    def fine(check, fig):
        fig["value"] = 42

    def unmet(check, fig):
        fig.expect(False, "a check that does not hold")

    monkeypatch.setattr(script, "SECTIONS", [("boom", boom), ("fine", fine), ("unmet", unmet)])
    code = script.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert code == 1 and report["failed_sections"] == ["boom", "unmet"]
    assert sections["boom"]["status"] == "failed"
    assert sections["boom"]["error"] == "RuntimeError: kernel exploded"
    assert any("kernel exploded" in line for line in sections["boom"]["traceback"])
    assert sections["fine"] == {"status": "ok", "seconds": sections["fine"]["seconds"], "value": 42}
    assert sections["unmet"]["failed_checks"] == ["a check that does not hold"]
    assert "## boom: failed" in (tmp_path / "gpu_check.md").read_text()


def test_over_budget_sections_are_skipped(tmp_path, monkeypatch):
    from scripts.tools.gpu_check import runner as script
    monkeypatch.setattr(script, "SECTIONS", [("late", lambda check, fig: None)])
    code = script.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "-1"])
    late = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["late"]
    assert code == 0 and late["status"] == "skipped" and late["reason"] == "over the time budget"


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    script = _load_script()
    assert script.main(["--device", "cpu", "--tiny", "--only", "nope", "--out", str(tmp_path)]) == 2
    assert "no such section" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()


def test_oracle_draft_proposes_the_known_continuation_with_fixed_corruptions():
    import torch

    from scripts.tools.bench.oracle_draft import OracleDraft, OracleDraftConfig

    config = OracleDraftConfig(block_size=5, target_layer_ids=[0], vocab_size=50, hidden_size=8)
    draft = OracleDraft(config, max_batch_size=2, max_length=20, corrupt=0.5, seed=3)
    draft.set_sequences([list(range(10, 22)), list(range(30, 36))])
    cache = draft.new_context_cache(2, 20)
    draft.append_context(cache, torch.zeros(2, 3, 8), torch.tensor([3, 2]))
    tokens = draft.propose(cache, torch.tensor([13, 32])).tokens
    # Row 0 has 3 committed positions, so its anchor sits at 3 and proposals start at 4.
    clean = torch.tensor([[14, 15, 16, 17], [33, 34, 35, 0]])
    flipped = tokens != clean
    assert torch.equal(tokens[flipped], (clean[flipped] + 1) % 50)
    assert 0 < int(flipped.sum()) < flipped.numel()  # some corrupted, some not
    assert torch.equal(draft.propose(cache, torch.tensor([13, 32])).tokens, tokens)  # fixed draws
    draft.crop_context(cache, torch.tensor([1, 5]))
    assert cache.lengths.tolist() == [1, 2]  # crop only lowers


def test_memory_section_builds_the_8b_recipes_draft_without_its_tokenizer():
    """The GPU run's memory section sizes the `qwen3_8b` draft from the shipped target config
    alone (no tokenizer on the device): the draft must resolve as `plan_only` resolves it."""
    from scripts.tools.gpu_check.memory import recipe_draft

    config, target, draft = recipe_draft("qwen3_8b")
    assert (target.num_hidden_layers, target.hidden_size) == (36, 4096)
    assert (draft.num_layers, draft.block_size) == (5, 16)
    assert list(draft.target_layer_ids) == [1, 9, 17, 25, 33]
    assert 0 <= draft.mask_token_id < target.vocab_size
