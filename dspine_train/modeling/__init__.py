"""The DSpine draft network (METHOD 1-2.4).

The public names below load on first access. The engine imports this package's light modules
(`sdpa_attention`, `exponential_race`, `transition_cache`) for plain decoding, which must not
pull in transformers' model machinery (it imports accelerate). Accessing any of the names
imports the model, whose module registers the `dspine` model type with `AutoConfig` /
`AutoModel`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .configuration_dspine import DSpineConfig, default_target_layer_ids
    from .context_cache import DraftContextCache
    from .markov_head import DSparkOutput
    from .modeling_dspine import DraftProposal, DSpineDraftModel, DSpineTrainOutput
    from .transition_cache import WalkResult

# public name -> the module (in this package) that defines it
_HOMES = {
    "DSpineConfig": "configuration_dspine",
    "DSpineDraftModel": "modeling_dspine",
    "DSpineTrainOutput": "modeling_dspine",
    "DraftContextCache": "context_cache",
    "DSparkOutput": "markov_head",
    "DraftProposal": "modeling_dspine",
    "WalkResult": "transition_cache",
    "default_target_layer_ids": "configuration_dspine",
}
__all__ = [
    "DSpineConfig",
    "DSpineDraftModel",
    "DSpineTrainOutput",
    "DSparkOutput",
    "DraftContextCache",
    "DraftProposal",
    "WalkResult",
    "default_target_layer_ids",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(f"{__name__}.modeling_dspine")  # registers the model type
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later accesses skip this function
    return value
