"""Train a DSpine draft for a frozen target LLM (the same command as `dspine-train train`).

    python train.py recipe=tiny                                   # CPU, under a minute
    accelerate launch train.py recipe=qwen3_8b                    # the published setting
    accelerate launch train.py recipe=qwen3_8b deepspeed=zero3 optim.lr=3e-4
    python train.py recipe=qwen3_8b plan_only=true world_size=8   # per-GPU memory, no weights

The main lives in `dspine_train/training/train.py` (its docstring says what a run writes);
this file is the script `accelerate launch` runs.
"""

from dspine_train.training.train import run

if __name__ == "__main__":
    run()
