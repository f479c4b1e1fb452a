"""``data.source.hub``: Hub datasets read by the real ``datasets.load_dataset`` from a loopback
stand-in for the Hub (``tests/_hub_helpers.py``), in subprocesses whose ``HF_ENDPOINT`` points
at it; rows get the same checks, held-out split and accounting as local files."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _data_helpers import FakeChatServer
from _hub_helpers import COMMIT, HubStandIn, parquet_bytes

from data_prep.config import (
    REPO_ROOT,
    HubPreset,
    HubSourceConfig,
    SourceConfig,
)
from data_prep.hub import sample_indices
from data_prep.regenerate import REPORT_FILE
from data_prep.shards import shard_paths
from data_prep.sources import is_heldout

CARD = b"""---
configs:
- config_name: default
  data_files:
  - split: train_sft
    path: data/train_sft-*
  - split: test_sft
    path: data/test_sft-*
---
# A tiny UltraChat-shaped set
"""


def ultrachat_rows(count: int) -> list[dict]:
    """UltraChat-200k's layout: prompt, prompt_id, messages of role/content."""
    rows = [{"prompt": f"question {i}", "prompt_id": f"p{i:03d}",
             "messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(count)]
    rows[3]["messages"][1]["content"] = "  "  # empty_content: skipped with a reason
    rows[5]["messages"][0]["role"] = "narrator"  # unknown_role: skipped with a reason
    return rows


ULTRA = ultrachat_rows(40)
REPOS = {
    "org/chat": {"README.md": CARD,
                 "data/train_sft-00000-of-00002.parquet": parquet_bytes(ULTRA[:25]),
                 "data/train_sft-00001-of-00002.parquet": parquet_bytes(ULTRA[25:]),
                 "data/test_sft-00000-of-00001.parquet": parquet_bytes(ULTRA[:2])},
    # ShareGPT / Open-PerfectBlend layout: conversations of from/value, no id column
    "org/blend": {"data/train-00000-of-00001.parquet": parquet_bytes([
        {"conversations": [{"from": "human", "value": f"blend {i}"},
                           {"from": "chatgpt" if i % 2 else "gpt", "value": f"reply {i}"}],
         "source": "x"} for i in range(6)])},
    # instruction sets: text columns
    "org/qa": {"train.jsonl": "".join(
        json.dumps({"uid": f"q{i}", "sys": "Be brief." if i else "", "question": f"what {i}",
                    "answer": f"this {i}"}) + "\n" for i in range(4)).encode()},
}

# Loads a source in a subprocess (HF_ENDPOINT is read at import) and prints what it got.
LOAD_SOURCE = """
import json, sys
from omegaconf import OmegaConf
from data_prep.config import SourceConfig
from data_prep.schema import DataError
from data_prep.sources import load_source
for spec in json.loads(sys.argv[1]):
    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SourceConfig), spec))
        source = load_source(config)
    except DataError as error:
        print(json.dumps({"error": str(error)}))
        continue
    print(json.dumps({"counts": source.counts, "rows": source.rows,
                      "skipped": [row.to_json() for row in source.skipped]}))
"""


@pytest.fixture(scope="module")
def hub():
    with HubStandIn(REPOS) as stand_in:
        yield stand_in


def load_sources(hub, home, *specs, **env):
    result = subprocess.run([sys.executable, "-c", LOAD_SOURCE, json.dumps(specs)],
                            cwd=REPO_ROOT, env=hub.env(home, PYTHONPATH=str(REPO_ROOT), **env),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def regenerate(hub, home, output_dir, url, *overrides, **env):
    command = [sys.executable, "-m", "data_prep.regenerate", "data=qwen3_hub_http",
               "data.regenerate.http.max_in_flight=4", "data.regenerate.shard_size=8",
               f"data.regenerate.http.urls=[{url}]", f"data.regenerate.output_dir={output_dir}",
               f"hydra.run.dir={output_dir.parent / 'hydra'}", *overrides]
    return subprocess.run(command, cwd=REPO_ROOT, env=hub.env(home, **env),
                          capture_output=True, text=True, timeout=300)


def shard_rows(output_dir):
    return {row["id"]: row for path in shard_paths(output_dir)
            for row in map(json.loads, path.read_text().splitlines())}


def test_regenerate_cli_reads_a_hub_preset_sample_with_heldout_split_and_accounting(hub, tmp_path):
    home = tmp_path / "hf"
    entry = "data.source.hub=[{preset: ultrachat_200k, name: org/chat, max_rows: 30}]"
    with FakeChatServer() as server:
        run = regenerate(hub, home, tmp_path / "train", server.url, entry,
                         "data.source.heldout_fraction=0.25")
    assert run.returncode == 0, run.stderr[-3000:]
    assert any(r.startswith("GET /datasets/org/chat/resolve/") and r.endswith(".parquet")
               for r in hub.requests)  # the real download path ran against the stand-in

    # max_rows: a seeded sample of 30 of the split's 40 rows is read, no more
    sampled = sample_indices(40, 30, 0, "org/chat/train_sft")
    assert len(sampled) == 30
    report = json.loads((tmp_path / "train" / REPORT_FILE).read_text())
    assert report["source"]["records"] == 30 and report["source"]["hub_not_read"] == 10
    # the same row checks as local files: the bad rows read are skipped with their reasons
    bad = {3: "empty_content", 5: "unknown_role"}
    skipped = {row["line"] - 1: row["reason"] for row in report["skipped_rows"]}
    assert skipped == {i: reason for i, reason in bad.items() if i in sampled}
    assert {row["source"] for row in report["skipped_rows"]} <= {"org/chat/train_sft"}
    # the same held-out hashing: the training part is exactly the valid, not held-out ids
    valid = [f"p{i:03d}" for i in sampled if i not in bad]
    train = {i for i in valid if not is_heldout(i, 0.25, 0)}
    rows = shard_rows(tmp_path / "train")
    assert set(rows) == train and 0 < len(train) < len(valid)
    assert report["input"] == report["done"] + report["skipped"] == len(train) + len(skipped)
    assert report["source"]["outside_part"] == len(valid) - len(train)
    assert report["source"]["records"] == len(train) + len(skipped) + len(valid) - len(train)
    # the mapping: messages and prompt_id came from the Hub columns
    some = sorted(train)[0]
    assert rows[some]["messages"][0] == {"role": "user", "content": f"question {int(some[1:])}"}

    # the held-out part, offline from the cache the first run filled: the complement
    requests_before = len(hub.requests)
    with FakeChatServer() as server:
        run = regenerate(hub, home, tmp_path / "heldout", server.url, entry,
                         "data.source.heldout_fraction=0.25", "data.source.part=heldout",
                         HF_HUB_OFFLINE="1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert set(shard_rows(tmp_path / "heldout")) == set(valid) - train
    assert len(hub.requests) == requests_before  # nothing asked of the Hub offline


def test_mappings_roles_config_revision_and_row_ids(hub, tmp_path):
    blend, qa, pinned = load_sources(
        hub, tmp_path / "hf",
        {"hub": [{"preset": "open_perfectblend", "name": "org/blend",
                  "roles": {"chatgpt": "assistant"}}], "part": "all"},
        {"hub": [{"name": "org/qa", "prompt_field": "question", "response_field": "answer",
                  "system_field": "sys", "id_field": "uid"}], "part": "all"},
        {"hub": [{"name": "org/chat", "split": "test_sft", "revision": COMMIT,
                  "messages_field": "messages", "id_field": "prompt_id"}], "part": "all"})
    # conversations of from/value; the entry's roles name chatgpt an assistant
    assert blend["counts"]["selected"] == 6
    assert blend["rows"][1]["messages"] == [{"role": "user", "content": "blend 1"},
                                            {"role": "assistant", "content": "reply 1"}]
    assert len({row["id"] for row in blend["rows"]}) == 6  # content-hash ids, all distinct
    # text columns -> system (when set) + user + assistant, the id from the named column
    assert [row["id"] for row in qa["rows"]] == ["q0", "q1", "q2", "q3"]
    assert qa["rows"][0]["messages"] == [{"role": "user", "content": "what 0"},
                                         {"role": "assistant", "content": "this 0"}]
    assert qa["rows"][1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [row["id"] for row in pinned["rows"]] == ["p000", "p001"]

    without_roles, = load_sources(hub, tmp_path / "hf", {"hub": [
        {"name": "org/blend", "messages_field": "conversations"}], "part": "all"})
    assert {row["reason"] for row in without_roles["skipped"]} == {"unknown_role"}


def test_load_errors_name_the_entry_field_and_the_repository(hub, tmp_path):
    results = load_sources(
        hub, tmp_path / "hf",
        {"hub": [{"name": "org/chat", "split": "train"}]},
        {"hub": [{"name": "org/chat", "config": "other", "split": "train_sft"}]},
        {"paths": [], "hub": [{"name": "org/chat", "split": "train_sft"},
                              {"name": "org/absent"}]},
        {"hub": [{"name": "org/chat", "revision": "v9", "split": "train_sft"}]},
        {"hub": [{"name": "org/chat", "split": "train_sft", "messages_field": "turns"}]},
        {"hub": [{"name": "org/qa"}]})
    errors = [result["error"] for result in results]
    assert errors[0].startswith("data.source.hub[0].split: org/chat: Unknown split")
    assert "train_sft" in errors[0]
    assert errors[1].startswith("data.source.hub[0].config: org/chat: BuilderConfig 'other'")
    assert errors[2].startswith("data.source.hub[1].name: Dataset 'org/absent' doesn't exist")
    assert errors[3].startswith("data.source.hub[0].revision: Revision 'v9'")
    assert errors[4].startswith("data.source.hub[0].messages_field: org/chat/train_sft has no "
                                "column 'turns' (columns: prompt, prompt_id, messages)")
    assert errors[5].startswith("data.source.hub[0].messages_field: org/qa/train has neither")
    assert all("\n" not in error for error in errors)


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_and_not_cached_is_one_line_naming_the_dataset(hub, tmp_path, offline):
    before = len(hub.requests)
    with FakeChatServer() as server:
        run = regenerate(hub, tmp_path / "empty_cache", tmp_path / "out", server.url,
                         "data.source.hub=[{preset: ultrachat_200k}]", **{offline: "1"})
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines[-1] == (
        "error: data.source.hub[0] (HuggingFaceH4/ultrachat_200k): not in the local datasets "
        "cache and offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); run once with "
        "network access (both unset) to download it, or point HF_HOME / HF_DATASETS_CACHE at a "
        "cache holding it")
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()
    assert len(hub.requests) == before


def test_presets_fill_unset_fields_and_the_entry_keeps_its_own():
    entry = HubSourceConfig(preset=HubPreset.ultrachat_200k, max_rows=1000).resolved("k")
    assert (entry.name, entry.split, entry.messages_field, entry.id_field, entry.max_rows) == (
        "HuggingFaceH4/ultrachat_200k", "train_sft", "messages", "prompt_id", 1000)
    mine = HubSourceConfig(preset=HubPreset.ultrachat_200k, split="test_sft").resolved("k")
    assert mine.split == "test_sft"
    sharegpt = HubSourceConfig(preset=HubPreset.sharegpt, roles={"bard": "user"}).resolved("k")
    assert sharegpt.roles["bard"] == "user" and sharegpt.roles["bing"] == "assistant"
    for preset in HubPreset:
        assert HubSourceConfig(preset=preset).resolved("k").name.count("/") == 1
    # a plain entry: split defaults to train, nothing else is guessed
    plain = HubSourceConfig(name="org/set").resolved("k")
    assert (plain.split, plain.messages_field, plain.prompt_field) == ("train", None, None)


@pytest.mark.parametrize(("entry", "key"), [
    ({}, "source.hub[0].name"),
    ({"name": "not a repo id"}, "source.hub[0].name"),
    ({"name": "org/set", "split": ""}, "source.hub[0].split"),
    ({"name": "org/set", "max_rows": 0}, "source.hub[0].max_rows"),
    ({"name": "org/set", "prompt_field": "q", "messages_field": "m"},
     "source.hub[0].prompt_field"),
    ({"name": "org/set", "response_field": "a"}, "source.hub[0].response_field"),
    ({"name": "org/set", "roles": {"bot": "robot"}}, "source.hub[0].roles.bot"),
])
def test_config_errors_name_the_key(entry, key):
    with pytest.raises(ValueError, match=f"^data config: {re.escape(key)}: "):
        SourceConfig(hub=[HubSourceConfig(**entry)])


@pytest.mark.parametrize(("override", "named"), [
    ("data.source.hub=[{preset: ultrachat}]", "Invalid value 'ultrachat', expected one of "
     "[sharegpt, ultrachat_200k, open_perfectblend, nemotron_v1_chat]"),
    ("data.source.hub=[{name: org/set, messages_column: m}]", "Key 'messages_column' not in "
     "'HubSourceConfig'"),
    ("data.source.hub=[{name: org/set, max_rows: 0}]",
     "error: data config: source.hub[0].max_rows: must be > 0"),
])
def test_cli_refuses_an_unknown_preset_or_key_naming_it(tmp_path, override, named):
    run = subprocess.run([sys.executable, "-m", "data_prep.regenerate", "data=qwen3_hub_http",
                          override, f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert named in run.stderr and "Traceback" not in run.stderr


def test_max_rows_sample_is_seeded_spread_and_only_grows():
    small, large = sample_indices(1000, 50, 0, "org/set/train"), sample_indices(1000, 200, 0,
                                                                                "org/set/train")
    assert small == sorted(small) and len(set(small)) == 50 and set(small) <= set(large)
    assert small == sample_indices(1000, 50, 0, "org/set/train")  # same settings, same rows
    assert small != sample_indices(1000, 50, 1, "org/set/train")  # the source seed salts it
    assert max(small) > 500  # not a prefix: sets sorted by origin are sampled throughout
    assert sample_indices(40, 40, 0, "org/set/train") is None  # all rows: read in order
