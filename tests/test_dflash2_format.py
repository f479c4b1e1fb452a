"""DFlash2 drafts in z-lab's own format, and sliding-window drafts, proven against z-lab's client.

The reference is `dflash==0.1.0`'s `DFlash2DraftModel` (and its `DFlashDraftModel` for a
windowed DFlash): what vLLM registers under the same architecture name and what SpecForge's
published DFlash2 configs (every layer a `sliding_attention` one) are written for. Its sliding
layers let a query at position p see the keys j with p - j < W (`_attention_mask`). A tiny
random Qwen3 target, CPU, fp32.
"""

from __future__ import annotations

import json

import pytest
import torch
from _engine_helpers import (
    build_tiny_target,
    build_tokenizer,
    edited_export,
    hf_features,
    hf_greedy,
    nontrivial_dflash2,
    tiny_draft,
    zlab_draft_config,
)
from device_harness import DEVICE_TYPE, accelerator
from dflash.model import DFlash2DraftModel, DFlashDraftModel
from safetensors.torch import load_file

from dspine_train.engine import Engine
from dspine_train.export import main as export_main
from dspine_train.formats import FormatError, export_dir, load_draft
from dspine_train.modeling import DSpineConfig
from dspine_train.modeling.attention_masks import dense_training_mask, training_mask_mod
from scripts.tools.bench.reference_parity import (
    compare_rounds,
    our_block_logits,
    record_engine_rounds,
    record_reference_rounds,
    reference_block_logits,
)

VOCAB = 200  # ids the tokenizer uses; the mask token is 200
BLOCK = 4
WINDOW = 6  # narrower than every prompt below, so the window hides context
NEW = 20
TOP_K = 5
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3 target with its tokenizer, and DFlash2 drafts (full attention and a
    sliding window) and a windowed DFlash draft, saved in our format and exported in z-lab's."""
    root = tmp_path_factory.mktemp("zlab")
    hf = build_tiny_target(root / "target", "qwen3", head_scale=4.0, num_hidden_layers=6,
                           eos_token_id=None)
    build_tokenizer(root / "target", vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (9, 14)]
    settings = dict(block_size=BLOCK, selector_rank=12, selector_top_k=TOP_K, conv_group_size=8)
    drafts = {"full": nontrivial_dflash2(tiny_draft(hf, VOCAB, method="dflash2", **settings)),
              "window": nontrivial_dflash2(tiny_draft(hf, VOCAB, method="dflash2",
                                                      sliding_window=WINDOW, **settings)),
              "dflash_window": tiny_draft(hf, VOCAB, method="dflash", block_size=BLOCK,
                                          sliding_window=WINDOW)}
    for name, draft in drafts.items():
        draft.save_pretrained(root / name)
        assert export_main([str(root / name), str(root / f"{name}_zlab"), "--format",
                            "dflash"]) == 0
    return {"root": root, "hf": hf, "prompts": prompts,
            "reference": [hf_greedy(hf, p, NEW) for p in prompts]}


def _ours(world, name: str):
    draft = load_draft(world["root"] / name)
    draft.bind_target(world["hf"].model.embed_tokens.weight, world["hf"].lm_head.weight)
    return draft.eval()


def _theirs(world, name: str):
    cls = DFlashDraftModel if name.startswith("dflash") else DFlash2DraftModel
    return cls.from_pretrained(str(world["root"] / f"{name}_zlab")).eval()


@pytest.mark.parametrize("name", ["full", "window"])
def test_zlab_loads_our_dflash2_export_with_every_weight(world, name):
    root = world["root"]
    fields = json.loads((root / f"{name}_zlab" / "config.json").read_text())
    assert fields["architectures"] == ["DFlash2DraftModel"] and fields["is_causal"] is False
    assert {k: fields["dflash_config"][k] for k in KEYS} == {
        "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 12, "selector_top_k": TOP_K}
    theirs, info = DFlash2DraftModel.from_pretrained(str(root / f"{name}_zlab"),
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    attention = theirs.layers[0].self_attn
    assert attention.is_causal is False
    assert attention.sliding_window == (WINDOW if name == "window" else None)
    assert theirs.candidate_selector.top_k == TOP_K and theirs.block_size == BLOCK
    mine = load_draft(root / name).state_dict()
    for key, tensor in theirs.state_dict().items():  # z-lab keeps the codebooks as embeddings
        assert tensor.equal(mine[key.removesuffix(".weight") if "codebook" in key else key]), key


@pytest.mark.parametrize("name", ["full", "window", "dflash_window"])
def test_zlab_computes_our_slot_logits(world, name):
    """The same unary logits as z-lab's forward, block after block, with and without the
    window; and the window matters here (the same weights without it give other logits)."""
    hf, ours, theirs = world["hf"], _ours(world, name), _theirs(world, name)
    for prompt in world["prompts"]:
        _, feats = hf_features(hf, prompt, ours.config.target_layer_ids)
        for anchor in (prompt[-1], 42):
            mine = our_block_logits(ours, feats, anchor)
            torch.testing.assert_close(mine, reference_block_logits(theirs, hf, feats, anchor),
                                       rtol=1e-5, atol=1e-5)
    if name != "full":
        ours.config.sliding_window = None
        assert not torch.allclose(our_block_logits(ours, feats, 42), mine, atol=1e-3)


def test_the_training_forward_sees_the_window_the_engine_sees(world):
    """The training forward (dense mask, every block of a sequence at once) gives each block
    the logits the cached inference path gives it; the flex predicate is the dense mask."""
    hf, ours = world["hf"], _ours(world, "window")
    prompt = world["prompts"][1]
    _, feats = hf_features(hf, prompt, ours.config.target_layer_ids)
    anchors = [3, 7, 9]
    ids = torch.tensor([prompt + [0] * BLOCK])
    context = torch.cat([feats, torch.zeros(BLOCK, feats.shape[1])])[None]
    with torch.no_grad():
        out = ours(ids, context, torch.tensor([anchors]), use_flex=False)
    for i, anchor in enumerate(anchors):
        torch.testing.assert_close(ours.logits(out.hidden[0, i])[1:],
                                   our_block_logits(ours, feats[:anchor], prompt[anchor]),
                                   rtol=1e-5, atol=1e-5)
    seq_len = ids.shape[1]
    anchors_t = torch.tensor([anchors])
    dense = dense_training_mask(anchors_t, seq_len, BLOCK, False, WINDOW)[0, 0]
    predicate = training_mask_mod(anchors_t, seq_len, BLOCK, False, WINDOW)
    q, kv = torch.meshgrid(torch.arange(dense.shape[0]), torch.arange(dense.shape[1]),
                           indexing="ij")
    assert torch.equal(predicate(torch.zeros_like(q), 0, q, kv), dense)
    # slot k of the block at 9 sees context 9 + k - 5 .. 8
    assert dense[2 * BLOCK + 1, :seq_len].nonzero().flatten().tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("name", ["full", "window", "dflash_window"])
def test_zlab_spec_generate_with_our_draft_is_lossless_and_drafts_as_our_engine(world, name):
    root = world["root"]
    engine = Engine.from_pretrained(root / "target", root / f"{name}_zlab", max_seq_len=64,
                                    eos_token_ids=[], max_batch_size=1)
    for prompt, reference in zip(world["prompts"], world["reference"]):
        theirs = _theirs(world, name)
        ref_rounds = record_reference_rounds(theirs)
        out = theirs.spec_generate(world["hf"], torch.tensor([prompt]), max_new_tokens=NEW,
                                   stop_token_ids=None)
        assert out[0, len(prompt):].tolist() == reference  # the target's greedy output
        our_rounds = record_engine_rounds(engine)
        assert engine.generate([prompt], max_new_tokens=NEW, chat=False).token_ids == [reference]
        rounds = compare_rounds(ref_rounds, our_rounds, BLOCK, prompt + reference)
        assert rounds.same and rounds.compared >= 3, (ref_rounds, our_rounds)


@pytest.mark.parametrize("device", [DEVICE_TYPE, pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_windowed_draft_runs_on_the_device_in_compiled_steps(world, device):
    """The CUDA path with a window: every tensor of a round on the device (the device-faithful
    harness in `make test`, CUDA in `make gpu-check`), one host read per round, and the
    compiled steps (`fullgraph=True`, strict; eager backend) trace the windowed block."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    root = world["root"]
    with accelerator(device) as dev:
        engine = Engine.from_pretrained(root / "target", root / "window_zlab", device=dev.device,
                                        dtype=torch.float32, max_batch_size=2, max_seq_len=64,
                                        eos_token_ids=[])
        with dev.counting() as syncs:
            out = engine.generate(world["prompts"], max_new_tokens=NEW, chat=False)
        assert out.token_ids == world["reference"]
        assert sum(syncs.values()) <= out.stats.steps + 1, syncs.sites
    eager = Engine.from_pretrained(root / "target", root / "window_zlab", max_batch_size=2,
                                   max_seq_len=64, eos_token_ids=[])
    compiled = Engine.from_pretrained(root / "target", root / "window_zlab", max_batch_size=2,
                                      max_seq_len=64, eos_token_ids=[], compile=True,
                                      compile_backend="eager", strict_graphs=True)
    for temperature in (0.0, 0.8):
        expected = eager.generate(world["prompts"], max_new_tokens=8, chat=False,
                                  temperature=temperature, seed=2)
        assert compiled.generate(world["prompts"], max_new_tokens=8, chat=False,
                                 temperature=temperature, seed=2).token_ids == expected.token_ids
    assert compiled._draft_step.compiled and compiled._draft_step._compiled_keys


def test_a_zlab_dflash2_draft_imports_and_converts_back_bit_for_bit(world, tmp_path):
    """A DFlash2 made by z-lab's class, as SpecForge publishes them (every layer sliding,
    `is_causal: false`), imports as a `method: dflash2` draft with its window, computes its
    logits, and goes to our format and back to z-lab's with the same tensors and keys."""
    hf = world["hf"]
    config = zlab_draft_config(
        hf.config, 2, num_target_layers=6, is_causal=False,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
        layer_types=["sliding_attention"] * 2,
        dflash_config={"target_layer_ids": [1, 4], "mask_token_id": VOCAB, "block_size": BLOCK,
                       "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6,
                       "selector_top_k": 3})
    torch.manual_seed(3)
    theirs = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if param.dim() == 1 else 0.0))
    theirs.save_pretrained(tmp_path / "ref")
    ours = load_draft(tmp_path / "ref")
    assert (ours.config.method, ours.config.sliding_window) == ("dflash2", WINDOW)
    assert (ours.config.selector_rank, ours.config.selector_top_k) == (6, 3)
    ours.bind_target(hf.model.embed_tokens.weight, hf.lm_head.weight)
    _, feats = hf_features(hf, world["prompts"][1], [1, 4])
    torch.testing.assert_close(our_block_logits(ours, feats, 42),
                               reference_block_logits(theirs, hf, feats, 42),
                               rtol=1e-5, atol=1e-5)
    export_dir(tmp_path / "ref", tmp_path / "as_dspine", "dspine")
    export_dir(tmp_path / "as_dspine", tmp_path / "back", "dflash")
    # z-lab's save_pretrained names the codebooks `*.weight`; the export writes vLLM's names,
    # which z-lab's loader maps back onto the same weights
    before = {k.removesuffix(".weight") if "codebook" in k else k: v
              for k, v in load_file(tmp_path / "ref" / "model.safetensors").items()}
    after = load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)
    reloaded = DFlash2DraftModel.from_pretrained(str(tmp_path / "back")).state_dict()
    assert all(v.equal(reloaded[k]) for k, v in theirs.state_dict().items())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("architectures", "layer_types", "sliding_window", "use_sliding_window",
                "is_causal", "num_hidden_layers"):
        assert back[key] == theirs.config.to_dict()[key], key
    assert back["dflash_config"] == {**config.dflash_config, "num_target_layers": 6}


def test_a_warm_start_from_a_windowed_dflash_keeps_its_window(world):
    """`model.init_from` = a windowed DFlash checkpoint: the window is part of the structure the
    run takes (`from_dflash.STRUCTURE_FIELDS`), and a recipe that sets another is refused."""
    from dspine_train.training.errors import TrainingError
    from dspine_train.training.initialisation.from_dflash import (
        dflash_checkpoint,
        structure_overrides,
    )

    source = str(world["root"] / "dflash_window_zlab")
    checkpoint = dflash_checkpoint(source)
    assert (checkpoint.method, checkpoint.sliding_window) == ("dflash", WINDOW)
    assert structure_overrides({}, checkpoint, source)["sliding_window"] == WINDOW
    with pytest.raises(TrainingError, match=r"model\.sliding_window=64 \(the checkpoint has 6\)"):
        structure_overrides({"sliding_window": 64}, checkpoint, source)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f, t: f["dflash_config"].pop("selector_rank"), r"no dflash_config\.selector_rank"),
    (lambda f, t: f.update(layer_types=["sliding_attention", "full_attention"]),
     r"full and sliding layers in one draft"),
    (lambda f, t: f.pop("is_causal"), r"sliding_attention layers without is_causal"),
    (lambda f, t: f.update(output_multiplier=2.0), r"output_multiplier=2\.0"),
    (lambda f, t: f["dflash_config"].update(use_swa=True), r"dflash_config\.use_swa=True"),
    (lambda f, t: f["dflash_config"].update(causal=True), r"is_causal=True"),
    (lambda f, t: f.update(is_neox_style=False), r"is_neox_style=False"),
    (lambda f, t: t.pop("candidate_selector.hidden_projection.weight"),
     r"missing: candidate_selector\.hidden_projection\.weight"),
    (lambda f, t: t.update(extra=torch.zeros(1)), r"unexpected: extra"),
])
def test_a_zlab_dflash2_checkpoint_we_cannot_run_is_refused(world, tmp_path, edit, message):
    with pytest.raises(FormatError, match=message):
        load_draft(edited_export(world["root"] / "window_zlab", tmp_path / "edited", edit))


def test_formats_whose_loaders_window_otherwise_refuse_a_windowed_draft(world, capsys):
    root = world["root"]
    for name, fmt in (("window", "speculators"), ("dflash_window", "speculators"),
                      ("window", "specforge")):
        out = root / f"refused_{name}_{fmt}"
        assert export_main([str(root / name), str(out), "--format", fmt]) == 2
        err = capsys.readouterr().err.strip()
        assert f"sliding_window={WINDOW}" in err and "--format dflash" in err, err
        assert not out.exists()
    with pytest.raises(ValueError, match=r"sliding_window \(3\) must be >= block_size \(4\)"):
        DSpineConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, transfer_dim=8, message_size=8, candidate_k=4, block_size=4,
                     sliding_window=3)
