"""kda_dhu as a backend in fla's registry (fla >= 0.6).

fla 0.6 decorates ``chunk_gated_delta_rule_bwd_dhu`` with ``@dispatch('common')``.  The
wrapper walks the backends registered for the operation ``'common'`` in priority order
(lower first; fla's own are 5, Ascend's 0); for each available and enabled one it calls
``backend.verify(name, *args, **kwargs)``, which calls ``<name>_verifier`` with the
caller's arguments exactly as passed (positional or keyword) and turns an exception into
a rejection.  On (False, reason) fla logs the reason once and tries the next backend; on
(True, _) it calls ``getattr(backend, name)(*args, **kwargs)``; with no taker it runs its
own Triton kernel.  Note the 'common' registry is shared by every common op
(chunk_fwd_o, chunk_bwd_dqkwg, ...): a backend without ``<op>_verifier`` is "accepted"
for those, then skipped because it has no ``<op>`` attribute; this backend defines
stage 4's pair and the forward scan's (``chunk_gated_delta_rule_fwd_h``), whose verifier
declines while ``KDA_DHU_FWD_H=off`` (on by default: its records are in benches/results/).

The verifier binds the caller's arguments (Python's own binding where fla's parameters
are 0.6's, checked once at registration; fla's signature through ``inspect`` otherwise)
and asks ``kda_dhu._dispatch.verify``: the switches read once, then Rust reads,
validates and decides the call once. An accepted call's handoff (the decision, or the
switches' reading) is kept (per thread) for the implementation, which fla calls next with
the same arguments: it carries the decision out (the kernel: allocate and launch in one
crossing), nothing decided twice. A
call whose inputs must be copied is accepted too (fla's function would read them as if
contiguous); the implementation copies and runs the kernel or fla's *undecorated*
function, so nothing re-enters fla's dispatch wrapper.

Switch: ``FLA_KDA_DHU=0`` disables the backend (default enabled), as fla's backends do.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import operator
import sys
import threading

from . import _fla_compat

__all__ = ["register_backend", "unregister_backend", "is_registered", "BACKEND_TYPE", "ENV_VAR", "PRIORITY"]

logger = logging.getLogger(__name__)

BACKEND_TYPE = "kda_dhu"
ENV_VAR = "FLA_KDA_DHU"
PRIORITY = 1  # fla's default is 5; lower runs first
OPERATION = "common"
NAME = "chunk_gated_delta_rule_bwd_dhu"

_lock = threading.Lock()  # never held across an import (see register_backend)
_backend_cls: type | None = None


def _dispatch_module():
    """kda_dhu._dispatch (it imports torch: loaded on first use). The verifier and the
    implementation ask on every call: a dict lookup once it is loaded."""
    return sys.modules.get("kda_dhu._dispatch") or importlib.import_module("kda_dhu._dispatch")


# fla 0.6's parameters of chunk_gated_delta_rule_bwd_dhu, in order. When fla's own are
# these (checked once, at registration), the verifier and the implementation bind the
# caller's arguments with Python's own call machinery (no inspect on the hot path).
_FLA_PARAMS = (*_fla_compat.REQUIRED, *_fla_compat.NEWER)


def _bound(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False, cu_seqlens=None,
           chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False, **newer):  # fmt: skip
    """The caller's arguments by fla 0.6's signature, plus any of a newer fla's (``newer``)."""
    return (q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_indices, chunk_offsets,
            use_graph), newer  # fmt: skip


@functools.lru_cache(maxsize=8)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def _bind_slow(args: tuple, kwargs: dict):
    """For an fla whose parameters differ from 0.6's: bind with its signature, then by name."""
    fla_fn = _dispatch_module().fla_function()
    bound = _signature(fla_fn).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    defaults = {n: p.default for n, p in _signature(fla_fn).parameters.items()}
    ours = {n: named.pop(n) for n in _FLA_PARAMS if n in named}
    return _bound(**ours, **named), defaults


_fast_binding: bool | None = None  # fla's parameters are 0.6's (decided at registration)


def _bind(args: tuple, kwargs: dict):
    """((fla 0.6's 16 arguments), reason or None): reason says why an argument of a newer
    fla rules the call out (only tolerated at its default)."""
    if _fast_binding:
        values, newer = _bound(*args, **kwargs)
        defaults = None
    else:
        (values, newer), defaults = _bind_slow(args, kwargs)
    for name, value in newer.items():
        default = defaults.get(name) if defaults else None
        if not (value is None or value is False or value is default):
            return values, f"argument {name!r} of this fla version is not supported by kda_dhu"
    return values, None


class _Pending(threading.local):
    """The verifier's prepared call, for the implementation fla calls next with the same
    arguments (per thread: fla calls the two back to back)."""

    values: tuple | None = None
    call = None


_pending = _Pending()


def _same(a: tuple, b: tuple) -> bool:
    """The implementation's arguments are the verifier's objects: fla passes the same
    arguments to both (and the defaults are the same objects), so identity settles it."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _forward_module():
    """kda_dhu._forward (imports torch: loaded on first use)."""
    return sys.modules.get("kda_dhu._forward") or importlib.import_module("kda_dhu._forward")


FWD_H_SWITCH = "KDA_DHU_FWD_H"


def _fwd_h_verdict(args: tuple, kwargs: dict) -> tuple[bool, str | None]:
    """The forward scan's verdict: accepted for k on a CUDA device while the forward scan is
    on (``_core.fwd_h_on()``: KDA_DHU_FWD_H, else its default; KDA_DHU_FORCE=kernel wins,
    =fla declines), the implementation deciding kernel or fla's function per call as the
    direct entry point does; else declined with the reason, and fla runs its own."""
    from . import _core

    force = _core.force()
    if force == "fla":
        return False, "KDA_DHU_FORCE=fla (fla's own forward scan)"
    if force is None and not _core.fwd_h_on():
        return False, f"{FWD_H_SWITCH} is off (fla's own forward scan)"
    k = args[0] if args else kwargs.get("k")
    if not getattr(k, "is_cuda", False):
        return False, "k is not a CUDA tensor"
    return True, None


def _make_backend_class(base: type) -> type:
    class KdaDhuBackend(base):
        """fla backend running stage 4 on kda_dhu's kernel where its planner accepts."""

        backend_type = BACKEND_TYPE
        package_name = None
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        def chunk_gated_delta_rule_bwd_dhu_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            _pending.values = _pending.call = None
            try:
                values, reason = _bind(args, kwargs)
                if reason is not None:
                    return False, reason
                accepted, reason, call = _dispatch_module().verify(*values)
                if accepted:
                    _pending.values, _pending.call = values, call
                return bool(accepted), reason
            except Exception as error:  # fla also catches, but never raise out of a verifier
                return False, f"kda_dhu verifier error: {type(error).__name__}: {error}"

        def chunk_gated_delta_rule_fwd_h_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            try:
                return _fwd_h_verdict(args, kwargs)
            except Exception as error:  # never raise out of a verifier
                return False, f"kda_dhu verifier error: {type(error).__name__}: {error}"

        def chunk_gated_delta_rule_fwd_h(self, *args, **kwargs):
            # the kernel where it covers the call, else fla's undecorated function
            return _forward_module().chunk_gated_delta_rule_fwd_h(*args, **kwargs)

        def chunk_gated_delta_rule_bwd_dhu(self, *args, **kwargs):
            values, reason = _bind(args, kwargs)
            if reason is not None:  # the verifier rejected this already
                raise TypeError(reason)
            handoff, pending = _pending.call, _pending.values
            _pending.values = _pending.call = None
            dispatch = _dispatch_module()
            if handoff is None or pending is None or not _same(values, pending):
                return dispatch.chunk_gated_delta_rule_bwd_dhu(*values)  # no verdict of ours: decide anew
            return dispatch.run_decided(values, handoff)  # the verifier's decision, carried out

    KdaDhuBackend.__module__ = __name__
    KdaDhuBackend.__qualname__ = "KdaDhuBackend"
    return KdaDhuBackend


def _registry():
    """fla's BackendRegistry for 'common', or None on fla without fla.backends."""
    try:
        backends = importlib.import_module("fla.backends")
    except ImportError:
        return None, None
    if not (hasattr(backends, "register") and hasattr(backends, "BaseBackend")):
        return None, None
    # make sure the operation's registry and fla's own backends exist first
    try:
        importlib.import_module("fla.ops.common.chunk_delta_h")
    except ImportError:
        return None, None
    getter = getattr(backends, "_get_operation_registry", None)
    if getter is not None:
        registry = getter(OPERATION)
    else:
        registry = getattr(backends, "_operation_registries", {}).get(OPERATION)
    return backends, registry


def register_backend() -> bool:
    """Register kda_dhu in fla's 'common' backend registry.

    Returns True when registered (or already registered), False on fla without a backend
    registry (fla < 0.6) or without ``fla.ops.common.chunk_delta_h``, and when fla's
    dispatch is switched off (``FLA_DISABLE_BACKEND_DISPATCH=1``: fla then calls its
    functions directly and no backend is ever consulted; use kda_dhu.patch instead).
    Idempotent and thread-safe, and safe as the first thing a process does with fla (it
    imports fla's stage-4 module, whose import hook calls this function again). Raises
    ``kda_dhu._fla_compat.FlaVersionError`` (an ImportError) if fla's stage 4 lacks
    parameters kda-dhu's fallback passes.
    """
    global _backend_cls, _fast_binding
    # Every import first, holding no lock: importing fla's stage-4 module runs the
    # registration hook (_autoregister), which calls this function again, on this thread
    # or on another that would then wait for a lock held across the import.
    backends, registry = _registry()
    if backends is None:
        return False
    if getattr(backends, "_DISPATCH_DISABLED", False):
        logger.info("kda_dhu: fla's backend dispatch is disabled; not registering")
        return False
    # FlaVersionError here for an fla whose stage 4 is too old for the fallback
    params = tuple(_signature(_dispatch_module().fla_function()).parameters)
    with _lock:  # nothing imported below: the class and one registry entry
        if _backend_cls is None or not issubclass(_backend_cls, backends.BaseBackend):
            _backend_cls = _make_backend_class(backends.BaseBackend)
        _fast_binding = params == _FLA_PARAMS
        if registry is not None and isinstance(
            getattr(registry, "_backends", {}).get(BACKEND_TYPE), _backend_cls
        ):
            return True
        backends.register(OPERATION)(_backend_cls)
        logger.debug("kda_dhu: registered fla backend %r for %r", BACKEND_TYPE, OPERATION)
        return True


def _registered_instance(registry):
    """The registry's kda_dhu backend object, or None (reads; imports nothing)."""
    if registry is None or _backend_cls is None:
        return None
    instance = getattr(registry, "_backends", {}).get(BACKEND_TYPE)
    return instance if isinstance(instance, _backend_cls) else None


def is_registered() -> bool:
    """True if fla's 'common' registry holds this module's backend."""
    registry = _registry()[1]  # imports fla: before the lock
    with _lock:
        return _registered_instance(registry) is not None


def unregister_backend() -> bool:
    """Remove the backend from fla's registry (and fla's once-only log keys for it).

    Returns True if something was removed.  Reaches into fla's private
    ``BackendRegistry._backends``; meant for tests.
    """
    registry = _registry()[1]  # imports fla: before the lock
    with _lock:
        if _registered_instance(registry) is None:
            return False
        registry._backends.pop(BACKEND_TYPE, None)
        logged = getattr(registry, "_logged", None)
        if isinstance(logged, set):
            # fla's keys: "<operation>:<function>:<backend_type>[:fail]"
            for key in [k for k in logged if k.split(":")[2:3] == [BACKEND_TYPE]]:
                logged.discard(key)
        return True


def backend_instance():
    """The registered backend object, or None (for tests and diagnostics)."""
    registry = _registry()[1]  # imports fla: before the lock
    with _lock:
        return _registered_instance(registry)
