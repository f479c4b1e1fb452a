"""The demo's settings resolved for this machine and recipe, and the training config the feature
cache and `train.py` share."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .records import Demo, DemoError


def train_overrides(demo: Demo) -> list[str]:
    """Hydra overrides shared by the feature cache and `train.py`.

    The target layers follow METHOD 1 for the chosen number of draft layers.
    """
    from dspine_train.modeling import default_target_layer_ids

    a = demo.args
    depth = json.loads((demo.target / "config.json").read_text())["num_hidden_layers"]
    layers = ",".join(str(i) for i in default_target_layer_ids(depth, a.draft_layers))
    return [f"recipe={a.recipe}", f"output_dir={demo.path('train')}",
            f"model.target_path={demo.target}",
            f"model.token_table_path={demo.path('token_table.safetensors')}",
            f"data.train_path={demo.path('data', 'tokenized')}",
            f"data.offline_features_dir={demo.path('features')}",
            f"optim.max_steps={a.steps}", f"model.num_layers={a.draft_layers}",
            f"model.target_layer_ids=[{layers}]",
            f"model.block_size={a.block_size}", f"data.num_anchors={a.num_anchors}",
            f"model.draft_vocab_size={a.draft_vocab_size or 'null'}",
            # features from the target in the dtype that answered the prompts; the draft in
            # the matching precision (bf16: bf16 weights and activations, fp32 master copy)
            f"model.target_dtype={a.dtype}",
            f"precision={'bf16' if a.dtype == 'bfloat16' else 'fp32'}",
            "logging.wandb=false", *a.train_override]


def resolve_dtype(args: argparse.Namespace) -> None:
    """Resolve the demo's two dtypes (printed; the stage records hold the resolved values, so a
    cached stage is redone if another machine resolves otherwise).

    `args.serve_dtype`: the dtype the target generates in. It answers the training prompts in
    it, and the engine evaluates and checks parity in it, so the answers are the engine's own
    greedy ones: float32 on a CPU, where the engine's lossless check is bit-exact and a bf16
    target rounds a one-row decode step and a multi-row verify differently at near-ties
    (docs/results/demo_2026-12-02), and bfloat16 on CUDA.

    `args.answer_dtype` (`--answer-dtype`): the answers' dtype, `serve_dtype` unless set.

    `args.dtype` (`--dtype`): the cached features and the draft's training precision; `auto`
    is the dtype this machine runs fastest (bf16 where it computes bf16 natively).
    """
    import torch

    cuda = torch.cuda.is_available()
    args.serve_dtype = "bfloat16" if cuda else "float32"
    if getattr(args, "answer_dtype", "auto") == "auto":
        args.answer_dtype = args.serve_dtype
    if args.dtype != "auto":
        return
    from dspine_train.cpu_bf16 import native_bf16

    device = torch.device("cuda" if cuda else "cpu")
    args.dtype = "bfloat16" if native_bf16(device) else "float32"
    print(f"[demo] --dtype auto: {args.dtype} for the features and the training ({device.type}"
          f"{', native bf16' if args.dtype == 'bfloat16' else ', no native bf16'}); answers "
          f"in {args.answer_dtype}, the engine in {args.serve_dtype}", flush=True)


def resolve_draft_shape(args: argparse.Namespace) -> None:
    """Fill `--draft-layers` / `--block-size` left unset with the recipe's values (its model
    group, then `--train-override`), or DSpineConfig's defaults where the recipe sets none: the
    recipe stays the one source of the draft's shape, and the stage records name it."""
    if args.draft_layers is not None and args.block_size is not None:
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dspine_train.modeling import DSpineConfig
    from dspine_train.training.config import ConfigError, compose_train_config

    try:
        model = compose_train_config(f"recipe={args.recipe}", *args.train_override).model
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        raise DemoError(f"training config (--recipe/--train-override): {err}") from err
    if args.draft_layers is None:
        args.draft_layers = model.num_layers or DSpineConfig.num_layers
    if args.block_size is None:
        args.block_size = model.block_size or DSpineConfig.block_size


def train_config(demo: Demo) -> Any:
    """The composed and validated training config (fails fast on a bad override)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dspine_train.training.config import ConfigError, compose_train_config

    try:
        return compose_train_config(*train_overrides(demo))
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        raise DemoError(f"training config (--recipe/--train-override): {err}") from err
