"""pytest setup: import paths, the ``gpu`` marker, a seeded RNG fixture."""

from __future__ import annotations

import importlib.util
import os
import sys
import zlib

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
_PYTHON = os.path.join(os.path.dirname(_TESTS), "python")

# helpers.py is importable from every test module (CPU and GPU tests alike).
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
# Use the source tree's package unless an installed kda_dhu (e.g. a wheel with the
# compiled extension, on the GPU machine) is already importable.
if importlib.util.find_spec("kda_dhu") is None and os.path.isdir(_PYTHON):
    sys.path.insert(0, _PYTHON)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU torch.Generator seeded from the test's node id: fresh data per test,
    reproducible across runs (and across devices: helpers draw on the CPU)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen
