"""Shared test set-up: fixed seeds, so every run sees the same weights, prompts and interleavings."""

from __future__ import annotations

import random

import pytest
import torch

SEED = 1234  # one seed for everything a test does not seed itself

# The CPU tests run thousands of tiny ops (one per tile); on a 2-core machine torch's intra-op
# thread pool makes them ~10x slower (threads spin and hand off for 100-element matmuls).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_seeds():
    random.seed(SEED)
    torch.manual_seed(SEED)
    yield


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests skip cleanly on a machine without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def save_checkpoint(model: torch.nn.Module, folder) -> None:
    """Save a tiny random transformers model as a checkpoint, its norm weights perturbed first:
    they initialise to 1, so a misplaced norm weight would otherwise go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
