"""The pruned draft vocabulary (`draft_vocab_size`): selection, objective, export, lossless decoding.

* the kept ids are the most frequent supervised tokens plus the template's special tokens, and
  `outside_share` counts what the draft can no longer propose;
* a "pruned" vocabulary holding every id trains exactly like the full one (the restriction and
  the id maps are the identity there), and a real pruning trains only its rows;
* a pruned export reloads bit-identically (config.json `draft_vocab_size`, the `d2t` tensor),
  and the DFlash / speculators / SpecForge formats refuse it by name;
* decoding with a pruned draft stays lossless: greedy equals the target's own greedy output,
  and sampled tokens follow the target's distribution (chi-square), with drafts accepted.
"""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dspine_train.engine import Engine
from dspine_train.formats import FormatError, write_format
from dspine_train.modeling import DSpineDraftModel
from dspine_train.objective import dspine_loss, sample_anchors
from dspine_train.training.draft_vocab import (
    outside_share,
    select_draft_vocab,
    supervised_token_counts,
)
from dspine_train.vocab_loss import target_topk
from tests._engine_helpers import (
    SAMPLED_TOKENS,
    assert_sampled_like,
    build_tiny_target,
    build_tokenizer,
    exact_marginals,
    hf_greedy,
    sample_rows,
    tiny_draft,
    train_draft_briefly,
)
from tests._model_helpers import context_features, randomise_injection, tiny_target
from tests._model_helpers import tiny_draft as model_draft


def test_selection_keeps_the_most_frequent_supervised_tokens_and_the_template_tokens():
    rows = {"input_ids": [[5, 5, 5, 7, 7, 9, 1], [7, 5, 2, 2]],
            "loss_mask": [[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1]]}
    data = datasets.Dataset.from_dict(rows)
    counts = supervised_token_counts(data, 12)
    assert counts[5] == 3 and counts[7] == 3 and counts[2] == 2 and counts[1] == 0
    assert select_draft_vocab(counts, 3).tolist() == [2, 5, 7]
    assert select_draft_vocab(counts, 3, always=[11]).tolist() == [5, 7, 11]
    with pytest.raises(ValueError, match="draft_vocab_size 1"):
        select_draft_vocab(counts, 1, always=[10, 11])
    # 9 supervised tokens: 5 x3, 7 x3, 2 x2, 9 x1 -> keeping {5, 7} leaves 3 outside
    assert outside_share(data, torch.tensor([5, 7]), 12) == pytest.approx(3 / 9)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=4)


def _inputs(target, draft, seed=0, sharpen=20.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (2, 40), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :5] = 0
    feats, final = context_features(target, draft, ids)
    anchors, mask = sample_anchors(loss_mask, 8, draft.config.block_size, g)
    return ids, feats, final * sharpen, loss_mask, anchors, mask  # a peaked target


def _loss(draft, inputs, topk_k=None):
    ids, feats, final, loss_mask, anchors, mask = inputs
    draft.zero_grad(set_to_none=True)
    out = draft(ids, feats, anchors, mask)
    topk = None
    if topk_k:
        parts = target_topk(final.reshape(-1, final.shape[-1]), draft._target_head, topk_k)
        topk = tuple(t.view(*final.shape[:2], -1) for t in parts)
    loss, metrics = dspine_loss(draft, out, final, loss_mask, anchors, mask, step=30,
                                chunk_size=9, target_topk=topk)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in draft.named_parameters()
                                    if p.grad is not None}


def _pruned(target, size, ids, **fields):
    draft = model_draft(target, draft_vocab_size=size, **fields)
    draft.set_draft_vocab(ids)
    return draft


@pytest.mark.parametrize("topk_k", [None, 256])
def test_a_pruned_vocabulary_of_every_id_trains_as_the_full_one(target, topk_k):
    full = model_draft(target)
    randomise_injection(full)
    pruned = _pruned(target, 256, torch.arange(256))
    pruned.load_state_dict(full.state_dict(), strict=False)
    inputs = _inputs(target, full)
    loss_f, m_f, g_f = _loss(full, inputs, topk_k)
    loss_p, m_p, g_p = _loss(pruned, inputs, topk_k)
    torch.testing.assert_close(loss_p, loss_f, rtol=1e-5, atol=1e-6)
    assert float(m_p["outside_draft_vocab"]) == 0.0
    for name, grad in g_f.items():
        torch.testing.assert_close(g_p[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("topk_k", [None, 16])
def test_a_pruned_vocabulary_trains_over_its_rows_against_the_renormalised_target(target, topk_k):
    keep = torch.arange(0, 256, 2)  # the even ids
    draft = _pruned(target, 128, keep)
    randomise_injection(draft)
    assert draft.logits(torch.randn(3, 64)).shape == (3, 128)
    assert torch.equal(draft.draft_to_target(torch.arange(128)), keep)
    assert draft.target_to_draft(torch.tensor([4, 5, -100])).tolist() == [2, -1, -1]
    # a top-16 target restricted to the kept ids assumes its remainder mass lies among them:
    # a sharper target keeps that remainder (and the error) small
    inputs = _inputs(target, draft, seed=3, sharpen=20.0 if topk_k is None else 60.0)
    loss, metrics, grads = _loss(draft, inputs, topk_k)
    labels = inputs[0]
    share = float(metrics["outside_draft_vocab"])
    assert torch.isfinite(loss) and 0.2 < share < 0.8  # odd labels are outside
    assert (labels % 2 == 1).any() and grads["norm.weight"].abs().sum() > 0
    # the backbone term only: a dense reference over the kept rows, renormalised target
    draft.config.refine_weight, draft.config.alignment_weight = 0.0, 0.0
    backbone, _, _ = _loss(draft, inputs, topk_k)
    ids, feats, final, loss_mask, anchors, mask = inputs
    with torch.no_grad():
        out = draft(ids, feats, anchors, mask)
        from dspine_train.objective import slot_weights

        w = slot_weights(loss_mask, anchors, mask, draft.config.block_size,
                         draft.config.loss_gamma).reshape(-1)
        lab = out.labels.reshape(-1)
        rows = (w > 0) & (lab % 2 == 0)
        pos = (anchors[..., None] + torch.arange(draft.config.block_size - 1)).clamp_max(39)
        b = torch.arange(2)[:, None, None].expand_as(pos)
        states = final[b.reshape(-1), pos.reshape(-1)][rows]
        p_t = torch.softmax(draft.target_logits(states), -1)[:, keep]
        p_t = p_t / p_t.sum(-1, keepdim=True)
        logp = torch.log_softmax(draft.logits(out.hidden[..., 1:, :].reshape(-1, 64)[rows]), -1)
        ce = -logp.gather(-1, (lab[rows] // 2)[:, None]).squeeze(-1)
        l1 = (logp.exp() - p_t).abs().sum(-1)
        c = draft.config.ce_weight
        want = ((c * ce + (1 - c) * l1) * w[rows]).sum() / w[rows].sum()
    tol = 1e-5 if topk_k is None else 2e-3  # a top-16 target: the remainder bound
    torch.testing.assert_close(backbone, want, rtol=tol, atol=tol)


def test_pruned_export_round_trips_and_other_formats_refuse_it(target, tmp_path):
    keep = torch.arange(3, 256, 3)
    draft = _pruned(target, keep.numel(), keep)
    randomise_injection(draft)
    draft.save_pretrained(tmp_path / "draft")
    fields = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert fields["draft_vocab_size"] == keep.numel()
    saved = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert torch.equal(saved["d2t"] + torch.arange(keep.numel()), keep)
    back = DSpineDraftModel.from_pretrained(tmp_path / "draft")
    mine, theirs = draft.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(back.draft_token_ids(), keep)
    for fmt in ("dflash", "speculators", "specforge"):
        with pytest.raises(FormatError, match=f"draft_vocab_size={keep.numel()}.*--format {fmt}"):
            write_format(draft, tmp_path / fmt, fmt)


# ------------------------------------------------------------------ lossless decoding
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("pruned")
    hf = build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6,
                           eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=200)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist()
               for n in torch.randint(2, 10, (8,), generator=gen).tolist()]
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts])
    # the 120 ids the last 4 sequences use most: some tokens of the first 4 stay outside
    counts = np.bincount(sequences[4:].reshape(-1).numpy(), minlength=256)
    keep = select_draft_vocab(counts, 120)
    drafts = {}
    for name, fields in (("dspine", {}), ("dflash", {"method": "dflash"})):
        draft = tiny_draft(hf, 200, draft_vocab_size=120, **fields)
        draft.set_draft_vocab(keep)
        train_draft_briefly(draft, hf, sequences, steps=60, lr=1e-2).save_pretrained(root / name)
        drafts[name] = root / name
    return {"root": root, "hf": hf, "prompts": prompts, "keep": keep}


@pytest.mark.parametrize("name", ["dspine", "dflash"])
def test_greedy_with_a_pruned_draft_equals_the_targets_greedy(world, name):
    engine = Engine.from_pretrained(world["root"] / "target", world["root"] / name,
                                    max_seq_len=96, eos_token_ids=[], max_batch_size=4)
    result = engine.generate(world["prompts"][:4], max_new_tokens=24, chat=False)
    reference = [hf_greedy(world["hf"], p, 24) for p in world["prompts"][:4]]
    assert result.token_ids == reference
    outside = sum(t not in set(world["keep"].tolist()) for row in reference for t in row)
    assert outside > 0  # the target emitted tokens the draft cannot propose
    assert result.stats.tau > 1.2  # and drafts were accepted


@pytest.mark.parametrize("name", ["dspine", "dflash"])
def test_token_trees_of_a_pruned_draft_are_target_ids(world, name, monkeypatch):
    """The tree's lattice maps draft ids as the chain's walk does: a one-path tree through the
    tree code is the chain round for round, and a wider tree stays lossless."""
    def engine(**kwargs):
        return Engine.from_pretrained(world["root"] / "target", world["root"] / name,
                                      max_seq_len=160, eos_token_ids=[], max_batch_size=4,
                                      **kwargs)
    batch = world["prompts"][:4]
    chain = engine().generate(batch, max_new_tokens=24, chat=False)
    one_path = engine()
    monkeypatch.setattr(one_path, "_tree_budget", lambda num_draft: num_draft)  # M = 1, N = g
    walked = one_path.generate(batch, max_new_tokens=24, chat=False)
    assert walked.stats.round_accepted == chain.stats.round_accepted
    wide = engine(tree_paths=3).generate(batch, max_new_tokens=24, chat=False)
    assert wide.token_ids == chain.token_ids == [hf_greedy(world["hf"], p, 24) for p in batch]
    assert wide.stats.tree_paths == 3 and wide.stats.tau > 1.2


def test_sampling_with_a_pruned_draft_matches_the_target_distribution(tmp_path):
    vocab, prompt, rows = 32, [3, 17, 8, 25], 600
    hf = build_tiny_target(tmp_path / "target", "qwen3", head_scale=6.0, vocab_size=vocab,
                           num_hidden_layers=6, eos_token_id=None)
    draft = tiny_draft(hf, 30, transfer_dim=8, message_size=8, draft_vocab_size=20)
    exact = exact_marginals(hf, prompt, vocab, steps=SAMPLED_TOKENS)
    likely = torch.stack(exact).sum(0).argsort(descending=True)
    draft.set_draft_vocab(likely[:20])  # 20 of 32 ids: the rest only by the residual
    draft.save_pretrained(tmp_path / "draft")
    engine = Engine.from_pretrained(tmp_path / "target", tmp_path / "draft",
                                    max_batch_size=rows, max_seq_len=16, eos_token_ids=[])
    tokens, results = sample_rows(engine, prompt, rows)
    assert_sampled_like(tokens, exact)
    assert 1.0 < results[-1].stats.tau < 3.0
    outside = ~torch.isin(tokens, likely[:20])
    assert outside.any()  # tokens outside the draft's vocabulary were sampled (residual)


def test_the_trainer_prunes_trains_on_cached_topk_and_exports_the_map(tiny_assets, tmp_path):
    """The tiny recipe end to end: cache features (with the top-k), train a pruned draft on
    them, export; the export reloads with its map and the log says what was kept."""
    from tests._train_helpers import check_ok, run_module, run_train, tiny_overrides

    features = tmp_path / "features"
    args = tiny_overrides(tiny_assets, tmp_path / "run", f"data.offline_features_dir={features}",
                          "model.draft_vocab_size=300", "optim.max_steps=3", "eval.every=0",
                          "checkpoint.every=0", "data.target_topk=32")
    check_ok(run_module(["-m", "dspine_train.training.cache_features", *args]))
    assert json.loads((features / "train" / "index.json").read_text())["target_topk"] == 32
    proc = run_train(args)
    check_ok(proc)
    assert "pruned draft vocabulary: 300 of 512 ids" in proc.stdout
    assert "target distribution: top-32 + remainder, cached once per token" in proc.stdout
    draft = DSpineDraftModel.from_pretrained(tmp_path / "run" / "final")
    assert draft.config.draft_vocab_size == 300
    kept = draft.draft_token_ids()
    assert kept.numel() == 300 and torch.equal(kept, torch.unique(kept))
    data = datasets.load_from_disk(str(tiny_assets["data"]))["train"]
    counts = supervised_token_counts(data, 512)
    # the most frequent supervised tokens are kept (a few places may go to template tokens)
    frequent = np.nonzero(counts > np.sort(counts)[::-1][289])[0]
    assert len(frequent) > 100 and set(frequent.tolist()) <= set(kept.tolist())


@pytest.mark.parametrize(("override", "message"), [
    ("export.format=dflash", "model.draft_vocab_size: a pruned draft exports only with"),
    ("data.target_topk=-1", "data.target_topk must be >= 0"),
])
def test_config_refuses_a_pruned_dflash_export_and_a_negative_topk(override, message):
    from dspine_train.training.config import ConfigError, compose_train_config

    with pytest.raises(ConfigError, match=message):
        compose_train_config("recipe=tiny", "model.method=dflash", "model.draft_vocab_size=300",
                             override)
