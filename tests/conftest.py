"""Test tiers: each directory's tests carry its marker; gpu tests skip without CUDA."""

from pathlib import Path

import pytest
import torch

TIERS = ("unit", "dist", "gpu", "e2e")


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs CUDA (tests/gpu run on an H100/H200; this machine has none)")
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(no_cuda)
