"""What kda-dhu takes from fla: its own stage-4 and forward-scan functions (the
fallbacks) and its cached chunk count of a packed batch.

Imports nothing else of kda-dhu's, so that the dispatcher, the patch and the backend can
all ask it (the patch hands it fla's original function before rebinding the name).

No lock: importing fla's stage-4 module runs kda-dhu's registration hook
(``_autoregister``), which asks :func:`fla_function` again on the same thread, so a lock
held across that import would wait on itself (it did: the first fallback of a process
that had not imported fla yet never returned). The import system serializes the import
itself; two threads that both find ``_fla_fn`` unset compute the same function, and
either may store it.
"""

from __future__ import annotations

import importlib
import inspect

from . import _fla_compat

SOURCE = "fla.ops.common.chunk_delta_h"
NAME = "chunk_gated_delta_rule_bwd_dhu"
FWD_H = "chunk_gated_delta_rule_fwd_h"  # the forward scan, in the same module

_fla_fn = None
_fla_fwd_h_fn = None
# fla's functions as kda_dhu.patch found them, by name, before it rebound the names
_originals: dict = {}


def remember_original(fn, name: str = NAME) -> None:
    """Called by ``kda_dhu.patch`` before it rebinds fla's ``name`` in SOURCE: fla's
    function as it was."""
    if name not in _originals and not getattr(fn, "_kda_dhu_entry", False):
        _originals[name] = fn


def _found(mod, name: str):
    """fla's ``name`` in SOURCE, or the original kda_dhu.patch replaced there."""
    found = mod.__dict__.get(name)
    if getattr(found, "_kda_dhu_entry", False):
        if name not in _originals:
            raise RuntimeError(f"{SOURCE}.{name} holds kda_dhu's function, not put there by kda_dhu.patch")
        found = _originals[name]
    return found


def _import_source(what: str):
    try:
        return importlib.import_module(SOURCE)  # may re-enter (see the module's docstring)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"kda_dhu falls back to flash-linear-attention for {what} its kernel does "
            "not cover, and fla is not importable: pip install fla-core"
        ) from err


def fla_function():
    """fla's own ``chunk_gated_delta_rule_bwd_dhu``, undecorated.

    The function under fla's backend-dispatch wrapper, so that a fallback never routes
    back into kda-dhu's fla backend or patch; on fla-core 0.5, a wrapper that leaves out
    the arguments its function does not take yet (``_fla_compat.adapt``). Raises
    ImportError if fla is not installed, FlaVersionError (an ImportError) if its stage 4
    is too old for the fallback's call,
    RuntimeError if fla's module holds kda-dhu's dispatcher and kda_dhu.patch did not put
    it there.
    """
    global _fla_fn
    fn = _fla_fn
    if fn is not None:
        return fn
    found = _found(_import_source("calls"), NAME)
    # an fla too old for the fallback's call raises here (FlaVersionError)
    fn = _fla_compat.adapt(inspect.unwrap(found))
    if _fla_fn is None:
        _fla_fn = fn
    return _fla_fn


def fla_fwd_h_function():
    """fla's own ``chunk_gated_delta_rule_fwd_h`` (the forward scan), undecorated: under
    fla's backend-dispatch wrapper, so that a call handed to fla never routes back into
    kda-dhu's backend or patch. Raises ImportError if fla is not installed, RuntimeError as
    :func:`fla_function`."""
    global _fla_fwd_h_fn
    fn = _fla_fwd_h_fn
    if fn is not None:
        return fn
    fn = inspect.unwrap(_found(_import_source("forward-scan calls"), FWD_H))
    if _fla_fwd_h_fn is None:
        _fla_fwd_h_fn = fn
    return _fla_fwd_h_fn


def chunk_count(cu_seqlens, T: int) -> int:
    """NT, the chunks of a packed batch, for a call without chunk_indices: through fla's
    tensor-cached ``prepare_chunk_indices`` (one host read per distinct cu_seqlens tensor,
    shared with fla's own forward and backward), else by reading cu_seqlens here. Bad
    values raise ValueError naming cu_seqlens (the Rust checker's message)."""
    from ._core import BT  # tokens per chunk of every kernel (cuda/dhu_layout.h)

    try:
        from fla.ops.utils.index import prepare_chunk_indices
    except ImportError:
        prepare_chunk_indices = None
    if prepare_chunk_indices is not None:
        try:
            return int(prepare_chunk_indices(cu_seqlens, BT).shape[0])
        except Exception:  # noqa: BLE001 - fla's helper on bad values: name them below
            pass
    from . import _core

    return _core.check_tables(cu_seqlens.tolist(), T)[-1]
