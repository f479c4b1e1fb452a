"""`model.init_from` = a DFlash checkpoint: a DSpine run warm-started from a published draft.

The "published" draft is a briefly trained `method: dflash` draft exported with
`--format dflash` (the reference client `dflash` loads it, `tests/test_dflash_format.py`). At
step 0 the warm-started DSpine draft has zero injection writes, so:

* with `block_attention: bidirectional` (DFlash's attention) its block logits are the DFlash
  draft's, and its transition-cache walk picks each slot's argmax: it proposes exactly what
  the DFlash draft proposes, block for block, in the engine too;
* with DSpine's default causal attention the backbone runs under another mask: its logits are
  exactly those of the DFlash backbone under a causal block mask (the mask is the only
  difference), and its proposals differ from the DFlash draft's.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from _engine_helpers import (
    build_tiny_target,
    build_tokenizer,
    hf_features,
    hf_greedy,
    tiny_draft,
    train_draft_briefly,
)
from dflash.model import DFlashDraftModel
from safetensors.torch import load_file

from dspine_train.engine import Engine
from dspine_train.formats import export_dir, load_draft, write_format
from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.modeling.transition_cache import top_candidates, transition_table
from dspine_train.token_table import build_token_table
from dspine_train.training.config import (
    ModelConfig,
    compose_train_config,
)
from dspine_train.training.draft_builder import build_draft, draft_config_for
from dspine_train.training.errors import TrainingError
from dspine_train.training.memory_plan.for_recipe import plan_draft_config
from scripts.tools.bench.reference_parity import (
    record_engine_rounds,
    reference_block_logits,
)
from tests._train_helpers import check_ok, run_train, tiny_overrides

VOCAB = 200  # ids the tokenizer uses; the mask token is 200
NEW = 24
# The DSpine parts' sizes of the warm-started draft (the recipe's; the checkpoint has none).
SMALL = dict(transfer_dim=16, message_size=16, candidate_k=4)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target (6 layers), a briefly trained DFlash draft for it in DFlash format
    (3 layers, block 6, context layers [0, 2, 4]: none of them the recipe defaults), prompts."""
    root = tmp_path_factory.mktemp("warm")
    hf = build_tiny_target(
        root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6, eos_token_id=None
    )
    build_tokenizer(root / "target", vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 7, 10, 5)]
    sequences = torch.tensor([p + hf_greedy(hf, p, 40 - len(p)) for p in prompts])
    draft = tiny_draft(hf, VOCAB, method="dflash", num_layers=3, block_size=6,
                       target_layer_ids=[0, 2, 4])
    draft = train_draft_briefly(draft, hf, sequences, steps=100, lr=1e-2)
    draft.save_pretrained(root / "trained")
    export_dir(root / "trained", root / "dflash", "dflash")
    table = build_token_table(hf.lm_head.weight.detach().float(), SMALL["transfer_dim"])
    return {"root": root, "hf": hf, "prompts": prompts, "dflash": root / "dflash",
            "table": table}


def _bound(draft: DSpineDraftModel, hf) -> DSpineDraftModel:
    draft.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    return draft.eval()


def _model_cfg(world, **fields) -> ModelConfig:
    return ModelConfig(target_path=str(world["root"] / "target"),
                       init_from=str(world["dflash"]), **{**SMALL, **fields})


def _warm(world, seed: int = 0, **fields) -> DSpineDraftModel:
    """The step-0 draft of a run with `model.init_from` = the DFlash checkpoint, as the trainer
    builds it (`draft_config_for` then `build_draft`)."""
    m = _model_cfg(world, **fields)
    config = draft_config_for(m, world["hf"].config, VOCAB)
    return _bound(build_draft(m, config, world["table"], world["hf"].config, seed), world["hf"])


def _contexts(world):
    """(context features, anchor) pairs: every prompt, its last token and another anchor."""
    hf, layers = world["hf"], [0, 2, 4]
    for prompt in world["prompts"]:
        _, feats = hf_features(hf, prompt, layers)
        for anchor in (prompt[-1], 42):
            yield feats, anchor


def _propose(draft: DSpineDraftModel, feats: torch.Tensor, anchor: int):
    """The draft's greedy proposal (its own decode) and its slot logits for one block."""
    cache = draft.new_context_cache(1, feats.shape[0] + draft.config.block_size)
    draft.append_context(cache, feats[None], torch.tensor([feats.shape[0]]))
    logits, pre, recv = draft.draft_forward(cache, torch.tensor([anchor]))
    tokens = draft.walk(pre, recv, logits, torch.tensor([anchor])).tokens[0]
    return tokens, logits[0], pre, recv


# ----------------------------------------------------------------------------- what loads
def test_backbone_is_the_checkpoints_and_dspine_parts_start_at_their_init(world):
    warm = _warm(world)
    c = warm.config
    # the run's recipe (DSpine), the checkpoint's structure
    assert (c.method, c.injection, c.block_attention, c.transition_cache) == (
        "dspine", True, "causal", True)
    assert (c.num_layers, c.block_size, c.target_layer_ids, c.mask_token_id) == (
        3, 6, [0, 2, 4], VOCAB)
    published = load_file(world["dflash"] / "model.safetensors")
    state = warm.state_dict()
    backbone = [k for k in state if k.startswith(("fc.", "hidden_norm.", "layers.", "norm."))]
    assert sorted(backbone) == sorted(published)
    assert all(state[k].equal(published[k]) for k in published)
    # DSpine's own parts are exactly those of a fresh run with the same seed
    torch.manual_seed(0)
    fresh = DSpineDraftModel(c)
    fresh.init_token_table(world["table"])
    for name, value in fresh.state_dict().items():
        if name not in published:
            assert state[name].equal(value), name
    assert all(not w.weight.any() for w in warm.injection.writes)
    assert not warm.injection.gate_pred.weight.any()
    assert warm.token_codes.equal(world["table"].codes)


def test_a_dflash_checkpoint_is_not_read_as_a_dspine_export(world):
    """A DFlash checkpoint has none of DSpine's fields: `init_from` must not go through
    `DSpineDraftModel.from_pretrained` (which refuses it)."""
    with pytest.raises(ValueError):
        DSpineDraftModel.from_pretrained(world["dflash"])
    assert _warm(world).config.method == "dspine"


# ----------------------------------------------------------------------------- step 0
def test_bidirectional_warm_start_proposes_what_the_dflash_draft_proposes(world):
    hf = world["hf"]
    warm = _warm(world, block_attention="bidirectional")
    assert warm.config.transition_cache and warm.config.injection  # still a DSpine draft
    dflash = _bound(load_draft(world["dflash"]), hf)
    reference = DFlashDraftModel.from_pretrained(str(world["dflash"])).eval()
    for feats, anchor in _contexts(world):
        ours, logits, pre, recv = _propose(warm, feats, anchor)
        theirs, their_logits, _, _ = _propose(dflash, feats, anchor)
        # zero writes: the same network, the same block logits as the DFlash draft (bitwise)
        # and as z-lab's client
        assert logits.equal(their_logits)
        torch.testing.assert_close(logits, reference_block_logits(reference, hf, feats, anchor),
                                   rtol=1e-5, atol=1e-5)
        # the transition table at zero writes: every row is the slot's logits at its
        # candidates, whatever the predecessor, so the walk picks each slot's argmax
        cand = top_candidates(logits[None], warm.config.candidate_k)
        table = transition_table(warm.refined_scores, pre[:, 1:], recv,
                                 torch.tensor([anchor]), cand)[0]
        at_cand = torch.gather(logits, -1, cand[0])
        torch.testing.assert_close(table, at_cand[:, None, :].expand_as(table),
                                   rtol=1e-5, atol=1e-5)
        assert ours.tolist() == theirs.tolist() == logits.argmax(-1).tolist()


def test_engine_drafts_the_same_blocks_from_the_warm_start_and_the_dflash_draft(world, tmp_path):
    """The engine, the DFlash checkpoint and the warm-started draft (exported as the trainer
    would at step 0): the same drafted tokens at the same positions in every round."""
    root = world["root"]
    warm = _warm(world, block_attention="bidirectional")
    tmp_path.joinpath("warm").mkdir()
    write_format(warm, tmp_path / "warm", "dspine")
    rounds = {}
    for name, path in (("dflash", world["dflash"]), ("warm", tmp_path / "warm")):
        engine = Engine.from_pretrained(root / "target", path, max_seq_len=96, eos_token_ids=[],
                                        max_batch_size=1)
        assert engine.draft.config.method == ("dflash" if name == "dflash" else "dspine")
        rounds[name] = record_engine_rounds(engine)
        for prompt in world["prompts"]:
            reference = hf_greedy(world["hf"], prompt, NEW)
            assert engine.generate([prompt], max_new_tokens=NEW,
                                   chat=False).token_ids == [reference]
    assert len(rounds["warm"]) >= 2 * len(world["prompts"])
    assert rounds["warm"] == rounds["dflash"]


def test_causal_warm_start_differs_from_dflash_by_the_block_mask_only(world):
    """DSpine's default causal attention: the backbone runs under a mask it was not trained
    with. Its logits are exactly the DFlash backbone's under a causal block mask with no
    injection, its walk still picks each slot's argmax, and its proposals differ from the
    DFlash draft's (the agreement is printed)."""
    hf = world["hf"]
    warm = _warm(world)
    dflash = _bound(load_draft(world["dflash"]), hf)
    fields = {**dflash.config.to_dict(), "method": "dspine", "injection": False,
              "transition_cache": False, "block_attention": "causal", **SMALL}
    causal_dflash = DSpineDraftModel(DSpineConfig(**{k: v for k, v in fields.items()
                                                     if k in DSpineConfig.own_fields()}))
    causal_dflash.load_state_dict(load_file(world["dflash"] / "model.safetensors"), strict=False)
    causal_dflash = _bound(causal_dflash, hf)
    same = total = 0
    differ = False
    for feats, anchor in _contexts(world):
        ours, logits, _, _ = _propose(warm, feats, anchor)
        masked, masked_logits, _, _ = _propose(causal_dflash, feats, anchor)
        theirs, their_logits, _, _ = _propose(dflash, feats, anchor)
        assert logits.equal(masked_logits)  # the mask is the only difference ...
        assert ours.tolist() == masked.tolist() == logits.argmax(-1).tolist()
        differ |= not torch.allclose(logits, their_logits, atol=1e-3)  # ... and it matters
        same += int((ours == theirs).sum())
        total += ours.numel()
    assert differ
    print(f"causal warm start: {same}/{total} drafted tokens equal the DFlash draft's")
    assert same < total


def test_recipe_method_dflash_continues_the_dflash_draft(world):
    warm = _warm(world, method="dflash")
    dflash = _bound(load_draft(world["dflash"]), world["hf"])
    assert warm.config.method == "dflash" and not warm.config.transition_cache
    for feats, anchor in list(_contexts(world))[:2]:
        assert _propose(warm, feats, anchor)[1].equal(_propose(dflash, feats, anchor)[1])


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("field, value", [
    ("num_layers", 2), ("block_size", 8), ("target_layer_ids", [1, 3, 4]),
    ("mask_token_id", VOCAB + 1),
])
def test_a_recipe_structure_other_than_the_checkpoints_is_refused_by_name(world, field, value):
    with pytest.raises(TrainingError, match=rf"model\.{field}=.*the checkpoint has"):
        draft_config_for(_model_cfg(world, **{field: value}), world["hf"].config, VOCAB)
    # restating the checkpoint's value is fine
    same = {"num_layers": 3, "block_size": 6, "target_layer_ids": [0, 2, 4],
            "mask_token_id": VOCAB}[field]
    draft_config_for(_model_cfg(world, **{field: same}), world["hf"].config, VOCAB)


@pytest.mark.parametrize("key, value, named", [
    ("hidden_size", 128, "hidden_size=128"),
    ("intermediate_size", 96, "intermediate_size=96"),
    ("num_target_layers", 12, "target_num_layers=12"),
    ("rope_theta", 5.0, "rope_parameters="),
])
def test_a_checkpoint_for_another_target_is_refused_by_name(world, tmp_path, key, value, named):
    source = tmp_path / "other"
    source.mkdir()
    fields = json.loads((world["dflash"] / "config.json").read_text())
    fields[key] = value
    if key == "rope_theta":
        fields["rope_parameters"]["rope_theta"] = value
    if key == "num_target_layers":
        fields["dflash_config"]["num_target_layers"] = value
    (source / "config.json").write_text(json.dumps(fields))
    m = ModelConfig(target_path=str(world["root"] / "target"), init_from=str(source), **SMALL)
    with pytest.raises(TrainingError, match=rf"made for another target: .*{named}"):
        draft_config_for(m, world["hf"].config, VOCAB)


def test_unreadable_init_from_is_named(world, tmp_path):
    m = ModelConfig(target_path=str(world["root"] / "target"), init_from=str(tmp_path), **SMALL)
    with pytest.raises(TrainingError, match=r"model\.init_from: .*config\.json"):
        draft_config_for(m, world["hf"].config, VOCAB)


# The config.json of z-lab's published Qwen3-8B-DFlash-b16 as the DFlash loaders read it
# (block size at the top level, dflash_config with the mask and context layers only).
PUBLISHED_8B = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
    "block_size": 16, "dflash_config": {"mask_token_id": 151669,
                                        "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12288, "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 5,
    "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_the_published_qwen3_8b_draft_fits_the_qwen3_8b_recipe(tmp_path):
    """docs/TRAINING.md's warm-start line, planned from configs only: the recipe leaves the structure
    to the checkpoint and trains DSpine; the 4B recipe refuses the 8B draft by name."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_8B))
    config = compose_train_config("recipe=qwen3_8b", f"model.init_from={tmp_path}")
    draft = plan_draft_config(config)
    assert (draft.method, draft.block_attention, draft.injection) == ("dspine", "causal", True)
    assert (draft.num_layers, draft.block_size, draft.target_layer_ids, draft.mask_token_id) == (
        5, 16, [1, 9, 17, 25, 33], 151669)
    with pytest.raises(TrainingError, match=r"another target: .*hidden_size=4096 "
                                            r"\(this target: 2560\)"):
        plan_draft_config(compose_train_config("recipe=qwen3_4b", f"model.init_from={tmp_path}"))


# ----------------------------------------------------------------------------- train.py
def _tiny_dflash_checkpoint(target, out, **block) -> None:
    """A DFlash draft made by z-lab's class for the tiny recipe's target (its structure:
    2 layers, block 8, context layers [1, 2], mask 511), random with non-trivial norms."""
    target_config = transformers.AutoConfig.from_pretrained(target)
    config = transformers.Qwen3Config(
        **{k: getattr(target_config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")},
        rope_parameters=dict(target_config.rope_parameters), num_hidden_layers=2,
        num_target_layers=target_config.num_hidden_layers,
        dflash_config={"target_layer_ids": [1, 2], "mask_token_id": 511, **block},
        block_size=8,
    )
    torch.manual_seed(5)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out)


def test_the_tiny_recipe_refuses_a_checkpoint_of_another_structure(tiny_assets, tmp_path):
    _tiny_dflash_checkpoint(tiny_assets["target"], tmp_path / "b4", block_size=4)
    config = compose_train_config("recipe=tiny", f"model.target_path={tiny_assets['target']}",
                                  f"model.init_from={tmp_path / 'b4'}")
    with pytest.raises(TrainingError, match=r"model\.block_size=8 \(the checkpoint has 4\)"):
        plan_draft_config(config)


@pytest.mark.slow  # one DeepSpeed run of the tiny recipe
def test_train_py_starts_from_a_dflash_checkpoint(tiny_assets, tmp_path):
    """`python train.py recipe=tiny model.init_from=<DFlash dir>`, one step at lr 0: the run's
    draft is the step-0 draft. Its backbone is the checkpoint's, its writes are zero, it is a
    DSpine draft, and (bidirectional attention) it proposes what the DFlash draft proposes."""
    source = tmp_path / "published"
    _tiny_dflash_checkpoint(tiny_assets["target"], source)
    out = tmp_path / "run"
    proc = run_train(tiny_overrides(tiny_assets, out, f"model.init_from={source}",
                                    "model.block_attention=bidirectional", "optim.max_steps=1",
                                    "optim.lr=0", "eval.every=0"))
    check_ok(proc)
    assert "model.init_from: the backbone of the DFlash draft" in proc.stdout
    final = load_draft(out / "final")
    assert (final.config.method, final.config.block_attention) == ("dspine", "bidirectional")
    published = load_file(source / "model.safetensors")
    state = final.state_dict()
    assert all(state[k].equal(published[k]) for k in published)
    assert all(not w.weight.any() for w in final.injection.writes)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_assets["target"]).eval()
    ours, theirs = _bound(final, hf), _bound(load_draft(source), hf)
    for prompt in ([5, 6, 7, 8, 9], [300, 2, 77]):
        _, feats = hf_features(hf, prompt, [1, 2])
        mine, logits, _, _ = _propose(ours, feats, prompt[-1])
        other, their_logits, _, _ = _propose(theirs, feats, prompt[-1])
        torch.testing.assert_close(logits, their_logits, rtol=1e-5, atol=1e-5)
        assert mine.tolist() == other.tolist()
