"""Drop-in monkeypatch of fla's stage 4 and forward scan for any fla version.

fla's ops import the function by name
(``from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu`` in
``fla.ops.kda.chunk_bwd``, ``fla.ops.gated_delta_rule.chunk``, ``fla.ops.delta_rule.chunk``,
...), so replacing the attribute of ``fla.ops.common.chunk_delta_h`` alone would not
reach them.  :func:`patch` rebinds the name in *every* imported ``fla.*`` module whose
global ``chunk_gated_delta_rule_bwd_dhu`` is fla's function (the dispatch-decorated one
of fla >= 0.6 or the undecorated original), including ``fla.ops.common.chunk_delta_h``
itself so that modules imported later pick up the replacement too.  It first imports
the fla modules known to use the function, so they bind fla's original before the
patch and are rebound with the rest.

The forward scan, ``chunk_gated_delta_rule_fwd_h`` (same module; imported by name in
``fla.ops.kda.chunk_fwd``, ``chunk_bwd`` and the same family), is rebound the same way to
``kda_dhu.chunk_gated_delta_rule_fwd_h`` where fla's function has the parameters that
function takes, in its order (fla-core 0.6's; an older fla keeps its own): that function
runs the kernel or fla's own as ``KDA_DHU_FWD_H`` says, per call.

Every replacement is recorded as (module, name, previous object, new object); :func:`unpatch`
puts back exactly the previous objects (``is``-identical), and only where the module
still holds our replacement (a name someone else rebound since is left alone).

On fla >= 0.6 prefer :func:`kda_dhu.fla_backend.register_backend`, which plugs into
fla's own backend registry without touching module globals.

Note: the dispatcher's fallback must call fla's function through a reference captured
before patching (``kda_dhu._fla.fla_function()``, the undecorated original, which this
module hands fla's function before rebinding the name); looking the name up in
``fla.ops.common.chunk_delta_h`` at call time would find the replacement and recurse.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from . import _fla

__all__ = ["patch", "unpatch", "patched", "is_patched", "patched_modules", "original_function"]

logger = logging.getLogger(__name__)

NAME = "chunk_gated_delta_rule_bwd_dhu"
FWD_H = _fla.FWD_H  # chunk_gated_delta_rule_fwd_h
SOURCE = "fla.ops.common.chunk_delta_h"

# fla modules that import the function by name (fla 0.5 - 0.6 layouts); a missing one
# is skipped.  Any other already-imported fla module holding it is patched as well.
_KNOWN_USERS = (
    "fla.ops.common.chunk_delta_h",
    "fla.ops.kda",
    "fla.ops.kda.chunk",
    "fla.ops.kda.chunk_fwd",
    "fla.ops.kda.chunk_bwd",
    "fla.ops.gated_delta_rule",
    "fla.ops.gated_delta_rule.chunk",
    "fla.ops.delta_rule",
    "fla.ops.delta_rule.chunk",
    "fla.ops.comba",
    "fla.ops.comba.chunk",
    "fla.ops.gdn2",
    "fla.ops.gdn2.chunk_fwd",
    "fla.ops.gdn2.chunk_bwd",
    "fla.ops.precond_kda",
    "fla.ops.precond_kda.chunk",
    "fla.ops.precond_gated_delta_rule",
    "fla.ops.precond_gated_delta_rule.chunk",
    "fla.ops.gated_delta_product",
    "fla.ops.gated_delta_product.chunk",
    "fla.ops.generalized_delta_rule",
)

_lock = threading.Lock()  # guards _records; never held across an import
# (module, name, previous object, replacement), in the order they were made
_records: list[tuple[ModuleType, str, Any, Any]] = []


def _dispatch_module() -> ModuleType:
    return importlib.import_module("kda_dhu._dispatch")


def _wraps_target(obj: Any, target: Any, max_depth: int = 32) -> bool:
    """True if ``obj`` is ``target`` or reaches it through a ``__wrapped__`` chain."""
    seen = 0
    while obj is not None and seen <= max_depth:
        if obj is target:
            return True
        try:
            obj = getattr(obj, "__wrapped__", None)
        except Exception:  # exotic objects: not fla's function
            return False
        seen += 1
    return False


def _import_known_users() -> None:
    for name in _KNOWN_USERS:
        try:
            importlib.import_module(name)
        except Exception as error:  # missing in this fla version, or unusable here
            logger.debug("kda_dhu.patch: skipping %s (%s: %s)", name, type(error).__name__, error)


def _fla_modules() -> list[ModuleType]:
    return [
        m
        for n, m in list(sys.modules.items())
        if (n == "fla" or n.startswith("fla.")) and isinstance(m, ModuleType)
    ]


def _forward_target():
    """(fla's original forward scan, kda-dhu's) where fla's has the parameters kda-dhu's
    takes, in its order; else None (an fla whose callers could pass what ours does not
    take: they keep fla's)."""
    try:
        original = inspect.unwrap(_fla.fla_fwd_h_function())
        params = list(inspect.signature(original).parameters)
    except (ImportError, AttributeError, TypeError, ValueError, RuntimeError) as error:
        logger.debug("kda_dhu.patch: %s left to fla (%s: %s)", FWD_H, type(error).__name__, error)
        return None
    from ._core import fwd_h_arguments

    if params != [name for name, _ in fwd_h_arguments()]:
        logger.debug("kda_dhu.patch: %s left to fla (its parameters %s)", FWD_H, params)
        return None
    return original, importlib.import_module("kda_dhu._forward").chunk_gated_delta_rule_fwd_h


def _prepare() -> dict:
    """{name: (fla's original function, kda-dhu's)} (stage 4, and the forward scan where
    fla's takes kda-dhu's parameters), with every fla module that uses them imported.
    Imports only, so called holding no lock: fla's stage-4 import runs kda-dhu's
    registration hook, and a lock held across it could wait on itself."""
    dispatch = _dispatch_module()
    # Raises ImportError without fla, FlaVersionError (an ImportError) for an fla too
    # old for kda-dhu's fallback: before anything is rebound.
    targets = {NAME: (inspect.unwrap(dispatch.fla_function()), dispatch.chunk_gated_delta_rule_bwd_dhu)}
    forward = _forward_target()
    if forward is not None:
        targets[FWD_H] = forward
    _import_known_users()
    return targets


def _rebind(targets: dict) -> int:
    """Rebinds each name in every imported fla module holding fla's function; under _lock."""
    count = 0
    for module in _fla_modules():
        for name, (original, ours) in targets.items():
            current = module.__dict__.get(name)
            if current is None or current is ours or not _wraps_target(current, original):
                continue
            if module.__name__ == SOURCE:
                _fla.remember_original(current, name)
            setattr(module, name, ours)
            _records.append((module, name, current, ours))
            count += 1
            logger.debug("kda_dhu.patch: %s.%s -> kda_dhu", module.__name__, name)
    if not _records:
        logger.warning("kda_dhu.patch: no fla module holds %s; nothing patched", NAME)
    return count


def patch() -> int:
    """Route fla's stage 4 to ``kda_dhu.chunk_gated_delta_rule_bwd_dhu`` and its forward
    scan to ``kda_dhu.chunk_gated_delta_rule_fwd_h`` (where fla's takes that function's
    parameters; KDA_DHU_FWD_H decides per call whether it runs the kernel).

    Imports fla's modules that use the functions, then rebinds the names in every
    imported ``fla.*`` module that holds fla's function.  Idempotent: a second call
    only picks up fla modules imported (with fla's function) since the first. Safe as
    the first thing a process does (fla imported or not) and from several threads.

    Returns the number of module globals rebound by this call.
    Raises ImportError (from ``kda_dhu._dispatch.fla_function``) if fla is missing, and
    its subclass ``kda_dhu._fla_compat.FlaVersionError`` if fla's stage 4 lacks
    parameters the fallback passes (an fla older than 0.5.2), naming them.
    """
    targets = _prepare()
    with _lock:
        return _rebind(targets)


def unpatch() -> int:
    """Undo :func:`patch`: every rebound name gets back the identical previous object.

    A name that no longer holds our replacement (rebound by someone else since) is
    left as it is.  Without a prior patch this is a no-op.  Returns the number of
    module globals restored.
    """
    with _lock:
        count = 0
        for module, name, previous, replacement in reversed(_records):
            if module.__dict__.get(name) is replacement:
                setattr(module, name, previous)
                count += 1
            else:
                logger.warning(
                    "kda_dhu.unpatch: %s.%s was rebound by someone else; left as is", module.__name__, name
                )
        _records.clear()
        return count


def is_patched() -> bool:
    """True between a :func:`patch` that rebound at least one name and :func:`unpatch`."""
    with _lock:
        return bool(_records)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Context manager: :func:`patch` on entry; on exit (exceptions included) undo it,
    unless fla was already patched on entry (then the outer patch stays)."""
    targets = _prepare()
    with _lock:
        was_patched = bool(_records)
        _rebind(targets)
    try:
        yield
    finally:
        if not was_patched:
            unpatch()


def patched_modules(name: str = NAME) -> list[str]:
    """Names of the fla modules whose ``name`` (stage 4's by default, or
    ``"chunk_gated_delta_rule_fwd_h"``) is currently rebound (for diagnostics and tests)."""
    with _lock:
        return [module.__name__ for module, n, _, _ in _records if n == name]


def original_function() -> Any:
    """The object ``fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_dhu`` held
    before :func:`patch` (fla's decorated function on fla >= 0.6), or what it holds now
    when not patched.  Takes no lock (it may import fla), reading a snapshot of the
    records.

    Raises ImportError without fla, RuntimeError if the module holds kda_dhu's
    dispatcher but this module did not put it there.
    """
    for module, name, previous, _ in list(_records):
        if module.__name__ == SOURCE and name == NAME:
            return previous
    module = importlib.import_module(SOURCE)
    current = module.__dict__.get(NAME)
    if getattr(current, "_kda_dhu_entry", False):
        raise RuntimeError(f"{SOURCE}.{NAME} holds kda_dhu's dispatcher, not put there by kda_dhu.patch")
    return current
