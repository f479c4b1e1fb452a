"""DFlash2 drafts in z-lab's own format (`dflash==0.1.0`'s `DFlash2DraftModel`).

What z-lab's loader reads (`dflash/model.py`), the layout vLLM registers under the same
architecture name (`qwen3_dflash2.py`) and SpecForge's published DFlash2 configs use:

* `config.json`: DFlash's (`dflash.config_dict`: a Qwen3 config, `is_causal: false`,
  `num_target_layers`, `dflash_config {target_layer_ids, mask_token_id, block_size}`) under
  `architectures: ["DFlash2DraftModel"]`, with DFlash2's four keys in `dflash_config`:
  `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k` (z-lab's loader
  has no defaults for them: a config without one is refused). Sliding-window layers are read
  and written as in `dflash.py`.
* weights: DFlash's backbone plus each layer's `{attention,mlp}_conv.{base_kernel,
  kernel_projection.weight}` and `candidate_selector.{predecessor_codebook,successor_codebook,
  hidden_projection.weight}`: our names and vLLM's. z-lab's class holds the two codebooks as
  embeddings: it maps these names onto their `.weight` when it loads, and its own
  `save_pretrained` writes `candidate_selector.*_codebook.weight`, which is read too.

A `method: dflash2` draft is written in it by `--format dflash`; `load_draft` reads it.
`speculators_dflash2.py` writes and reads the same tensors in vLLM's speculators layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..modeling import DSpineConfig, DSpineDraftModel
from . import dflash
from .dflash import FormatError

ARCHITECTURE = "DFlash2DraftModel"
# DFlash2's own tensors beside DFlash's backbone (its convolutions sit under `layers.`).
HEAD_PREFIXES = ("candidate_selector.",)
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# The codebooks as z-lab's own `save_pretrained` names them (its embeddings' weights).
ZLAB_SAVED_NAMES = {f"candidate_selector.{name}_codebook.weight":
                    f"candidate_selector.{name}_codebook" for name in ("predecessor", "successor")}


def is_dflash2_config(fields: dict[str, Any]) -> bool:
    """Whether a `config.json` dict is a DFlash2 checkpoint in z-lab's format (speculators'
    DFlash2 names the same architecture and adds `speculators_model_type`)."""
    return (ARCHITECTURE in (fields.get("architectures") or [])
            and "speculators_model_type" not in fields)


def check_exportable(config: DSpineConfig, source: str) -> None:
    """`FormatError` unless `config` is a DFlash2 draft."""
    if config.method != "dflash2":
        raise FormatError(f"{source}: method: {config.method} is not a DFlash2 draft")


def config_dict(config: DSpineConfig, dtype: torch.dtype) -> dict[str, Any]:
    """z-lab's DFlash2 `config.json` of a draft with `config` and weights of `dtype`."""
    out = dflash.config_dict(config, dtype)
    out["architectures"] = [ARCHITECTURE]
    out["dflash_config"].update({key: getattr(config, key) for key in KEYS})
    return out


def is_dflash2_key(name: str) -> bool:
    """Whether state-dict key `name` is part of a DFlash2 checkpoint (backbone, convolutions
    or selector)."""
    return dflash.is_backbone_key(name) or name.startswith(HEAD_PREFIXES)


def state_dict(draft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone, convolution and selector tensors of a DFlash2 draft's state dict."""
    return {k: v.detach().contiguous() for k, v in draft_state.items() if is_dflash2_key(k)}


def config_from_dict(fields: dict[str, Any], source: str) -> DSpineConfig:
    """A `method: dflash2` `DSpineConfig` for z-lab's DFlash2 `config.json`; `FormatError`
    names every key this project does not run, and each of DFlash2's keys it lacks."""
    block = dict(fields.get("dflash_config") or {})
    settings = {key: block.get(key, fields.get(key)) for key in KEYS}
    missing = [key for key, value in settings.items() if value is None]
    if missing:
        raise FormatError(f"{source}: config.json has no dflash_config.{', '.join(missing)} "
                          "(z-lab's DFlash2 reads them there)")
    return dflash.config_from_dict(fields, source, ARCHITECTURE, "dflash2", **settings)


def read_draft(directory: str | Path, config: DSpineConfig) -> DSpineDraftModel:
    """The DFlash2 draft with `config` whose tensors lie at `directory` (z-lab's or speculators'
    layout: the same names), every tensor checked; in the dtype of its `fc.weight`. DSpine's
    own parts (`injection.*`, `token_codes`), unused by a DFlash2 draft, keep their initial
    values."""
    draft = DSpineDraftModel(config)
    expected = draft.state_dict()
    tensors = {ZLAB_SAVED_NAMES.get(k, k): v for k, v in dflash.read_tensors(directory).items()}
    dflash.check_tensors(directory, tensors, expected, is_dflash2_key)
    draft.load_state_dict(tensors, strict=False)
    draft.config._name_or_path = str(directory)
    return draft.to(tensors["fc.weight"].dtype).eval()


def import_dflash2(directory: str | Path) -> DSpineDraftModel:
    """z-lab's DFlash2 checkpoint at `directory` as a `method: dflash2` `DSpineDraftModel`."""
    directory = Path(directory)
    return read_draft(directory, config_from_dict(dflash.read_config(directory), str(directory)))
