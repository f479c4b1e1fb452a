"""Evaluation of draft models: how many drafted tokens the target accepts (METHOD 1 "Inference").

    block_metrics.py   the per-slot acceptance rule, its sums, per-block results and their SEs
    held_out.py        the trainer's simulated evaluation on held-out rows (the eval loop)
    harness.py         engine-measured acceptance and speed on benchmarks
    parity.py          served against trained acceptance, block by block

Dependencies point one way (`tests/test_layering.py`): `block_metrics` and `held_out` import
nothing from training or the engine, so the trainer can use them; `harness` runs the engine and
`parity` the engine and the trainer's `DraftStep`, so nothing in training or the engine imports
them. This file imports nothing, so importing one module does not load the others.
"""
