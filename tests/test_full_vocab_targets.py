"""Targets whose tokenizer uses every vocabulary id (Llama-3, Gemma-3 style), on tiny local
stand-ins: mask id among the reserved tokens, Gemma's embedding scale, tied heads, head_dim
!= hidden/heads, the chat template's end-of-turn token, the token table, the engine."""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers
from _engine_helpers import hf_greedy, train_draft_briefly
from _full_vocab_helpers import (
    HIDDEN,
    VOCAB,
    build_full_vocab_target,
    special_ids,
    tiny_config,
    word_ids,
)

from data_prep.loss_mask import end_of_turn_token, tokenize_conversation
from dspine_train.modeling import DSpineConfig, DSpineDraftModel
from dspine_train.token_table import build_token_table
from dspine_train.training.target import read_embedding_and_head

DRAFT = dict(num_layers=2, block_size=8, transfer_dim=16, message_size=16, candidate_k=4,
             target_layer_ids=[1, 2])
FAMILIES = ["llama", "gemma"]
RESERVED = {"llama": "<|reserved_special_token_0|>", "gemma": "<unused0>"}
END_OF_TURN = {"llama": "<|eot_id|>", "gemma": "<end_of_turn>"}


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    """family -> (directory, HF model, tokenizer)."""
    root = tmp_path_factory.mktemp("full_vocab")
    out = {}
    for family in FAMILIES:
        path = root / family
        model = build_full_vocab_target(path, family)
        out[family] = (path, model, transformers.AutoTokenizer.from_pretrained(path))
    return out


def _draft(model, tokenizer, **fields) -> DSpineDraftModel:
    config = DSpineConfig.from_target(model.config, tokenizer, **{**DRAFT, **fields})
    torch.manual_seed(0)
    draft = DSpineDraftModel(config).eval()
    draft.init_token_table(build_token_table(model.lm_head.weight.detach().float(), 16))
    draft.bind_target(model.get_input_embeddings().weight.detach(),
                      model.get_output_embeddings().weight.detach())
    return draft


# ---------------------------------------------------------------------------- mask id
@pytest.mark.parametrize("family", FAMILIES)
def test_mask_id_is_the_first_reserved_token(targets, family):
    path, model, tok = targets[family]
    assert len(tok) == model.config.vocab_size == VOCAB  # every id is a token
    config = DSpineConfig.from_target(model.config, tok, **DRAFT)
    assert config.mask_token_id == special_ids(family)[RESERVED[family]]
    assert config.target_vocab_size == VOCAB


@pytest.mark.parametrize("family", FAMILIES)
def test_explicit_reserved_mask_id_is_kept(targets, family):
    _, model, tok = targets[family]
    other = special_ids(family)["<|reserved_special_token_5|>" if family == "llama" else "<unused3>"]
    config = DSpineConfig.from_target(model.config, tok, mask_token_id=other, **DRAFT)
    assert config.mask_token_id == other


@pytest.mark.parametrize("family", FAMILIES)
def test_used_mask_id_is_refused_by_name(targets, family):
    _, model, tok = targets[family]
    eot = special_ids(family)[END_OF_TURN[family]]
    with pytest.raises(ValueError, match=rf"mask_token_id {eot} is '{END_OF_TURN[family]}'.*"
                                         rf"{RESERVED[family].replace('|', '.')}"):
        DSpineConfig.from_target(model.config, tok, mask_token_id=eot, **DRAFT)
    word = word_ids(family)[3]
    with pytest.raises(ValueError, match=rf"mask_token_id {word} is 'w3'"):
        DSpineConfig.from_target(model.config, tok, mask_token_id=word, **DRAFT)


def test_full_tokenizer_without_reserved_tokens_is_an_error(targets, tmp_path):
    from _engine_helpers import build_tokenizer

    _, model, _ = targets["llama"]
    tok = build_tokenizer(tmp_path, vocab_size=VOCAB)  # every id a word, nothing reserved
    with pytest.raises(ValueError, match=r"mask_token_id: the tokenizer uses all 256 ids and "
                                         r"has no reserved"):
        DSpineConfig.from_target(model.config, tok, **DRAFT)


# ---------------------------------------------------------------------------- architecture
@pytest.mark.parametrize("family", FAMILIES)
def test_draft_mirrors_head_dim_and_rope(targets, family):
    _, model, tok = targets[family]
    config = DSpineConfig.from_target(model.config, tok, **DRAFT)
    assert config.head_dim == 24 != HIDDEN // config.num_attention_heads
    expected = "llama3" if family == "llama" else "default"
    assert config.rope_parameters["rope_type"] == expected
    if family == "gemma":  # the full-attention layers' RoPE, not the per-type dict
        assert config.rope_parameters["rope_theta"] == 1_000_000.0
    draft = _draft(model, tok)
    ids = torch.randint(0, VOCAB, (1, 24))
    features = torch.randn(1, 24, 2 * HIDDEN)
    anchors = torch.tensor([[2, 9]])
    out = draft(ids, features, anchors)
    assert torch.isfinite(out.hidden).all()


def test_gemma_embedding_scale_reaches_the_draft(targets):
    _, model, tok = targets["gemma"]
    draft = _draft(model, tok)
    assert draft.config.embed_scale == pytest.approx(HIDDEN ** 0.5)
    ids = torch.tensor([[5, 17, 200, 9]])
    # The draft embeds tokens exactly as the target does (Gemma3TextScaledWordEmbedding).
    torch.testing.assert_close(draft.embed_tokens(ids), model.get_input_embeddings()(ids),
                               rtol=0, atol=0)
    # ... and its block forward uses that scaled embedding: unscaled, the proposals change.
    ids = torch.randint(20, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 24, 2 * HIDDEN, generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[2, 9]])
    with torch.no_grad():
        scaled = draft(ids, features, anchors).hidden
        draft.config.embed_scale = 1.0
        unscaled = draft(ids, features, anchors).hidden
    assert not torch.allclose(scaled, unscaled, atol=1e-3)


def test_llama_embedding_is_unscaled(targets):
    _, model, tok = targets["llama"]
    assert DSpineConfig.from_target(model.config, tok, **DRAFT).embed_scale == 1.0


def test_softcapped_target_is_refused_by_name(targets):
    _, _, tok = targets["gemma"]
    config = tiny_config("gemma", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30.0 \(gemma3_text\)"):
        DSpineConfig.from_target(config, tok, **DRAFT)


def test_export_without_embed_scale_loads_as_unscaled(targets, tmp_path):
    """Drafts exported before `embed_scale` existed (all for unscaled targets) still load."""
    import json

    _, model, tok = targets["llama"]
    _draft(model, tok).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["embed_scale"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert DSpineDraftModel.from_pretrained(tmp_path).config.embed_scale == 1.0


# ---------------------------------------------------------------------------- tied head
@pytest.mark.parametrize("family", FAMILIES)
def test_tied_head_is_read_and_tabled(targets, family):
    path, model, _ = targets[family]
    embed, head = read_embedding_and_head(str(path))  # no lm_head.weight in the file
    assert embed.shape == head.shape == (VOCAB, HIDDEN)
    torch.testing.assert_close(head, model.lm_head.weight.detach())
    table = build_token_table(head.float(), 16)
    assert tuple(table.codes.shape) == (VOCAB, 16)


# ---------------------------------------------------------------------------- chat template
@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_turn_is_an_added_special_token(targets, family):
    _, _, tok = targets[family]
    assert END_OF_TURN[family] not in tok.all_special_tokens  # flagged special only
    eot = end_of_turn_token(tok)
    assert eot == END_OF_TURN[family]
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]
    masked = tokenize_conversation(tok, messages, end_of_turn=eot)
    supervised = [t for t, m in zip(masked.input_ids, masked.loss_mask) if m]
    assert tok.convert_ids_to_tokens(supervised) == ["w3", "w4", END_OF_TURN[family]]


@pytest.mark.parametrize("family", FAMILIES)
def test_local_regeneration_stops_on_the_templates_end_of_turn(targets, family):
    from data_prep.backends.local import LocalBackend
    from data_prep.config import LocalBackendConfig, SamplingConfig

    path, model, _ = targets[family]
    # A base checkpoint's eos is not the end-of-turn token of the chat template.
    tok = transformers.AutoTokenizer.from_pretrained(
        path, eos_token="<|end_of_text|>" if family == "llama" else "<eos>")
    backend = LocalBackend(LocalBackendConfig(model_path=str(path), device="cpu"),
                           SamplingConfig(temperature=0.0, max_new_tokens=4),
                           model=model, tokenizer=tok)
    assert special_ids(family)[END_OF_TURN[family]] in backend.stop_ids


# ---------------------------------------------------------------------------- training data
def test_mask_token_in_the_data_is_refused_by_name(targets, tmp_path):
    from dspine_train.training.config import TrainConfig
    from dspine_train.training.errors import TrainingError
    from dspine_train.training.inputs import check_inputs

    path, _, _ = targets["llama"]
    words = word_ids("llama")
    reserved = special_ids("llama")[RESERVED["llama"]]
    rows = [words[i:i + 20] for i in range(0, 100, 10)]
    rows[3] = rows[3][:5] + [reserved] + rows[3][6:]
    datasets.Dataset.from_dict({
        "input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
        "length": [len(r) for r in rows],
    }).save_to_disk(str(tmp_path / "data"))
    config = TrainConfig(name="unit", output_dir=str(tmp_path / "out"))
    config.model.target_path = str(path)
    for key, value in DRAFT.items():
        setattr(config.model, key, value)
    config.data.train_path = str(tmp_path / "data")
    with pytest.raises(TrainingError, match=r"data.train_path: model.mask_token_id "
                       rf"{reserved} \('<\|reserved_special_token_0\|>'\) occurs in row 3"):
        check_inputs(config)


def test_token_check_names_the_row_of_a_reordered_dataset():
    from dspine_train.training.data import check_token_absent
    from dspine_train.training.errors import TrainingError

    rows = [[1, 2, 3], [4, 5], [6, 7, 9], [9], [8]]
    data = datasets.Dataset.from_dict({"input_ids": rows}).select([1, 0, 2, 3, 4])
    check_token_absent(data, 10, "data.train_path", "here", "the mask")  # absent: no error
    with pytest.raises(TrainingError, match=r"data.train_path: the mask occurs in row 2 of here"):
        check_token_absent(data, 9, "data.train_path", "here", "the mask")


# ---------------------------------------------------------------------------- engine
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_is_lossless_on_a_full_vocab_target(targets, family, tmp_path):
    """Llama-3 (llama3 RoPE scaling, tied head) and Gemma-3 (scaled embeddings, 1 + w norms,
    sandwich norms, sliding-window layers with their own RoPE): the engine's greedy output is
    transformers' own, with prompts + output longer than the sliding window."""
    from dspine_train.engine import Engine

    path, model, tok = targets[family]
    gen = torch.Generator().manual_seed(0)
    words = torch.tensor(word_ids(family))
    prompts = [words[torch.randint(0, len(words), (n,), generator=gen)].tolist()
               for n in (3, 7, 5, 9, 4, 6)]
    reference = [hf_greedy(model, p, 24) for p in prompts]
    # Overfit briefly on the target's own continuations, so blocks get accepted.
    sequences = torch.tensor([(p + r)[:24] for p, r in zip(prompts, reference)])
    draft = train_draft_briefly(_draft(model, tok), model, sequences, steps=60, lr=1e-2)
    draft.save_pretrained(tmp_path / "draft")
    engine = Engine.from_pretrained(path, tmp_path / "draft", max_seq_len=96, eos_token_ids=[],
                                    max_batch_size=2)
    outputs, committed, verifications = [], 0, 0
    for i in range(0, len(prompts), 2):
        result = engine.generate(prompts[i:i + 2], max_new_tokens=24, chat=False)
        outputs += result.token_ids
        committed += result.stats.committed
        verifications += result.stats.verifications
    assert outputs == reference
    assert len(set(outputs[0])) > 2  # not a degenerate repetition
    assert committed / verifications > 1.3  # multi-token acceptance was exercised


def test_engine_names_an_unsupported_family(targets, tmp_path):
    from dspine_train.engine import load_target
    from dspine_train.engine.errors import CheckpointError

    path, model, _ = targets["llama"]
    config = transformers.Gemma2Config(**{
        k: v for k, v in tiny_config("gemma").to_dict().items()
        if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim")})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma2")
    with pytest.raises(CheckpointError, match=r"model_type='gemma2' is not supported by the "
                                              r"engine \(supported: qwen3, qwen2, llama, "
                                              r"gemma3_text\)"):
        load_target(tmp_path / "gemma2")


def test_engine_refuses_a_softcapped_target(tmp_path):
    from dspine_train.engine import load_target
    from dspine_train.engine.errors import CheckpointError

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("gemma", final_logit_softcapping=30.0))
    model.save_pretrained(tmp_path / "capped")
    with pytest.raises(CheckpointError, match=r"final_logit_softcapping=30.0: softcapped"):
        load_target(tmp_path / "capped")


def test_engine_refuses_a_draft_without_the_targets_embedding_scale(targets, tmp_path):
    import json

    from dspine_train.engine import Engine
    from dspine_train.engine.errors import IncompatibleDraftError

    path, model, tok = targets["gemma"]
    _draft(model, tok).save_pretrained(tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    config["embed_scale"] = 1.0
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(IncompatibleDraftError, match=r"embed_scale: draft 1.0, the target "
                                                     r"scales its embeddings by 8.0"):
        Engine.from_pretrained(path, tmp_path / "draft", max_seq_len=96)
