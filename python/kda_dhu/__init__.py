"""kda-dhu: fla's state scans of the chunked gated delta rule as CUDA kernels: stage 4 of
the backward (``chunk_gated_delta_rule_bwd_dhu``) for Hopper (sm_90a: TMA + wgmma) and
Blackwell (sm_100a: tcgen05 + TMEM, behind a self-check), and the forward scan
(``chunk_gated_delta_rule_fwd_h``) for Hopper.

Public API:
    chunk_gated_delta_rule_bwd_dhu(...)  fla's full signature; kernel where it covers the call
    chunk_gated_delta_rule_fwd_h(...)    the forward scan, fla's full signature (KDA_DHU_FWD_H)
    kda_dhu_b2a(...)                     positional KDA form (qg, kg, w, g2, ...), narrow rule
    chunk_gated_delta_rule_bwd_dhu_op()  stage 4 through a torch custom op (torch.compile)
    chunk_gated_delta_rule_fwd_h_op()    the forward scan through its custom op
    plan_call(...), plan_b2a(...)        the planner's verdict (kernel or fallback, and why)
    patch(), unpatch(), patched()        reversible monkeypatch of fla's modules (both scans)
    register_backend()                   kda-dhu as a backend in fla's registry (fla >= 0.6)
    reference                            float64 implementation of the recurrence (SPEC.md)
    testing                              random inputs and checks for tests
    cuda_status()                        (driver usable?, message)
    check_errors()                       raise a bad packed batch found on the device

``import kda_dhu`` imports neither torch nor fla: the names above that need torch load
their module on first access (once; afterwards they are plain module attributes), and
the fla backend is registered when fla's stage-4 module is imported, before fla's first
stage-4 call, whichever of the two packages is imported first (``_autoregister``).
``torch.ops.kda_dhu.chunk_gated_delta_rule_bwd_dhu`` and ``..._fwd_h`` exist once the custom
ops' module is imported: through ``chunk_gated_delta_rule_bwd_dhu_op`` /
``chunk_gated_delta_rule_fwd_h_op`` or ``import kda_dhu.ops``.

Environment switches: one table, in the core that reads them (src/env.rs), listed with
their current values by ``kda_dhu._core.switches()`` and ``python -m kda_dhu --doctor``.
"""

from __future__ import annotations

import importlib as _importlib

from . import _autoregister
from .patch import is_patched, patch, patched, unpatch

__version__ = "0.1.0"

# Public names that need torch, and the module of each: loaded on first access.
_LAZY = {
    "chunk_gated_delta_rule_bwd_dhu": "_dispatch",
    "fla_function": "_dispatch",
    "kda_dhu_b2a": "_dispatch",
    "plan_b2a": "_dispatch",
    "plan_call": "_dispatch",
    "check_errors": "_dispatch",
    "register_backend": "fla_backend",
    "unregister_backend": "fla_backend",
    "chunk_gated_delta_rule_bwd_dhu_op": "ops",
    "chunk_gated_delta_rule_fwd_h": "_forward",
    "chunk_gated_delta_rule_fwd_h_op": "ops",
}
# Submodules reachable as attributes without an import of their own.
_SUBMODULES = ("reference", "testing", "bench", "ops", "fla_backend", "doctor", "_dispatch")


def __getattr__(name: str):
    """The lazy names and submodules above: imported once, then kept in the module's
    namespace (later lookups never come here)."""
    if name in _LAZY:
        value = getattr(_importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def cuda_status():
    """(usable, message): whether a CUDA driver and device are there for the kernel."""
    from . import _dispatch

    if _dispatch._core is None:
        return False, f"kda_dhu's compiled extension is not built: {_dispatch._core_error}"
    return _dispatch._core.cuda_status()


_autoregister.install()

__all__ = [
    "chunk_gated_delta_rule_bwd_dhu",
    "chunk_gated_delta_rule_fwd_h",
    "kda_dhu_b2a",
    "chunk_gated_delta_rule_bwd_dhu_op",
    "chunk_gated_delta_rule_fwd_h_op",
    "plan_call",
    "plan_b2a",
    "fla_function",
    "patch",
    "unpatch",
    "patched",
    "is_patched",
    "register_backend",
    "unregister_backend",
    "cuda_status",
    "check_errors",
    "reference",
    "testing",
]
