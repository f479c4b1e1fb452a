"""The engine renders a prompt to the same ids as the training rows, and warns on another template.

For every chat template the project supports (Qwen2.5 with its default system prompt, Qwen3
with thinking on and off, the tiny recipe's ChatML): the prompt part of a training row
(`data_prep.loss_mask.tokenize_conversation`, everything before the first supervised token) is
exactly what the engine and the evaluation harness feed the target for the same user turn,
rendered with the kwargs the draft's export records. A draft recording another template's
fingerprint or other kwargs makes the engine warn.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _data_helpers import QWEN3_TEMPLATE, QWEN25_TEMPLATE, word_level_tokenizer
from _engine_helpers import build_tiny_target, tiny_draft

from data_prep.loss_mask import end_of_turn_token, tokenize_conversation
from dspine_train.chat_template import chat_template_record
from dspine_train.engine import Engine
from dspine_train.engine.prompts import encode_prompts
from dspine_train.evaluation.harness import encode_messages
from dspine_train.training.tiny_assets import CHAT_TEMPLATE as TINY_TEMPLATE

WORDS = ["hi there", "hello friend", "add two numbers", "def add ( a , b ) : return a + b",
         "let me think"]
QUESTION = "add two numbers"
ANSWER = "def add ( a , b ) : return a + b"
# what a target answers with thinking on: its reasoning, then the answer
THINKING_ANSWER = "<think>\nlet me think\n</think>\n\n" + ANSWER
TEMPLATES = {  # name -> (template, chat-template kwargs of the training rows, the answer)
    "qwen2.5": (QWEN25_TEMPLATE, {}, ANSWER),
    "qwen3-thinking": (QWEN3_TEMPLATE, {"enable_thinking": True}, THINKING_ANSWER),
    "qwen3-no-thinking": (QWEN3_TEMPLATE, {"enable_thinking": False}, ANSWER),
    "tiny": (TINY_TEMPLATE, {}, ANSWER),
}


def _training_prompt(tokenizer, kwargs, answer: str = ANSWER) -> list[int]:
    """The ids of a training row before its first supervised token."""
    row = tokenize_conversation(
        tokenizer, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}],
        end_of_turn=end_of_turn_token(tokenizer, kwargs), chat_template_kwargs=kwargs)
    return row.input_ids[:row.loss_mask.index(1)]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_engine_and_harness_render_the_training_prompt(name):
    template, kwargs, answer = TEMPLATES[name]
    tokenizer = word_level_tokenizer(template, WORDS)
    expected = _training_prompt(tokenizer, kwargs, answer)
    got = encode_prompts([QUESTION], tokenizer, chat=True, vocab_size=len(tokenizer),
                         chat_template_kwargs=kwargs)
    assert got == [expected]
    assert encode_messages(tokenizer, [[{"role": "user", "content": QUESTION}]], kwargs) == [expected]


@pytest.fixture(scope="module")
def qwen3_world(tmp_path_factory):
    """A tiny target with the Qwen3 template and two drafts: one recording thinking off, one
    recording another template."""
    root = tmp_path_factory.mktemp("template")
    tokenizer = word_level_tokenizer(QWEN3_TEMPLATE, WORDS)
    hf = build_tiny_target(root / "target", "qwen3", vocab_size=len(tokenizer) + 8,
                           eos_token_id=None)
    tokenizer.save_pretrained(root / "target")
    for name, record in (("draft", chat_template_record(tokenizer, {"enable_thinking": False})),
                         ("other", chat_template_record(word_level_tokenizer(QWEN25_TEMPLATE,
                                                                             WORDS), {}))):
        draft = tiny_draft(hf, len(tokenizer))
        for key, value in record.items():
            setattr(draft.config, key, value)
        draft.save_pretrained(root / name)
    return {"root": root, "tokenizer": tokenizer}


def test_engine_serves_with_the_recorded_thinking_flag(qwen3_world):
    root, tokenizer = qwen3_world["root"], qwen3_world["tokenizer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recorded template matches: no warning
        engine = Engine.from_pretrained(root / "target", root / "draft", max_seq_len=96,
                                        eos_token_ids=[])
    assert engine.chat_template_kwargs == {"enable_thinking": False}
    with torch.no_grad():
        result = engine.generate(QUESTION, max_new_tokens=2)
    # the prompt held the empty think block a thinking-off training row was prompted with
    assert result.stats.prompt_tokens == len(_training_prompt(tokenizer, {"enable_thinking": False}))
    thinking = _training_prompt(tokenizer, {"enable_thinking": True}, THINKING_ANSWER)
    assert result.stats.prompt_tokens > len(thinking)


def test_engine_warns_when_serving_with_another_template(qwen3_world):
    root = qwen3_world["root"]
    with pytest.warns(UserWarning, match="another chat template.*fingerprint"):
        Engine.from_pretrained(root / "target", root / "other", max_seq_len=96, eos_token_ids=[])
    with pytest.warns(UserWarning, match="enable_thinking"):
        Engine.from_pretrained(root / "target", root / "draft", max_seq_len=96, eos_token_ids=[],
                               chat_template_kwargs={"enable_thinking": True})


def test_engine_cli_takes_chat_template_kwargs(qwen3_world, tmp_path):
    import argparse

    from dspine_train.engine.cli import add_engine_arguments, build_engine, engine_argument_problem

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    root = qwen3_world["root"]
    base = ["--target", str(root / "target"), "--draft", str(root / "draft"),
            "--prompts", str(tmp_path / "p.txt"), "--device", "cpu", "--max-seq-len", "96"]
    bad = parser.parse_args([*base, "--chat-template-kwargs", "enable_thinking"])
    assert "--chat-template-kwargs is not JSON" in engine_argument_problem(bad)
    listed = parser.parse_args([*base, "--chat-template-kwargs", "[1]"])
    assert "must be a JSON object" in engine_argument_problem(listed)
    recorded = build_engine(parser.parse_args(base))
    assert recorded.chat_template_kwargs == {"enable_thinking": False}
    with pytest.warns(UserWarning, match="enable_thinking"):
        chosen = build_engine(parser.parse_args(
            [*base, "--chat-template-kwargs", '{"enable_thinking": true}']))
    assert chosen.chat_template_kwargs == {"enable_thinking": True}


def test_the_training_rows_template_travels_with_the_export(qwen3_world, tmp_path):
    """tokenize report -> trainer's draft config -> export -> the engine renders the same."""
    from _data_helpers import chat_row, write_jsonl

    from data_prep.tokenize import tokenize_files
    from dspine_train.chat_template import chat_template_fingerprint
    from dspine_train.modeling import DSpineDraftModel
    from dspine_train.training.config import compose_train_config
    from dspine_train.training.inputs import check_inputs

    root, tokenizer = qwen3_world["root"], qwen3_world["tokenizer"]
    rows = write_jsonl(tmp_path / "rows.jsonl",
                       [chat_row(f"r{i}", QUESTION, ANSWER) for i in range(4)])
    thinking_off = {"enable_thinking": False}
    report = tokenize_files([rows], tokenizer, tmp_path / "data", eval_fraction=0,
                            chat_template_kwargs=thinking_off)
    assert report["settings"]["chat_template_fingerprint"] == chat_template_fingerprint(tokenizer)
    config = compose_train_config(
        "recipe=tiny", f"model.target_path={root / 'target'}",
        "model.tiny_random_target=false", "data.synthetic=false",
        f"data.train_path={tmp_path / 'data'}", f"model.mask_token_id={len(tokenizer)}")
    draft_config = check_inputs(config).draft_config
    assert draft_config.chat_template_kwargs == thinking_off
    assert draft_config.chat_template_fingerprint == chat_template_fingerprint(tokenizer)
    DSpineDraftModel(draft_config).save_pretrained(tmp_path / "export")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine.from_pretrained(root / "target", tmp_path / "export", max_seq_len=96,
                                        eos_token_ids=[])
    assert engine.chat_template_kwargs == thinking_off
