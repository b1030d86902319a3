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
only stage 4's pair.

The verifier binds the arguments with fla's own signature and asks
``kda_dhu._dispatch.plan_call``; the implementation calls
``kda_dhu._dispatch.chunk_gated_delta_rule_bwd_dhu``, whose fallback is fla's
*undecorated* function, so nothing re-enters fla's dispatch wrapper.

Switch: ``FLA_KDA_DHU=0`` disables the backend (default enabled), as fla's backends do.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from typing import Any

__all__ = ["register_backend", "unregister_backend", "is_registered", "BACKEND_TYPE", "ENV_VAR", "PRIORITY"]

logger = logging.getLogger(__name__)

BACKEND_TYPE = "kda_dhu"
ENV_VAR = "FLA_KDA_DHU"
PRIORITY = 1  # fla's default is 5; lower runs first
OPERATION = "common"
NAME = "chunk_gated_delta_rule_bwd_dhu"

_lock = threading.RLock()
_backend_cls: type | None = None


def _dispatch_module():
    return importlib.import_module("kda_dhu._dispatch")


@functools.lru_cache(maxsize=8)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def _bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Name the caller's arguments with fla's signature (defaults applied)."""
    bound = _signature(_dispatch_module().fla_function()).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _ours_kwargs(arguments: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """Keep the arguments our dispatcher knows.  An argument of a newer fla that we do
    not know is only tolerated at its default (None / False / fla's default)."""
    dispatch = _dispatch_module()
    known = _signature(dispatch.chunk_gated_delta_rule_bwd_dhu).parameters
    fla_params = _signature(dispatch.fla_function()).parameters
    out = {}
    for name, value in arguments.items():
        if name in known:
            out[name] = value
        elif not (value is None or value is False or value is fla_params[name].default):
            return None, f"argument {name!r} of this fla version is not supported by kda_dhu"
    return out, None


def _make_backend_class(base: type) -> type:
    class KdaDhuBackend(base):
        """fla backend running stage 4 on kda_dhu's kernel where its planner accepts."""

        backend_type = BACKEND_TYPE
        package_name = None
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        def chunk_gated_delta_rule_bwd_dhu_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            try:
                ours, reason = _ours_kwargs(_bind(args, kwargs))
                if ours is None:
                    return False, reason
                accepted, reason = _dispatch_module().plan_call(**ours)
                return bool(accepted), reason
            except Exception as error:  # fla also catches, but never raise out of a verifier
                return False, f"kda_dhu verifier error: {type(error).__name__}: {error}"

        def chunk_gated_delta_rule_bwd_dhu(self, *args, **kwargs):
            ours, reason = _ours_kwargs(_bind(args, kwargs))
            if ours is None:  # the verifier rejected this already
                raise TypeError(reason)
            return _dispatch_module().chunk_gated_delta_rule_bwd_dhu(**ours)

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
    Idempotent. Raises ``kda_dhu._fla_compat.FlaVersionError`` (an ImportError) if fla's
    stage 4 lacks parameters kda-dhu's fallback passes.
    """
    global _backend_cls
    with _lock:
        backends, registry = _registry()
        if backends is None:
            return False
        if getattr(backends, "_DISPATCH_DISABLED", False):
            logger.info("kda_dhu: fla's backend dispatch is disabled; not registering")
            return False
        # Version check: raises FlaVersionError if fla's stage 4 is too old for the fallback.
        _dispatch_module().fla_function()
        if _backend_cls is None or not issubclass(_backend_cls, backends.BaseBackend):
            _backend_cls = _make_backend_class(backends.BaseBackend)
        if registry is not None and isinstance(
            getattr(registry, "_backends", {}).get(BACKEND_TYPE), _backend_cls
        ):
            return True
        backends.register(OPERATION)(_backend_cls)
        logger.debug("kda_dhu: registered fla backend %r for %r", BACKEND_TYPE, OPERATION)
        return True


def _registered_instance():
    backends, registry = _registry()
    if registry is None or _backend_cls is None:
        return None, None
    instance = getattr(registry, "_backends", {}).get(BACKEND_TYPE)
    return registry, (instance if isinstance(instance, _backend_cls) else None)


def is_registered() -> bool:
    """True if fla's 'common' registry holds this module's backend."""
    with _lock:
        return _registered_instance()[1] is not None


def unregister_backend() -> bool:
    """Remove the backend from fla's registry (and fla's once-only log keys for it).

    Returns True if something was removed.  Reaches into fla's private
    ``BackendRegistry._backends``; meant for tests.
    """
    with _lock:
        registry, instance = _registered_instance()
        if instance is None:
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
    with _lock:
        return _registered_instance()[1]
