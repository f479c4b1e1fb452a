"""`scripts/ablate.py --smoke`: the whole ablation study on a tiny random target.

One run (a module fixture, ~1 minute on 2 busy cores) trains the four trained variants with
`train.py` on a shared offline feature cache, derives `dspine_no_tcache`, evaluates every export
with the evaluation harness and writes the report; the tests read what it left behind. A second
invocation checks that a rerun skips every finished stage.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.tools.ablation.records import RunBudget
from scripts.tools.ablation.variants import ABLATION
from tests._train_helpers import train_env

# The smoke study (one module fixture) trains and evaluates five variants: slow on a CPU.
SLOW = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SMOKE_STEPS = 8  # scripts/ablate.py's smoke budget
BLOCK = 8  # the tiny recipe's block size
BENCHES = ["humaneval", "sharegpt"]
TEMPERATURES = [0.0, 1.0]


def run_ablate(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python scripts/ablate.py <args>` from the repo root, offline, output captured.

    The timeout only guards against a hang: in a fresh clone the smoke study also JIT-builds
    DeepSpeed's CPU op first, which takes a while.
    """
    return subprocess.run([sys.executable, str(REPO / "scripts" / "ablate.py"), *args], cwd=REPO,
                          env=train_env(), capture_output=True, text=True, timeout=timeout)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + "\n" + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The smoke study: its directory and its JSON report."""
    out = tmp_path_factory.mktemp("ablation")
    check_ok(run_ablate("--smoke", "--out", str(out)))
    return out, json.loads((out / "ablation.json").read_text())


@SLOW
def test_every_variant_trains_and_is_evaluated(smoke: tuple[Path, dict]) -> None:
    out, report = smoke
    rows = report["variants"]
    assert [r["variant"] for r in rows] == list(ABLATION.rows)
    for row in rows:
        assert (out / row["variant"] / "final" / "model.safetensors").is_file()
        measured = [(r["bench"], r["temperature"]) for r in row["engine"]]
        assert measured == [(b, t) for b in BENCHES for t in TEMPERATURES], row["variant"]
        for result in row["engine"]:
            assert 1.0 <= result["tau"] <= BLOCK
            assert len(result["per_position"]) == BLOCK - 1
            assert result["num_prompts"] == 2 and result["new_tokens"] > 0
            # every variant decodes losslessly at temperature 0 (plain decoding runs in smoke)
            assert result["lossless"] is (True if result["temperature"] == 0 else None)
        assert 1.0 <= row["simulated"]["tau"] <= BLOCK
        assert row["final_losses"]["loss"] > 0
    trained = [r for r in rows if r["trained"]]
    assert [r["variant"] for r in trained] == ["dflash", "dspine", "dspine_no_alignment",
                                               "dspine_token_ce"]
    # each trained variant has its own run (its own metrics), trained to the end
    for row in trained:
        metrics = (out / row["variant"] / "metrics.jsonl").read_text().splitlines()
        assert json.loads(metrics[-1])["step"] == SMOKE_STEPS
    # only the token-CE variant logs the intermediate CE, only non-DFlash rows the alignment
    assert {r["variant"] for r in rows if "token_ce_intermediate" in r["final_losses"]} == {
        "dspine_token_ce"}
    assert "alignment" not in rows[0]["final_losses"]


@SLOW
def test_same_seed_data_and_steps_for_all(smoke: tuple[Path, dict]) -> None:
    """The budget read back from every run's own saved config is the same for all rows."""
    _, report = smoke
    budgets = {RunBudget(**row["run"]).key() for row in report["variants"]}
    assert len(budgets) == 1
    run = report["variants"][0]["run"]
    assert run["steps"] == SMOKE_STEPS and run["seed"] == 0
    assert report["meta"]["same_budget"] is True
    # beyond the budget: the runs' whole saved configs differ only in the variants' switches
    assert report["meta"]["config_differences"] == []
    # one feature cache for all, and the derived row points at dspine's run
    assert len({row["run"]["offline_features_dir"] for row in report["variants"]}) == 1
    no_tcache = report["variants"][-1]
    assert no_tcache["reuse"] == "dspine" and no_tcache["run"]["dir"].endswith("dspine")


@SLOW
def test_variant_switches_reach_the_exports(smoke: tuple[Path, dict]) -> None:
    out, _ = smoke

    def config(name: str) -> dict:
        return json.loads((out / name / "final" / "config.json").read_text())

    assert config("dflash")["method"] == "dflash" and config("dflash")["injection"] is False
    assert config("dflash")["transition_cache"] is False
    assert config("dflash")["block_attention"] == "bidirectional"
    assert config("dspine")["injection"] is True and config("dspine")["transition_cache"] is True
    assert config("dspine")["block_attention"] == "causal"
    assert config("dspine_no_alignment")["alignment_weight"] == 0.0
    assert config("dspine_token_ce")["token_ce_intermediate"] is True
    assert config("dspine_no_tcache")["transition_cache"] is False
    assert config("dspine_no_tcache")["dspine_config"]["transition_cache"] is False
    # the derived export decodes dspine's weights: the very same file
    derived = (out / "dspine_no_tcache" / "final" / "model.safetensors").read_bytes()
    assert derived == (out / "dspine" / "final" / "model.safetensors").read_bytes()


def _history(out: Path, variant: str) -> dict[int, dict]:
    """A run's logged training rows (one per step in the tiny recipe), by step."""
    rows = [json.loads(line) for line in (out / variant / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@SLOW
def test_variant_switches_reach_training(smoke: tuple[Path, dict]) -> None:
    """Each trained variant's switch changes its loss by exactly its own term, and its weights.

    Step 1 runs every variant on the same init, batch, anchors and replacement draws, so the
    shared terms are equal bit for bit and the total losses differ by exactly the switched
    terms, recomputed here from the *other* run's logged terms. A switch that does not reach
    the objective (or a run that trained another budget) breaks these equalities; a switch
    that does not reach the optimizer leaves the variant's weights equal to dspine's.
    """
    out, _ = smoke
    runs = {v: _history(out, v) for v in ("dflash", "dspine", "dspine_no_alignment",
                                          "dspine_token_ce")}
    full, no_cos, tok_ce, dflash = (runs[v][1] for v in ("dspine", "dspine_no_alignment",
                                                         "dspine_token_ce", "dflash"))
    for row in (no_cos, tok_ce):
        for term in ("backbone_ce", "backbone_l1", "refine_ce", "refine_l1",
                     "candidate_coverage", "supervised_slots"):
            assert row[term] == full[term], term
    # dspine's loss = dspine_no_alignment's + beta * CE * alignment (METHOD 2.3)
    alignment = full["alignment_beta"] * full["backbone_ce"] * full["alignment"]
    assert alignment > 0.1
    assert full["loss"] - no_cos["loss"] == pytest.approx(alignment, rel=1e-5)
    # dspine_token_ce's loss = dspine's + the intermediate layers' CE
    assert tok_ce["token_ce_intermediate"] > 0.1
    assert tok_ce["loss"] - full["loss"] == pytest.approx(tok_ce["token_ce_intermediate"],
                                                          rel=1e-5)
    # dflash's switches change the forward itself (injection, block attention) ...
    assert dflash["backbone_ce"] != full["backbone_ce"]
    # ... and every switch changes what is learnt: no two variants end with the same weights
    from safetensors.torch import load_file

    weights = {v: load_file(out / v / "final" / "model.safetensors") for v in runs}
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = weights[a].keys() & weights[b].keys()
            assert any(not weights[a][k].equal(weights[b][k]) for k in shared), (a, b)


def independent_acceptance(out: Path, variant: str) -> tuple[float, float, torch.Tensor]:
    """(blocks, accepted, drafted tokens) of the variant's export on the trainer's held-out
    blocks, computed without the evaluation code under test.

    The blocks are every held-out anchor (loss_mask[a] and loss_mask[a+1]), enumerated here
    row by row (the runner evaluates every block); everything else is recomputed:
    the target's greedy tokens from the full target model (not the offline cache nor the
    draft's bound head), supervision and labels from the raw data, and acceptance by counting
    each block's leading slots where the draft, the target's greedy choice and the data agree.
    The draft proposes with its own decode (`walk`), which is what the evaluation measures.
    """
    import datasets
    from transformers import AutoModelForCausalLM

    from dspine_train.modeling import DSpineDraftModel
    from dspine_train.training.data import TokenBatches
    from scripts.tools.ablation.simulated import load_run_config

    source = "dspine" if variant == "dspine_no_tcache" else variant
    config = load_run_config(out / source / "hydra" / "config.yaml")
    d, e = config.data, config.eval
    target = AutoModelForCausalLM.from_pretrained(config.model.target_path,
                                                  dtype=torch.float32).eval()
    draft = DSpineDraftModel.from_pretrained(str(out / variant / "final")).eval()
    draft.bind_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    bk, layer_ids = draft.config.block_size, draft.config.target_layer_ids
    batches = TokenBatches(datasets.load_from_disk(d.train_path)[d.eval_split], d.max_length,
                           draft.config.vocab_size, "eval")
    assert e.every_block and e.max_blocks >= 10**6  # the runner evaluates every block
    blocks = accepted = 0.0
    drafted = []
    with torch.no_grad():
        for row in range(len(batches)):
            batch = batches.collate([row])
            ids, mask = batch.input_ids, batch.loss_mask
            run = target(ids, attention_mask=batch.attention_mask, output_hidden_states=True)
            greedy = run.logits.argmax(-1)  # greedy[b, p]: the target's choice for token p + 1
            context = torch.cat([run.hidden_states[i + 1] for i in layer_ids], dim=-1)
            every = [a for a in range(ids.shape[1] - 1) if mask[0, a] and mask[0, a + 1]]
            if not every:
                continue
            anchors = torch.tensor([every])
            valid = torch.ones_like(anchors, dtype=torch.bool)
            fwd = draft(ids, context, anchors, valid)
            n, a = anchors.shape
            walk = draft.walk(fwd.pre_injection.flatten(0, 1), fwd.recv_features.flatten(0, 1),
                              draft.logits(fwd.hidden[..., 1:, :]).flatten(0, 1),
                              torch.gather(ids, 1, anchors).flatten())
            tokens = walk.tokens.view(n, a, bk - 1)
            lengths = batch.attention_mask.sum(1)
            for b in range(n):
                for j in range(a):
                    if not valid[b, j]:
                        continue
                    blocks += 1
                    drafted.append(tokens[b, j])
                    anchor = int(anchors[b, j])
                    for k in range(1, bk):
                        p = anchor + k
                        if not (p < lengths[b] and mask[b, p] and ids[b, p] == greedy[b, p - 1]
                                == tokens[b, j, k - 1]):
                            break
                        accepted += 1
    return blocks, accepted, torch.stack(drafted)


@SLOW
def test_simulated_tau_matches_an_independent_recount(smoke: tuple[Path, dict]) -> None:
    """The simulated tau of every row (and the trainer's own, for trained rows) equals a
    recount from the full target model and the raw data, and each row's evaluation decodes
    with its own switches: no two variants draft the same tokens on the same blocks."""
    out, report = smoke
    drafted = {}
    for row in report["variants"]:
        blocks, accepted, drafted[row["variant"]] = independent_acceptance(out, row["variant"])
        assert row["simulated"]["blocks"] == blocks
        assert row["simulated"]["tau"] == pytest.approx(1 + accepted / blocks, abs=1e-12)
        if row["trained"]:
            assert row["trainer_sim_tau"] == pytest.approx(1 + accepted / blocks, abs=1e-12)
        else:
            assert row["trainer_sim_tau"] is None
    names = list(drafted)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not drafted[a].equal(drafted[b]), (a, b)


@SLOW
def test_report_has_one_row_per_variant(smoke: tuple[Path, dict]) -> None:
    out, report = smoke
    text = (out / "ablation.md").read_text()
    main_table = text.split("\n\n")[3].splitlines()  # title, bullets, legend, then the table
    assert main_table[0].startswith("| variant | trained |")
    assert [line.split("|")[1].strip() for line in main_table[2:]] == [f"`{v}`" for v in ABLATION.rows]
    assert report["meta"]["git_commit"] in text
    assert "scripts/ablate.py --smoke --out" in text
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@SLOW
def test_rerun_skips_finished_variants(smoke: tuple[Path, dict]) -> None:
    out, _ = smoke
    exports = {v: out / v / "final" / "model.safetensors" for v in ABLATION.rows if v != "dspine_no_tcache"}
    before = {v: p.stat().st_mtime_ns for v, p in exports.items()}
    # Naming the feature cache explicitly and a report stem with dots of its own ("qwen2.5")
    # must not change what is reused; the report keeps the whole stem and records the paths.
    stem = out / "report_qwen2.5-0.5b"
    proc = run_ablate("--smoke", "--out", str(out), "--features", str(out / "features"),
                      "--report", str(stem), timeout=120)
    check_ok(proc)
    report = json.loads(stem.with_name(stem.name + ".json").read_text())
    assert report["meta"]["settings"]["features_override"] == str(out / "features")
    assert stem.with_name(stem.name + ".md").is_file()
    for variant in exports:
        assert f"[ablate] {variant}: export exists, skipping training" in proc.stdout
    for variant in ABLATION.rows:
        assert f"[ablate] {variant}: evaluation exists, skipping" in proc.stdout
    assert {v: p.stat().st_mtime_ns for v, p in exports.items()} == before


@SLOW
def test_other_steps_in_the_same_directory_are_refused(smoke: tuple[Path, dict]) -> None:
    """A finished directory is never reused for another budget (nor overwritten)."""
    out, _ = smoke
    proc = run_ablate("--smoke", "--out", str(out), "--steps", "5", "--variants", "dflash",
                      timeout=120)
    assert proc.returncode == 1
    assert f"{out / 'dflash'} was trained with other arguments" in proc.stderr


def _ablate_module():
    spec = importlib.util.spec_from_file_location("ablate_script", REPO / "scripts" / "ablate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unknown_variant_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown variant.*'dspine_nope'"):
        ABLATION.select(["dspine_nope"])
    # a derived variant brings the variant it reuses
    assert [v.name for v in ABLATION.select(["dspine_no_tcache"])] == ["dspine",
                                                                       "dspine_no_tcache"]
    ablate = _ablate_module()
    with pytest.raises(SystemExit) as exit_info:
        ablate.parse_args(["--variants", "dflash,dspine_nope"])
    assert exit_info.value.code != 0
    assert "dspine_nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ablate.parse_args(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_a_foreign_folder_of_a_derived_variant_is_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A derived variant's folder holding another run is neither replaced nor written into,
    and the refusal comes before any variant trains."""
    from scripts.tools.ablation import runner

    ran: list = []

    def fake_train(args, log_path, what, **_):  # leaves an export, as train.py does
        ran.append(args)
        export = Path(next(a for a in args if a.startswith("output_dir="))[11:]) / "final"
        export.mkdir(parents=True)
        (export / "config.json").write_text("{}")

    monkeypatch.setattr(runner, "run_logged", fake_train)
    settings = runner.StudySettings(out_dir=tmp_path / "ablation", recipe="tiny", steps=8)
    foreign = settings.out_dir / "dspine_no_tcache"
    (foreign / "final").mkdir(parents=True)
    (foreign / "final" / "config.json").write_text('{"mine": true}')
    (foreign / "final" / "model.safetensors").write_bytes(b"my weights")
    with pytest.raises(runner.StudyError) as err:
        runner.prepare_variants(settings, ABLATION.select(["dspine_no_tcache"]))
    (line,) = str(err.value).splitlines()
    assert str(foreign) in line and "did not write" in line
    assert ran == []  # nothing trained
    assert (foreign / "final" / "config.json").read_text() == '{"mine": true}'
    assert (foreign / "final" / "model.safetensors").read_bytes() == b"my weights"
    assert not (settings.out_dir / "dspine").exists()
