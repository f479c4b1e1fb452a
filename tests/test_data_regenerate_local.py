"""Local transformers backend on a tiny random Qwen3 model, and regenerate -> tokenize."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _data_helpers import QWEN3_TEMPLATE, chat_row, tiny_qwen3, word_level_tokenizer, write_jsonl
from hydra import compose, initialize_config_dir

from data_prep.backends.local import LocalBackend
from data_prep.config import REPO_ROOT, LocalBackendConfig, SamplingConfig, to_data_config
from data_prep.regenerate import run_regeneration
from data_prep.shards import shard_paths
from data_prep.tokenize import run_tokenize

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WORDS = ["what", "is", "the", "sum", "of", "and", "please", "explain", "more", "ok", "why"]
ROWS = [
    chat_row("short", "why"),
    chat_row("medium", "what is the sum of 1 and 2", "3"),
    chat_row("long", "please explain the sum of 1 and 2 and 3 and more and more", "ok"),
    chat_row("two-turns", "what is the sum", "it is", "why", "ok"),
    chat_row("other", "explain more", "ok"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = word_level_tokenizer(QWEN3_TEMPLATE, WORDS + [str(i) for i in range(4)])
    return tiny_qwen3(tokenizer, tmp_path_factory.mktemp("tiny_qwen3"))


def backend(model_dir, batch_size, **sampling):
    return LocalBackend(LocalBackendConfig(model_path=str(model_dir), batch_size=batch_size),
                        SamplingConfig(max_new_tokens=6, **sampling))


def test_batched_left_padded_generation_matches_one_by_one(model_dir):
    single = {o.id: o.row for o in backend(model_dir, 1).regenerate(ROWS)}
    batched = {o.id: o.row for o in backend(model_dir, 4).regenerate(ROWS)}
    assert single == batched
    assert set(single) == {row["id"] for row in ROWS}
    two = single["two-turns"]["messages"]
    assert [m["role"] for m in two] == ["user", "assistant", "user", "assistant"]
    assert two[0]["content"] == "what is the sum" and two[2]["content"] == "why"
    assert two[1]["content"] != "it is"  # regenerated, not copied
    # The tiny model never emits a stop token: every reply runs to max_new_tokens.
    assert all(m.get("truncated") for m in two if m["role"] == "assistant")


def test_turns_see_the_regenerated_history_and_thinking_flag(model_dir):
    local = backend(model_dir, 2, enable_thinking=False)
    prompts = []
    real = local.generate_batch
    local.generate_batch = lambda texts: prompts.extend(texts) or real(texts)
    outcome = next(iter(local.regenerate([ROWS[3]])))
    first_reply = outcome.row["messages"][1]["content"]
    assert len(prompts) == 2
    assert prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert f"<|im_start|>assistant\n{first_reply}<|im_end|>" in prompts[1]
    assert outcome.completion_tokens == 12


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM: ``generate`` appends fixed token rows."""

    def __init__(self, continuations, eos_ids):
        super().__init__()
        from transformers import GenerationConfig, PretrainedConfig

        self.continuations = continuations
        self.generation_config = GenerationConfig(eos_token_id=eos_ids)
        self.config = PretrainedConfig(max_position_embeddings=64)

    def generate(self, input_ids, attention_mask, **options):
        assert attention_mask[:, -1].all()  # left padding: every prompt ends at the last column
        new = torch.tensor(self.continuations[: input_ids.shape[0]])
        return torch.cat([input_ids, new], dim=1)


def test_stop_tokens_truncation_and_empty_replies():
    tokenizer = word_level_tokenizer(QWEN3_TEMPLATE, ["hi", "a", "b", "c", "d"])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    a, b, c, d = tokenizer.convert_tokens_to_ids(["a", "b", "c", "d"])
    model = ScriptedModel([[a, b, eos, pad], [a, b, c, d], [eos, pad, pad, pad]], [eos, pad])
    local = LocalBackend(LocalBackendConfig(batch_size=3), SamplingConfig(max_new_tokens=4),
                         model=model, tokenizer=tokenizer)
    rows = [chat_row("stops", "hi"), chat_row("cut", "hi a"), chat_row("empty", "hi b")]
    outcomes = {o.id: o for o in local.regenerate(rows)}
    assert outcomes["stops"].row["messages"][-1] == {"role": "assistant", "content": "a b"}
    assert outcomes["stops"].completion_tokens == 3
    assert outcomes["cut"].row["messages"][-1] == {"role": "assistant", "content": "a b c d",
                                                   "truncated": True}
    assert outcomes["empty"].row is None and outcomes["empty"].error.startswith("empty_reply: ")


def test_regenerate_then_tokenize_with_local_backend(tmp_path, model_dir):
    from datasets import load_from_disk

    inputs = write_jsonl(tmp_path / "in.jsonl", ROWS)
    overrides = ["data.source.builtin=null", f"data.source.paths=[{inputs}]",
                 "data.source.heldout_fraction=0", f"data.regenerate.local.model_path={model_dir}",
                 "data.regenerate.local.batch_size=2", "data.regenerate.sampling.max_new_tokens=5",
                 f"data.regenerate.output_dir={tmp_path / 'regen'}",
                 f"data.tokenize.output_dir={tmp_path / 'tok'}", "data.tokenize.eval_fraction=0"]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base="1.3"):
        data = to_data_config(compose(config_name="data_prep_job", overrides=overrides).data)
    report = run_regeneration(data)
    assert (report["input"], report["done"], report["failed"]) == (5, 5, 0)
    assert report["completion_tokens"] == 6 * 5  # two-turns row has two replies
    assert len(shard_paths(tmp_path / "regen")) == 1

    summary = run_tokenize(data)
    assert summary["kept"] == 5 and summary["train_rows"] == 5
    train = load_from_disk(str(tmp_path / "tok"))["train"]
    settings = json.loads((tmp_path / "tok" / "tokenize_report.json").read_text())["settings"]
    assert settings["end_of_turn"] == "<|im_end|>"
    # Every reply was cut at max_new_tokens, so no end-of-turn token is supervised; the
    # re-tokenised 5-token replies (word level) are.
    for row in train:
        assert sum(row["loss_mask"]) in (5, 10)


def test_sampling_is_reproducible_for_a_seed(model_dir):
    def sample(seed):
        local = backend(model_dir, 4, temperature=1.0, top_p=0.9, seed=seed)
        return [o.row["messages"][-1]["content"] for o in local.regenerate(ROWS)]

    first = sample(seed=1)
    assert sample(seed=1) == first
    assert sample(seed=2) != first


def test_a_resume_in_another_precision_is_refused_and_old_directories_record_it(tmp_path,
                                                                                model_dir):
    from data_prep.regenerate import SETTINGS_FILE, greedy_local_job
    from data_prep.schema import DataError

    prompts = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    out = tmp_path / "regen"

    def job(dtype):
        return greedy_local_job(prompts, model_dir, out, max_new_tokens=3, batch_size=2,
                                dtype=dtype)

    assert run_regeneration(job("float32"))["done"] == 2
    recorded = json.loads((out / SETTINGS_FILE).read_text())
    assert recorded["dtype"] == "float32"
    # greedy answers of a bfloat16 target differ from float32 ones: never mixed in one directory
    with pytest.raises(DataError, match=r"dtype: 'float32' -> 'bfloat16'"):
        run_regeneration(job("bfloat16"))
    # a directory an older version made has no dtype: accepted once, then recorded
    (out / SETTINGS_FILE).write_text(json.dumps({k: v for k, v in recorded.items()
                                                 if k != "dtype"}))
    assert run_regeneration(job("bfloat16"))["done"] == 2
    assert json.loads((out / SETTINGS_FILE).read_text())["dtype"] == "bfloat16"
