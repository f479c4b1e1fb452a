"""`python train.py recipe=tiny model.method=domino` (DeepSpeed on CPU, gloo): Domino trains on
its objective, evaluates with its served decode, resumes exactly and exports a draft that
reloads bit-identically (as `test_train_run.py` does for the other methods).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors import safe_open

from dspine_train import DSpineDraftModel
from dspine_train.domino_objective import lambda_base
from dspine_train.evaluation.block_metrics import BlockResults
from dspine_train.training.checkpointing import checkpoint_name
from tests._train_helpers import check_ok, read_metrics, run_train, tiny_overrides, train_losses

pytestmark = pytest.mark.slow  # DeepSpeed training runs as module fixtures, slow each

STEPS, HALF = 24, 12
BLOCK = 8  # the tiny recipe's block size
TIMEOUT = 900  # seconds a run may take on a loaded 2-core machine
DOMINO = ("model.method=domino", "model.domino_gru_hidden_dim=32", "model.domino_emb_dim=16",
          "model.domino_lambda_decay_ratio=1.0")


@pytest.fixture(scope="module")
def domino_run(tiny_assets, tmp_path_factory) -> Path:
    """24 steps of a same-position-label Domino draft, checkpoints at 12 and 24."""
    out = tmp_path_factory.mktemp("domino_run")
    proc = run_train(tiny_overrides(tiny_assets, out, *DOMINO, f"checkpoint.every={HALF}"),
                     timeout=TIMEOUT)
    check_ok(proc)
    assert "target distribution: none (Domino's objective" in proc.stdout
    return out


@pytest.fixture(scope="module")
def domino_resumed(tiny_assets, domino_run, tmp_path_factory) -> Path:
    """The Domino run resumed from its step-12 checkpoint, into another directory."""
    out = tmp_path_factory.mktemp("domino_resumed")
    ckpt = domino_run / "checkpoints" / checkpoint_name(HALF)
    check_ok(run_train(tiny_overrides(tiny_assets, out, *DOMINO, f"checkpoint.every={HALF}",
                                      f"checkpoint.resume_from={ckpt}"), timeout=TIMEOUT))
    return out


def _assert_export_matches(export: Path, checkpoint: Path) -> None:
    draft = DSpineDraftModel.from_pretrained(export)
    reloaded = draft.state_dict()
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    saved = {k.removeprefix("draft."): v for k, v in state.items()}
    params = dict(draft.named_parameters())
    assert params and set(params) <= set(saved)
    assert {"prefix_gru.weight_ih_l0", "embed_proj.2.weight"} <= set(params)
    for name in params:
        assert torch.equal(reloaded[name], saved[name].to(reloaded[name].dtype)), name


def test_domino_trains_with_its_objective_and_the_loss_falls(domino_run: Path) -> None:
    losses = train_losses(domino_run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = list(losses.values())[:5], list(losses.values())[-5:]
    assert sum(last) / 5 < sum(first) / 5 - 0.3, losses
    rows = [r for r in read_metrics(domino_run) if "loss" in r]
    for key in ("backbone_ce", "domino_ce", "top1_acc", "base_top1_acc", "lambda_base"):
        assert all(key in r for r in rows), key
    assert not any("refine_ce" in r or "backbone_l1" in r for r in rows)
    # (1 - l) CE(final) + l CE(base), l falling linearly from 1 to 0 over the run
    for r in rows:
        lam = lambda_base(r["step"] - 1, STEPS, 1.0, 1.0)
        assert r["lambda_base"] == pytest.approx(lam, abs=1e-6)
        mix = (1 - lam) * r["domino_ce"] + lam * r["backbone_ce"]
        assert r["loss"] == pytest.approx(mix, rel=1e-5)


def test_domino_evaluation_counts_its_block_drafts(domino_run: Path) -> None:
    evals = [r for r in read_metrics(domino_run) if "eval/tau" in r]
    assert [r["step"] for r in evals] == [HALF, STEPS]
    for r in evals:  # B-1 drafts a block with same-position labels: tau up to B
        assert 1.0 <= r["eval/tau"] <= BLOCK
        assert f"eval/accept_pos{BLOCK - 1}" in r and f"eval/accept_pos{BLOCK}" not in r
    final = BlockResults.load(domino_run / "eval_blocks" / f"step{STEPS:07d}.npz")
    assert final.num_drafts == BLOCK - 1 and final.tau == pytest.approx(evals[-1]["eval/tau"])


def test_domino_resume_repeats_the_uninterrupted_run_exactly(domino_run: Path,
                                                              domino_resumed: Path) -> None:
    full, resumed = train_losses(domino_run), train_losses(domino_resumed)
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    assert [resumed[s] for s in sorted(resumed)] == [full[s] for s in sorted(resumed)]
    tau = [r["eval/tau"] for r in read_metrics(domino_run)
           if r["step"] == STEPS and "eval/tau" in r]
    assert [r["eval/tau"] for r in read_metrics(domino_resumed) if "eval/tau" in r] == tau
    _assert_export_matches(domino_resumed / "final",
                           domino_run / "checkpoints" / checkpoint_name(STEPS))


def test_domino_export_reloads_bit_identically(domino_run: Path) -> None:
    export = domino_run / "final"
    _assert_export_matches(export, domino_run / "checkpoints" / checkpoint_name(STEPS))
    draft = DSpineDraftModel.from_pretrained(export)
    assert draft.config.method == "domino" and not draft.config.anchor_predicts
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight",
            "embed_proj.2.weight"} <= keys
    assert not any(k.startswith("embed_tokens") or "lm_head" in k for k in keys)
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "dspine" and config["method"] == "domino"
    assert config["domino_gru_hidden_dim"] == 32 and config["domino_emb_dim"] == 16


def test_the_published_preset_trains_with_shifted_labels(tiny_assets, tmp_path) -> None:
    """preset=domino_published on the tiny recipe: the anchor slot predicts too (B drafts a
    block, tau up to B + 1) with a pure-draft prefix of 1; the export says so."""
    out = tmp_path / "run"
    check_ok(run_train(tiny_overrides(tiny_assets, out, "preset=domino_published",
                                      "model.block_size=8", "model.domino_gru_hidden_dim=32",
                                      "model.domino_emb_dim=16", "optim.max_steps=4",
                                      "eval.every=2"), timeout=TIMEOUT))
    evals = [r for r in read_metrics(out) if "eval/tau" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 1.0 <= r["eval/tau"] <= BLOCK + 1
        assert f"eval/accept_pos{BLOCK}" in r
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert [r["lambda_base"] for r in rows] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    draft = DSpineDraftModel.from_pretrained(out / "final")
    assert draft.config.domino_shift_label and draft.config.domino_prefix_len == 1
    assert draft.config.num_predictions == BLOCK
