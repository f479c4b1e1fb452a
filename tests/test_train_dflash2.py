"""`train.py recipe=tiny model.method=dflash2`: DFlash2 trains on its objective, evaluates with
its served decode, resumes exactly and exports a draft that reloads bit-identically (DeepSpeed
on CPU, as `test_train_run.py` runs DSpine and DSpark)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from dspine_train import DSpineDraftModel
from dspine_train.evaluation.block_metrics import BlockResults
from dspine_train.training.checkpointing import checkpoint_name
from tests._train_helpers import check_ok, read_metrics, run_train, tiny_overrides, train_losses
from tests.test_train_run import _assert_export_matches

pytestmark = pytest.mark.slow  # DeepSpeed training runs as module fixtures, slow each

STEPS, HALF = 24, 12
BLOCK = 8  # the tiny recipe's block size
TIMEOUT = 900  # a shared 1-core CPU runs DeepSpeed's start-up slowly


@pytest.fixture(scope="module")
def dflash2_run(tiny_assets, tmp_path_factory) -> Path:
    """`python train.py recipe=tiny model.method=dflash2`: 24 steps, checkpoints at 12 and 24."""
    out = tmp_path_factory.mktemp("dflash2_run")
    proc = run_train(tiny_overrides(tiny_assets, out, "model.method=dflash2",
                                    f"checkpoint.every={HALF}"), timeout=TIMEOUT)
    check_ok(proc)
    assert "target distribution: exact" in proc.stdout  # speculators' objective: the exact p_t
    return out


@pytest.fixture(scope="module")
def dflash2_resumed(tiny_assets, dflash2_run, tmp_path_factory) -> Path:
    """The DFlash2 run resumed from its step-12 checkpoint, into another directory."""
    out = tmp_path_factory.mktemp("dflash2_resumed")
    ckpt = dflash2_run / "checkpoints" / checkpoint_name(HALF)
    check_ok(run_train(tiny_overrides(tiny_assets, out, "model.method=dflash2",
                                      f"checkpoint.every={HALF}",
                                      f"checkpoint.resume_from={ckpt}"), timeout=TIMEOUT))
    return out


def test_dflash2_trains_with_its_objective_and_the_loss_falls(dflash2_run: Path) -> None:
    losses = train_losses(dflash2_run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = list(losses.values())[:5], list(losses.values())[-5:]
    assert sum(last) / 5 < sum(first) / 5 - 0.3, losses
    rows = [r for r in read_metrics(dflash2_run) if "loss" in r]
    for key in ("backbone_kl", "backbone_ce", "selector_ce", "top1_acc", "candidate_coverage",
                "selector_acc"):
        assert all(key in r for r in rows), key
    assert not any("refine_ce" in r or "alignment" in r or "confidence_bce" in r for r in rows)
    assert all(r["selector_ce"] > 0 and r["backbone_kl"] > 0 for r in rows)


def test_dflash2_evaluation_counts_its_block_drafts(dflash2_run: Path) -> None:
    evals = [r for r in read_metrics(dflash2_run) if "eval/tau" in r]
    assert [r["step"] for r in evals] == [HALF, STEPS]
    for r in evals:  # B-1 drafts a block (DFlash's layout): tau up to B
        assert 1.0 <= r["eval/tau"] <= BLOCK
        assert f"eval/accept_pos{BLOCK - 1}" in r and f"eval/accept_pos{BLOCK}" not in r
    final = BlockResults.load(dflash2_run / "eval_blocks" / f"step{STEPS:07d}.npz")
    assert final.num_drafts == BLOCK - 1 and final.tau == pytest.approx(evals[-1]["eval/tau"])


def test_dflash2_resume_repeats_the_uninterrupted_run_exactly(dflash2_run: Path,
                                                                dflash2_resumed: Path) -> None:
    full, resumed = train_losses(dflash2_run), train_losses(dflash2_resumed)
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    assert [resumed[s] for s in sorted(resumed)] == [full[s] for s in sorted(resumed)]
    tau = [r["eval/tau"] for r in read_metrics(dflash2_run)
           if r["step"] == STEPS and "eval/tau" in r]
    assert [r["eval/tau"] for r in read_metrics(dflash2_resumed) if "eval/tau" in r] == tau
    _assert_export_matches(dflash2_resumed / "final",
                           dflash2_run / "checkpoints" / checkpoint_name(STEPS))


def test_dflash2_export_reloads_bit_identically(dflash2_run: Path) -> None:
    export = dflash2_run / "final"
    _assert_export_matches(export, dflash2_run / "checkpoints" / checkpoint_name(STEPS))
    draft = DSpineDraftModel.from_pretrained(export)
    assert draft.config.method == "dflash2" and not draft.config.anchor_predicts
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    # the convolutions were trained off their identity start
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("layers.0.attention_conv.kernel_projection.weight").abs().sum() > 0
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "dspine" and config["method"] == "dflash2"
    assert (config["conv_kernel_size"], config["conv_group_size"], config["selector_rank"],
            config["selector_top_k"]) == (2, 16, 256, 16)
