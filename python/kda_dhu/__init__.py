"""kda-dhu: fla's stage 4 (``chunk_gated_delta_rule_bwd_dhu``) as a Hopper TMA + wgmma kernel.

Public API:
    chunk_gated_delta_rule_bwd_dhu(...)  fla's full signature; kernel where it covers the call
    kda_dhu_b2a(...)                     the seed's dispatcher, its exact rule
    chunk_gated_delta_rule_bwd_dhu_op()  the same through a torch custom op (torch.compile)
    plan_call(...), plan_b2a(...)        the planner's verdict (kernel or fallback, and why)
    patch(), unpatch(), patched()        reversible monkeypatch of fla's modules
    register_backend()                   kda-dhu as a backend in fla's registry (fla >= 0.6)
    reference                            float64 implementation of the recurrence (SPEC.md)
    cuda_status()                        (driver usable?, message)

Environment:
    KDA_DHU_FORCE=kernel|fla   force a path, for debugging
    KDA_DHU_SM100=check|wait|on|off  the Blackwell kernel's check (see _selfcheck)
    KDA_DHU_CACHE_DIR          where its verdicts are kept (else $XDG_CACHE_HOME/kda_dhu, ~/.cache/kda_dhu)
    FLA_KDA_DHU=0              switch the fla backend off, as fla's own backends are
    KDA_DHU_NO_AUTOREGISTER=1  do not register with fla on import
"""

from __future__ import annotations

import os as _os

from ._dispatch import (
    chunk_gated_delta_rule_bwd_dhu,
    fla_function,
    kda_dhu_b2a,
    plan_b2a,
    plan_call,
)
from .fla_backend import register_backend, unregister_backend
from .ops import chunk_gated_delta_rule_bwd_dhu_op
from .patch import is_patched, patch, patched, unpatch

__version__ = "0.1.0"


def cuda_status():
    """(usable, message): whether a CUDA driver and device are there for the kernel."""
    from . import _dispatch

    if _dispatch._core is None:
        return False, f"kda_dhu's compiled extension is not built: {_dispatch._core_error}"
    return _dispatch._core.cuda_status()


if _os.environ.get("KDA_DHU_NO_AUTOREGISTER", "0") == "0":
    try:
        import importlib.util as _ilu

        if _ilu.find_spec("fla") is not None:
            register_backend()
    except Exception:  # noqa: BLE001 - registration is a convenience; never break the import
        pass

__all__ = [
    "chunk_gated_delta_rule_bwd_dhu",
    "kda_dhu_b2a",
    "chunk_gated_delta_rule_bwd_dhu_op",
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
]
