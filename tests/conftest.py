"""Test-session settings: offline, one intra-op thread, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests run tiny models, where a second intra-op thread costs more in synchronisation than
# it gains (and subprocesses started by tests inherit the env var).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny target, its dataset and token-table path (`_train_helpers.build_tiny_assets`),
    written once for every trainer test module."""
    from tests._train_helpers import build_tiny_assets

    return build_tiny_assets(tmp_path_factory.mktemp("tiny_assets"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
