"""kda-dhu as torch custom ops, for torch.compile and graph capture.

``torch.ops.kda_dhu.chunk_gated_delta_rule_bwd_dhu`` (stage 4) and
``torch.ops.kda_dhu.chunk_gated_delta_rule_fwd_h`` (the forward scan; at the end of this
module, the same way) are registered with torch.library
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


# ---- the forward scan (fla's chunk_gated_delta_rule_fwd_h): kda_dhu.chunk_gated_delta_rule_fwd_h


def _flag(name: str, value) -> bool:
    """A bool argument of the forward op's schema, checked by name as the eager function's
    validator does (a Python or numpy bool)."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if not (isinstance(value, bool) or numpy_bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


@torch.library.custom_op("kda_dhu::chunk_gated_delta_rule_fwd_h", mutates_args=())
def _fwd_h_op(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor | None,
    gk: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    save_new_value: bool,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    chunk_offsets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ._forward import chunk_gated_delta_rule_fwd_h

    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(
        k, w, u, g=g, gk=gk, initial_state=initial_state, output_final_state=output_final_state, chunk_size=BT,
        save_new_value=save_new_value, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
    )  # fmt: skip
    if v_new is None:
        v_new = u.new_empty(0)
    if final_state is None:
        final_state = k.new_empty(0, dtype=torch.float32)
    return h, v_new, final_state


@_fwd_h_op.register_fake
def _fwd_h_op_fake(
    k, w, u, g, gk, initial_state, output_final_state, save_new_value, state_v_first, cu_seqlens, cu_seqlens_cpu,
    chunk_indices, chunk_offsets,
):  # fmt: skip
    B, T, _, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    if cu_seqlens is None:
        N, NT = B, (T + BT - 1) // BT
    else:
        N = cu_seqlens.shape[0] - 1
        # the chunk count of a packed batch without fla's table depends on cu_seqlens' values
        NT = (
            chunk_indices.shape[0]
            if chunk_indices is not None
            else torch.library.get_ctx().new_dynamic_size()
        )
    state = (HV, V, K) if state_v_first else (HV, K, V)
    h = k.new_empty((B, NT, *state))
    v_new = u.new_empty(u.shape) if save_new_value else u.new_empty(0)
    final_state = (
        k.new_empty((N, *state), dtype=torch.float32)
        if output_final_state
        else k.new_empty(0, dtype=torch.float32)
    )
    return h, v_new, final_state


def chunk_gated_delta_rule_fwd_h_op(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    save_new_value: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``kda_dhu.chunk_gated_delta_rule_fwd_h`` through the custom op
    ``torch.ops.kda_dhu.chunk_gated_delta_rule_fwd_h`` (torch.compile-able, CUDA graphs:
    the kernel route neither synchronizes nor allocates outside torch).

    Same arguments, shapes and results (h, v_new or None, final_state or None) as the
    eager function; chunk_size must be 64 (the op's schema fixes it). Raises TypeError /
    ValueError naming the argument otherwise, and whatever the eager function raises.
    """
    from ._forward import chunk_gated_delta_rule_fwd_h

    tensors = (k, w, u, g, gk, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)
    if any(t is not None and not isinstance(t, torch.Tensor) for t in tensors) or not isinstance(
        k, torch.Tensor
    ):
        # not tensors where the schema wants them: the eager function names the argument
        return chunk_gated_delta_rule_fwd_h(
            k, w, u, g=g, gk=gk, initial_state=initial_state, output_final_state=output_final_state,
            chunk_size=chunk_size, save_new_value=save_new_value, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        )  # fmt: skip
    _, state_v_first = _op_scalars(1.0, state_v_first, chunk_size)
    output_final_state = _flag("output_final_state", output_final_state)
    save_new_value = _flag("save_new_value", save_new_value)
    h, v_new, final_state = torch.ops.kda_dhu.chunk_gated_delta_rule_fwd_h(
        k, w, u, g, gk, initial_state, output_final_state, save_new_value, state_v_first, cu_seqlens, cu_seqlens_cpu,
        chunk_indices, chunk_offsets,
    )  # fmt: skip
    return h, (v_new if save_new_value else None), (final_state if output_final_state else None)
