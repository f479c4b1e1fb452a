"""dspine-train: train and serve DSpine parallel draft models for lossless speculative decoding.

`DSpineConfig` / `DSpineDraftModel` are imported lazily: `import dspine_train.engine` (and the
CLIs) must not pull in transformers' model machinery, which imports accelerate. Accessing
these names loads the model, which registers the `dspine` model type with `AutoConfig` /
`AutoModel`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .modeling import DSpineConfig, DSpineDraftModel

__all__ = ["DSpineConfig", "DSpineDraftModel"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module 'dspine_train' has no attribute {name!r}")
