"""Registers kda-dhu's fla backend when fla's stage-4 module is imported, without importing fla.

fla's dispatch wrapper looks its backend registry up at every call of
``chunk_gated_delta_rule_bwd_dhu``, and that function lives in
``fla.ops.common.chunk_delta_h`` (the module that also builds the ``'common'`` registry
through ``@dispatch('common')``). So registering right after that module has run is
early enough for fla's first stage-4 call, whichever of kda_dhu and fla is imported
first:

- the module is already imported (fla came first): register at once;
- and for its imports to come: a finder at the head of ``sys.meta_path`` waits for that
  one module name, lets the other finders find it, and wraps its loader so that the
  registration runs right after the module's code (before the import returns to
  whoever asked for it).

Importing fla costs seconds and prints warnings on machines without a GPU; this way
``import kda_dhu`` costs neither, and a process that never imports fla never does.
The hook adds no third-party dependency (the wheels are installed without dependencies
on the GPU hosts) and imports no more than ``logging``, ``os``, ``sys`` and
``threading``: the finder and the loader follow importlib's protocols without its
abstract base classes, whose import alone costs more than the rest of ``import
kda_dhu``. A registration error never breaks fla's import: it is kept in ``state``
(``python -m kda_dhu --doctor`` prints it) and logged at debug level.

``KDA_DHU_NO_AUTOREGISTER=1`` skips all of it (``kda_dhu.register_backend()`` still
registers by hand).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["install", "state", "TARGET", "ENV_VAR"]

logger = logging.getLogger(__name__)

# The module whose import the registration follows: fla's stage 4 and its registry.
TARGET = "fla.ops.common.chunk_delta_h"
ENV_VAR = "KDA_DHU_NO_AUTOREGISTER"

# What happened, for diagnostics: "off" (ENV_VAR set), "waiting" (hook installed, TARGET
# not imported yet), "registered", "not registered" (register_backend() returned False:
# fla without a registry, or its dispatch switched off), "failed" (it raised: "error").
state: dict = {"status": "not installed", "error": None}

_lock = threading.Lock()


def _register() -> None:
    """register_backend(), its result and any error recorded in ``state``; never raises."""
    try:
        from .fla_backend import register_backend

        ok = register_backend()
        state.update(status="registered" if ok else "not registered", error=None)
    except Exception as err:  # noqa: BLE001 - fla's import must not fail because of us
        state.update(status="failed", error=f"{type(err).__name__}: {err}")
        logger.debug("kda_dhu: registering the fla backend failed", exc_info=True)


class _RegisteringLoader:
    """The loader of TARGET, wrapped: runs the module, then registers the backend."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # The module sees its own loader (source lookups by Triton and inspect go there).
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # anything else a loader offers (get_source, ...)
        if name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)


class _Finder:
    """Answers for TARGET only: the spec the other finders give, its loader wrapped."""

    _kda_dhu_autoregister = True  # recognised by install() across reloads of this module

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in list(sys.meta_path):
            if getattr(finder, "_kda_dhu_autoregister", False):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # nothing to wrap (not a plain module): the import goes on as it would
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def _switch_set(name: str) -> bool:
    try:
        from . import _core
    except ImportError:  # a source checkout without the extension: read it here
        return os.environ.get(name, "0").strip().lower() not in ("", "0", "auto")
    return _core.switch(name) is not None


def install() -> None:
    """Registers now if fla's stage-4 module is imported, and again whenever it is
    (imported for the first time, or anew after a reload or a purge of sys.modules).

    Reads ``KDA_DHU_NO_AUTOREGISTER`` (through the core's one reader of every switch;
    anything but unset skips); idempotent (one finder however often it is called). Imports
    nothing of fla or torch."""
    if _switch_set(ENV_VAR):
        state.update(status="off", error=None)
        return
    with _lock:  # held for the finder alone: registering imports fla, whose hook lands in _register
        if not any(getattr(f, "_kda_dhu_autoregister", False) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    if TARGET in sys.modules:
        _register()
    else:
        state.update(status="waiting", error=None)
