"""Served acceptance equals trained acceptance, block by block (`dspine_train.evaluation.parity`).

A tiny random target, a draft trained briefly on the target's own greedy continuations, and
rows that are the target's greedy continuations of held-out prompts: on every block the engine
verifies, the trainer's simulated evaluation at the same anchor accepts exactly as many drafts
(fp32 on CPU; the engine's compact target and transformers agree to rounding, and a trained
draft on a peaked target leaves no near-ties at these sizes). Each planted train/serve
mismatch (a context layer off by one, another mask token, the anchor's own feature visible)
breaks the equality, so the check would catch it.
"""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import (
    build_tiny_target,
    build_tokenizer,
    hf_greedy,
    tiny_draft,
    train_draft_briefly,
)

from dspine_train.engine import Engine
from dspine_train.evaluation.parity import (
    NEAR_TIE_LOGITS,
    ParityRowInput,
    extractor_features,
    hf_next_logits,
    round_anchors,
    rows_from_dataset,
    run_parity,
    valid_anchors,
)
from dspine_train.modeling import DSpineDraftModel
from dspine_train.training.draft_step import DraftStep
from dspine_train.training.target import TargetFeatures

RESPONSE = 24  # tokens of each row's response


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Target, a draft trained briefly on 8 of the prompts' greedy continuations (saved), and
    the greedy rows of all 12 prompts (4 held out)."""
    root = tmp_path_factory.mktemp("parity")
    hf = build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6,
                           eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=200)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist()
               for n in torch.randint(2, 11, (12,), generator=gen).tolist()]
    train = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts[:8]])
    draft = train_draft_briefly(tiny_draft(hf, 200), hf, train, steps=80, lr=1e-2)
    draft.save_pretrained(root / "draft")
    rows = [ParityRowInput(str(i), p, hf_greedy(hf, p, RESPONSE)) for i, p in enumerate(prompts)]
    return {"root": root, "hf": hf, "rows": rows}


def _pair(world, feature_shift: int = 0):
    root, hf = world["root"], world["hf"]
    engine = Engine.from_pretrained(root / "target", root / "draft", max_seq_len=64,
                                    max_batch_size=1, eos_token_ids=[])
    draft = DSpineDraftModel.from_pretrained(str(root / "draft")).eval()
    draft.bind_target(hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach())
    features = extractor_features(hf, draft.config.target_layer_ids)
    if feature_shift:
        # planted: position i carries the features of i + shift (the anchor's own visible)
        inner = features

        def features(ids):  # noqa: ANN001, ANN202
            f = inner(ids)
            return TargetFeatures(torch.roll(f.context, -feature_shift, dims=1), f.final_hidden)
    return engine, DraftStep(draft), features


def test_engine_acceptance_equals_simulated_on_every_block(world):
    engine, step, features = _pair(world)
    report = run_parity(engine, step, features, world["rows"])
    rows = report.rows
    assert all(r.reproduces_row for r in rows)  # the rows are the target's greedy output
    # first round of every row: the block anchored at the first new token
    assert [r.engine[0] for r in rows] == [r.simulated[0] for r in rows]
    for r in rows:
        assert [min(e, room) for e, room in zip(r.engine, r.room)] == r.simulated, r
    assert report.mismatched_rounds == 0 and report.difference == 0.0
    assert not any("different number" in w for w in report.warnings)
    # non-trivial: drafts are accepted, deep positions too, and rejections occur
    engine_counts = [e for r in rows for e in r.engine]
    assert max(engine_counts) >= 4 and min(engine_counts) == 0
    # the trainer's per-anchor results replayed as the engine walks reproduce its rounds
    clipped = [min(e, room) for r in rows for e, room in zip(r.engine, r.room)]
    walk = report.simulated_walk
    assert walk.blocks == len(clipped) and walk.tau == pytest.approx(1 + sum(clipped) / len(clipped))
    # uniform anchors weigh every position alike, the engine's rounds crowd where few drafts are
    # accepted: on the same rows the trainer's usual figure is higher than the served one
    assert report.simulated_all_anchors.tau > walk.tau + 0.3
    # the rounds tile the output: anchors advance by accepted + 1
    for r in rows:
        assert r.anchors == round_anchors(r.prompt_len, r.engine)
        assert r.anchors[-1] <= r.prompt_len + r.new_tokens - 1


@pytest.mark.parametrize("plant", ["layer", "mask_id", "anchor_visible"])
def test_a_planted_mismatch_is_caught(world, plant):
    engine, step, features = _pair(world, feature_shift=1 if plant == "anchor_visible" else 0)
    if plant == "layer":  # the engine reads the output of the next layer
        engine.target.set_feature_layers([i + 1 for i in engine.draft.config.target_layer_ids])
    elif plant == "mask_id":  # the engine's block uses another mask token
        engine.draft.config.mask_token_id = 5
    report = run_parity(engine, step, features, world["rows"])
    assert report.mismatched_rounds > 0
    assert any("different number" in w for w in report.warnings)


def test_rows_from_dataset_take_the_prompt_and_first_response():
    rows = rows_from_dataset([[5, 6, 7, 8, 9, 10, 11], [1, 2]], [[0, 0, 1, 1, 0, 1, 1], [1, 1]],
                             ["a", "b"])
    assert [(r.row_id, r.prompt, r.response) for r in rows] == [("a", [5, 6], [7, 8])]
    assert valid_anchors([0, 1, 1, 1, 0, 1]) == [1, 2]


def _dataset(world, path):
    """The rows as a tokenised DatasetDict (prompt unsupervised, response supervised)."""
    import datasets

    rows = world["rows"]
    ids = [r.prompt + r.response for r in rows]
    masks = [[0] * len(r.prompt) + [1] * len(r.response) for r in rows]
    split = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks,
                                        "length": [len(x) for x in ids]})
    datasets.DatasetDict(train=split, eval=split).save_to_disk(str(path))
    return path


def _script():
    """`scripts/eval_acceptance.py` as a module (its `main(argv)` returns the exit status)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "eval_acceptance.py"
    spec = importlib.util.spec_from_file_location("eval_acceptance", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_eval_acceptance_parity_mode_on_the_eval_split(world, tmp_path, capsys):
    import json

    data = _dataset(world, tmp_path / "data")
    root = world["root"]
    status = _script().main([
        "--parity", "--target", str(root / "target"), "--draft", str(root / "draft"),
        "--data", str(data), "--limit", "4", "--device", "cpu", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert status == 0, printed.err[-3000:]
    assert "paired difference" in printed.out and "simulated, engine's walk" in printed.out
    report = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert len(report["rows"]) == 4 and report["mismatched_rounds"] == 0
    assert all(r["reproduces_row"] for r in report["rows"])
    assert report["engine"]["blocks"] == report["simulated_same_anchors"]["blocks"] > 0
    assert len(report["engine"]["per_position"]) == 7  # block 8: g = 7 drafts verified
    assert (tmp_path / "out" / "parity.md").read_text().startswith("#### Parity")


def test_eval_acceptance_parity_mode_needs_data(world, tmp_path, capsys):
    script = _script()
    root = world["root"]
    base = ["--parity", "--target", str(root / "target"), "--draft", str(root / "draft"),
            "--out", str(tmp_path / "out")]
    assert script.main(base) == 1
    assert "--parity needs --data" in capsys.readouterr().err
    assert script.main([*base, "--data", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing" in err[0]
    assert not (tmp_path / "out").exists()


def test_simulated_counts_do_not_depend_on_how_anchors_are_grouped(world):
    from dspine_train.evaluation.parity import simulated_accepted

    _, step, features = _pair(world)
    row = world["rows"][0]
    seq = row.prompt + row.response
    mask = [0] * len(row.prompt) + [1] * len(row.response)
    anchors = valid_anchors(mask)
    together = simulated_accepted(step, features, seq, mask, anchors)
    assert simulated_accepted(step, features, seq, mask, anchors, anchors_per_forward=5) == together
    assert len(together) == len(anchors) and max(together) > 0


def test_every_block_evaluation_counts_what_parity_counts(world):
    """The trainer's every-block evaluation (`every_block_plan` + `simulated_block_accepts`:
    several right-padded rows per forward, rows split into anchor chunks) counts on every
    block exactly what the parity check counts row by row, one forward per row."""
    from types import SimpleNamespace

    from dspine_train.evaluation.held_out import every_block_plan, simulated_block_accepts
    from dspine_train.evaluation.parity import simulated_accepted

    _, step, features = _pair(world)
    seqs = [row.prompt + row.response for row in world["rows"]]
    masks = [[0] * len(row.prompt) + [1] * len(row.response) for row in world["rows"]]
    expected = {}
    for index, (seq, mask) in enumerate(zip(seqs, masks)):
        anchors = valid_anchors(mask)
        counts = simulated_accepted(step, features, seq, mask, anchors)
        expected.update({(index, a): n for a, n in zip(anchors, counts)})

    def collate(rows):
        width = max(len(seqs[r]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        loss = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(seqs[r])] = torch.tensor(seqs[r])
            loss[i, :len(masks[r])] = torch.tensor(masks[r])
        batch = SimpleNamespace(rows=torch.tensor(rows), input_ids=ids, loss_mask=loss)
        batch.to = lambda device: batch
        return batch

    plan = every_block_plan(masks, 64, batch_size=3, anchors_per_forward=7)
    accepted = simulated_block_accepts(step, SimpleNamespace(collate=collate), plan,
                                       lambda batch: features(batch.input_ids))
    got = {(int(r), int(a)): int(n) for r, a, n in zip(plan.rows, plan.anchors, accepted)}
    assert got == expected and max(got.values()) > 0


def test_a_response_leaving_the_greedy_output_at_a_near_tie_is_numerics_not_a_warning(world):
    """A response that differs from the engine's greedy output is a warning, unless the target
    scores the two tokens where they part within NEAR_TIE_LOGITS (batched-decoding numerics):
    then the report names the row and its margin instead."""
    engine, step, features = _pair(world)
    rows = world["rows"][:2]
    changed = []
    for r in rows:  # both responses leave the greedy output at their 4th token
        response = list(r.response)
        response[3] = (response[3] + 1) % 200
        changed.append(ParityRowInput(r.row_id, r.prompt, response))
    real = hf_next_logits(world["hf"])
    report = run_parity(engine, step, features, changed, max_new_tokens=RESPONSE,
                        next_logits=real)
    assert [r.first_divergence for r in report.rows] == [3, 3]
    assert all(r.divergence_margin > NEAR_TIE_LOGITS for r in report.rows)  # argmax vs another
    assert any("2 of 2 rows' responses are not what the engine generates" in w
               for w in report.warnings)

    def tie_with_the_first_row(ids):  # the first row's two candidates within 1e-3 logits
        logits = real(ids)
        if ids[:len(rows[0].prompt)] == rows[0].prompt:
            top = int(logits.argmax())
            logits[changed[0].response[3]] = logits[top] - 1e-3
        return logits

    report = run_parity(engine, step, features, changed, max_new_tokens=RESPONSE,
                        next_logits=tie_with_the_first_row)
    assert report.rows[0].near_tie and not report.rows[1].near_tie
    assert any("1 of 2 rows' responses are not what the engine generates greedily "
               f"(first: {rows[1].row_id})" in w for w in report.warnings)
    assert f"{rows[0].row_id} token 3, margin 0.001" in report.markdown()


def test_a_response_holding_the_engine_text_in_another_token_split_is_not_a_warning(world):
    """Answers are stored as text and re-tokenized: two generated tokens can come back as one.
    Such a row is named in the report, not warned about; a row whose text differs still is."""
    engine, step, features = _pair(world)
    rows = world["rows"][:2]
    merged = 199  # an id the tiny target's greedy rows do not use here: decodes as two tokens
    assert all(merged not in r.response for r in rows)
    a, b = rows[0].response[3], rows[0].response[4]
    first = ParityRowInput(rows[0].row_id, rows[0].prompt,
                           rows[0].response[:3] + [merged] + rows[0].response[5:])
    second = ParityRowInput(rows[1].row_id, rows[1].prompt,
                            rows[1].response[:3] + [merged] + rows[1].response[5:])

    def decode(ids):  # the tiny tokenizer's text, with the merged id spelling out a and b
        return "".join(f"<{a}><{b}>" if t == merged else f"<{t}>" for t in ids)

    report = run_parity(engine, step, features, [first, second], max_new_tokens=RESPONSE,
                        decode=decode)
    assert [r.same_text for r in report.rows] == [True, False]  # row 1's tokens are not a, b
    assert any("1 of 2 rows' responses are not what the engine generates greedily "
               f"(first: {rows[1].row_id})" in w for w in report.warnings)
    assert f"1 holds the engine's text split into other tokens ({rows[0].row_id})" in (
        report.markdown())
