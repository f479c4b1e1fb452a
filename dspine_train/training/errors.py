"""The error a training run stops with when its input is bad (data, target, resume state)."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A run cannot continue; the message names the file, field or step at fault.

    `train.py` prints it without a traceback and exits non-zero. Checkpoints written before
    the error stay as they are (they are only ever replaced by complete ones).
    """
