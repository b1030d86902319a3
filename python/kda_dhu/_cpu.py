"""Stage 4 on the CPU, in the Rust core (``kda_dhu._core.cpu_bwd_dhu``).

The same op as the CUDA kernels (SPEC.md's recurrence, every variant: gk, g or no gate,
GVA, cu_seqlens, tails, optional dht / h0, state_v_first), multi-threaded over
(sequence, value head), in one of two arithmetics:

* ``mode="fla"``: fla's precision. 16-bit (or fp32) inputs are read as they are, the
  arithmetic is fp32 with fp32 accumulation, and values are rounded where fla's Triton
  kernel rounds them: the state b to k's dtype before ``k @ b``, dv2 to w's dtype before
  ``w^T dv2``, do to q's dtype before ``q^T do`` (no gate g; with g fla's gated q and that
  dot are fp32), and ``scale`` multiplies the finished fp32 ``q^T do`` dot. Outputs in
  fla's dtypes: dh in q's, dv2 in dv's, dh0 fp32. What differs from fla on a GPU is
  summation order, fla's TF32 dot on the g path (fp32 here) and the GPU's approximate
  exp2.
* ``mode="float64"``: the reference arithmetic (the exact recurrence in float64, no
  rounding). Outputs are float64, and float64 inputs (q, k, w, do, dv, g, gk, dht) are
  taken too. The tests' oracle: it matches ``kda_dhu.reference`` with
  ``emulate_rounding=False`` to ~1e-15.

Inputs are CPU torch tensors (any dtype fla takes, bfloat16 included; any strides) or
numpy arrays (float16 / float32 / float64: numpy has no bfloat16), read through DLPack;
outputs are torch tensors when q is a torch.Tensor, numpy arrays otherwise.
"""

from __future__ import annotations

from typing import Any

try:
    from . import _core
except ImportError as _err:  # a source checkout without the compiled extension
    _core = None
    _core_error = _err

__all__ = ["chunk_gated_delta_rule_bwd_dhu_cpu", "MODES"]

MODES = ("fla", "float64")


def chunk_gated_delta_rule_bwd_dhu_cpu(
    q: Any,
    k: Any,
    w: Any,
    do: Any,
    dv: Any,
    g: Any = None,
    gk: Any = None,
    h0: Any = None,
    dht: Any = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Any = None,
    chunk_size: int = 64,
    chunk_indices: Any = None,
    chunk_offsets: Any = None,
    use_graph: bool = False,
    mode: str = "fla",
    *,
    _poison: bool = False,
) -> tuple[Any, Any | None, Any]:
    """fla's ``chunk_gated_delta_rule_bwd_dhu`` on CPU tensors, computed by the Rust core.

    The reverse state scan of the chunked gated delta rule backward (SPEC.md; fla-core
    0.6's ``fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_dhu``): for each
    sequence and value head, walking chunks of 64 tokens newest first, the state gradient
    entering each chunk (dh), the corrected value gradient (dv2) and the gradient of the
    initial state (dh0).

    Args:
        q, k: [B, T, H, K]; bf16, fp16 or fp32 (and float64 in ``mode="float64"``).
        w: [B, T, HV, K], q's dtype. H must divide HV: value head h reads q/k head
            h // (HV // H).
        do, dv: [B, T, HV, V], one dtype (as q's set).
        g: [B, T, HV] fp32 scalar log2-space gate, chunk-local cumsum (GDN), or None.
        gk: [B, T, HV, K] fp32 per-key log2-space gate, chunk-local cumsum (KDA), or
            None; only the last row of each chunk is read.
        h0: the initial state, [N, HV, K, V] ([N, HV, V, K] with state_v_first), any
            float dtype; only its presence matters: dh0 is returned iff it is given.
        dht: fp32 gradient of the final state, shaped like h0, or None (zeros).
        scale: multiplies ``q^T do``; None means K ** -0.5.
        state_v_first: dh, dht, h0 and dh0 keep V before K.
        cu_seqlens: int64 / int32 [N + 1] offsets of sequences packed along T (B == 1),
            or None (N = B). Tokens past cu_seqlens[-1] (a padded packed batch) are not
            read; their dv2 rows are zeros.
        chunk_size: 64 (fla's callers' chunk size; others raise ValueError).
        chunk_indices: fla's int [NT, 2] chunk table (with cu_seqlens); only its length
            is used, as dh's NT. Rows of dh past the sequences' chunks are zeros.
        chunk_offsets: fla's int [N + 1] first chunk of each sequence (with cu_seqlens),
            checked against cu_seqlens; a table of N entries is not used (as on the CUDA
            path: the chunks are counted from cu_seqlens).
        use_graph: fla's CUDA-graph buffers; ignored on the CPU.
        mode: "fla" (fla's precision) or "float64" (the reference arithmetic); see the
            module docstring.

    Returns:
        (dh, dh0, dv2) of the caller's kind (torch tensors for a torch q, numpy arrays
        otherwise): dh [B, NT, HV, K, V] ([B, NT, HV, V, K] with state_v_first), NT =
        ceil(T / 64), or with cu_seqlens the total chunk count of the sequences (or
        len(chunk_indices)); dh0 shaped like h0, or None without h0; dv2 like dv. Dtypes:
        in "fla" mode dh as q, dh0 float32, dv2 as dv; in "float64" mode all float64.

    Raises:
        TypeError / ValueError: the same errors, with the same messages, as the CUDA
            path for the same bad input (a dtype, shape, stride, scalar or cu_seqlens
            value fla's contract refuses), naming the argument; ValueError naming the
            first argument not in CPU memory ("k: expected a CPU tensor, got a tensor on
            cuda:0"), for ``chunk_size != 64`` and for an unknown ``mode``.
        ImportError: kda_dhu's compiled extension is not built.
    """
    del use_graph  # CUDA graphs' static buffers: nothing to do on the CPU
    if _core is None:
        raise ImportError(f"kda_dhu's compiled extension (kda_dhu._core) is not built: {_core_error}")
    return _core.cpu_bwd_dhu(
        mode,
        q,
        k,
        w,
        do,
        dv,
        g,
        gk,
        h0,
        dht,
        scale,
        state_v_first,
        cu_seqlens,
        chunk_size,
        chunk_indices,
        chunk_offsets,
        poison=_poison,
    )
