"""Training: the Hydra config schema, data loading, the DeepSpeed trainer, checkpoints, export.

Entry point: `train.py` at the repository root (`python train.py recipe=tiny`).
"""
