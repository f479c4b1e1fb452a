"""dspine-train: train and serve DSpine parallel draft models for lossless speculative decoding."""

from transformers import AutoConfig, AutoModel

from .modeling import DSpineConfig, DSpineDraftModel

AutoConfig.register("dspine", DSpineConfig, exist_ok=True)
AutoModel.register(DSpineConfig, DSpineDraftModel, exist_ok=True)

__all__ = ["DSpineConfig", "DSpineDraftModel"]
__version__ = "0.1.0"
