"""The study stack (`scripts.tools.ablation`): variant checks, skip/resume, session wall time,
the wall-time plan, typed records and the report writer - on tiny configs, no training."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from dspine_train.evaluation.block_metrics import BlockResults, paired_difference
from dspine_train.training.config import compose_train_config
from dspine_train.training.memory_plan.for_recipe import plan_draft_config
from scripts.tools.ablation import runner, study, study_plan
from scripts.tools.ablation.records import Evaluation, StudyRecord
from scripts.tools.ablation.runner import (
    StudyError,
    StudySettings,
    finished_result,
    train_variant,
    training_wall_s,
)
from scripts.tools.ablation.study import check_variant_overrides, paired_by_step
from scripts.tools.ablation.study_plan import seconds_per_step
from scripts.tools.ablation.study_report import (
    conditional_acceptance,
    target_title,
    write_study_report,
)
from scripts.tools.ablation.variants import ABLATION, METHODS, STUDY, VARIANTS, Variant

REPO = Path(__file__).resolve().parents[1]


def tiny_settings(tmp_path: Path, tiny_assets: dict | None = None, **kw) -> StudySettings:
    overrides = []
    if tiny_assets is not None:
        overrides = [f"model.target_path={tiny_assets['target']}",
                     f"data.train_path={tiny_assets['data']}"]
    kw.setdefault("steps", 12)
    return StudySettings(out_dir=tmp_path / "study", recipe="tiny", overrides=overrides, **kw)


def test_a_variant_with_an_unknown_key_fails_by_name_before_training(
        tiny_assets: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained = []
    monkeypatch.setattr(runner, "run_logged", lambda *a, **k: trained.append(a))
    settings = tiny_settings(tmp_path, tiny_assets)
    good = Variant("good", "", ("model.alignment_weight=0.0",))
    bad = Variant("not_merged", "", ("model.no_such_setting=1",))
    check_variant_overrides(settings, [good])  # a real key passes
    with pytest.raises(StudyError) as err:
        study.run_study(settings, [good, bad], target=str(tiny_assets["target"]))
    message = str(err.value)
    assert "variant not_merged" in message and "model.no_such_setting" in message
    assert "variant good" not in message
    assert trained == []  # nothing ran: not even the feature cache


def test_each_variant_composes_to_a_draft_that_differs_where_it_says(tmp_path: Path) -> None:
    """What `train.py` composes from a variant's arguments: the change the variant names."""
    names = [v.name for v in STUDY.select(None)]
    assert names[0] == "dspine" and "dflash" in names and "dspine_specforge" in names
    assert "dspine_warm_start" not in names and "dspine_fp32" not in names  # optional: by name
    with pytest.raises(ValueError, match="unknown variant"):
        STUDY.select(["nope"])
    settings = tiny_settings(tmp_path)

    def composed(name: str):
        config = compose_train_config(*settings.train_arguments(VARIANTS[name]))
        return config, plan_draft_config(config)

    base_config, base = composed("dspine")
    config, dflash = composed("dflash")
    assert (base.method, dflash.method) == ("dspine", "dflash")
    assert base.injection and not dflash.injection
    assert dflash.block_attention == "bidirectional" != base.block_attention
    assert config.data == base_config.data and config.optim == base_config.optim
    for name in names[1:]:  # every variant changes the run it is compared with
        config = compose_train_config(*settings.train_arguments(VARIANTS[name]))
        assert config.output_dir != base_config.output_dir, name  # a folder of its own
        assert dataclasses.replace(config, output_dir=base_config.output_dir) != base_config, name


def test_the_method_rows_train_their_method_on_dspines_data_budget_and_backbone(
    tmp_path: Path,
) -> None:
    """A method row is that method's draft on everything else `dspine` trains with, and runs
    only when named (the study's planned rows do not grow by a method)."""
    assert METHODS and not set(METHODS) & set(STUDY.default())
    settings = tiny_settings(tmp_path)
    base_config = compose_train_config(*settings.train_arguments(VARIANTS["dspine"]))
    base = plan_draft_config(base_config)
    for name in METHODS:
        config = compose_train_config(*settings.train_arguments(VARIANTS[name]))
        draft = plan_draft_config(config)
        assert draft.method == name
        assert (config.data, config.optim) == (base_config.data, base_config.optim), name
        assert (draft.block_size, draft.num_layers, draft.target_layer_ids) == (
            base.block_size, base.num_layers, base.target_layer_ids), name
        assert [v.name for v in STUDY.select([name])] == [name]


def test_each_variant_has_one_name_and_both_studies_pick_from_the_registry() -> None:
    """No two registered variants train (or decode) the same thing under two names."""
    seen: dict[tuple, str] = {}
    for variant in VARIANTS.values():
        key = (frozenset(variant.overrides), variant.reuse)
        assert key not in seen, f"{variant.name} is {seen.get(key)} again"
        seen[key] = variant.name
    for rows in (ABLATION, STUDY):
        assert set(rows.rows) <= set(VARIANTS) and set(rows.optional) <= set(rows.rows)
        assert all(VARIANTS[n].reuse in rows.rows for n in rows.rows if VARIANTS[n].reuse)
    assert [v.name for v in ABLATION.select(["dspine_no_tcache"])] == ["dspine",
                                                                       "dspine_no_tcache"]


@pytest.mark.parametrize("name", [n for n in VARIANTS if VARIANTS[n].switches()])
def test_a_variants_overrides_change_the_composed_field(name: str, tmp_path: Path) -> None:
    """Every `model.<field>` a variant sets is the field `train.py` composes (and a change
    from the reference's); a derived variant's are what its `config.json` is given."""
    settings = tiny_settings(tmp_path)
    base = compose_train_config(*settings.train_arguments(VARIANTS["dspine"]))
    variant = VARIANTS[name]
    config = compose_train_config(*settings.train_arguments(variant))
    for key, value in variant.switches().items():
        composed = getattr(config.model, key)
        assert getattr(composed, "value", composed) == value, key
        assert composed != getattr(base.model, key), key


def test_a_run_resumes_evaluates_and_checkpoints_as_set(tmp_path: Path) -> None:
    """What the runs are given reaches the composed config; the variant's overrides win over
    the shared ones."""
    settings = StudySettings(out_dir=tmp_path, recipe="tiny", steps=12, eval_every=5,
                             checkpoint_every=3, eval_max_blocks=64,
                             overrides=["model.alignment_weight=0.5"])
    config = compose_train_config(*settings.train_arguments(VARIANTS["dspine_no_alignment"]))
    assert (config.optim.max_steps, config.eval.every, config.eval.max_blocks) == (12, 5, 64)
    assert config.eval.every_block and config.checkpoint.every == 3
    assert config.checkpoint.resume_from == "latest"
    assert config.model.alignment_weight == 0.0
    assert config.model.token_table_path is None  # each run builds its own table
    shared = dataclasses.replace(settings, token_table=tmp_path / "table.safetensors")
    config = compose_train_config(*shared.train_arguments(VARIANTS["dspine"]))
    assert config.model.token_table_path == str(tmp_path / "table.safetensors")
    assert config.model.alignment_weight == 0.5


def test_an_evaluation_is_reused_for_the_same_request_and_redone_for_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scripts.tools.ablation import simulated

    monkeypatch.setattr(simulated, "load_run_config", lambda path: None)
    monkeypatch.setattr(simulated, "simulated_acceptance", lambda export, config: None)
    settings = tiny_settings(tmp_path)
    variant = VARIANTS["dspine"]
    fake_export(settings.run_dir(variant))
    calls: list[Path] = []

    def engine(export: Path) -> list[dict]:
        calls.append(export)
        return [{"bench": "humaneval", "temperature": 0.0, "tau": 1.5}]

    first = runner.evaluate_variant(settings, variant, engine)
    assert first.engine[0]["tau"] == 1.5 and calls == [settings.export_dir(variant)]
    assert runner.evaluate_variant(settings, variant, engine) == first  # read back, not rerun
    assert len(calls) == 1
    more = dataclasses.replace(settings, limit=settings.limit + 1)
    assert runner.evaluate_variant(more, variant, engine).request["limit"] == more.limit
    assert len(calls) == 2  # another request: evaluated again
    os.utime(settings.export_dir(variant) / "model.safetensors", ns=(1, 1))
    runner.evaluate_variant(more, variant, engine)
    assert len(calls) == 3  # other weights: evaluated again


def test_the_committed_study_report_is_rewritten_from_its_archive_unchanged(
        tmp_path: Path) -> None:
    """The typed records read the archive committed under docs/results and write the same
    report, byte for byte."""
    results = REPO / "docs" / "results"
    committed = {suffix: results / f"study_qwen2.5-coder-0.5b_2026-12-02.{suffix}"
                 for suffix in ("md", "json")}
    archive = results / "study_qwen2.5-coder-0.5b" / "variants"
    (tmp_path / "report.json").write_bytes(committed["json"].read_bytes())
    md, js, _ = study.rewrite_report(archive, tmp_path / "report")
    assert js.read_text() == committed["json"].read_text()
    assert md.read_text() == committed["md"].read_text()
    first = json.loads((archive / "dflash" / study.RECORD_FILE).read_text())
    assert StudyRecord.from_json(first).to_json() == first


def fake_export(run_dir: Path) -> None:
    (run_dir / "final").mkdir(parents=True, exist_ok=True)
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "final" / "model.safetensors").write_bytes(b"weights")


def test_finished_variants_are_skipped_and_a_killed_one_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    calls: list[list[str]] = []

    def fake_run(args, log_path, what, **_):
        calls.append(list(args))
        fake_export(Path(next(a for a in args if a.startswith("output_dir="))[11:]))

    monkeypatch.setattr(runner, "run_logged", fake_run)
    settings = tiny_settings(tmp_path)
    done, killed, fresh = (Variant(n, n) for n in ("done", "killed", "fresh"))
    # "done": exported before; "killed": a complete checkpoint at step 8, no export
    train_variant(settings, done)
    assert len(calls) == 1
    train_variant(settings, done)
    assert len(calls) == 1  # skipped: its export exists
    # the study's own folder (its request.json is written before training starts)
    runner.claim_run_dir(settings.run_dir(killed), settings.train_arguments(killed))
    ckpt = settings.run_dir(killed) / "checkpoints" / "step_00000008"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 8}))
    plan = {"killed": {"s_per_step": 2.0}, "fresh": {"s_per_step": 1.0}}
    lines = study_plan.plan_lines(settings, [killed, fresh], plan)
    assert "4 steps left" in lines[1] and "12 steps left" in lines[2]  # 12 steps, 8 done
    train_variant(settings, killed)
    assert "resuming at step 8" in capsys.readouterr().out
    assert "checkpoint.resume_from=latest" in calls[-1]
    train_variant(settings, fresh)
    sessions = json.loads((settings.run_dir(fresh) / "sessions.json").read_text())
    assert len(sessions) == 1 and sessions[0]["end"] >= sessions[0]["start"]
    # a result counts only for the export it evaluated
    export = settings.export_dir(done) / "model.safetensors"
    result = Evaluation(export.stat().st_mtime_ns, {}, [])
    (settings.run_dir(done) / "result.json").write_text(json.dumps(result.to_json()))
    assert finished_result(settings, done) == result
    os.utime(export, ns=(1, 1))
    assert finished_result(settings, done) is None


def test_training_wall_time_counts_killed_sessions(tmp_path: Path) -> None:
    run_dir = tmp_path / "v"
    run_dir.mkdir()
    sessions = [{"start": 1000.0, "end": 1100.0}, {"start": 2000.0, "end": None}]
    (run_dir / "sessions.json").write_text(json.dumps(sessions))
    (run_dir / "metrics.jsonl").write_text("{}\n")
    os.utime(run_dir / "metrics.jsonl", (2050.0, 2050.0))  # killed 50 s in
    assert training_wall_s(run_dir) == pytest.approx(150.0)
    # an open session followed by another counts at most until the next one started
    sessions = [{"start": 1000.0, "end": None}, {"start": 1040.0, "end": 1100.0}]
    (run_dir / "sessions.json").write_text(json.dumps(sessions))
    assert training_wall_s(run_dir) == pytest.approx(100.0)


def test_a_new_session_closes_the_killed_one_at_its_last_metrics_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resumed run rewrites metrics.jsonl, so the killed session's end is taken first."""
    monkeypatch.setattr(runner, "run_logged", lambda args, *a, **k: (
        fake_export(Path(next(x for x in args if x.startswith("output_dir="))[11:]))))
    settings = tiny_settings(tmp_path)
    variant = Variant("v", "v")
    run_dir = settings.run_dir(variant)
    runner.claim_run_dir(run_dir, settings.train_arguments(variant))  # the study's own folder
    (run_dir / "sessions.json").write_text(json.dumps([{"start": 1000.0, "end": None}]))
    (run_dir / "metrics.jsonl").write_text("{}\n")
    os.utime(run_dir / "metrics.jsonl", (1300.0, 1300.0))
    train_variant(settings, variant)
    sessions = json.loads((run_dir / "sessions.json").read_text())
    assert sessions[0] == {"start": 1000.0, "end": 1300.0, "killed": True}
    assert len(sessions) == 2 and sessions[1]["end"] is not None


def test_step_time_from_the_training_bar() -> None:
    log = ("loading\rtrain:  25%|##| 1/4 [00:05<00:15, 5.01s/it]\rtrain:  50%|##| 2/4 "
           "[00:09<00:09, 4.50s/it]\n other 9.0s/it\n")
    assert seconds_per_step(log) == pytest.approx(4.5)
    assert seconds_per_step("train: 10/10 [00:02<00:00, 4.00it/s]") == pytest.approx(0.25)
    assert seconds_per_step("train:  40%|#| 8/20 [02:11<03:21, 16.78s/step, loss=3.7]") == \
        pytest.approx(16.78)  # the trainer's bar counts steps
    assert seconds_per_step("no bar") is None


def blocks(accepted: list[int]) -> BlockResults:
    return BlockResults(rows=[0, 0, 1, 1, 2, 2], anchors=[1, 2, 1, 2, 1, 2],
                        accepted=accepted, block_size=4)


def record(name: str, result: BlockResults, reference: BlockResults | None) -> StudyRecord:
    rec = StudyRecord(
        variant=name, description=name, overrides=[], steps=12, seed=0, batch_size=2,
        block_size=4, train_wall_s=7200.0, sessions=2,
        final_losses={"loss": 2.5, "candidate_coverage": 0.8},
        curve=[{"step": 6, "tau": 1.2, "tau_se": 0.1, "tau_se_row": 0.2,
                "train": {"loss": 3.0, "candidate_coverage": 0.5}},
               {"step": 12, "tau": result.tau, "tau_se": result.tau_se,
                "tau_se_row": result.tau_se_row}],
        simulated=result.summary(),
        engine=[{"bench": "humaneval", "temperature": 0.0, "tau": 1.5, "num_prompts": 20,
                 "new_tokens": 1280, "lossless": True, "speedup": 1.1,
                 "tokens_per_s_spec": 9.0}])
    if reference is not None:
        rec.paired_vs_reference = paired_difference(result, reference)
        rec.paired_curve = {"12": paired_difference(result, reference)}
    return rec


def table_row(text: str, variant: str) -> list[str]:
    """The cells of the first markdown table row of `variant` in `text`."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {variant} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_dspark_row_has_one_more_position_and_the_others_are_padded(tmp_path: Path) -> None:
    """A DSpark block of 4 drafts 4 tokens (the others 3): the per-position tables get a k=4
    column, the other rows show "-" there, and every row keeps the header's width."""
    ref = blocks([3, 2, 1, 2, 0, 1])
    dspark = BlockResults(rows=[0, 0, 1, 1, 2, 2], anchors=[1, 2, 1, 2, 1, 2],
                          accepted=[4, 1, 0, 2, 4, 0], block_size=4, num_drafts=4)
    records = [record("dspine", ref, None), record("dspark", dspark, ref)]
    meta = {"command": "python scripts/study.py run", "commit": "abc123", "dirty": False,
            "machine": {"cpu": "test"}, "date": "2026-12-07"}
    text = write_study_report(records, meta, tmp_path / "study_p")[0].read_text()
    section = text.split("## Acceptance per position")[1].split("## Learning curves")[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0].split("|")[-2].strip() == "k=4"
    assert {line.count("|") for line in rows} == {rows[0].count("|")}
    dspine_rows = [line for line in rows if line.startswith("| dspine |")]
    dspark_rows = [line for line in rows if line.startswith("| dspark |")]
    assert len(dspine_rows) == len(dspark_rows) == 2  # shares, then conditional shares
    assert all(line.split("|")[-2].strip() == "-" for line in dspine_rows)
    assert float(dspark_rows[0].split("|")[-2]) == pytest.approx(2 / 6, abs=5e-4)


def test_report_writer_tables_pairs_and_curves(tmp_path: Path) -> None:
    ref, dflash = blocks([3, 2, 1, 2, 0, 1]), blocks([1, 1, 0, 2, 0, 0])
    records = [record("dspine", ref, None), record("dflash", dflash, ref)]
    records[1] = dataclasses.replace(records[1], steps=24, train_wall_s=5400.0,
                                     final_losses={"loss": 3.25, "candidate_coverage": 0.4})
    meta = {"command": "python scripts/study.py run", "commit": "abc123", "dirty": False,
            "machine": {"cpu": "test"}, "date": "2026-12-02",
            "plan": {"dspine": {"s_per_step": 1.5}, "dflash": {"s_per_step": 1.0}},
            "data": {"train_path": "data", "splits": "train 10 rows",
                     "meta": {"settings": {"regen_dtype": "bfloat16", "max_new_tokens": 256,
                                           "regen_batch_size": 16},
                              "stages": {"regenerate_train": {"wall_s_total": 3600.0}}}}}
    paths = write_study_report(records, meta, tmp_path / "docs" / "study_x")
    assert [p.suffix for p in paths] == [".md", ".json", ".png"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    text = paths[0].read_text()
    diff = paired_difference(dflash, ref)
    assert diff["diff"] == pytest.approx(-5 / 6)
    assert f"{diff['diff']:+.4f} ± {diff['se']:.4f} ({diff['se_row']:.4f})" in text
    # each variant's row shows the numbers of its own record
    for rec, result in zip(records, (ref, dflash)):
        cells = table_row(text, rec.variant)
        assert int(cells[1]) == rec.steps
        assert float(cells[2].removesuffix(" h")) == rec.train_wall_s / 3600
        assert int(cells[3]) == len(result.accepted)
        assert float(cells[4].split(" ± ")[0]) == pytest.approx(result.tau, abs=5e-4)
        assert float(cells[5]) == pytest.approx(result.tau - 1, abs=5e-4)  # accepted drafts
        assert float(cells[8]) == rec.final_losses["candidate_coverage"]
        assert float(cells[9]) == rec.final_losses["loss"]
    assert "bfloat16" in text and "abc123" in text and "python scripts/study.py run" in text
    assert text.startswith("# Training study on the target (2026-12-02)")  # no target recorded
    assert "misses the aim of 1.6" not in text and "DSpine / DFlash" in text
    saved = json.loads(paths[1].read_text())
    assert [v["variant"] for v in saved["variants"]] == ["dspine", "dflash"]
    assert "## Findings" not in text  # none given
    # the title names the target, not the path it has on the machine (the path is listed)
    target = tmp_path / "machine" / "default_target"
    target.mkdir(parents=True)
    (target / "assembly.json").write_text(json.dumps({"gguf_name": "model-q4.gguf",
                                                      "dtype": "bfloat16"}))
    meta.update(target=str(target), target_title=target_title(target))
    text = write_study_report(records, meta, tmp_path / "docs" / "study_t")[0].read_text()
    assert text.startswith("# Training study on the embedded target (model-q4.gguf, bfloat16) (")
    assert f"- target: `{target}`" in text
    # a study row no piece has planned yet is listed too
    meta["study_variants"] = ["dspine", "dflash", "dspine_no_alignment"]
    text = write_study_report(records, meta, tmp_path / "docs" / "study_y")[0].read_text()
    planned = table_row(text, "dspine_no_alignment")
    assert planned[7] == "not yet" and set(planned[1:7] + planned[8:]) <= {"-", "`-`"}
    # the provenance table names the CPU and the feature cache each row trained on
    session = {"machine": {"cpu": "Some CPU"}, "features_digest": "0123456789abcdef"}
    records[1] = dataclasses.replace(records[1], session=session)
    text = write_study_report(records, meta, tmp_path / "docs" / "study_z")[0].read_text()
    provenance = text[text.index("## Wall time and provenance"):]
    assert table_row(provenance, "dflash")[-2:] == ["Some CPU", "`01234567`"]
    assert table_row(provenance, "dspine")[-2:] == ["-", "-"]
    # a row whose bf16 products ran in float32 (a CPU without native bf16) says so
    session["machine"]["bf16_matmul"] = "float32"
    text = write_study_report(records, meta, tmp_path / "docs" / "study_f")[0].read_text()
    provenance = text[text.index("## Wall time and provenance"):]
    assert table_row(provenance, "dflash")[-2] == "Some CPU (bf16 products in float32)"


def test_conditional_acceptance_is_where_the_chain_breaks() -> None:
    rates = conditional_acceptance([0.5, 0.25, 0.0, 0.0])
    assert rates[:3] == pytest.approx([0.5, 0.5, 0.0]) and math.isnan(rates[3])


def test_paired_curve_reads_the_same_blocks_at_each_step(tmp_path: Path) -> None:
    for name, values in (("ref", [3, 2, 1, 2, 0, 1]), ("v", [1, 1, 0, 2, 0, 0])):
        blocks(values).save(tmp_path / name / "eval_blocks" / "step0000250.npz")
    blocks([0] * 6).save(tmp_path / "v" / "eval_blocks" / "step0000500.npz")  # no partner
    paired = paired_by_step(tmp_path / "v", tmp_path / "ref")
    assert list(paired) == [250]
    assert paired[250]["diff"] == pytest.approx(np.mean([-2, -1, -1, 0, 0, -1]))


# ------------------------------------------------------------------ what a session keeps
def test_finished_variants_are_archived_and_a_new_session_skips_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh checkout keeps only the archive: the next session trains nothing archived,
    rewrites the same report from it, and refuses an archive made for another request."""
    trained: list[str] = []
    per_block = {"dspine": [3, 2, 1, 2, 0, 1], "dflash": [1, 1, 0, 2, 0, 0]}

    def fake_train(settings, variant):
        trained.append(variant.name)
        blocks(per_block[variant.name]).save(
            settings.run_dir(variant) / study.EVAL_BLOCKS_DIR / "step0000006.npz")

    def fake_evaluate(settings, variant, engine_eval):
        result = blocks(per_block[variant.name])
        result.save(settings.run_dir(variant) / study.BLOCKS_FILE)
        return Evaluation(0, result.summary(), [])

    def fake_record(settings, variant, result):
        rec = record(variant.name, blocks(per_block[variant.name]), None)
        rec.simulated = result.simulated
        return rec

    monkeypatch.setattr(study, "train_variant", fake_train)
    monkeypatch.setattr(study, "evaluate_final", fake_evaluate)
    monkeypatch.setattr(study, "variant_record", fake_record)
    monkeypatch.setattr(study, "check_variant_overrides", lambda *a: None)
    monkeypatch.setattr(study, "ensure_features", lambda *a: None)
    monkeypatch.setattr(study, "data_meta", lambda *a: None)
    monkeypatch.setattr(study, "study_request",
                        lambda settings, v, data: {"train": [f"optim.max_steps={settings.steps}"]})
    variants = [Variant("dspine", "ref"), Variant("dflash", "baseline")]
    archive = tmp_path / "committed"

    def session(name: str, steps: int = 12, only: list | None = None) -> list[Path]:
        settings = tiny_settings(tmp_path / name, plan_steps=0, archive_dir=archive, steps=steps)
        return study.run_study(settings, only or variants, target="t")

    # a piece run for the reference alone, then one for the baseline alone (`--variants`):
    # the second piece's report still holds the first piece's row
    session("session1", only=variants[:1])
    assert trained == ["dspine"]
    first = session("session1", only=variants[1:])
    assert trained == ["dspine", "dflash"]
    assert [r["variant"] for r in json.loads(first[1].read_text())["variants"]] == [
        "dspine", "dflash"]
    saved = json.loads((archive / "dflash" / study.RECORD_FILE).read_text())
    assert saved["request"] == {"train": ["optim.max_steps=12"]} and "commit" in saved["session"]
    assert (archive / "dflash" / "eval_blocks" / "step0000006.npz").is_file()
    report = json.loads(first[1].read_text())["variants"]
    expected = paired_difference(blocks(per_block["dflash"]), blocks(per_block["dspine"]))
    assert report[1]["paired_vs_reference"] == pytest.approx(expected)
    assert report[1]["paired_curve"]["6"] == pytest.approx(expected)

    second = session("session2")  # a new checkout: no run directories, the same archive
    assert trained == ["dspine", "dflash"]  # nothing trained again
    again = json.loads(second[1].read_text())["variants"]
    assert again == report  # the same report, from the archive alone

    # `study.py report`: the same rows from the archive alone, with the hand-written findings
    (tmp_path / study.FINDINGS_FILE).write_text("The baseline accepts less.\n")
    rewritten = study.rewrite_report(archive, second[0].with_suffix(""))
    assert json.loads(rewritten[1].read_text())["variants"] == report
    text = rewritten[0].read_text()
    assert "## Findings (hand-written" in text and "The baseline accepts less." in text
    with pytest.raises(StudyError, match="no report to rewrite"):
        study.rewrite_report(archive, tmp_path / "elsewhere" / "report")
    with pytest.raises(StudyError, match="archived for another request.*max_steps=12"):
        session("session3", steps=13)


def test_answers_are_packed_once_and_restored_on_a_fresh_checkout(tmp_path: Path) -> None:
    from dataclasses import asdict

    from data_prep.backends import backend_identity
    from data_prep.regenerate import SETTINGS_FILE
    from data_prep.shards import read_done_ids
    from scripts.tools.ablation.study_data import (
        StudyDataSettings,
        archive_answers,
        greedy_job,
        restore_answers,
    )

    target = tmp_path / "target"
    target.mkdir()
    (target / "assembly.json").write_text(json.dumps({"gguf_sha256": "ab", "dtype": "bf16",
                                                      "conversion_version": 2}))
    answers = tmp_path / "committed" / "answers"

    def data_dir(name: str) -> StudyDataSettings:
        settings = StudyDataSettings(data_dir=tmp_path / name, target=target,
                                     answers_dir=answers)
        prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]}
                   for i in range(3)]
        settings.path("prompts").mkdir(parents=True)
        settings.path("prompts", "train.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in prompts))
        return settings

    first = data_dir("first")
    done = first.path("regenerated", "train")
    done.mkdir(parents=True)
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}]}
            for i in (2, 0, 1)]
    (done / "part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (done / "part-00001.jsonl").write_text(json.dumps(rows[2]) + "\n")

    job = greedy_job(first, "train").regenerate
    (done / SETTINGS_FILE).write_text(json.dumps(
        {**backend_identity(job), "sampling": asdict(job.sampling)}, default=str))
    packed = archive_answers(first, "train", {"wall_s_total": 4800.0})
    assert packed == answers / "train.jsonl.gz"
    assert archive_answers(first, "train", {"wall_s_total": 1.0}) is None  # packed once
    manifest = json.loads((answers / "manifest.json").read_text())
    assert manifest["parts"]["train"]["rows"] == 3
    assert manifest["parts"]["train"]["stage"] == {"wall_s_total": 4800.0}

    fresh = data_dir("fresh")
    restored = restore_answers(fresh, "train")
    assert restored is not None and restored["wall_s_total"] == 4800.0
    assert read_done_ids(fresh.path("regenerated", "train")) == {"p0", "p1", "p2"}
    assert restore_answers(fresh, "train") is None  # answers exist there now: nothing to do

    other = data_dir("other_target")
    (target / "assembly.json").write_text(json.dumps({"gguf_sha256": "cd", "dtype": "bf16",
                                                      "conversion_version": 2}))
    with pytest.raises(RuntimeError, match="another target"):
        restore_answers(other, "train")
    assert not other.path("regenerated", "train").exists()  # nothing half-written


def test_the_feature_digest_changes_with_the_cached_values(tmp_path: Path) -> None:
    shard = tmp_path / "train" / "shard_00000.safetensors"
    shard.parent.mkdir()
    (tmp_path / "train" / "index.json").write_text("{}")
    shard.write_bytes(b"\x00" * 100 + b"\x01")
    first = study.features_digest(tmp_path)
    assert study.features_digest(tmp_path) == first
    shard.write_bytes(b"\x00" * 100 + b"\x02")
    assert study.features_digest(tmp_path) != first
    head_only = study.features_digest(tmp_path, head_bytes=100)
    shard.write_bytes(b"\x00" * 100 + b"\x01")
    assert study.features_digest(tmp_path, head_bytes=100) == head_only  # past the head: unread


def test_step_times_side_by_side_on_the_same_batches(tiny_assets: dict, tmp_path: Path) -> None:
    """`study.py steps`: every variant's real step (its method, vocabulary, precision),
    interleaved on the same batches; the ratios are to the reference, and the report shows
    them."""
    from scripts.tools.ablation.study_steps import time_steps
    from tests._train_helpers import check_ok, run_module, tiny_overrides

    features = tmp_path / "features"
    check_ok(run_module(["-m", "dspine_train.training.cache_features", *tiny_overrides(
        tiny_assets, tmp_path / "run", f"data.offline_features_dir={features}")]))
    settings = tiny_settings(tmp_path, tiny_assets, features_override=features)
    variants = [Variant("dspine", ""), Variant("dflash", "", ("model.method=dflash",)),
                Variant("pruned", "", ("model.draft_vocab_size=300", "precision=bf16"))]
    result = time_steps(settings, variants, tmp_path / "steps", batches=2, iters=4,
                        progress=lambda line: None)
    rows = result["variants"]
    assert list(rows) == ["dspine", "dflash", "pruned"] and result["reference"] == "dspine"
    assert rows["dspine"]["ratio"] == 1.0
    assert (rows["dflash"]["method"], rows["pruned"]["draft_vocab_size"]) == ("dflash", 300)
    assert (rows["dspine"]["precision"], rows["pruned"]["precision"]) == ("float32", "bfloat16")
    for row in rows.values():
        assert len(row["steps_s"]) == 4 and row["step_s"] > 0
        assert row["ratio"] == pytest.approx(row["step_s"] / rows["dspine"]["step_s"])
    assert len(result["rows"]) == 2
    import torch

    from dspine_train.cpu_bf16 import resolve_bf16_matmul  # as train.py runs here
    assert result["bf16_matmul"] == resolve_bf16_matmul("auto", torch.device("cpu")).value
    result.update(command="python scripts/study.py steps", commit="abc")
    path = tmp_path / "step_times.json"
    path.write_text(json.dumps(result))
    ref = blocks([1, 0, 1, 0, 1, 0])
    text = write_study_report([record("dspine", ref, None)], {"date": "d"}, tmp_path / "r",
                              step_times=path)[0].read_text()
    assert "## Step time side by side" in text
    assert f"| dflash | {rows['dflash']['step_s']:.2f} |" in text


def test_step_times_without_a_feature_cache_run_the_target_for_the_timed_batches(
        tiny_assets: dict, tmp_path: Path) -> None:
    """`study.py steps` on a machine without the study's feature cache: the timed batches'
    features come from the target, run in the process, and they are the cache's values (the
    same target, dtype and layers; padding aside)."""
    import torch

    from dspine_train.training.config import compose_train_config
    from dspine_train.training.draft_builder import build_draft, load_or_build_token_table
    from dspine_train.training.inputs import check_inputs
    from dspine_train.training.target import read_embedding_and_head
    from scripts.tools.ablation.study_steps import _features_in_process, time_steps
    from scripts.tools.bench.step_bench import first_batches
    from tests._train_helpers import check_ok, run_module, tiny_overrides

    settings = tiny_settings(tmp_path, tiny_assets)
    variants = [Variant("dspine", ""), Variant("dflash", "", ("model.method=dflash",))]
    result = time_steps(settings, variants, tmp_path / "steps", batches=2, iters=2,
                        progress=lambda line: None, cached_features=False)
    assert result["features"] == "target run in process" and len(result["rows"]) == 2
    assert all(row["step_s"] > 0 for row in result["variants"].values())

    features = tmp_path / "features"
    check_ok(run_module(["-m", "dspine_train.training.cache_features", *tiny_overrides(
        tiny_assets, tmp_path / "run", f"data.offline_features_dir={features}")]))
    config = compose_train_config(*tiny_overrides(tiny_assets, tmp_path / "cfg",
                                                  f"data.offline_features_dir={features}"))
    inputs = check_inputs(config)
    embed, head = read_embedding_and_head(config.model.target_path)
    table = load_or_build_token_table(tmp_path / "table.safetensors", head,
                                      inputs.draft_config.transfer_dim, True, lambda: None)
    draft = build_draft(config.model, inputs.draft_config, table, inputs.target_config, 0)
    cached, _ = first_batches(config, inputs.train, draft, 2, head)
    made, cache = first_batches(config, inputs.train, draft, 2, head, _features_in_process(config))
    assert cache is None
    for (batch, want, *_), (other, got, *_) in zip(cached, made, strict=True):
        assert torch.equal(batch.input_ids, other.input_ids)
        valid = batch.attention_mask.bool()
        # float32, but the cache ran its rows in batches of another padded width
        torch.testing.assert_close(got.context[valid], want.context[valid], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(got.final_hidden[valid], want.final_hidden[valid],
                                   rtol=1e-3, atol=1e-4)


def test_the_method_rows_train_on_the_study_feature_cache(tiny_assets: dict,
                                                        tmp_path: Path) -> None:
    """DSpark, DFlash2 and Domino take real steps on the feature cache the study trains the
    other rows on (their objectives read the target's head, not the cached top-k)."""
    from scripts.tools.ablation.study_steps import time_steps
    from tests._train_helpers import check_ok, run_module, tiny_overrides

    features = tmp_path / "features"
    check_ok(run_module(["-m", "dspine_train.training.cache_features", *tiny_overrides(
        tiny_assets, tmp_path / "run", f"data.offline_features_dir={features}")]))
    settings = tiny_settings(tmp_path, tiny_assets, features_override=features)
    variants = [VARIANTS["dspine"], *(VARIANTS[name] for name in METHODS)]
    result = time_steps(settings, variants, tmp_path / "steps", batches=1, iters=1,
                        progress=lambda line: None)
    rows = result["variants"]
    assert list(rows) == ["dspine", *METHODS]
    for name in METHODS:
        assert rows[name]["method"] == name and rows[name]["step_s"] > 0


def test_steps_without_the_study_data_fails_by_name(tmp_path: Path, capsys) -> None:
    from scripts.tools.ablation.study_cli import main

    assert main(["--root", str(tmp_path), "steps", "--variants", "dspine"]) == 1
    assert "the study's token data is not ready" in capsys.readouterr().err


def test_steps_refuses_batches_it_would_not_time(tmp_path: Path) -> None:
    from scripts.tools.ablation.study_steps import time_steps

    with pytest.raises(StudyError, match="--batches 3, --iters 2"):
        time_steps(tiny_settings(tmp_path), [Variant("dspine", "")], tmp_path, 3, 2)


# ------------------------------------------------------------------ foreign folders
def _no_work(monkeypatch: pytest.MonkeyPatch) -> list:
    """Fakes for everything `run_study` runs; the returned list records what it ran."""
    ran: list = []
    def fake_run(args, log_path, what, **_):  # a train.py run: its log, nothing else
        ran.append(list(args))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("train: 4/4 [00:04<00:00, 1.00s/step]\n")

    monkeypatch.setattr(runner, "run_logged", fake_run)
    monkeypatch.setattr(study_plan, "run_logged", fake_run)  # the plan's step-time runs

    def fake_evaluate(settings, variant, engine_eval):
        ran.append(("evaluate", variant.name))
        blocks([1] * 6).save(settings.run_dir(variant) / study.BLOCKS_FILE)
        return Evaluation(0, blocks([1] * 6).summary(), [])

    monkeypatch.setattr(study, "evaluate_final", fake_evaluate)
    monkeypatch.setattr(study, "variant_record", lambda settings, v, result: record(
        v.name, blocks([1] * 6), None))
    monkeypatch.setattr(study, "check_variant_overrides", lambda *a: None)
    monkeypatch.setattr(study, "ensure_features", lambda *a: None)
    monkeypatch.setattr(study, "data_meta", lambda *a: None)
    return ran


def _snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_foreign_run_in_a_variant_folder_is_refused_not_archived(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant folder holding another run (the demo's 450 steps, no checkpoints, no record
    of the study's) is neither trained over nor archived as the variant."""
    ran = _no_work(monkeypatch)
    settings = tiny_settings(tmp_path, plan_steps=0, steps=20)
    variant = Variant("dspine", "ref")
    foreign = settings.run_dir(variant)
    fake_export(foreign)
    (foreign / "metrics.jsonl").write_text('{"step": 450, "loss": 1.0}\n')
    (foreign / "hydra").mkdir()
    (foreign / "hydra" / "config.yaml").write_text("optim:\n  max_steps: 450\n")
    before = _snapshot(tmp_path)
    with pytest.raises(StudyError) as err:
        study.run_study(settings, [variant], target="t")
    (line,) = str(err.value).splitlines()
    assert str(foreign) in line and "request.json" in line
    assert ran == []  # nothing trained, evaluated or archived
    assert not settings.archive.exists()
    assert _snapshot(tmp_path) == before  # the foreign run is untouched


def test_a_variant_folder_of_another_request_is_refused_naming_what_differs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The study's own folder from a run with other settings (its finished result included)
    is not this study's result."""
    ran = _no_work(monkeypatch)
    variant = Variant("dspine", "ref")
    old = tiny_settings(tmp_path, plan_steps=0, steps=450)
    fake_export(old.run_dir(variant))
    (old.run_dir(variant) / "request.json").write_text(json.dumps(
        {"train_arguments": old.train_arguments(variant)}))
    blocks([1] * 6).save(old.run_dir(variant) / study.BLOCKS_FILE)
    weights = old.export_dir(variant) / "model.safetensors"
    (old.run_dir(variant) / "result.json").write_text(json.dumps(
        Evaluation(weights.stat().st_mtime_ns, {}, []).to_json()))
    settings = tiny_settings(tmp_path, plan_steps=0, steps=20)
    assert finished_result(settings, variant) is not None  # what was reused before
    before = _snapshot(tmp_path)
    with pytest.raises(StudyError) as err:
        study.run_study(settings, [variant], target="t")
    (line,) = str(err.value).splitlines()
    assert str(settings.run_dir(variant)) in line
    assert "optim.max_steps: 450 -> 20" in line
    assert ran == [] and not settings.archive.exists()
    assert _snapshot(tmp_path) == before


def test_a_foreign_plan_folder_is_refused_not_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _no_work(monkeypatch)
    settings = tiny_settings(tmp_path, plan_steps=4)
    variant = Variant("dspine", "ref")
    foreign = settings.out_dir / "plan" / variant.name
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StudyError) as err:
        study.run_study(settings, [variant], target="t")
    (line,) = str(err.value).splitlines()
    assert str(foreign) in line and "did not write" in line
    assert (foreign / "notes.txt").read_text() == "mine"
    assert ran == []
    # the study's own earlier plan run is replaced by a new one
    (foreign / "notes.txt").unlink()
    (foreign / "request.json").write_text(json.dumps({"train_arguments": ["old"]}))
    (foreign / "train.log").write_text("old")
    study_plan.measure_plan(settings, [variant], lambda v: False)
    assert [a for a in ran[0] if a.startswith("output_dir=")] == [f"output_dir={foreign}"]
    assert not (foreign / "train.log").read_text().startswith("old")


def test_the_study_reuses_its_own_folder_for_the_same_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _no_work(monkeypatch)
    settings = tiny_settings(tmp_path, plan_steps=0)
    variant = Variant("dspine", "ref")
    train_variant(settings, variant)  # writes request.json before anything else
    assert json.loads((settings.run_dir(variant) / "request.json").read_text()) == {
        "train_arguments": settings.train_arguments(variant)}
    fake_export(settings.run_dir(variant))
    study.run_study(settings, [variant], target="t")
    assert ("evaluate", "dspine") in ran
    assert (settings.archived_dir(variant) / study.RECORD_FILE).is_file()


@pytest.mark.parametrize("value", [",", "", " , "])
def test_an_empty_variant_list_is_refused(value: str, capsys: pytest.CaptureFixture) -> None:
    from scripts.tools.ablation.study_cli import main

    for command in ("run", "steps"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--root", "/nonexistent", command, "--variants", value])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --variants: {value!r} names no variant" in err, err


@pytest.mark.parametrize("native,argv,warned", [
    (False, ["data"], True),
    (False, ["data", "--stages", "prompts,regenerate,tokenize"], False),
    (False, ["run", "--variants", "dspark"], True),
    (False, ["run", "--precision", "fp32"], False),
    (True, ["data"], False),
])
def test_the_long_stages_warn_on_a_cpu_without_native_bf16(monkeypatch, capsys, native, argv,
                                                          warned) -> None:
    from dspine_train import cpu_bf16
    from scripts.tools.ablation.study_cli import build_parser, warn_without_native_bf16

    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda device: native)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    warn_without_native_bf16(build_parser().parse_args(argv))
    assert ("no native bf16" in capsys.readouterr().err) == warned


def test_the_checkpoint_schedule_does_not_make_another_request(tmp_path: Path) -> None:
    """A row resumed with `--checkpoint-every 100` is the row archived with 250 (a run resumes
    exactly); the paths and the schedule are left out, a changed budget is refused by name."""
    settings = tiny_settings(tmp_path, archive_dir=tmp_path / "archive")
    variant = Variant("dspine", "ref")
    train = ["recipe=tiny", "optim.max_steps=12"]
    archived = {"train": [*train, "checkpoint.every=250", "checkpoint.keep_last=1"], "data": "d"}
    folder = settings.archived_dir(variant)
    folder.mkdir(parents=True)
    rec = dataclasses.replace(record("dspine", blocks([1, 0, 2, 0, 1, 3]), None),
                              request=archived)
    (folder / study.RECORD_FILE).write_text(json.dumps(rec.to_json(), default=str))

    assert study.result_arguments([*train, "checkpoint.every=100", "output_dir=/x"]) == train
    same = {"train": train, "data": "d"}
    assert study.archived_record(settings, variant, same).variant == "dspine"
    with pytest.raises(StudyError, match="archived for another request.*max_steps=13"):
        study.archived_record(settings, variant,
                              {"train": ["recipe=tiny", "optim.max_steps=13"], "data": "d"})
    real = study.study_request(settings, variant, "d")["train"]
    assert not [a for a in real if a.startswith(("checkpoint.", "output_dir="))]
    assert any(a.startswith("optim.max_steps=") for a in real)


def test_a_run_folder_resumes_with_another_checkpoint_schedule(tmp_path: Path) -> None:
    """A run folder claimed with `checkpoint.every=250` is the same run when resumed with 100
    (the trainer allows it, `RESUME_MAY_CHANGE`); another budget is still refused by name."""
    run_dir = tmp_path / "dspine"
    train = ["recipe=tiny", "optim.max_steps=12", "checkpoint.resume_from=latest"]
    runner.claim_run_dir(run_dir, [*train, "checkpoint.every=250", "checkpoint.keep_last=1"])
    runner.check_run_dir(run_dir, [*train, "checkpoint.every=100", "checkpoint.keep_last=2"])
    runner.check_run_dir(run_dir, train)
    with pytest.raises(StudyError, match=r"other arguments .*optim\.max_steps: 12 -> 13\)"):
        runner.check_run_dir(run_dir, ["recipe=tiny", "optim.max_steps=13",
                                       "checkpoint.resume_from=latest", "checkpoint.every=100"])
    recorded = json.loads((run_dir / runner.REQUEST_FILE).read_text())["train_arguments"]
    assert "checkpoint.every=250" in recorded  # the claim is not rewritten by a resume
