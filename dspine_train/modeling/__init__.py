"""The DSpine draft network (METHOD 1-2.4)."""

from .configuration_dspine import DSpineConfig, default_target_layer_ids
from .context_cache import DraftContextCache
from .modeling_dspine import DraftProposal, DSpineDraftModel, DSpineTrainOutput
from .transition_cache import WalkResult

__all__ = [
    "DSpineConfig",
    "DSpineDraftModel",
    "DSpineTrainOutput",
    "DraftContextCache",
    "DraftProposal",
    "WalkResult",
    "default_target_layer_ids",
]

from transformers import AutoConfig, AutoModel  # noqa: E402 - registration after the classes

AutoConfig.register("dspine", DSpineConfig, exist_ok=True)
AutoModel.register(DSpineConfig, DSpineDraftModel, exist_ok=True)
