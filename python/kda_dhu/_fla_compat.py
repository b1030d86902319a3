"""Which fla versions kda-dhu's fallback can call, judged by stage 4's signature.

kda-dhu falls back to fla's own ``chunk_gated_delta_rule_bwd_dhu`` and calls it with
keywords: the fourteen parameters of ``REQUIRED`` (fla-core 0.5.2 has them all), plus
``chunk_offsets`` and ``use_graph`` (fla-core 0.6) where fla's function takes them. An
fla whose function lacks one of ``REQUIRED`` is too old: :func:`adapt` raises
``FlaVersionError`` saying so, which ``kda_dhu._dispatch.fla_function`` (every
fallback), :func:`kda_dhu.patch.patch` and :func:`kda_dhu.fla_backend.register_backend`
surface before any call is routed. Tested against fla-core 0.5.2 (no ``fla.backends``:
the patch path) and 0.6.0 (tests/unit/test_fla_versions.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["REQUIRED", "NEWER", "FlaVersionError", "adapt"]

# Parameters kda-dhu passes to fla's stage 4 on every fallback (fla-core >= 0.5.2).
REQUIRED = (
    "q",
    "k",
    "w",
    "do",
    "dv",
    "g",
    "gk",
    "h0",
    "dht",
    "scale",
    "state_v_first",
    "cu_seqlens",
    "chunk_size",
    "chunk_indices",
)
# Passed only where fla's function takes them (fla-core >= 0.6), with the value fla's
# older function behaves as: chunk_offsets are derived from cu_seqlens (the same numbers),
# use_graph=False is the plain allocation.
NEWER = {"chunk_offsets": None, "use_graph": False}

TESTED = "fla-core 0.5.2 and 0.6.0"


class FlaVersionError(ImportError):
    """The installed fla's stage 4 lacks parameters kda-dhu's fallback passes."""


def _fla_version() -> str:
    try:
        import fla

        return f"fla-core {fla.__version__}"
    except Exception:  # noqa: BLE001 - only for the message
        return "this fla"


def adapt(fn: Any) -> Any:
    """fla's undecorated ``chunk_gated_delta_rule_bwd_dhu`` as kda-dhu calls it.

    ``fn`` itself when it takes every parameter kda-dhu passes (fla-core 0.6). Where it
    lacks only ``NEWER`` ones (fla-core 0.5): a wrapper that leaves those out of the call
    when they hold the value fla's function behaves as (``chunk_offsets`` is dropped in
    any case: fla derives the same offsets from ``cu_seqlens``), and raises ValueError
    for ``use_graph=True``, which that fla cannot honour.

    Raises:
        FlaVersionError: ``fn`` lacks one of ``REQUIRED``; the message names them, the
            fla version and the versions kda-dhu is tested with.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as err:
        raise FlaVersionError(
            f"{_fla_version()}'s chunk_gated_delta_rule_bwd_dhu has no signature: {err}"
        ) from err
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in REQUIRED if name not in params and not takes_kwargs]
    if missing:
        raise FlaVersionError(
            f"{_fla_version()} is too old for kda-dhu: its chunk_gated_delta_rule_bwd_dhu "
            f"(fla.ops.common.chunk_delta_h) takes no {', '.join(missing)}, which kda-dhu passes "
            f"when it falls back to fla. kda-dhu is tested with {TESTED}: pip install -U 'fla-core>=0.5.2'"
        )
    absent = [name for name in NEWER if name not in params and not takes_kwargs]
    if not absent:
        return fn

    current = (*REQUIRED, *NEWER)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if len(args) > len(current) or any(name in kwargs for name in current[: len(args)]):
            raise TypeError(f"chunk_gated_delta_rule_bwd_dhu: expected the arguments ({', '.join(current)})")
        kwargs.update(zip(current, args))
        if kwargs.get("use_graph", False) and "use_graph" in absent:
            raise ValueError(
                f"use_graph: {_fla_version()}'s chunk_gated_delta_rule_bwd_dhu has no CUDA-graph buffers "
                "(fla-core >= 0.6 has them); expected use_graph=False"
            )
        for name in absent:
            kwargs.pop(name, None)
        return fn(**kwargs)

    call._kda_dhu_left_out = tuple(absent)
    return call
