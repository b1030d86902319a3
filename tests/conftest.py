"""pytest setup: import paths, the ``gpu`` marker, a seeded RNG fixture, and (with a GPU)
fla's stage-4 kernels pinned to one Triton config.

GPU tests compare against fla's own stage 4 on many head / size keys; its autotuner would
compile and time twelve configs for each new key (minutes over the suite, the K = 256 cases
over three minutes alone). Every config computes the same recurrence (BV splits the V
columns; the warps and stages change the schedule, not the sums), so the tests run fla
with one config valid for every K <= 256 and every dtype: BV = 32, 4 warps, one stage.
KDA_DHU_TEST_FLA_TUNE=1 keeps fla's autotuning (the benchmarks always keep it: they
time fla at its best)."""

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


@pytest.fixture(scope="session", autouse=True)
def _fla_stage4_one_config():
    from helpers import pin_fla_stage4

    restore = pin_fla_stage4() if torch.cuda.is_available() else None
    yield
    if restore is not None:
        restore()


@pytest.fixture
def no_switches(monkeypatch):
    """None of the switches that change what a call runs is set (``helpers.call_switches()``:
    the core's list and fla's own switch of this backend); restored after the test."""
    from helpers import call_switches

    for name in call_switches():
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU torch.Generator seeded from the test's node id: fresh data per test,
    reproducible across runs (and across devices: helpers draw on the CPU)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen
