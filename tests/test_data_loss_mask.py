"""Golden loss masks: exact supervised tokens for the Qwen2.5 and Qwen3 chat templates.

Expected strings list every token; supervised ones are in brackets.  The fixture tokenizers
are word-level (one token per word, punctuation mark or newline) so each line can be checked
by eye against the template; the real Qwen2.5 tokenizer is checked when the assembled default
target is present.
"""

from __future__ import annotations

import pytest
from _data_helpers import QWEN3_TEMPLATE, QWEN25_TEMPLATE, marked, word_level_tokenizer

from data_prep.config import default_target_dir
from data_prep.loss_mask import (
    TemplateError,
    end_of_turn_token,
    longest_run,
    tokenize_conversation,
)

WORDS = ["hi there", "hello friend", "add two numbers", "def add ( a , b ) : return a + b",
         "let me think", "be brief", "sum it"]
QWEN25_SYSTEM = ("<|im_start|> system \\n You are Qwen , created by Alibaba Cloud . "
                 "You are a helpful assistant . <|im_end|> \\n")


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def masked(tokenizer, messages, **kwargs):
    eot = end_of_turn_token(tokenizer, kwargs)
    out = tokenize_conversation(tokenizer, messages, end_of_turn=eot, chat_template_kwargs=kwargs)
    assert len(out.input_ids) == len(out.loss_mask)
    return marked(tokenizer, out.input_ids, out.loss_mask)


@pytest.fixture(scope="module")
def qwen25():
    return word_level_tokenizer(QWEN25_TEMPLATE, WORDS)


@pytest.fixture(scope="module")
def qwen3():
    return word_level_tokenizer(QWEN3_TEMPLATE, WORDS)


def test_qwen25_single_turn_with_default_system_prompt(qwen25):
    got = masked(qwen25, [user("hi there"), assistant("hello friend")])
    assert got == (QWEN25_SYSTEM + " <|im_start|> user \\n hi there <|im_end|> \\n"
                   " <|im_start|> assistant \\n [hello] [friend] [<|im_end|>] \\n")


def test_qwen25_multi_turn_with_system_and_truncated_last_answer(qwen25):
    messages = [{"role": "system", "content": "be brief"}, user("add two numbers"),
                assistant("def add ( a , b ) : return a + b"), user("sum it"),
                assistant("return a + b", truncated=True)]
    assert masked(qwen25, messages) == (
        "<|im_start|> system \\n be brief <|im_end|> \\n"
        " <|im_start|> user \\n add two numbers <|im_end|> \\n"
        " <|im_start|> assistant \\n [def] [add] [(] [a] [,] [b] [)] [:] [return] [a] [+] [b]"
        " [<|im_end|>] \\n"
        " <|im_start|> user \\n sum it <|im_end|> \\n"
        # cut at max_new_tokens: the target never emitted this <|im_end|>
        " <|im_start|> assistant \\n [return] [a] [+] [b] <|im_end|> \\n")


def test_qwen3_thinking_on_supervises_the_reasoning(qwen3):
    got = masked(qwen3, [user("add two numbers"),
                         assistant("<think>\nlet me think\n</think>\n\nreturn a + b")],
                 enable_thinking=True)
    assert got == ("<|im_start|> user \\n add two numbers <|im_end|> \\n"
                   " <|im_start|> assistant \\n [<think>] [\\n] [let] [me] [think] [\\n]"
                   " [</think>] [\\n] [\\n] [return] [a] [+] [b] [<|im_end|>] \\n")


def test_qwen3_thinking_off_leaves_the_prompted_empty_think_block_out(qwen3):
    got = masked(qwen3, [user("add two numbers"), assistant("return a + b")],
                 enable_thinking=False)
    assert got == ("<|im_start|> user \\n add two numbers <|im_end|> \\n"
                   " <|im_start|> assistant \\n <think> \\n \\n </think> \\n \\n"
                   " [return] [a] [+] [b] [<|im_end|>] \\n")


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_multi_turn_history_drops_reasoning(qwen3, thinking):
    first = ("<think>\nlet me think\n</think>\n\nhello friend" if thinking else "hello friend")
    last = "<think>\nlet me think\n</think>\n\nsum it" if thinking else "sum it"
    got = masked(qwen3, [user("hi there"), assistant(first), user("add two numbers"),
                         assistant(last)], enable_thinking=thinking)
    history = ("<|im_start|> user \\n hi there <|im_end|> \\n"
               # an earlier turn is rendered without its reasoning, in both modes
               " <|im_start|> assistant \\n [hello] [friend] [<|im_end|>] \\n"
               " <|im_start|> user \\n add two numbers <|im_end|> \\n <|im_start|> assistant \\n")
    if thinking:
        tail = (" [<think>] [\\n] [let] [me] [think] [\\n] [</think>] [\\n] [\\n] [sum] [it]"
                " [<|im_end|>] \\n")
    else:
        tail = " <think> \\n \\n </think> \\n \\n [sum] [it] [<|im_end|>] \\n"
    assert got == history + tail


def test_qwen3_template_inserted_empty_think_block_is_left_out_of_the_row(qwen3):
    # Thinking on (template default) but the answer has no reasoning: the template inserts an
    # empty block the target neither saw in its prompt nor wrote. The row is the prompt and the
    # answer as the target produced them (and as the engine serves: the draft's context
    # features are those of this prefix), so the block is cut out, not only unsupervised.
    got = masked(qwen3, [user("hi there"), assistant("hello friend")])
    assert got.endswith("<|im_end|> \\n <|im_start|> assistant \\n"
                        " [hello] [friend] [<|im_end|>] \\n")
    # in a longer conversation the spans after the cut still land on their tokens
    got = masked(qwen3, [user("hi there"), assistant("hello friend"), user("add two numbers"),
                         assistant("sum it")])
    assert got.endswith("<|im_start|> user \\n add two numbers <|im_end|> \\n"
                        " <|im_start|> assistant \\n [sum] [it] [<|im_end|>] \\n")
    assert "[hello] [friend] [<|im_end|>]" in got


def test_end_of_turn_inside_content_is_rejected(qwen25):
    with pytest.raises(TemplateError) as error:
        masked(qwen25, [user("hi there"), assistant("hello <|im_end|> friend")])
    assert error.value.reason == "end_of_turn_in_content"


def test_longest_run():
    assert longest_run([0, 1, 1, 0, 1, 1, 1, 0]) == 3
    assert longest_run([0, 0]) == 0


@pytest.mark.skipif(not (default_target_dir() / "tokenizer.json").exists(),
                    reason="default target not assembled (python -m data_prep.default_target)")
def test_real_qwen25_tokenizer_golden():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    messages = [{"role": "system", "content": "Be brief."}, user("Add 2 and 3."),
                assistant("2 + 3 = 5."), user("Thanks!"), assistant("You're welcome.")]
    eot = end_of_turn_token(tokenizer)
    assert eot == "<|im_end|>"
    out = tokenize_conversation(tokenizer, messages, end_of_turn=eot)
    # (id, mask) checked by hand: <|im_start|>=151644, <|im_end|>=151645, "\n"=198,
    # system=8948, user=872, assistant=77091; content pieces decoded one by one.
    expected = [
        (151644, 0), (8948, 0), (198, 0), (3430, 0), (9814, 0), (13, 0),  # system\nBe brief.
        (151645, 0), (198, 0),
        (151644, 0), (872, 0), (198, 0), (2212, 0), (220, 0), (17, 0), (323, 0), (220, 0),
        (18, 0), (13, 0), (151645, 0), (198, 0),  # user\nAdd 2 and 3.
        (151644, 0), (77091, 0), (198, 0),  # assistant\n
        (17, 1), (488, 1), (220, 1), (18, 1), (284, 1), (220, 1), (20, 1), (13, 1),  # 2 + 3 = 5.
        (151645, 1), (198, 0),
        (151644, 0), (872, 0), (198, 0), (12658, 0), (0, 0), (151645, 0), (198, 0),  # Thanks!
        (151644, 0), (77091, 0), (198, 0),
        (2610, 1), (2299, 1), (10565, 1), (13, 1), (151645, 1), (198, 0),  # You're welcome.
    ]
    assert list(zip(out.input_ids, out.loss_mask)) == expected
    assert out.input_ids == tokenizer.apply_chat_template(messages, tokenize=True,
                                                          return_dict=True)["input_ids"]
