"""kda-dhu as a torch custom op, for torch.compile and graph capture.

``torch.ops.kda_dhu.chunk_gated_delta_rule_bwd_dhu`` is registered with torch.library
(schema below) with a fake (meta) implementation, so ``torch.compile(fullgraph=True)``
traces through it instead of breaking the graph on the DLPack / driver calls inside.
It is ``kda_dhu.chunk_gated_delta_rule_bwd_dhu``: on CUDA tensors the kernel or fla, as
planned; on CPU tensors the Rust core's CPU implementation in fla's precision, so graphs
that use it can be traced and tested anywhere.

Custom ops return tensors, not None: dh0 comes back as an empty fp32 tensor when h0 is
None; ``chunk_gated_delta_rule_bwd_dhu_op`` below turns it back into None.
"""

from __future__ import annotations

import math
import operator

import torch

from ._core import BT  # tokens per chunk of every kernel (cuda/dhu_layout.h)

_TENSOR_ARGS = (
    "q",
    "k",
    "w",
    "do",
    "dv",
    "g",
    "gk",
    "h0",
    "dht",
    "cu_seqlens",
    "chunk_indices",
    "chunk_offsets",
)


def _op_scalars(scale, state_v_first, chunk_size) -> tuple[float, bool]:
    """The op's schema takes (float, bool, fixed 64): check what the eager function's
    validator checks, by name, before anything is converted. Returns (scale, state_v_first).

    In Python, mirroring src/lib.rs's scale_arg / state_v_first_arg / chunk_size_arg (same
    messages): torch.compile traces this wrapper and cannot call into the extension."""
    if isinstance(chunk_size, bool):
        raise TypeError("chunk_size: expected an int, got bool")
    try:
        chunk_size = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}") from None
    if chunk_size != BT:
        raise ValueError(f"chunk_size: the custom op takes {BT}, got {chunk_size}")
    numpy_bool = type(state_v_first).__module__ == "numpy" and type(state_v_first).__name__ in (
        "bool",
        "bool_",
    )
    if not (isinstance(state_v_first, bool) or numpy_bool):
        raise TypeError(f"state_v_first: expected a bool, got {type(state_v_first).__name__}")
    # A Python float is the common case and the one torch.compile traces: dynamo may pass
    # it as a symbolic float, on which neither the string tests below nor math.isfinite
    # trace (the op's implementation checks finiteness when the graph runs).
    if type(scale) is float:
        value = scale
    else:
        kind = type(scale).__name__
        if isinstance(scale, (bool, complex, str, bytes, torch.Tensor)) or "complex" in kind:
            raise TypeError(
                f"scale: expected a float or None, got {kind}"
                + (
                    " (the custom op takes a Python or numpy float)"
                    if isinstance(scale, torch.Tensor)
                    else ""
                )
            )
        try:
            value = float(scale)
        except OverflowError:
            raise ValueError(f"scale: expected a finite float, got {kind} (too large for float64)") from None
        except (TypeError, ValueError):
            raise TypeError(f"scale: expected a float or None, got {kind}") from None
    if not torch.compiler.is_compiling() and not math.isfinite(value):
        raise ValueError(f"scale: expected a finite float, got {value}")
    return value, bool(state_v_first)


@torch.library.custom_op("kda_dhu::chunk_gated_delta_rule_bwd_dhu", mutates_args=())
def _op(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor,
    g: torch.Tensor | None,
    gk: torch.Tensor | None,
    h0: torch.Tensor | None,
    dht: torch.Tensor | None,
    scale: float,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    chunk_offsets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kw = dict(
        g=g,
        gk=gk,
        h0=h0,
        dht=dht,
        scale=scale,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        chunk_size=BT,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
    )
    # CUDA tensors: the kernel or fla, as planned; CPU tensors: the Rust core's CPU path in
    # fla's precision (the same input checks and messages either way).
    from ._dispatch import chunk_gated_delta_rule_bwd_dhu

    dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, **kw)
    if dh0 is None:
        dh0 = q.new_empty(0, dtype=torch.float32)
    return dh, dh0, dv2


@_op.register_fake
def _op_fake(q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_indices, chunk_offsets):
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if cu_seqlens is None:
        NT = (T + BT - 1) // BT
    elif chunk_indices is not None:
        NT = chunk_indices.shape[0]
    else:  # the chunk count of a packed batch depends on cu_seqlens' values
        NT = torch.library.get_ctx().new_dynamic_size()
    dh = q.new_empty((B, NT, HV, V, K) if state_v_first else (B, NT, HV, K, V))
    dh0 = (
        q.new_empty(h0.shape, dtype=torch.float32) if h0 is not None else q.new_empty(0, dtype=torch.float32)
    )
    return dh, dh0, torch.empty_like(dv)


def chunk_gated_delta_rule_bwd_dhu_op(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``kda_dhu.chunk_gated_delta_rule_bwd_dhu`` through the custom op (torch.compile-able).

    Same arguments, shapes and results (dh, dh0 or None, dv2) as the eager function;
    chunk_size must be 64 (the op's schema fixes it). Raises ValueError otherwise, and
    whatever the eager function raises.
    """
    from ._dispatch import _default_scale

    args = dict(
        q=q,
        k=k,
        w=w,
        do=do,
        dv=dv,
        g=g,
        gk=gk,
        h0=h0,
        dht=dht,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
    )
    if (
        any(args[n] is not None and not isinstance(args[n], torch.Tensor) for n in _TENSOR_ARGS)
        or not isinstance(q, torch.Tensor)
        or q.dim() != 4
    ):
        # not tensors where the schema wants them: the eager function names the argument
        from ._dispatch import chunk_gated_delta_rule_bwd_dhu

        return chunk_gated_delta_rule_bwd_dhu(
            **args, scale=scale, state_v_first=state_v_first, chunk_size=chunk_size
        )
    scale, state_v_first = _op_scalars(_default_scale(q, scale), state_v_first, chunk_size)
    dh, dh0, dv2 = torch.ops.kda_dhu.chunk_gated_delta_rule_bwd_dhu(
        q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_indices, chunk_offsets
    )
    return dh, (dh0 if h0 is not None else None), dv2
