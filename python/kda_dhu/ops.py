"""kda-dhu as a torch custom op, for torch.compile and graph capture.

``torch.ops.kda_dhu.chunk_gated_delta_rule_bwd_dhu`` is registered with torch.library
(schema below) with a fake (meta) implementation, so ``torch.compile(fullgraph=True)``
traces through it instead of breaking the graph on the DLPack / driver calls inside.
On CUDA tensors it is ``kda_dhu.chunk_gated_delta_rule_bwd_dhu`` (kernel or fla, as
planned); on CPU tensors it evaluates the float64 reference and casts to the output
dtypes, so graphs that use it can be traced and tested anywhere.

Custom ops return tensors, not None: dh0 comes back as an empty fp32 tensor when h0 is
None; ``chunk_gated_delta_rule_bwd_dhu_op`` below turns it back into None.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

BT = 64


@torch.library.custom_op("kda_dhu::chunk_gated_delta_rule_bwd_dhu", mutates_args=())
def _op(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, dv: torch.Tensor,
        g: Optional[torch.Tensor], gk: Optional[torch.Tensor], h0: Optional[torch.Tensor],
        dht: Optional[torch.Tensor], scale: float, state_v_first: bool,
        cu_seqlens: Optional[torch.Tensor], chunk_indices: Optional[torch.Tensor],
        chunk_offsets: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kw = dict(g=g, gk=gk, h0=h0, dht=dht, scale=scale, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens, chunk_size=BT, chunk_indices=chunk_indices,
              chunk_offsets=chunk_offsets)
    if q.is_cuda:
        from ._dispatch import chunk_gated_delta_rule_bwd_dhu

        dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, **kw)
    else:
        from . import _dispatch
        from .reference import chunk_gated_delta_rule_bwd_dhu_ref

        if _dispatch._core is not None:  # the same input checks as the CUDA path
            _dispatch._core.validate(q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first,
                                     cu_seqlens, BT, chunk_offsets)

        dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu_ref(q, k, w, do, dv, **kw)
        dh, dv2 = dh.to(q.dtype), dv2.to(dv.dtype)
        dh0 = dh0.float() if dh0 is not None else None
    if dh0 is None:
        dh0 = q.new_empty(0, dtype=torch.float32)
    return dh, dh0, dv2


@_op.register_fake
def _op_fake(q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_indices,
             chunk_offsets):
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if cu_seqlens is None:
        NT = (T + BT - 1) // BT
    elif chunk_indices is not None:
        NT = chunk_indices.shape[0]
    else:  # the chunk count of a packed batch depends on cu_seqlens' values
        NT = torch.library.get_ctx().new_dynamic_size()
    dh = q.new_empty((B, NT, HV, V, K) if state_v_first else (B, NT, HV, K, V))
    dh0 = (q.new_empty(h0.shape, dtype=torch.float32) if h0 is not None
           else q.new_empty(0, dtype=torch.float32))
    return dh, dh0, torch.empty_like(dv)


def chunk_gated_delta_rule_bwd_dhu_op(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, dv: torch.Tensor,
    g: Optional[torch.Tensor] = None, gk: Optional[torch.Tensor] = None,
    h0: Optional[torch.Tensor] = None, dht: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = 64,
    chunk_indices: Optional[torch.Tensor] = None, chunk_offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``kda_dhu.chunk_gated_delta_rule_bwd_dhu`` through the custom op (torch.compile-able).

    Same arguments, shapes and results (dh, dh0 or None, dv2) as the eager function;
    chunk_size must be 64 (the op's schema fixes it). Raises ValueError otherwise, and
    whatever the eager function raises.
    """
    if chunk_size != BT:
        raise ValueError(f"chunk_size: the custom op takes 64, got {chunk_size}")
    from ._dispatch import _default_scale

    scale = _default_scale(q, scale)
    if scale is None:  # q is not a tensor with a K dim: let the eager path name it
        from ._dispatch import chunk_gated_delta_rule_bwd_dhu

        return chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, g=g, gk=gk, h0=h0, dht=dht,
                                              state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                              chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    dh, dh0, dv2 = torch.ops.kda_dhu.chunk_gated_delta_rule_bwd_dhu(
        q, k, w, do, dv, g, gk, h0, dht, float(scale), state_v_first, cu_seqlens, chunk_indices,
        chunk_offsets)
    return dh, (dh0 if h0 is not None else None), dv2
