"""Inference engine: lossless DSpine speculative decoding of a Qwen3 / Qwen2 / Llama target.

Imports nothing from training (no hydra, deepspeed, accelerate, datasets); the draft model is
imported only when `Engine.from_pretrained` loads one.

    engine = Engine.from_pretrained("path/to/target", "path/to/draft", device="cuda")
    result = engine.generate(["Hello"], max_new_tokens=64)
    baseline = engine.generate_ar(["Hello"], max_new_tokens=64)
"""

from dspine_train.engine.acceptance import Acceptance, clip_at_eos, greedy_accept, rejection_accept
from dspine_train.engine.cuda_graphs import GraphCaptureError
from dspine_train.engine.engine import Engine, GenerationResult
from dspine_train.engine.errors import CheckpointError, GenerationInputError, IncompatibleDraftError
from dspine_train.engine.stats import GenerationStats
from dspine_train.engine.target_model import TargetConfig, TargetModel
from dspine_train.engine.weights import load_target

__all__ = [
    "Acceptance",
    "CheckpointError",
    "Engine",
    "GenerationInputError",
    "GenerationResult",
    "GenerationStats",
    "GraphCaptureError",
    "IncompatibleDraftError",
    "TargetConfig",
    "TargetModel",
    "clip_at_eos",
    "greedy_accept",
    "load_target",
    "rejection_accept",
]
