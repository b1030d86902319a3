"""Every first act after ``import kda_dhu`` returns, whichever of kda_dhu and fla was
imported first (CPU): ``patch()``, ``fla_function()``, ``register_backend()``,
``chunk_count()``, a CPU-tensor call and ``plan_call`` on CPU tensors, and two threads
making the first fallback, patch and registration at once.

Importing fla's stage-4 module runs kda-dhu's registration hook, which asks
``fla_function()`` and takes the backend's lock: a lock held across that import (by the
caller of the import, on the same thread or another) waits on itself, and the process
never returns. Each case therefore runs in a fresh interpreter with a time limit, so a
regression fails here instead of hanging the suite. The interpreters are started
together (one fixture for the module) and each test waits for its own.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from helpers import finish_child, start_child

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla is not installed")

# Generous for a loaded CI machine (importing fla takes 5-15 s on two cores); a hang is forever.
LIMIT_S = 400

# What each case does right after its imports; prints "DONE <what>" when it returned.
_ACTS = {
    "patch": "n = kda_dhu.patch(); assert n > 0 and kda_dhu.is_patched(), n; kda_dhu.unpatch(); print('DONE', n)",
    "fla_function": "fn = kda_dhu.fla_function(); assert callable(fn); print('DONE', fn.__name__)",
    "register_backend": "ok = kda_dhu.register_backend(); assert ok is True; print('DONE', ok)",
    "chunk_count": (
        "import torch; from kda_dhu import _fla\n"
        "nt = _fla.chunk_count(torch.tensor([0, 5, 70, 200]), 200); assert nt == 1 + 2 + 3, nt; print('DONE', nt)"
    ),
    "cpu_call": (
        "from kda_dhu.testing import make_inputs\n"
        "a = make_inputs(1, 70, 1, 1, 16, 16, gate='gk')\n"
        "dh, dh0, dv2 = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a); assert dh.shape[1] == 2; print('DONE', dh.shape)"
    ),
    "plan_call_cpu": (
        "from kda_dhu.testing import make_inputs\n"
        "a = make_inputs(1, 70, 1, 1, 16, 16, gate='gk')\n"
        "ok, why = kda_dhu.plan_call(**a); assert ok is False and why.startswith('cpu: '), why; print('DONE', why)"
    ),
}
_ORDERS = {
    "kda_dhu first": "import sys\nimport kda_dhu\nassert 'fla' not in sys.modules\n",
    "fla first": "import fla.ops\nimport kda_dhu\n",
}

# Two threads at once, each the first of the process to want fla's function; then two
# threads patching and registering at once.
_THREADS = """
import sys, threading, inspect
import kda_dhu
from kda_dhu import _fla
assert "fla" not in sys.modules
start = threading.Barrier(2)
got, errors = [], []
def first_fallback():
    try:
        start.wait()
        got.append(_fla.fla_function())
    except BaseException as e:
        errors.append(repr(e))
threads = [threading.Thread(target=first_fallback) for _ in range(2)]
[t.start() for t in threads]
[t.join(200) for t in threads]
assert not any(t.is_alive() for t in threads), "a first fallback never returned"
assert not errors, errors
import fla.ops.common.chunk_delta_h as mod
want = inspect.unwrap(mod.chunk_gated_delta_rule_bwd_dhu)
assert len(got) == 2 and all(inspect.unwrap(f) is want for f in got), got
both = threading.Barrier(2)
def act(fn):
    try:
        both.wait()
        fn()
    except BaseException as e:
        errors.append(repr(e))
threads = [threading.Thread(target=act, args=(f,)) for f in (kda_dhu.patch, kda_dhu.register_backend)]
[t.start() for t in threads]
[t.join(200) for t in threads]
assert not any(t.is_alive() for t in threads), "patch and register_backend at once never returned"
assert not errors, errors
assert kda_dhu.is_patched() and kda_dhu.fla_backend.is_registered()
kda_dhu.unpatch()
print("DONE threads")
"""


def _cases() -> dict:
    cases = {
        f"{act} ({order})": _ORDERS[order] + textwrap.dedent(_ACTS[act]) for act in _ACTS for order in _ORDERS
    }
    cases["two threads, first fallback / patch / register at once"] = _THREADS
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def started():
    """Every case's interpreter, started at once: {name: (Popen, start time)}."""
    procs = {name: start_child(code) for name, code in CASES.items()}
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", list(CASES))
def test_first_act_returns(started, name):
    finish_child(started[name], LIMIT_S, name)
