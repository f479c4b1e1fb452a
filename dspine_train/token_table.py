"""PCA-whitened token codes from a target's frozen LM head (METHOD 2.1), and a CLI to build them.

From the head weight W (V x H): L2-normalise each row, subtract the vocabulary mean, take the
top-r eigenvectors of the H x H covariance of the centred rows (accumulated over row chunks, so
no V x V matrix and no second full-size copy of W), project each centred row on them, divide by
the square root of the eigenvalue (whitening) and L2-normalise the result. The codes (V x r) are
saved with the mean, directions and eigenvalues in one safetensors file; the draft initialises
its per-layer readouts from the same directions.

Run it on a Hugging Face checkpoint directory::

    python -m dspine_train.token_table --target /ckpt/Qwen3-8B --out tables/qwen3-8b.safetensors

or from Python / a Hydra recipe with ``build_from_config(TokenTableConfig(target=..., out=...))``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.linalg
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from sklearn.decomposition import PCA
from threadpoolctl import threadpool_limits
from torch import Tensor
from tqdm.auto import tqdm

from dspine_train.checkpoint_io import SafetensorsWeights, write_atomic
from dspine_train.owned_dir import check_output_file
from dspine_train.writable import output_file_problem

FORMAT_NAME = "dspine-token-table"
TOOL = "dspine_train.token_table"
FORMAT_VERSION = "1"
METHODS = ("covariance", "pca")
DEFAULT_MAX_TRANSFER_DIM = 1024
DEFAULT_CHUNK_SIZE = 16384
TENSOR_NAMES = ("codes", "mean", "directions", "eigenvalues")

LM_HEAD_KEY = "lm_head.weight"
EMBED_KEY = "model.embed_tokens.weight"

# Eigenvalues below this share of the largest are numerical noise of the fp32 chunk Gram
# matrices: whitening by them would amplify noise into unit-variance code dimensions.
_MIN_EIGENVALUE_RATIO = 1e-5


@dataclass(eq=False)
class TokenTable:
    """Whitened token codes of one target vocabulary and the PCA basis they were built from.

    All tensors are float32. ``codes[v]`` is the unit-norm whitened position of token ``v``;
    ``directions[:, i]`` is the i-th principal direction (descending ``eigenvalues``), signed so
    that its largest-magnitude entry is positive.
    """

    codes: Tensor  # (V, r) rows L2-normalised whitened coordinates
    mean: Tensor  # (H,) mean of the L2-normalised head rows
    directions: Tensor  # (H, r) top-r covariance eigenvectors, descending eigenvalue
    eigenvalues: Tensor  # (r,) covariance eigenvalues (denominator V - 1), descending
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = _shape_problem(self.codes, self.mean, self.directions, self.eigenvalues)
        if problem is not None:
            raise ValueError(f"inconsistent TokenTable: {problem}")

    @property
    def vocab_size(self) -> int:
        """Number of tokens V (rows of ``codes``)."""
        return self.codes.shape[0]

    @property
    def hidden_size(self) -> int:
        """Hidden size H of the head the table was built from."""
        return self.mean.shape[0]

    @property
    def transfer_dim(self) -> int:
        """Dimension r of the transfer space."""
        return self.codes.shape[1]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table to one safetensors file, atomically (temp file + rename)."""
        tensors = {name: getattr(self, name).detach().cpu().contiguous() for name in TENSOR_NAMES}
        write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=dict(self.metadata)))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenTable:
        """Read a table written by :meth:`save`, checking tensors, shapes and format version."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"token table file {path} does not exist")
        try:
            with safe_open(path, framework="pt") as f:
                metadata = dict(f.metadata() or {})
                found = set(f.keys())
                missing = [name for name in TENSOR_NAMES if name not in found]
                if missing:
                    raise ValueError(
                        f"token table {path} is missing tensor(s) {missing}; found {sorted(found)}"
                    )
                tensors = {name: f.get_tensor(name) for name in TENSOR_NAMES}
        except SafetensorError as exc:
            raise ValueError(
                f"token table {path} is not a readable safetensors file: {exc}"
            ) from exc
        version = metadata.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"token table {path} has format_version={version!r}; this code reads "
                f"version {FORMAT_VERSION!r}"
            )
        problem = _shape_problem(**tensors)
        if problem is not None:
            raise ValueError(f"token table {path} is inconsistent: {problem}")
        for key, actual in (
            ("vocab_size", tensors["codes"].shape[0]),
            ("hidden_size", tensors["mean"].shape[0]),
            ("transfer_dim", tensors["codes"].shape[1]),
        ):
            if key in metadata and metadata[key] != str(actual):
                raise ValueError(
                    f"token table {path}: metadata {key}={metadata[key]} but the tensors "
                    f"say {actual}"
                )
        return cls(**tensors, metadata=metadata)


def _shape_problem(
    codes: Tensor, mean: Tensor, directions: Tensor, eigenvalues: Tensor
) -> str | None:
    """Describe the first dtype/shape inconsistency among the table's tensors, or None."""
    named = {"codes": codes, "mean": mean, "directions": directions, "eigenvalues": eigenvalues}
    for name, tensor in named.items():
        if tensor.dtype != torch.float32:
            return f"{name} must be float32, got {tensor.dtype}"
    expected_ndim = {"codes": 2, "mean": 1, "directions": 2, "eigenvalues": 1}
    for name, ndim in expected_ndim.items():
        if named[name].ndim != ndim:
            return f"{name} must be {ndim}-D, got shape {tuple(named[name].shape)}"
    vocab, r = codes.shape
    hidden = mean.shape[0]
    if tuple(directions.shape) != (hidden, r):
        return (
            f"directions has shape {tuple(directions.shape)}, expected (hidden_size={hidden}, "
            f"transfer_dim={r}) from mean {tuple(mean.shape)} and codes {tuple(codes.shape)}"
        )
    if tuple(eigenvalues.shape) != (r,):
        return f"eigenvalues has shape {tuple(eigenvalues.shape)}, expected (transfer_dim={r},)"
    return None


def _check_weight(weight: Tensor) -> None:
    """Reject a head weight that is not a 2-D floating-point (vocab_size, hidden_size) matrix."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(
            f"weight must be a 2-D (vocab_size, hidden_size) matrix, got shape {tuple(weight.shape)}"
        )
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got dtype {weight.dtype}")


def _normalised_chunks(
    weight: Tensor, chunk_size: int, desc: str, progress: bool
) -> Iterator[tuple[slice, Tensor]]:
    """Yield ``(rows, x)`` with ``x`` the float32 L2-normalised rows ``weight[rows]``.

    Each chunk is a fresh float32 tensor, so callers may modify it in place; the full matrix is
    never copied. Non-finite values and all-zero rows are rejected here, by row index.
    """
    vocab = weight.shape[0]
    for start in tqdm(range(0, vocab, chunk_size), desc=desc, disable=not progress, leave=False):
        rows = slice(start, min(start + chunk_size, vocab))
        x = weight[rows].to(torch.float32, copy=True)  # (c, H)
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)  # (c, 1)
        # A NaN/inf entry makes its row norm non-finite: checking the c norms instead of all
        # c x H entries keeps validation off the profile; the rows are located only on failure.
        if not bool(torch.isfinite(norms).all()):
            bad = ~torch.isfinite(x).all(dim=1)
            if bad.any():
                row = start + int(bad.nonzero()[0])
                raise ValueError(f"weight has non-finite values (NaN/inf) in row {row}")
            row = start + int((~torch.isfinite(norms[:, 0])).nonzero()[0])
            raise ValueError(f"weight row {row} has a norm too large for float32")
        if (norms == 0).any():
            zero_rows = (start + (norms[:, 0] == 0).nonzero()[:, 0]).tolist()
            raise ValueError(
                f"weight rows {zero_rows[:8]} are all zero and cannot be L2-normalised"
            )
        yield rows, x.div_(norms)


def _gram(x: Tensor) -> Tensor:
    """``x.T @ x`` for a (c, H) float32 chunk, as an (H, H) float32 tensor."""
    if x.device.type == "cpu":
        # numpy's matmul recognises ``a.T @ a`` and calls BLAS syrk, half the flops of the GEMM
        # torch would run (torch has no syrk); .numpy() shares memory, nothing is copied.
        x_np = x.numpy()
        return torch.from_numpy(x_np.T @ x_np)
    return x.T @ x


def _top_eigenpairs(cov: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Top-r eigenpairs of a symmetric float64 matrix, descending: ((r,), (H, r))."""
    if cov.device.type == "cpu":
        # LAPACK's divide-and-conquer driver via scipy's OpenBLAS: ~2x faster than the MKL
        # behind torch.linalg.eigh on H = 4096 (AMD EPYC). One BLAS thread: its tridiagonal
        # reduction is bound by memory bandwidth, so a second thread gained nothing on 2 idle
        # cores, while on a busy machine the threads' spin-waits made it 3-4x slower (measured).
        with threadpool_limits(limits=1, user_api="blas"):
            values, vectors = scipy.linalg.eigh(cov.numpy(), driver="evd", overwrite_a=True)
        values, vectors = torch.from_numpy(values), torch.from_numpy(vectors)
    else:
        values, vectors = torch.linalg.eigh(cov)
    return values.flip(0)[:r], vectors.flip(1)[:, :r]


def _canonical_signs(directions: Tensor) -> Tensor:
    """Flip each column so its largest-magnitude entry is positive (sklearn's svd_flip rule)."""
    pivot = directions.abs().argmax(dim=0)  # (r,)
    signs = torch.sign(directions.gather(0, pivot[None, :]))  # (1, r)
    return directions * signs


def _covariance_basis(
    weight: Tensor, r: int, chunk_size: int, progress: bool
) -> tuple[Tensor, Tensor, Tensor, float]:
    """Chunked mean, covariance and its top-r eigenpairs of the L2-normalised rows.

    Returns (mean (H,) float64, eigenvalues (r,) float64, directions (H, r) float64, total
    variance). One pass over W: rows are shifted by the first chunk's mean (a close estimate of
    the vocabulary mean) before their Gram matrix is accumulated, so the final correction by
    the small remaining offset loses no precision, and no second pass to centre is needed.
    """
    vocab, hidden = weight.shape
    offset_sum = torch.zeros(hidden, dtype=torch.float64, device=weight.device)
    gram = torch.zeros(hidden, hidden, dtype=torch.float64, device=weight.device)
    shift: Tensor | None = None
    for _, x in _normalised_chunks(weight, chunk_size, "token table: covariance", progress):
        if shift is None:
            shift = x.mean(dim=0)  # (H,) float32
        x.sub_(shift)
        offset_sum += x.sum(dim=0, dtype=torch.float64)
        # Each chunk's Gram matrix is summed in float32 by BLAS; chunks add up in float64.
        gram += _gram(x)
    assert shift is not None  # vocab >= 2 was checked, so there was a chunk
    offset = offset_sum / vocab  # (H,) vocabulary mean minus shift
    mean = shift.double() + offset
    cov = gram.sub_(torch.outer(offset, offset), alpha=vocab).div_(vocab - 1)  # (H, H), in place
    total_variance = float(cov.diagonal().sum())
    eigenvalues, directions = _top_eigenpairs(cov, r)
    return mean, eigenvalues, directions, total_variance


def _pca_basis(
    weight: Tensor, r: int, chunk_size: int, progress: bool
) -> tuple[Tensor, Tensor, Tensor, float]:
    """The same quantities as :func:`_covariance_basis`, computed by scikit-learn's PCA.

    Needs one float32 copy of the normalised matrix; ``covariance_eigh`` is sklearn's solver
    for n_samples >> n_features (it eigendecomposes the H x H covariance, like we do).
    """
    vocab, hidden = weight.shape
    normalised = np.empty((vocab, hidden), dtype=np.float32)
    for rows, x in _normalised_chunks(weight, chunk_size, "token table: normalise", progress):
        normalised[rows] = x.cpu().numpy()
    pca = PCA(n_components=r, svd_solver="covariance_eigh", copy=False).fit(normalised)
    # sklearn keeps only the ratios; recover the total variance (trace) from the first one.
    ratio = float(pca.explained_variance_ratio_[0])
    total_variance = float(pca.explained_variance_[0]) / ratio if ratio > 0 else 0.0
    mean = torch.from_numpy(pca.mean_.astype(np.float64))
    eigenvalues = torch.from_numpy(pca.explained_variance_.astype(np.float64))
    directions = torch.from_numpy(pca.components_.T.astype(np.float64))  # (r, H) -> (H, r)
    return mean, eigenvalues, directions, total_variance


def _project(
    weight: Tensor,
    mean: Tensor,
    projection: Tensor,
    chunk_size: int,
    normalise: bool,
    progress: bool,
) -> Tensor:
    """Rows of W, L2-normalised and centred, times ``projection`` (H, r), chunk by chunk.

    With ``normalise`` each output row is L2-normalised too. Output: (V, r) float32, written
    into one preallocated tensor.
    """
    out = torch.empty(
        weight.shape[0], projection.shape[1], dtype=torch.float32, device=weight.device
    )
    for rows, x in _normalised_chunks(weight, chunk_size, "token table: codes", progress):
        block = out[rows]  # (c, r) view into the output
        torch.matmul(x.sub_(mean), projection, out=block)
        if normalise:
            block.div_(torch.linalg.vector_norm(block, dim=1, keepdim=True).clamp_min_(1e-12))
    return out


def _check_transfer_dim(transfer_dim: int, vocab: int, hidden: int) -> None:
    limit = min(hidden, vocab - 1)
    if isinstance(transfer_dim, bool) or not isinstance(transfer_dim, int):
        raise ValueError(f"transfer_dim must be an int, got {transfer_dim!r}")
    if not 1 <= transfer_dim <= limit:
        raise ValueError(
            f"transfer_dim={transfer_dim} must be in [1, min(hidden_size={hidden}, "
            f"vocab_size-1={vocab - 1})] = [1, {limit}]"
        )


def build_token_table(
    weight: Tensor,
    transfer_dim: int,
    *,
    method: str = "covariance",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    source: str = "",
    progress: bool = False,
) -> TokenTable:
    """Build the METHOD 2.1 token codes of a head weight ``weight`` (V, H), any float dtype.

    ``method="covariance"`` accumulates the H x H covariance over ``chunk_size``-row chunks and
    eigendecomposes it in float64; ``method="pca"`` asks scikit-learn's PCA for the basis (one
    extra float32 copy of W). Both give the same table up to float rounding. ``source`` names
    the checkpoint in the metadata. Raises ValueError naming the problem for bad input.
    """
    _check_weight(weight)
    vocab, hidden = weight.shape
    _check_transfer_dim(transfer_dim, vocab, hidden)
    if method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {METHODS}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be positive")

    basis = _covariance_basis if method == "covariance" else _pca_basis
    mean, eigenvalues, directions, total_variance = basis(
        weight, transfer_dim, chunk_size, progress
    )
    if eigenvalues[-1] <= _MIN_EIGENVALUE_RATIO * eigenvalues[0]:
        rank = int((eigenvalues > _MIN_EIGENVALUE_RATIO * eigenvalues[0]).sum())
        raise ValueError(
            f"transfer_dim={transfer_dim} exceeds the numerical rank (~{rank}) of the centred, "
            f"normalised head; whitening would divide by near-zero eigenvalues"
        )
    directions = _canonical_signs(directions)

    mean32 = mean.to(device=weight.device, dtype=torch.float32)
    directions32 = directions.to(device=weight.device, dtype=torch.float32).contiguous()
    eigenvalues32 = eigenvalues.to(device=weight.device, dtype=torch.float32)
    # Fold the whitening 1/sqrt(eigenvalue) into the projection, computed in float64.
    projection = (directions / eigenvalues.sqrt()).to(device=weight.device, dtype=torch.float32)
    codes = _project(weight, mean32, projection, chunk_size, normalise=True, progress=progress)

    explained = float(eigenvalues.sum()) / total_variance
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "source": source,
        "vocab_size": str(vocab),
        "hidden_size": str(hidden),
        "transfer_dim": str(transfer_dim),
        "method": method,
        "explained_variance_ratio": f"{explained:.6f}",
    }
    return TokenTable(codes, mean32, directions32, eigenvalues32, metadata)


def whitened_coordinates(
    weight: Tensor, table: TokenTable, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """Whitened coordinates (V, r) of ``weight``'s rows in ``table``'s basis, before the final
    row normalisation: ``(normalize(w) - mean) @ directions / sqrt(eigenvalues)``.

    For the weight the table was built from, their covariance is the identity.
    """
    _check_weight(weight)
    if tuple(weight.shape) != (table.vocab_size, table.hidden_size):
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but the table was built for "
            f"(vocab_size={table.vocab_size}, hidden_size={table.hidden_size})"
        )
    projection = table.directions.double() / table.eigenvalues.double().sqrt()
    projection = projection.to(device=weight.device, dtype=torch.float32)
    mean = table.mean.to(weight.device)
    return _project(weight, mean, projection, chunk_size, normalise=False, progress=False)


def _read_head_weight(target_path: Path) -> tuple[Tensor, str]:
    """The LM head of an HF checkpoint directory and the name of the tensor it came from."""
    if not target_path.exists():
        raise FileNotFoundError(f"target checkpoint directory {target_path} does not exist")
    if not target_path.is_dir():
        raise NotADirectoryError(
            f"target checkpoint {target_path} is not a directory (give the HF checkpoint folder)"
        )
    # Errors (no weights, a missing shard, a truncated file) are ValueError/FileNotFoundError
    # naming the file; only the header of the file holding the head is read, then that tensor.
    with SafetensorsWeights(target_path) as weights:
        name = _head_tensor_name(target_path, weights)
        return weights.get_tensor(name), name


def _head_tensor_name(target_path: Path, files: SafetensorsWeights) -> str:
    """``lm_head.weight``, or the tied ``model.embed_tokens.weight`` when allowed."""
    if LM_HEAD_KEY in files:
        name = LM_HEAD_KEY
    else:
        tied = _tie_word_embeddings(target_path)
        if tied is False:
            raise ValueError(
                f"target {target_path} has no {LM_HEAD_KEY} and its config.json sets "
                f"tie_word_embeddings=false, so the embedding is not its head"
            )
        if EMBED_KEY not in files:
            raise ValueError(
                f"target {target_path} has neither {LM_HEAD_KEY} nor the tied {EMBED_KEY}"
            )
        name = EMBED_KEY
    return name


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not valid UTF-8: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(content, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return content


def _tie_word_embeddings(target_path: Path) -> bool | None:
    """``tie_word_embeddings`` from config.json (top level or ``text_config``), None if unset."""
    config_path = target_path / "config.json"
    if not config_path.is_file():
        return None
    config = _read_json(config_path)
    for scope in (config, config.get("text_config") or {}):
        if "tie_word_embeddings" in scope:
            return bool(scope["tie_word_embeddings"])
    return None


def load_lm_head_weight(target_path: str | os.PathLike[str]) -> Tensor:
    """Read ``lm_head.weight`` (V, H) from an HF safetensors checkpoint directory.

    Handles single-file and sharded (``model.safetensors.index.json``) checkpoints, and falls
    back to the tied ``model.embed_tokens.weight`` when the head is not stored (tied
    embeddings). Only that one tensor is read. Returned in its stored dtype.
    """
    return _read_head_weight(Path(target_path))[0]


@dataclass
class TokenTableConfig:
    """Configuration of a token-table build (the CLI flags, as a Hydra-friendly schema)."""

    target: str = "???"  # HF checkpoint directory of the target model (required)
    out: str = "???"  # output .safetensors path (required)
    transfer_dim: int | None = None  # r; None -> min(1024, hidden_size, vocab_size - 1)
    method: str = "covariance"  # "covariance" (chunked, float64 eigh) or "pca" (scikit-learn)
    chunk_size: int = DEFAULT_CHUNK_SIZE  # head rows per chunk


def build_from_config(cfg: TokenTableConfig, *, progress: bool = False) -> TokenTable:
    """Read the target's head, build its token table and save it to ``cfg.out``."""
    for name in ("target", "out"):
        value = getattr(cfg, name)
        if not value or value == "???":
            raise ValueError(f"TokenTableConfig.{name} is required")
    out = Path(cfg.out)
    if out.is_dir():
        raise ValueError(f"out={out} is a directory; give a .safetensors file path")
    check_output_file(out, "out", TOOL, {"target": [cfg.target]}, is_own=is_token_table_file)
    target = Path(cfg.target)
    weight, tensor_name = _read_head_weight(target)
    vocab, hidden = weight.shape
    transfer_dim = cfg.transfer_dim
    if transfer_dim is None:
        transfer_dim = min(DEFAULT_MAX_TRANSFER_DIM, hidden, vocab - 1)
    table = build_token_table(
        weight,
        transfer_dim,
        method=cfg.method,
        chunk_size=cfg.chunk_size,
        source=str(target.resolve()),
        progress=progress,
    )
    table.metadata["source_tensor"] = tensor_name
    table.save(out)
    return table


def is_token_table_file(path: Path) -> bool:
    """Whether ``path`` is a token table this module wrote (its ``format`` metadata)."""
    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT_NAME
    except (SafetensorError, OSError):
        return False


def _argument_problem(args: argparse.Namespace) -> str | None:
    """The first flag value the CLI can reject before reading the target, naming the flag."""
    if args.transfer_dim is not None and args.transfer_dim < 1:
        return f"--transfer-dim must be >= 1, got {args.transfer_dim}"
    if args.chunk_size < 1:
        return f"--chunk-size must be >= 1, got {args.chunk_size}"
    # not over the target (T/model.safetensors are its weights), nor over a foreign file
    return output_file_problem(args.out, "--out", TOOL, {"--target": [args.target]},
                               is_own=is_token_table_file)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (2: a bad flag, 1: a bad checkpoint)."""
    parser = argparse.ArgumentParser(
        prog="python -m dspine_train.token_table",
        description="Build the PCA-whitened token table (METHOD 2.1) of a target's LM head.",
    )
    parser.add_argument("--target", required=True, help="HF checkpoint directory of the target")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    parser.add_argument(
        "--transfer-dim",
        type=int,
        default=None,
        help="r, the code dimension (default: min(1024, hidden_size))",
    )
    parser.add_argument("--method", choices=METHODS, default="covariance")
    parser.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="head rows processed at a time"
    )
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cfg = TokenTableConfig(
        target=args.target,
        out=args.out,
        transfer_dim=args.transfer_dim,
        method=args.method,
        chunk_size=args.chunk_size,
    )
    start = time.perf_counter()
    try:
        table = build_from_config(cfg, progress=True)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SafetensorError as exc:  # only writing raises it unwrapped (e.g. a full disk)
        print(f"error: --out {cfg.out}: cannot write ({exc})", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    meta = table.metadata
    print(
        f"token table: V={table.vocab_size} H={table.hidden_size} r={table.transfer_dim} "
        f"method={meta['method']} head={meta['source_tensor']} "
        f"explained_variance={float(meta['explained_variance_ratio']):.4f} "
        f"time={seconds:.1f}s -> {cfg.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
