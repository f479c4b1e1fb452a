"""Load a target checkpoint (HF layout, safetensors) into the compact `TargetModel`.

The model is built on the `meta` device, so no memory is spent on a random init; the tensors are
read through safetensors' memory map, cast to the requested dtype/device, and installed with
`load_state_dict(assign=True)`. Single files (`model.safetensors`) and sharded checkpoints
(`model.safetensors.index.json`) are accepted; tied embeddings reuse `embed_tokens` as the head.
Every problem (no weights, truncated or corrupted file, missing or misshapen tensors) raises a
`CheckpointError` naming the file and keys, before anything is allocated on the device.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspine_train.checkpoint_io import SafetensorsWeights, WeightsError
from dspine_train.engine.errors import CheckpointError
from dspine_train.engine.rope import rope_layer_types, rope_parameters
from dspine_train.engine.target_model import TargetConfig, TargetModel
from dspine_train.target_config import read_target_config

# Buffers some older exports carry; the engine computes them itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `directory` (memory-mapped, on CPU); errors name the
    bad file."""
    try:
        with SafetensorsWeights(directory) as weights:
            return dict(weights.tensors())
    except WeightsError as err:
        raise CheckpointError(str(err)) from err


def load_target(
    path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> TargetModel:
    """Build a `TargetModel` from an HF checkpoint directory (config.json + safetensors).

    `dtype` defaults to the checkpoint's own `torch_dtype`/`dtype` on CUDA and float32 on CPU.
    """
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: no config.json (expected an HF model directory)")
    try:
        hf_config = read_target_config(directory)
    except (ValueError, OSError, KeyError) as err:
        where = str(directory / "config.json")
        raise CheckpointError(
            str(err) if str(err).startswith(where) else f"{where}: cannot be read ({err})"
        ) from err
    config = TargetConfig.from_hf(hf_config)
    for kind in rope_layer_types(hf_config):  # reject unsupported RoPE before loading weights
        rope_parameters(hf_config, config.head_dim, kind)
    device = torch.device(device)
    if dtype is None:
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        stored = getattr(torch, stored) if isinstance(stored, str) else stored
        dtype = stored if device.type == "cuda" and stored is not None else torch.float32

    with torch.device("meta"):
        model = TargetModel(config, hf_config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    state = read_safetensors(directory)
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    _check_state(directory, state, expected)

    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != (
        model.model.embed_tokens.weight.data_ptr()
    ):
        # Keep one tensor for both roles, as HF does for tied checkpoints.
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    return model


def _check_state(
    directory: Path, state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]
) -> None:
    """Raise `CheckpointError` on missing, unexpected or misshapen tensors."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = [
        f"{key}: checkpoint {tuple(state[key].shape)} vs config {shape}"
        for key, shape in expected.items()
        if key in state and tuple(state[key].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(
            f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    if misshapen:
        problems.append(f"shape mismatches {misshapen[:8]}")
    if problems:
        raise CheckpointError(
            f"{directory}: weights do not match config.json: " + "; ".join(problems)
        )
