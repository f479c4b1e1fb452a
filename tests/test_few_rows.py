"""Few-row linear products: the CPU weight-first product equals `F.linear` (to float32
rounding), is used only for 2..N rows, and leaves the parameters an `nn.Linear`'s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspine_train.modeling.few_rows import Projection, set_weight_first_rows


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 48), (2, 4, 48), (1, 5, 48)])
def test_weight_first_product_equals_linear(shape, bias):
    torch.manual_seed(0)
    layer = Projection(48, 80, bias=bias)
    layer.weight_first_rows = 16
    x = torch.randn(shape)
    out = layer(x)
    assert out.shape == (*shape[:-1], 80)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_rows_outside_the_range_run_f_linear_exactly():
    torch.manual_seed(0)
    layer = Projection(48, 80)
    layer.weight_first_rows = 4
    for rows in (1, 5, 9):
        x = torch.randn(rows, 48)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    # Inside the range the other kernel runs: same values to rounding, computed another way.
    x = torch.randn(4, 48)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_state_dict_names_are_nn_linear_ones_and_the_setting_reaches_every_layer():
    model = nn.Sequential(Projection(8, 8), nn.ReLU(), nn.Sequential(Projection(8, 4, bias=False)))
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.0.weight"}
    set_weight_first_rows(model, 8)
    assert [m.weight_first_rows for m in model.modules() if isinstance(m, Projection)] == [8, 8]
    set_weight_first_rows(model, 0)
    assert all(m.weight_first_rows == 0 for m in model.modules() if isinstance(m, Projection))
    with pytest.raises(ValueError, match="weight_first_rows must be >= 0"):
        set_weight_first_rows(model, -1)


def test_the_engine_runs_its_targets_few_row_products_weight_first_on_a_cpu(tmp_path):
    from _engine_helpers import build_tiny_target, hf_greedy

    from dspine_train.engine import Engine
    from dspine_train.modeling.few_rows import FEW_ROWS

    hf = build_tiny_target(tmp_path / "target", "qwen2", head_scale=4.0, eos_token_id=None)
    prompt = [5, 17, 3, 99, 42]
    engine = Engine.from_pretrained(tmp_path / "target", max_batch_size=1, max_seq_len=64,
                                    eos_token_ids=[])
    layers = [m for m in engine.target.modules() if isinstance(m, Projection)]
    assert layers and all(m.weight_first_rows == FEW_ROWS for m in layers)
    # A 5-token prefill runs every layer weight-first (biases included): still transformers'
    # own greedy continuation.
    out = engine.generate_ar([prompt], max_new_tokens=12, chat=False)
    assert out.token_ids[0] == hf_greedy(hf, prompt, 12)

    off = Engine.from_pretrained(tmp_path / "target", max_batch_size=1, max_seq_len=64,
                                 eos_token_ids=[], weight_first_rows=0)
    assert all(m.weight_first_rows == 0 for m in off.target.modules() if isinstance(m, Projection))
