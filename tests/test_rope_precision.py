"""Rotary angles stay float32-exact whatever dtype the modules are cast to.

With rope_theta = 1e6, rounding `inv_freq` to bf16 (relative error ~4e-3) moves the angle of
the fastest channel at position 4000 by ~16 radians. The draft (trainer and engine cast it with
`.to(dtype)`) and the engine's target must both keep their rotary frequencies in float32.
"""

from __future__ import annotations

import math

import pytest
import torch
from _engine_helpers import build_tiny_target
from _model_helpers import USED_VOCAB

from dspine_train import DSpineConfig, DSpineDraftModel
from dspine_train.engine.rope import RopeTable
from dspine_train.training.tiny_assets import tiny_target_config

POSITIONS = torch.tensor([[0, 1, 1000, 4000, 8191]])
THETA = 1.0e6


def _reference(inv_freq64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 cos/sin (T, D) at POSITIONS in the rotate-half layout."""
    freqs = POSITIONS[0].double()[:, None] * inv_freq64[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _inv_freq64(head_dim: int) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return 1.0 / (THETA**exponent)


def _angle_error(cos: torch.Tensor, sin: torch.Tensor, ref_cos, ref_sin) -> float:
    """Largest wrapped angle difference (radians) between two cos/sin tables."""
    got = torch.atan2(sin.double(), cos.double())
    ref = torch.atan2(ref_sin, ref_cos)
    diff = torch.remainder(got - ref + math.pi, 2 * math.pi) - math.pi
    return float(diff.abs().max())


def _long_context_draft() -> DSpineDraftModel:
    target_cfg = tiny_target_config(
        vocab_size=256, max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )
    cfg = DSpineConfig.from_target(
        target_cfg, used_vocab_size=USED_VOCAB, num_layers=1, transfer_dim=16, message_size=8,
        candidate_k=4, block_size=4,
    )
    return DSpineDraftModel(cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_draft_rope_angles_survive_a_module_cast(dtype):
    draft = _long_context_draft().to(dtype)
    rotary = draft.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    # The angles themselves (fp32 output) against fp64: only fp32 rounding of position*freq.
    cos, sin = rotary(POSITIONS, torch.float32)
    ref_cos, ref_sin = _reference(_inv_freq64(draft.config.head_dim))
    assert _angle_error(cos[0, 0], sin[0, 0], ref_cos, ref_sin) < 2e-3
    # And what the layers really receive (cos/sin rounded to the module dtype, angle intact).
    cos, sin = rotary(POSITIONS, dtype)
    assert _angle_error(cos[0, 0], sin[0, 0], ref_cos, ref_sin) < 2e-2


def test_draft_rope_survives_save_and_load_in_bf16(tmp_path):
    draft = _long_context_draft()
    draft.save_pretrained(tmp_path)
    loaded = DSpineDraftModel.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(loaded.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)


def test_engine_target_rope_table_angles_in_bf16(tmp_path):
    model = build_tiny_target(
        tmp_path, "qwen3", max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )
    table = RopeTable(model.config, 16, 8192, device=torch.device("cpu"), dtype=torch.bfloat16)
    cos, sin = table.lookup(POSITIONS[0])
    ref_cos, ref_sin = _reference(_inv_freq64(16))
    assert _angle_error(cos, sin, ref_cos, ref_sin) < 2e-2


def test_engine_keeps_the_draft_rope_in_fp32(tmp_path):
    """The engine casts the draft to the target's dtype: the frequencies must stay fp32."""
    from _engine_helpers import tiny_draft

    from dspine_train.engine import Engine, load_target

    hf = build_tiny_target(tmp_path, "qwen3")
    target = load_target(tmp_path, dtype=torch.bfloat16)
    draft = tiny_draft(hf, used_vocab_size=200)
    engine = Engine(target, draft, max_batch_size=1, max_seq_len=64)
    assert engine.draft.fc.weight.dtype == torch.bfloat16
    assert engine.draft.rotary_emb.inv_freq.dtype == torch.float32
