"""Token table (METHOD 2.1): whitening, agreement with references, file format, head loading, CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

import dspine_train.token_table as token_table_module
from dspine_train.token_table import (
    TokenTable,
    TokenTableConfig,
    build_from_config,
    build_token_table,
    load_lm_head_weight,
    main,
    whitened_coordinates,
)

VOCAB, HIDDEN = 2000, 64


def random_head(vocab: int = VOCAB, hidden: int = HIDDEN, seed: int = 0) -> torch.Tensor:
    """A (vocab, hidden) head with a shared offset and clearly separated principal variances."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1.0, -1.0, hidden)  # distinct variances, so directions are unique
    return torch.randn(vocab, hidden, generator=gen) * scales + torch.randn(hidden, generator=gen)


def reference_table(weight: torch.Tensor, r: int) -> dict[str, torch.Tensor]:
    """METHOD 2.1 in float64 on the full matrix, straight from the definition."""
    rows = weight.double()
    rows = rows / rows.norm(dim=1, keepdim=True)
    mean = rows.mean(dim=0)
    centred = rows - mean
    cov = centred.T @ centred / (rows.shape[0] - 1)
    values, vectors = torch.linalg.eigh(cov)
    values, vectors = values.flip(0)[:r], vectors.flip(1)[:, :r]
    pivots = vectors.abs().argmax(dim=0)
    vectors = vectors * torch.sign(vectors[pivots, torch.arange(r)])
    whitened = centred @ vectors / values.sqrt()
    codes = whitened / whitened.norm(dim=1, keepdim=True)
    return {
        "mean": mean,
        "eigenvalues": values,
        "directions": vectors,
        "whitened": whitened,
        "codes": codes,
    }


@pytest.fixture(scope="module")
def head() -> torch.Tensor:
    return random_head()


@pytest.fixture(scope="module")
def table(head: torch.Tensor) -> TokenTable:
    return build_token_table(head, 48, chunk_size=300, source="unit-test")


# --- the math -------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [16, HIDDEN])
def test_whitened_coordinates_have_identity_covariance(head: torch.Tensor, r: int) -> None:
    table = build_token_table(head, r, chunk_size=300)
    coords = whitened_coordinates(head, table)
    assert coords.shape == (VOCAB, r)
    cov = torch.cov(coords.double().T)
    torch.testing.assert_close(cov, torch.eye(r, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        coords.double().mean(dim=0), torch.zeros(r, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_codes_have_unit_norm(table: TokenTable) -> None:
    norms = table.codes.norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(VOCAB), atol=1e-6, rtol=0)


def test_matches_float64_reference(head: torch.Tensor, table: TokenTable) -> None:
    ref = reference_table(head, 48)
    torch.testing.assert_close(table.mean.double(), ref["mean"], atol=1e-6, rtol=0)
    torch.testing.assert_close(table.eigenvalues.double(), ref["eigenvalues"], atol=0, rtol=1e-5)
    torch.testing.assert_close(table.directions.double(), ref["directions"], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        whitened_coordinates(head, table).double(), ref["whitened"], atol=5e-5, rtol=0
    )
    torch.testing.assert_close(table.codes.double(), ref["codes"], atol=1e-5, rtol=0)


def test_covariance_and_sklearn_pca_agree(head: torch.Tensor, table: TokenTable) -> None:
    pca = build_token_table(head, 48, method="pca")
    assert pca.metadata["method"] == "pca"
    torch.testing.assert_close(pca.mean, table.mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(pca.eigenvalues, table.eigenvalues, atol=0, rtol=1e-4)
    # sklearn's covariance_eigh works in the input's float32, hence the looser tolerance.
    torch.testing.assert_close(pca.directions, table.directions, atol=5e-4, rtol=0)
    torch.testing.assert_close(pca.codes, table.codes, atol=5e-4, rtol=0)


def test_basis_is_orthonormal_descending_and_sign_canonical(table: TokenTable) -> None:
    d = table.directions.double()
    torch.testing.assert_close(d.T @ d, torch.eye(48, dtype=torch.float64), atol=1e-6, rtol=0)
    assert bool((table.eigenvalues[:-1] > table.eigenvalues[1:]).all())
    pivots = d.abs().argmax(dim=0)
    assert bool((d[pivots, torch.arange(48)] > 0).all())


def test_chunking_and_dtype_do_not_change_the_table(head: torch.Tensor, table: TokenTable) -> None:
    one_chunk = build_token_table(head, 48, chunk_size=VOCAB)
    tiny_chunks = build_token_table(head, 48, chunk_size=37)  # last chunk: 2000 % 37 = 2 rows
    for other in (one_chunk, tiny_chunks):
        torch.testing.assert_close(other.codes, table.codes, atol=1e-5, rtol=0)
    # A bf16 checkpoint head gives the table of its exact float32 values.
    bf16 = head.to(torch.bfloat16)
    torch.testing.assert_close(
        build_token_table(bf16, 16).codes, build_token_table(bf16.float(), 16).codes, atol=0, rtol=0
    )


def test_metadata_describes_the_build(table: TokenTable) -> None:
    meta = table.metadata
    assert meta["source"] == "unit-test"
    assert (meta["vocab_size"], meta["hidden_size"], meta["transfer_dim"]) == ("2000", "64", "48")
    assert meta["method"] == "covariance"
    assert meta["format_version"] == "1"
    assert 0.5 < float(meta["explained_variance_ratio"]) < 1.0


# --- bad input ------------------------------------------------------------------------------


def _with(value: float, row: int = 5) -> torch.Tensor:
    weight = random_head(50, 8)
    weight[row, 3] = value
    return weight


def _zero_row() -> torch.Tensor:
    weight = random_head(50, 8)
    weight[7] = 0
    return weight


@pytest.mark.parametrize(
    ("weight", "r", "kwargs", "message"),
    [
        (torch.randn(50), 4, {}, "2-D"),
        (torch.randn(2, 50, 8), 4, {}, "2-D"),
        (torch.randint(0, 5, (50, 8)), 4, {}, "floating point"),
        (_with(float("nan")), 4, {}, "non-finite values (NaN/inf) in row 5"),
        (_with(float("inf"), row=40), 4, {"chunk_size": 16}, "in row 40"),
        (_with(1e20, row=9), 4, {}, "row 9 has a norm too large for float32"),
        (_zero_row(), 4, {}, "rows [7] are all zero"),
        (random_head(50, 8), 0, {}, "transfer_dim=0"),
        (random_head(50, 8), 9, {}, "transfer_dim=9"),
        (random_head(6, 8), 6, {}, "vocab_size-1=5"),
        (random_head(50, 8), 4, {"method": "svd"}, "method='svd'"),
        (random_head(50, 8), 4, {"chunk_size": 0}, "chunk_size=0"),
        # rank-3 rows: only ~2 directions of variance after centring
        (random_head(50, 3) @ random_head(3, 8), 6, {}, "numerical rank"),
    ],
    ids=[
        "1d",
        "3d",
        "int",
        "nan",
        "inf",
        "overflow",
        "zero-row",
        "r0",
        "r>H",
        "r>V-1",
        "method",
        "chunk",
        "rank",
    ],
)
def test_bad_input_is_rejected_by_name(
    weight: torch.Tensor, r: int, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_token_table(weight, r, **kwargs)


def test_whitened_coordinates_rejects_another_shape(table: TokenTable) -> None:
    with pytest.raises(ValueError, match="built for"):
        whitened_coordinates(random_head(VOCAB, 32), table)


# --- the file ---------------------------------------------------------------------------------


def test_save_load_round_trip_is_bit_identical(table: TokenTable, tmp_path: Path) -> None:
    path = tmp_path / "nested" / "table.safetensors"
    table.save(path)
    loaded = TokenTable.load(path)
    for name in ("codes", "mean", "directions", "eigenvalues"):
        assert torch.equal(getattr(loaded, name), getattr(table, name)), name
    assert loaded.metadata == table.metadata
    assert os.listdir(path.parent) == ["table.safetensors"]  # no temp file left behind


def test_failed_save_keeps_the_old_file(
    table: TokenTable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "table.safetensors"
    table.save(path)
    before = path.read_bytes()

    def broken_save_file(tensors: dict, filename: str, metadata: dict) -> None:
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(token_table_module, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        table.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["table.safetensors"]


def test_load_errors_name_the_file(table: TokenTable, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent.safetensors"):
        TokenTable.load(tmp_path / "absent.safetensors")

    partial = tmp_path / "partial.safetensors"
    save_file({"codes": table.codes}, partial, metadata={"format_version": "1"})
    with pytest.raises(ValueError, match=r"partial\.safetensors is missing tensor.*'mean'"):
        TokenTable.load(partial)

    tensors = {
        "codes": table.codes,
        "mean": table.mean,
        "eigenvalues": table.eigenvalues,
        "directions": table.directions[:, :10].contiguous(),
    }
    skewed = tmp_path / "skewed.safetensors"
    save_file(tensors, skewed, metadata={"format_version": "1"})
    with pytest.raises(ValueError, match=r"skewed\.safetensors is inconsistent: directions"):
        TokenTable.load(skewed)

    future = tmp_path / "future.safetensors"
    tensors["directions"] = table.directions
    save_file(tensors, future, metadata={"format_version": "99"})
    with pytest.raises(ValueError, match=r"future\.safetensors has format_version='99'"):
        TokenTable.load(future)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"garbage\.safetensors is not a readable"):
        TokenTable.load(garbage)


def test_constructor_rejects_inconsistent_tensors(table: TokenTable) -> None:
    with pytest.raises(ValueError, match="eigenvalues has shape"):
        TokenTable(table.codes, table.mean, table.directions, table.eigenvalues[:5])
    with pytest.raises(ValueError, match="codes must be float32"):
        TokenTable(table.codes.double(), table.mean, table.directions, table.eigenvalues)


# --- reading the head from a checkpoint --------------------------------------------------------


def _save_tiny_qwen3(path: Path, *, tied: bool, **save_kwargs: object) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path, **save_kwargs)
    return model


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, torch.nn.Module]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("targets")
    return {
        "untied": (root / "untied", _save_tiny_qwen3(root / "untied", tied=False)),
        "tied": (root / "tied", _save_tiny_qwen3(root / "tied", tied=True)),
        "sharded": (
            root / "sharded",
            _save_tiny_qwen3(root / "sharded", tied=False, max_shard_size="100KB"),
        ),
    }


def test_load_lm_head_weight_untied(checkpoints: dict) -> None:
    path, model = checkpoints["untied"]
    weight = load_lm_head_weight(path)
    assert torch.equal(weight, model.lm_head.weight.detach())
    assert not torch.equal(weight, model.model.embed_tokens.weight.detach())


def test_load_lm_head_weight_falls_back_to_tied_embedding(checkpoints: dict) -> None:
    path, model = checkpoints["tied"]
    assert torch.equal(load_lm_head_weight(path), model.model.embed_tokens.weight.detach())


def test_load_lm_head_weight_sharded(checkpoints: dict) -> None:
    path, model = checkpoints["sharded"]
    assert (path / "model.safetensors.index.json").is_file()
    assert torch.equal(load_lm_head_weight(path), model.lm_head.weight.detach())


def test_load_lm_head_weight_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_lm_head_weight(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_lm_head_weight(tmp_path)

    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors"):
        load_lm_head_weight(tmp_path)

    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="neither lm_head.weight nor the tied"):
        load_lm_head_weight(tmp_path)

    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    save_file({"model.embed_tokens.weight": torch.ones(8, 4)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        load_lm_head_weight(tmp_path)


# --- CLI and config ---------------------------------------------------------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dspine_train.token_table", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cli_builds_a_table_end_to_end(checkpoints: dict, tmp_path: Path) -> None:
    path, model = checkpoints["tied"]
    out = tmp_path / "table.safetensors"
    result = _run_cli("--target", str(path), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "V=512 H=64 r=64" in result.stdout
    table = TokenTable.load(out)
    assert table.codes.shape == (512, 64)  # default r = min(1024, hidden_size)
    assert table.metadata["source"] == str(path.resolve())
    assert table.metadata["source_tensor"] == "model.embed_tokens.weight"
    expected = build_token_table(model.model.embed_tokens.weight.detach(), 64)
    # another process may use another BLAS thread count, so agreement is to float rounding
    torch.testing.assert_close(table.codes, expected.codes, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("missing", [], "target checkpoint directory"),
        ("untied", ["--transfer-dim", "65"], "transfer_dim=65"),
    ],
)
def test_cli_failures_exit_nonzero_and_write_nothing(
    checkpoints: dict, tmp_path: Path, target: str, extra: list[str], message: str
) -> None:
    target_path = tmp_path / "missing" if target == "missing" else checkpoints[target][0]
    out = tmp_path / "out" / "table.safetensors"
    result = _run_cli("--target", str(target_path), "--out", str(out), *extra)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_main_in_process_with_pca(
    checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = checkpoints["sharded"]
    out = tmp_path / "pca.safetensors"
    assert (
        main(["--target", str(path), "--out", str(out), "--transfer-dim", "32", "--method", "pca"])
        == 0
    )
    assert "method=pca head=lm_head.weight" in capsys.readouterr().out
    assert TokenTable.load(out).metadata["method"] == "pca"


def test_build_from_structured_config(checkpoints: dict, tmp_path: Path) -> None:
    path, model = checkpoints["untied"]
    cfg = OmegaConf.structured(TokenTableConfig(target=str(path), out=str(tmp_path / "t.st")))
    cfg.transfer_dim = 16
    table = build_from_config(cfg)
    assert TokenTable.load(tmp_path / "t.st").codes.shape == (512, 16)
    assert table.metadata["source_tensor"] == "lm_head.weight"

    with pytest.raises(ValueError, match=r"TokenTableConfig\.target is required"):
        build_from_config(TokenTableConfig(out=str(tmp_path / "x.st")))
    with pytest.raises(ValueError, match="is a directory"):
        build_from_config(TokenTableConfig(target=str(path), out=str(tmp_path)))


def test_saved_table_is_readable_by_others(table: TokenTable, tmp_path: Path) -> None:
    # mkstemp creates owner-only files; a table shared across users must not stay 0600.
    path = tmp_path / "shared" / "table.safetensors"
    table.save(path)
    assert path.stat().st_mode & 0o777 == 0o644
