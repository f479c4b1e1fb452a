"""The cheaper training step: gradient-in-forward vocabulary terms and the cached top-k target.

* `vocab_loss.BackboneVocabTerms` gives the objective's value and gradients of the autograd +
  checkpointing path (`scripts.tools.bench.reference_objective`), with and without distillation;
* a top-k target distribution holding every id is the exact distribution; a short top-k moves
  the objective by less than 1e-3 on a test batch (and by at most 2 x the remainder mass);
* the feature cache pass stores the top-k and the reader gives it back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspine_train.objective import dspine_loss, sample_anchors
from dspine_train.vocab_loss import TargetDistribution, target_topk
from scripts.tools.bench.reference_objective import reference_dspine_loss
from tests._model_helpers import (
    USED_VOCAB,
    context_features,
    randomise_injection,
    tiny_draft,
    tiny_target,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=3)


def _inputs(target, draft, seed=0, seq=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, USED_VOCAB, (2, seq), generator=g)
    loss_mask = torch.ones(2, seq, dtype=torch.long)
    loss_mask[:, :6] = 0
    feats, final = context_features(target, draft, ids)
    anchors, mask = sample_anchors(loss_mask, 8, draft.config.block_size, g)
    replace = torch.rand(anchors.shape, generator=g) < 0.5
    return ids, feats, final, loss_mask, anchors, mask, replace


def _loss_and_grads(draft, inputs, loss_fn=dspine_loss, **kwargs):
    ids, feats, final, loss_mask, anchors, mask, replace = inputs
    draft.zero_grad(set_to_none=True)
    out = draft(ids, feats, anchors, mask, replace)
    loss, metrics = loss_fn(draft, out, final, loss_mask, anchors, mask, step=30,
                            chunk_size=7, **kwargs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


def _topk_of(draft, final, k):
    parts = target_topk(final.reshape(-1, final.shape[-1]), draft._target_head, k)
    return tuple(t.view(*final.shape[:2], -1) for t in parts)


@pytest.mark.parametrize("distill", [True, False])
def test_gradient_in_forward_equals_autograd_with_checkpointing(target, distill):
    draft = tiny_draft(target, distill=distill)
    randomise_injection(draft)
    inputs = _inputs(target, draft)
    fast, m_fast, g_fast = _loss_and_grads(draft, inputs)
    ref, m_ref, g_ref = _loss_and_grads(draft, inputs, reference_dspine_loss)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    for key in ("backbone_ce", "backbone_l1", "refine_ce", "top1_acc", "candidate_coverage"):
        torch.testing.assert_close(m_fast[key], m_ref[key], rtol=1e-5, atol=1e-6, msg=key)
    assert g_fast.keys() == g_ref.keys() and "norm.weight" in g_fast
    for name, grad in g_ref.items():
        torch.testing.assert_close(g_fast[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_full_topk_is_the_exact_distribution(target):
    draft = tiny_draft(target)
    randomise_injection(draft)
    inputs = _inputs(target, draft, seed=1)
    exact, m_exact, g_exact = _loss_and_grads(draft, inputs)
    topk = _topk_of(draft, inputs[2], draft.config.vocab_size)
    cached, m_cached, g_cached = _loss_and_grads(draft, inputs, target_topk=topk)
    torch.testing.assert_close(cached, exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m_cached["refine_l1"], m_exact["refine_l1"], rtol=1e-5, atol=1e-6)
    for name, grad in g_exact.items():
        torch.testing.assert_close(g_cached[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_short_topk_moves_the_objective_by_less_than_1e_3(target):
    draft = tiny_draft(target)
    randomise_injection(draft)
    ids, feats, final, *rest = _inputs(target, draft, seed=2)
    # a trained target's next-token distribution is peaked; the tiny random one is nearly flat,
    # so its final states are scaled to give a distribution of a few likely tokens
    final = final * 30
    inputs = (ids, feats, final, *rest)
    exact, m_exact, _ = _loss_and_grads(draft, inputs)
    k = 32
    topk = _topk_of(draft, final, k)
    remainder = 1 - topk[1].sum(-1)
    assert 1e-4 < remainder.mean() < 3e-2  # a real remainder, not the whole distribution
    cached, m_cached, _ = _loss_and_grads(draft, inputs, target_topk=topk)
    assert abs(float(cached - exact)) < 1e-3
    assert abs(float(m_cached["backbone_l1"] - m_exact["backbone_l1"])) <= 2 * float(
        remainder.max())
    assert float(cached) != float(exact)  # the top-k path was taken


def test_target_distribution_at_ids():
    dense = TargetDistribution(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    sparse = TargetDistribution(torch.tensor([[0.5, 0.3]]), torch.tensor([[0, 1]]))
    cand = torch.tensor([[1, 2, 0]])
    torch.testing.assert_close(dense.at(cand), torch.tensor([[0.3, 0.2, 0.5]]))
    torch.testing.assert_close(sparse.at(cand), torch.tensor([[0.3, 0.0, 0.5]]))


def test_feature_cache_stores_the_topk_and_reads_it_back(tiny_assets, tmp_path: Path):
    import datasets

    from dspine_train.training.data import TokenBatches
    from dspine_train.training.offline_features import (
        CacheIdentity,
        OfflineFeatures,
        write_feature_cache,
    )
    from dspine_train.training.target import (
        TargetFeatureExtractor,
        load_target,
        target_head_weights,
    )

    model = load_target(str(tiny_assets["target"]), "float32", torch.device("cpu"))
    _, head = target_head_weights(model)
    batches = TokenBatches(datasets.load_from_disk(str(tiny_assets["data"]))["train"], 64, 512,
                           "data.train_path")
    extract = TargetFeatureExtractor(model, [1, 2])
    identity = CacheIdentity(str(tiny_assets["target"]), [1, 2], 64, len(batches))
    cache_dir = tmp_path / "features"
    write_feature_cache(cache_dir, batches, extract, identity, torch.device("cpu"),
                        batch_size=16, topk=(head, 5))
    assert json.loads((cache_dir / "index.json").read_text())["target_topk"] == 5
    cache = OfflineFeatures(cache_dir, identity)
    batch = batches.collate([3, 7])
    feats = cache.features(batch.rows.tolist(), batch.input_ids.shape[1])
    online = extract(batch.input_ids, batch.attention_mask)
    for i, n in enumerate(batch.attention_mask.sum(1).tolist()):
        want_ids, want_probs, want_lse = target_topk(online.final_hidden[i, :n], head, 5)
        assert torch.equal(feats.topk_ids[i, :n], want_ids)
        torch.testing.assert_close(feats.topk_probs[i, :n], want_probs)
        torch.testing.assert_close(feats.target_lse[i, :n], want_lse)
    plain = cache.features(batch.rows.tolist(), batch.input_ids.shape[1], with_topk=False)
    assert plain.topk is None and feats.topk is not None



def test_bench_recipe_mode_times_the_paths_side_by_side(tiny_assets, tmp_path: Path):
    """`bench_train.py --recipe`: every path's ratio to the old one and its time split."""
    from scripts.tools.bench.step_profile import PARTS
    from tests._train_helpers import check_ok, run_module, tiny_overrides

    features = tmp_path / "features"
    args = tiny_overrides(tiny_assets, tmp_path / "run", f"data.offline_features_dir={features}")
    check_ok(run_module(["-m", "dspine_train.training.cache_features", *args]))
    out = tmp_path / "bench.json"
    proc = run_module(["scripts/bench_train.py", "--recipe", "tiny", *[
        f"--set={a}" for a in args[1:]], "--iters", "2", "--batches", "2", "--draft-vocab",
        "300", "--paths", "old,fused+topk,fused+topk+pruned", "--out", str(out)])
    check_ok(proc)
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["old", "fused+topk", "fused+topk+pruned"]
    assert results["old"]["ratio_vs_old"] == 1.0
    for r in results.values():
        assert r["step_ms"] > 0 and set(r["breakdown_ms"]) == set(PARTS)
    assert results["old"]["breakdown_ms"]["target distribution"] > 0
    assert report["topk_objective_change"]["k"] == 512  # the cache's top-1024 of 512 ids
    assert "pruned draft vocabulary: 300 of 512 ids" in proc.stdout
    assert "where one step's time goes" in proc.stdout


def test_bench_methods_mode_times_every_method_s_own_step(tmp_path: Path):
    """`bench_train.py --methods`: each method's draft and objective on one batch, as ratios to
    DSpine's step, with each method's heads counted in its parameters."""
    from tests._train_helpers import check_ok, run_module

    out = tmp_path / "methods.json"
    proc = run_module(["scripts/bench_train.py", "--methods", "--hidden", "64", "--vocab", "512",
                       "--seq", "64", "--anchors", "4", "--block", "8", "--iters", "1",
                       "--warmup", "1", "--transfer-dim", "16", "--message-size", "8",
                       "--out", str(out)], timeout=900)  # five methods; a loaded 2-core CPU
    check_ok(proc)
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["dspine", "dflash", "dspark", "dflash2", "domino"]
    assert report["ratio_to_dspine"]["dspine"] == 1.0 and report["overhead_ratio"] is None
    for name, r in results.items():
        assert r["step_ms"] > 0 and r["peak_memory_mib"] >= 0, name
        assert report["ratio_to_dspine"][name] == r["step_ms"] / results["dspine"]["step_ms"]
    for name in ("dspark", "dflash2", "domino"):  # their heads
        assert results[name]["parameters"] > results["dflash"]["parameters"], name
    assert "DSpine overhead" not in proc.stdout
