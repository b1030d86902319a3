"""fla's forward scan, ``chunk_gated_delta_rule_fwd_h``, on kda-dhu's kernel where it covers
the call (stage 4's twin: SPEC.md, "The twin"; the kernel is the register-state kernel's
FWD instance, cuda/dhu_sm90_regstate.cuh).

The call is read, validated, planned and launched in one crossing (``_core.fwd_h_run``,
src/forward.rs); every call it leaves to fla (see there: inputs to copy, a packed batch
without chunk_indices, a 16-bit initial_state, the planner's fallback, KDA_DHU_FWD_H off,
...) runs fla's own function with the same arguments; inputs in host memory run ``_cpu``
(the float64 reference with fla's casts). Public as ``kda_dhu.chunk_gated_delta_rule_fwd_h``;
``kda_dhu.patch()`` and fla's registry (``kda_dhu.fla_backend``) route fla's name here.
"""

from __future__ import annotations

import torch

from ._dispatch import _device_ctx, _require_core
from ._fla import fla_fwd_h_function


def chunk_gated_delta_rule_fwd_h(
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
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    chunk_offsets: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The forward state scan of the chunked gated delta rule: fla's signature, kda-dhu's kernel.

    ``fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_h`` (fla-core 0.6; the math is
    SPEC.md's "The twin"): for each sequence and value head, walking chunks of 64 tokens
    oldest first from ``initial_state``, it stores the state entering each chunk (h), the
    corrected values v_new = u - w h, and the final state.

    Args:
        k: [B, T, H, K] bf16/fp16 (KDA passes its gated kg).
        w: [B, T, HV, K], k's dtype (WY representation).
        u: [B, T, HV, V], k's dtype.
        g: [B, T, HV] fp32 scalar log2-space gate, chunk-local cumsum (GDN), or None.
        gk: [B, T, HV, K] fp32 per-key log2-space gate, chunk-local cumsum (KDA), or None;
            only the last row of each chunk is read.
        initial_state: fp32 [N, HV, K, V] ([N, HV, V, K] with state_v_first), or None (zeros);
            a bf16 / fp16 one (fla casts it on load) runs fla's function.
        output_final_state: return the state after the last chunk.
        chunk_size: 64 on the kernel path (fla handles others).
        save_new_value: return v_new (the kernel writes it either way).
        state_v_first: h, initial_state and final_state keep V before K.
        cu_seqlens: int64 or int32 [N + 1] sequence offsets of a packed batch (B == 1), or
            None; checked on the device where the kernel reads it.
        cu_seqlens_cpu: a host copy of cu_seqlens (not read).
        chunk_indices: fla's chunk table [NT, 2] of a packed batch; its length is h's NT.
            A packed batch without it runs fla's function.
        chunk_offsets: fla's [N + 1] first chunk of each sequence, or None.

    Returns:
        (h, v_new, final_state): h [B, NT, HV, K, V] in k's dtype ([.., V, K] with
        state_v_first), v_new like u (contiguous) or None unless save_new_value,
        final_state fp32 like initial_state or None unless output_final_state.

    Raises:
        TypeError / ValueError naming the argument and the expectation (dtype, shape,
            device, strides, a scalar argument), or a bad packed batch found on the device
            by an earlier call.
        RuntimeError: a CUDA driver or launch failure; KDA_DHU_FORCE=kernel on a call the
            kernel does not run.

    Runs the kernel where ``_core.fwd_h_run`` plans it and the forward scan is on
    (KDA_DHU_FWD_H, src/env.rs), else fla's own function with the same arguments, so
    results match fla's to rounding either way (bit for bit where measured:
    benches/NOTES.md).
    """
    with _device_ctx(k):
        out = _require_core().fwd_h_run(
            k, w, u, g, gk, initial_state, output_final_state, chunk_size, save_new_value, state_v_first,
            cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets,
        )  # fmt: skip
    if out is not None:
        return out
    if isinstance(k, torch.Tensor) and k.device.type == "cpu":  # validated (names) by fwd_h_run
        return _cpu(
            k, w, u, g, gk, initial_state, output_final_state, chunk_size, save_new_value, state_v_first,
            cu_seqlens, chunk_indices, chunk_offsets,
        )  # fmt: skip
    # fla's kernel reads every tensor as if contiguous: strided inputs are packed first (the
    # caller's tensors are left as they are).
    k, w, u, g, gk, initial_state = map(_packed, (k, w, u, g, gk, initial_state))
    return fla_fwd_h_function()(
        k=k, w=w, u=u, g=g, gk=gk, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, save_new_value=save_new_value, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
    )  # fmt: skip


chunk_gated_delta_rule_fwd_h._kda_dhu_entry = True


def _packed(x):
    """A contiguous copy of a strided torch tensor; anything else as it is."""
    return x.contiguous() if isinstance(x, torch.Tensor) and not x.is_contiguous() else x


def _cpu(k, w, u, g, gk, initial_state, output_final_state, chunk_size, save_new_value, state_v_first, cu_seqlens,
         chunk_indices, chunk_offsets):  # fmt: skip
    """The forward scan on the CPU (inputs in host memory, as stage 4's CPU path takes them):
    the float64 recurrence with fla's two operand casts (``reference.chunk_gated_delta_rule_fwd_h_ref``,
    ``emulate_rounding=True``), its outputs in fla's dtypes (h in k's, v_new in u's,
    final_state float32). Slow; for tests and CPU-only runs."""
    from .reference import chunk_gated_delta_rule_fwd_h_ref

    h, v_new, final = chunk_gated_delta_rule_fwd_h_ref(
        k, w, u, g=g, gk=gk, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=chunk_size, save_new_value=save_new_value, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, emulate_rounding=True,
    )  # fmt: skip
    return (
        h.to(k.dtype),
        None if v_new is None else v_new.to(u.dtype),
        None if final is None else final.to(torch.float32),
    )
