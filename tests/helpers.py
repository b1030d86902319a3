"""The tests' helpers live in the package (kda_dhu.testing) so that ``python -m kda_dhu``
can run the same CPU check; this module keeps ``from helpers import ...`` working."""

import os

from kda_dhu.testing import GATES, make_inputs, naive_bwd_dhu  # noqa: F401


def run_in_threads(worker, n: int) -> None:
    """Runs ``worker(i)`` for i in range(n), each in its own thread, all at once; fails
    with every exception the workers raised."""
    import threading

    errors = []

    def guarded(i):
        try:
            worker(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# --------------------------------------------------------------- GPU tests' shared tools
# ~0.2 s of GPU time at the H200's 1.98 GHz: far longer than any call's host time.
SLEEP_CYCLES = 400_000_000


def sync_debug(mode: str):
    """torch's sync debug mode ("error", "warn") for the duration of a with-block."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def scope():
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)

    return scope()


def without_sync(fn, what: str):
    """fn() behind a sleep kernel on the current stream, under sync debug mode "error";
    asserts the stream was still busy when it returned (the host did not wait for the GPU:
    this also catches a synchronizing driver call no torch hook sees). Returns (fn's
    result, torch CUDA allocations it made)."""
    import torch

    stream = torch.cuda.current_stream()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda._sleep(SLEEP_CYCLES)
    with sync_debug("error"):
        out = fn()
    busy = not stream.query()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - allocs
    torch.cuda.synchronize()
    assert busy, f"{what}: returned after the stream drained: the host waited for the GPU"
    return out, allocs


def count_syncs(fn) -> tuple:
    """(fn's result, synchronizing torch calls it made: sync debug mode "warn")."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_debug("warn"):
            out = fn()
    return out, sum("synchroniz" in str(w.message) for w in caught)


def register_or_skip() -> None:
    """kda-dhu registered as fla's stage-4 backend (skips where fla has no registry)."""
    import kda_dhu
    import pytest
    from kda_dhu import fla_backend

    if not kda_dhu.register_backend() and not fla_backend.is_registered():
        pytest.skip("kda-dhu cannot register as an fla backend here")


def via_registry(a: dict):
    """fla's public (dispatching) stage-4 function on keyword arguments: its registry,
    then kda-dhu's backend where registered and enabled."""
    import fla.ops.common.chunk_delta_h as m

    return m.chunk_gated_delta_rule_bwd_dhu(**a)


def pin_fla_stage4():
    """fla's stage-4 Triton kernels pinned to one config (``kda_dhu._measure.pin_fla_stage4``)
    so that a test comparing against fla does not tune twelve configs per new key. Returns
    the restoring function, or None (no usable fla here, or KDA_DHU_TEST_FLA_TUNE=1 keeps
    fla's own autotuning). Child processes of GPU tests call it too."""
    import os

    if os.environ.get("KDA_DHU_TEST_FLA_TUNE") == "1":
        return None
    try:
        from kda_dhu._measure import pin_fla_stage4 as pin

        return pin()
    except Exception:  # noqa: BLE001 - no (usable) fla here: nothing to pin
        return None


# ------------------------------------------------------------------------- paths
# The checkout's root (README.md, benches/, scripts/, cuda/) and its tests/ folder (this
# module's), for tests in any of tests/unit, tests/gpu, tests/tools.
# The cases and names the test files share (one table): the op's arguments in fla's
# order as the core describes them (validate::ARGUMENTS), its outputs, and the packed
# batch most files draw (lengths around the chunk size: 1, 63, 65, 128, 200, 64, 7).
def _op_names() -> tuple:
    try:
        from kda_dhu import _core
    except ImportError:  # a checkout without the extension: the tests that need it skip
        return ()
    return tuple(name for name, _ in _core.op_arguments())


CALL_ORDER = _op_names()  # fla's 16, use_graph last
POS = tuple(n for n in CALL_ORDER if n != "use_graph")  # the core's positional order after the rule
FLOAT_INPUTS = ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht")
OUTPUTS = ("dh", "dh0", "dv2")
VARLEN_LENGTHS = [1, 63, 65, 128, 200, 64, 7]

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS)
BENCHES = os.path.join(REPO_ROOT, "benches")


def lab_module(name: str):
    """A lab script of benches/ (not in the wheel) as a module, e.g. "bench" (the
    benchmark's record tools): benches/ put first on sys.path, as running it does."""
    import importlib
    import sys

    if BENCHES not in sys.path:
        sys.path.insert(0, BENCHES)
    return importlib.import_module(name)


# --------------------------------------------------------------- fresh interpreters
def call_switches() -> tuple[str, ...]:
    """The switches that change what a call runs: the core's list of those read at each
    call (``_core.per_call_switches()``, src/env.rs) and fla's own switch of this backend."""
    from kda_dhu import _core

    return (*_core.per_call_switches(), "FLA_KDA_DHU")


# Switches that change a call's route, left out of a child's environment unless it sets
# them: those read at each call, and those read on import (kda-dhu's registration in fla's
# registry, fla's switch of its whole backend dispatch).
ROUTE_SWITCHES = (*call_switches(), "KDA_DHU_NO_AUTOREGISTER", "FLA_DISABLE_BACKEND_DISPATCH")


def start_child(code: str, env: dict | None = None):
    """``python -c code`` in a fresh interpreter that imports this checkout's kda_dhu,
    with none of ROUTE_SWITCHES set unless ``env`` sets them; (Popen, start time)."""
    import os
    import subprocess
    import sys
    import time

    import kda_dhu

    root = os.path.dirname(os.path.dirname(os.path.abspath(kda_dhu.__file__)))
    full = {k: v for k, v in os.environ.items() if k not in ROUTE_SWITCHES}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    full["PYTHONWARNINGS"] = "ignore"
    full.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        cwd=root,
        start_new_session=True,
    )
    return proc, time.monotonic()


def finish_child(started, limit_s: float, what: str) -> str:
    """Waits for a ``start_child`` process until ``limit_s`` after its start; fails (after
    killing it) past that, or on a non-zero exit, or without a "DONE" line. Its stdout."""
    import subprocess
    import time

    import pytest

    proc, t0 = started
    try:
        out, err = proc.communicate(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"{what}: did not return within {limit_s:g} s (a lock held across an import?)\n{err[-2000:]}"
        )
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{out[-1000:]}\n{err[-3000:]}"
    assert "DONE" in out, f"{what}: no DONE line\n{out[-1000:]}\n{err[-2000:]}"
    return out
