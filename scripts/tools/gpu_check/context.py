"""What the GPU check's sections share: settings, the shared models, device and engine helpers."""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from dspine_train.engine import Engine, TargetConfig, TargetModel
from scripts.tools import REPO
from scripts.tools.gpu_check.models import (
    margin_target,
    tiny_qwen3_config,
)

if TYPE_CHECKING:
    from dspine_train.modeling import DSpineDraftModel
    from scripts.tools.bench.oracle_draft import OracleDraft

GIB = 1024**3


class Skip(Exception):
    """Raised by a section that cannot run here; its message is the reason."""


class Figures(dict):
    """A section's figures plus its failed checks (`expect`)."""

    def expect(self, ok: bool, message: str) -> bool:
        """Record `message` as a failed check unless `ok`."""
        if not ok:
            self.setdefault("failed_checks", []).append(message)
        return ok


class Check:
    """Settings and the objects sections share (built on first use, once)."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.tiny = args.tiny
        self.iters = args.iters or (50 if self.cuda else 3)
        self.tmp = tmp
        self.args = args
        self._real: dict[str, Any] | None = None
        self._timing: dict[str, Any] | None = None

    # -------------------------------------------------------------- shared models
    def real(self) -> dict[str, Any]:
        """The bf16 margin-scaled target (8B config, or the tiny one) as HF model + engine target."""
        if self._real is None:
            config = (tiny_qwen3_config() if self.tiny
                      else transformers.AutoConfig.from_pretrained(REPO / "recipes/targets/qwen3_8b"))
            start = time.perf_counter()
            hf, scale = margin_target(config, self.device, torch.bfloat16)
            target = engine_target_from_hf(hf)
            self._real = dict(hf=hf, target=target, config=config, residual_scale=scale,
                              build_s=time.perf_counter() - start)
        return self._real

    def timing_engine(self) -> dict[str, Any]:
        """An engine on the real target with a random DSpine draft of the recipe's shape.

        Memory is recorded after set-up and after every step shape is captured (section 6).
        """
        if self._timing is None:
            real = self.real()
            free_device_memory(self.device)
            before = memory_allocated(self.device)  # the target's weights (shared with HF)
            reset_peak(self.device)
            draft = recipe_draft(real["hf"], self.tiny)
            engine = make_engine(real["target"], draft, max_batch_size=4, max_seq_len=512)
            sync(self.device)
            setup = dict(allocated_gib=memory_allocated(self.device) / GIB,
                         peak_gib=max_memory(self.device) / GIB)
            start = time.perf_counter()
            warmup_engine(engine, [[5 + i for i in range(64)]], [0, 3, 7, 15])
            sync(self.device)
            captured = dict(allocated_gib=memory_allocated(self.device) / GIB,
                            peak_gib=max_memory(self.device) / GIB,
                            warmup_s=round(time.perf_counter() - start, 2))
            self._timing = dict(engine=engine, draft=draft, target_weights_gib=before / GIB,
                                setup=setup, captured=captured)
        return self._timing


# ------------------------------------------------------------------ device helpers
def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    """Drop what earlier sections left (engines, graphs) before a memory measurement."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def memory_allocated(device: torch.device) -> int:
    """Bytes held by tensors on `device` (0 on CPU: no allocator counter)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def max_memory(device: torch.device) -> int:
    """Peak bytes since the last `reset_peak` (0 on CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------ engine helpers
def engine_target_from_hf(hf: transformers.PreTrainedModel) -> TargetModel:
    """The engine's compact target sharing `hf`'s weight tensors (no copy, no file)."""
    with torch.device("meta"):
        target = TargetModel(TargetConfig.from_hf(hf.config), hf.config)
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    target.load_state_dict(state, strict=True, assign=True)
    return target.eval().requires_grad_(False)


def make_engine(
    target: TargetModel, draft: DSpineDraftModel | OracleDraft | None, **kwargs: Any
) -> Engine:
    """`Engine(...)` with strict graph capture; options this engine version lacks are dropped
    (`strict_graphs`, `compile`), so the check runs against the engine before and after them."""
    accepted = inspect.signature(Engine.__init__).parameters
    kwargs.setdefault("strict_graphs", True)
    kwargs.setdefault("eos_token_ids", [])
    return Engine(target, draft, **{k: v for k, v in kwargs.items() if k in accepted})


def warmup_engine(engine: Engine, prompts: list[list[int]], gs: list[int]) -> None:
    """Capture every step shape before timing (g = 0 is plain decoding): `Engine.warmup` where
    this engine has it, else one short run per g (a run captures the shapes it meets)."""
    if hasattr(engine, "warmup"):
        engine.warmup(batch_sizes=[len(prompts)], num_draft_tokens=gs)
        return
    for g in gs:
        if g == 0:
            engine.generate_ar(prompts, max_new_tokens=2)
        else:
            engine.generate(prompts, max_new_tokens=4, num_draft_tokens=g)


def recipe_draft(hf: transformers.PreTrainedModel, tiny: bool):  # noqa: ANN201
    """A random DSpine draft of the recipe's shape (qwen3_8b, or a tiny one), bound to `hf`."""
    from dspine_train.modeling import DSpineConfig, DSpineDraftModel
    from dspine_train.token_table import build_token_table

    if tiny:
        fields = dict(num_layers=2, block_size=16, transfer_dim=16, message_size=16, candidate_k=4)
    else:
        fields = dict(num_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33],
                      transfer_dim=1024, message_size=512, candidate_k=16)
    config = DSpineConfig.from_target(hf.config, used_vocab_size=hf.config.vocab_size - 1, **fields)
    torch.manual_seed(0)
    with torch.device(hf.device):
        draft = DSpineDraftModel(config)
    draft.init_token_table(build_token_table(hf.lm_head.weight.float(), config.transfer_dim))
    return draft.to(dtype=hf.dtype).eval()
