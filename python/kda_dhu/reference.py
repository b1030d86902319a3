"""Float64 references for fla's stage 4, ``chunk_gated_delta_rule_bwd_dhu``, and its forward
twin ``chunk_gated_delta_rule_fwd_h`` (``chunk_gated_delta_rule_fwd_h_ref``, below).

The math is SPEC.md's recurrence ("The recurrence"), which is what fla-core 0.6.0's
Triton kernel ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64``
(``fla/ops/common/chunk_delta_h.py``) computes.  For each sequence ``n`` and value head
``h`` (chunks of ``BT = chunk_size`` tokens ``[s, e)``, ``e = min(s + BT, end)``, so the
last chunk of a sequence may be short):

    b = dht[n, h]                       (zeros when dht is None)     [K, V]
    for each chunk, newest first:
        dh[chunk]  = b
        dv2[t]     = exp2(g[e-1] - g[t]) * (k[t] @ R_k(b)) + dv[t]   t in [s, e)
        b          = exp2(g[e-1]) * b                     (g only)
        b          = exp2(gk[e-1])[:, None] * b           (gk only)
        b          = b + scale * sum_t (exp2(g[t]) q[t])^T do[t]    (exp2(g[t]) g only)
                       - sum_t w[t]^T R_w(dv2[t])
    dh0[n, h] = b

Gates are log2-space chunk-local cumulative sums (fla multiplies by exp2, not exp);
``gk`` is only read at the last row of each chunk.  Value head ``h`` reads q/k head
``h // (HV // H)`` ("GVA").

Rounding model (``emulate_rounding=True``).  fla's kernel holds ``b`` in fp32 but feeds
two tensor-core dots with 16-bit operands, and those two casts are the only roundings
that change the *value* propagated through the recurrence by more than fp32 noise:

* ``R_k``: ``b`` is cast to ``k.dtype`` before ``k @ b`` (``b_dh.to(b_k.dtype)``;
  SPEC.md says q.dtype: q and k share a dtype in every fla caller).
* ``R_w``: the fp32 ``dv2`` accumulator is cast to ``w.dtype`` before ``w^T dv2``
  (``b_dv.to(b_w.dtype)``; SPEC.md says q.dtype, and the stored dv2 is cast to
  ``dv.dtype``: all three coincide in fla's callers, the dot consumes the ``w.dtype``
  cast, so that is what is modelled).

Everything else is computed exactly in float64 and *not* modelled: fp32 accumulation
order; the final casts of the outputs (``dh`` to q.dtype, ``dv2`` to dv.dtype, ``dh0``
to fp32: the returned tensors are the unrounded float64 values, which is what outputs
are compared against); with ``g``, fla's product ``q * exp2(g)``, which stays fp32 and
enters a fp32 ``tl.dot`` (TF32 on NVIDIA by default, 10 mantissa bits, finer than
bf16's 7); and, for fp32 inputs, the TF32 rounding of every fla dot.  With
``emulate_rounding=False`` the reference is the exact recurrence.  For float64 inputs
both settings agree (the casts are no-ops).

Checked against fla-core 0.6.0's kernel on an H200 (tests/gpu/test_reference_gpu.py),
bf16, B2 T512 H4 K=V=128, relative error of fla's outputs against this reference
rounded to fla's output dtypes, emulated / exact: gk dh 6.5e-5 / 1.3e-3, dh0 1.1e-4 /
1.6e-3; no gate dh0 7.8e-5 / 1.3e-3; g dh0 5.0e-4 / 1.6e-3 (the TF32 q*exp2(g) dot).
fp32 inputs: 5e-4 .. 1e-3 either way (TF32).  Against the unrounded reference, fla's
bf16 dh and dv2 are 1.66e-3 off in every variant: that is their own output rounding.

The computation runs in float64 on the inputs' device, vectorized over (sequence,
value head); only the chunk walk is a Python loop.
"""

from __future__ import annotations

import math

import torch

__all__ = ["chunk_gated_delta_rule_bwd_dhu_ref", "chunk_gated_delta_rule_fwd_h_ref", "rel_err"]


def _round_to(x: torch.Tensor, dtype: torch.dtype, enabled: bool) -> torch.Tensor:
    """Round float64 ``x`` to ``dtype`` and back (no-op when disabled or dtype is f64)."""
    if not enabled or dtype == torch.float64:
        return x
    return x.to(dtype).to(torch.float64)


def _check_w_and_gates(w, g, gk, B, T, H, HV, K) -> None:
    """The shapes both scans share: w [B, T, HV, K], H dividing HV, g [B, T, HV] and gk
    [B, T, HV, K] when given (ValueError naming the argument)."""
    if w.shape != (B, T, HV, K):
        raise ValueError(f"w must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(w.shape)}")
    if HV % H != 0:
        raise ValueError(f"H ({H}) must divide HV ({HV})")
    if g is not None and g.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)}, got {tuple(g.shape)}")
    if gk is not None and gk.shape != (B, T, HV, K):
        raise ValueError(f"gk must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(gk.shape)}")


class _Sequences:
    """The sequences of a call as fla's kernels walk them: N sequences (B dense rows, or
    ``len(cu_seqlens) - 1`` packed ones in row 0), each with its batch row, first token,
    length, chunk count and first chunk row in the [B, NT, HV, ...] chunk outputs (dense:
    row n's NT = ceil(T / BT) chunks; packed: ``chunk_offsets`` or the exclusive cumsum of
    the chunk counts, NT = ``len(chunk_indices)`` or their sum). ``gather`` / ``scatter``
    move [B, T, h, *] tensors to and from a padded float64 [N, HV, L, *] layout in which
    every sequence starts at position 0 (L = the most chunks of a sequence times BT)."""

    def __init__(self, B, T, BT, cu_seqlens, chunk_offsets, chunk_indices, device):
        self.B, self.T, self.BT = B, T, BT
        if cu_seqlens is None:
            N = B
            seq_batch, seq_bos, seq_len = list(range(B)), [0] * B, [T] * B
        else:
            if B != 1:
                raise ValueError(f"varlen (cu_seqlens) needs B == 1, got B = {B}")
            cu = [int(x) for x in cu_seqlens.tolist()]
            if len(cu) < 2 or cu[0] < 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > T:
                raise ValueError(f"cu_seqlens must be non-decreasing within [0, T={T}], got {cu}")
            N = len(cu) - 1
            seq_batch, seq_bos = [0] * N, cu[:-1]
            seq_len = [b - a for a, b in zip(cu, cu[1:])]
        seq_nt = [-(-n // BT) for n in seq_len]
        if cu_seqlens is None:
            NT = math.ceil(T / BT)
            offs = [0] * N
        else:
            if chunk_offsets is not None:
                offs = [int(x) for x in chunk_offsets.tolist()[:N]]
            else:
                offs = [0] * N
                for n in range(1, N):
                    offs[n] = offs[n - 1] + seq_nt[n - 1]
            NT = len(chunk_indices) if chunk_indices is not None else sum(seq_nt)
            for n in range(N):
                if seq_nt[n] and not (0 <= offs[n] and offs[n] + seq_nt[n] <= NT):
                    raise ValueError(
                        f"chunk_offsets[{n}] = {offs[n]} puts {seq_nt[n]} chunks outside [0, {NT})"
                    )
        self.N, self.NT, self.seq_nt = N, NT, seq_nt
        self.NTmax = max(seq_nt) if N else 0
        self.L = L = self.NTmax * BT
        self.device = device
        pos = torch.arange(L, device=device)
        self.lens = torch.tensor(seq_len, device=device, dtype=torch.long)
        self.valid = pos[None, :] < self.lens[:, None]  # [N, L]
        rows = (torch.tensor(seq_batch, device=device) * T + torch.tensor(seq_bos, device=device))[
            :, None
        ] + pos[None, :]
        self.rows = torch.where(self.valid, rows, torch.zeros_like(rows))  # [N, L] into B*T
        self.nt_t = torch.tensor(seq_nt, device=device)
        self.batch_t = torch.tensor(seq_batch, device=device)
        self.offs_t = torch.tensor(offs, device=device)

    def gather(self, x: torch.Tensor, repeat_heads: int = 1) -> torch.Tensor:
        """x [B, T, h, *] -> float64 [N, h * repeat_heads, L, *], zero outside the sequences
        (head j of the result reads head j // repeat_heads: GVA)."""
        N, L = self.N, self.L
        xt = x.reshape(self.B * self.T, *x.shape[2:])[self.rows].to(torch.float64)  # [N, L, h, *]
        mask = self.valid.reshape(N, L, *([1] * (xt.dim() - 2)))
        xt = torch.where(mask, xt, torch.zeros((), dtype=torch.float64, device=self.device))
        if repeat_heads > 1:
            xt = xt.repeat_interleave(repeat_heads, dim=2)
        return xt.movedim(2, 1).contiguous()

    def scatter(self, xp: torch.Tensor) -> torch.Tensor:
        """The inverse of ``gather`` for [N, HV, L, V]: float64 [B, T, HV, V], zero on the
        rows no sequence covers."""
        HV, V = xp.shape[1], xp.shape[3]
        out = torch.zeros(self.B * self.T, HV, V, dtype=torch.float64, device=self.device)
        out[self.rows[self.valid]] = xp.movedim(1, 2)[self.valid]
        return out.reshape(self.B, self.T, HV, V)


def chunk_gated_delta_rule_bwd_dhu_ref(
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
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.LongTensor | None = None,
    chunk_offsets: torch.LongTensor | None = None,
    use_graph: bool = False,
    *,
    emulate_rounding: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reference for ``fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_dhu``.

    Same arguments as fla 0.6.0 (match by keyword).  Shapes (N = B, or
    ``len(cu_seqlens) - 1`` with varlen, where B must be 1):

    ========== ======================== ==========================================
    q, k       [B, T, H, K]             any float dtype (bf16/fp16 in fla)
    w          [B, T, HV, K]            as q
    do, dv     [B, T, HV, V]            as q
    g          [B, T, HV]               log2-space chunk-local cumsum (scalar gate)
    gk         [B, T, HV, K]            log2-space chunk-local cumsum (per-K gate);
                                        only the last row of each chunk is read
    h0         any                      only ``h0 is None`` matters
    dht        [N, HV, K, V]            ([N, HV, V, K] with state_v_first); None = 0
    cu_seqlens [N + 1] int              varlen boundaries; rows >= cu_seqlens[-1]
                                        of a padded packed batch are ignored
    ========== ======================== ==========================================

    ``scale=None`` means ``K ** -0.5`` (fla's user-facing default; fla's stage 4
    itself requires callers to pass it).  ``chunk_indices`` only sets the length of
    dh's chunk dimension (``len(chunk_indices)``, as fla allocates it);
    ``chunk_offsets[n]`` is where sequence n's chunks start in that dimension
    (default: the exclusive cumsum of ``ceil(len_n / chunk_size)``, fla's
    ``prepare_chunk_offsets``).  ``use_graph`` is ignored.  H must divide HV.

    Returns float64 tensors on the inputs' device:

    * ``dh``  [B, NT, HV, K, V] ([B, NT, HV, V, K] with state_v_first): the state
      gradient entering each chunk (unrounded; fla stores it in q.dtype).  With
      varlen the chunks of all sequences are concatenated along dim 1.
    * ``dh0`` like dht (shape [N, HV, K, V] or [N, HV, V, K]), or None iff h0 is None.
    * ``dv2`` like dv (unrounded); rows no sequence covers stay zero.

    ``emulate_rounding`` models fla's two operand casts (see the module docstring).
    """
    del use_graph  # fla's static output buffers: irrelevant to the values
    BT = int(chunk_size)
    if BT <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be [B, T, H, K] of equal shape, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    B, T, H, K = q.shape
    if do.dim() != 4 or do.shape[:2] != (B, T):
        raise ValueError(f"do must be [B, T, HV, V], got {tuple(do.shape)}")
    HV, V = do.shape[2], do.shape[3]
    if dv.shape != do.shape:
        raise ValueError(f"dv must match do {tuple(do.shape)}, got {tuple(dv.shape)}")
    _check_w_and_gates(w, g, gk, B, T, H, HV, K)
    if scale is None:
        scale = K**-0.5
    scale = float(scale)
    device = q.device
    f64 = torch.float64
    G = HV // H

    seqs = _Sequences(B, T, BT, cu_seqlens, chunk_offsets, chunk_indices, device)
    N, NT, NTmax, lens, valid = seqs.N, seqs.NT, seqs.NTmax, seqs.lens, seqs.valid
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if dht is not None and tuple(dht.shape) != state_shape:
        raise ValueError(f"dht must be {state_shape}, got {tuple(dht.shape)}")

    def gather(x: torch.Tensor, expand_heads: bool = False) -> torch.Tensor:
        return seqs.gather(x, G if expand_heads else 1)

    qp = gather(q, expand_heads=True)
    kp = gather(k, expand_heads=True)
    wp = gather(w)
    dop = gather(do)
    dvp = gather(dv)
    gp = gather(g) if g is not None else None  # [N, HV, L]
    gkp = gather(gk) if gk is not None else None  # [N, HV, L, K]

    if dht is None:
        b = torch.zeros(N, HV, K, V, dtype=f64, device=device)
    else:
        b = dht.to(device=device, dtype=f64)
        if state_v_first:
            b = b.transpose(-1, -2)
        b = b.contiguous()

    dh = torch.zeros(B, NT, HV, K, V, dtype=f64, device=device)
    dv2p = torch.zeros(N, HV, seqs.L, V, dtype=f64, device=device)
    seq_nt_t, seq_batch_t, offs_t = seqs.nt_t, seqs.batch_t, seqs.offs_t

    for c in range(NTmax - 1, -1, -1):
        s, e = c * BT, (c + 1) * BT
        active = seq_nt_t > c  # [N]
        act_idx = active.nonzero().squeeze(1)
        dh[seq_batch_t[act_idx], offs_t[act_idx] + c] = b[act_idx]
        # last row of the chunk per sequence (clamped into the chunk for inactive ones)
        last = (torch.minimum(lens, torch.full_like(lens, e)) - 1).clamp(min=s)  # [N]
        vmask = valid[:, s:e]  # [N, BT]

        kc, qc, wc = kp[:, :, s:e], qp[:, :, s:e], wp[:, :, s:e]
        dvc = kc @ _round_to(b, k.dtype, emulate_rounding)  # [N, HV, BT, V]
        if gp is not None:
            g_last = gp.gather(2, last.view(N, 1, 1).expand(N, HV, 1))  # [N, HV, 1]
            gc = gp[:, :, s:e]
            fac = torch.where(
                vmask[:, None, :], torch.exp2(g_last - gc), torch.zeros((), dtype=f64, device=device)
            )
            dvc = dvc * fac[..., None]
            qc = qc * torch.exp2(gc)[..., None]
        dvc = dvc + dvp[:, :, s:e]
        dv2p[:, :, s:e] = dvc

        bn = b
        if gp is not None:
            bn = bn * torch.exp2(g_last)[..., None]
        if gkp is not None:
            gk_last = gkp.gather(2, last.view(N, 1, 1, 1).expand(N, HV, 1, K))  # [N, HV, 1, K]
            bn = bn * torch.exp2(gk_last).transpose(-1, -2)  # per-K-row decay
        bn = (
            bn
            + scale * (qc.transpose(-1, -2) @ dop[:, :, s:e])
            - wc.transpose(-1, -2) @ _round_to(dvc, w.dtype, emulate_rounding)
        )
        b = torch.where(active.view(N, 1, 1, 1), bn, b)

    dh0 = None
    if h0 is not None:
        dh0 = b.transpose(-1, -2).contiguous() if state_v_first else b
    if state_v_first:
        dh = dh.transpose(-1, -2).contiguous()

    return dh, dh0, seqs.scatter(dv2p)


def chunk_gated_delta_rule_fwd_h_ref(
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
    *,
    emulate_rounding: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reference for ``fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_h``, stage 4's
    forward twin (SPEC.md, "The twin"; fla-core 0.6.0's Triton kernel
    ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``).

    Same arguments as fla 0.6.0 (match by keyword). Shapes (N = B, or ``len(cu_seqlens) - 1``
    with varlen, where B must be 1):

    ============= ==================== ==========================================
    k             [B, T, H, K]         16-bit in fla (KDA passes the gated k)
    w             [B, T, HV, K]        as k
    u             [B, T, HV, V]        as k
    g             [B, T, HV]           log2-space chunk-local cumsum (scalar gate)
    gk            [B, T, HV, K]        log2-space chunk-local cumsum (per-K gate);
                                       only the last row of each chunk is read
    initial_state [N, HV, K, V]        ([N, HV, V, K] with state_v_first); None = 0
    cu_seqlens    [N + 1] int          varlen boundaries (rows past cu_seqlens[-1] of a
                                       padded packed batch are ignored)
    ============= ==================== ==========================================

    Per sequence and value head, oldest chunk first, from h = initial_state, chunks
    ``[s, e)`` of ``chunk_size`` tokens (the last one may be short)::

        h_out[chunk] = h
        v_new[t]     = u[t] - w[t] @ R_w(h)                          t in [s, e)
        v_upd[t]     = exp2(g[e-1] - g[t]) * v_new[t]    (g only; else v_new[t])
        h            = exp2(g[e-1]) * h                  (g only)
        h            = exp2(gk[e-1])[:, None] * h        (gk only)
        h            = h + k^T @ R_k(v_upd)
        final_state  = h

    Value head ``h`` reads k's head ``h // (HV // H)`` (GVA). ``chunk_indices`` only sets
    the length of h's chunk dimension (``len(chunk_indices)``, as fla allocates it);
    ``chunk_offsets[n]`` is where sequence n's chunks start there (default: the exclusive
    cumsum of the chunk counts, fla's ``prepare_chunk_offsets``); ``cu_seqlens_cpu`` is
    ignored.

    Rounding model (``emulate_rounding=True``): fla holds h in fp32 and feeds its two dots
    16-bit operands: ``R_w``, h cast to w.dtype before ``w @ h``; ``R_k``, the gated v_upd
    cast to k.dtype before ``k^T @ v_upd``. Everything else is exact in float64 (the
    stored v_new is u - w @ R_w(h) before its cast to u.dtype, and ungated; h_out before
    its cast to k.dtype). With ``emulate_rounding=False`` the exact recurrence.

    Returns float64 tensors on the inputs' device:

    * ``h``           [B, NT, HV, K, V] ([.., V, K] with state_v_first): the state entering
      each chunk; with varlen the chunks of all sequences along dim 1 (rows no sequence
      writes stay zero).
    * ``v_new``       like u, or None unless ``save_new_value``; rows no sequence covers
      stay zero.
    * ``final_state`` like initial_state ([N, HV, K, V] or [N, HV, V, K]), or None unless
      ``output_final_state``.
    """
    del cu_seqlens_cpu  # a host copy of cu_seqlens: irrelevant to the values
    BT = int(chunk_size)
    if BT <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K], got {tuple(k.shape)}")
    B, T, H, K = k.shape
    if u.dim() != 4 or u.shape[:2] != (B, T):
        raise ValueError(f"u must be [B, T, HV, V], got {tuple(u.shape)}")
    HV, V = u.shape[2], u.shape[3]
    _check_w_and_gates(w, g, gk, B, T, H, HV, K)
    device = k.device
    f64 = torch.float64
    seqs = _Sequences(B, T, BT, cu_seqlens, chunk_offsets, chunk_indices, device)
    N, lens, valid = seqs.N, seqs.lens, seqs.valid
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {state_shape}, got {tuple(initial_state.shape)}")

    kp = seqs.gather(k, HV // H)  # [N, HV, L, K]
    wp = seqs.gather(w)
    up = seqs.gather(u)  # [N, HV, L, V]
    gp = seqs.gather(g) if g is not None else None  # [N, HV, L]
    gkp = seqs.gather(gk) if gk is not None else None  # [N, HV, L, K]

    if initial_state is None:
        h = torch.zeros(N, HV, K, V, dtype=f64, device=device)
    else:
        h = initial_state.to(device=device, dtype=f64)
        h = (h.transpose(-1, -2) if state_v_first else h).contiguous()

    hs = torch.zeros(B, seqs.NT, HV, K, V, dtype=f64, device=device)
    vnp = torch.zeros(N, HV, seqs.L, V, dtype=f64, device=device)
    zero = torch.zeros((), dtype=f64, device=device)
    for c in range(seqs.NTmax):
        s, e = c * BT, (c + 1) * BT
        active = seqs.nt_t > c  # [N]
        act = active.nonzero().squeeze(1)
        hs[seqs.batch_t[act], seqs.offs_t[act] + c] = h[act]
        last = (torch.minimum(lens, torch.full_like(lens, e)) - 1).clamp(min=s)  # [N]
        vmask = valid[:, s:e]  # [N, BT]
        vn = up[:, :, s:e] - wp[:, :, s:e] @ _round_to(h, w.dtype, emulate_rounding)  # [N, HV, BT, V]
        vn = torch.where(vmask[:, None, :, None], vn, zero)
        vnp[:, :, s:e] = vn
        hn = h
        if gp is not None:
            g_last = gp.gather(2, last.view(N, 1, 1).expand(N, HV, 1))  # [N, HV, 1]
            fac = torch.where(vmask[:, None, :], torch.exp2(g_last - gp[:, :, s:e]), zero)
            vn = vn * fac[..., None]
            hn = hn * torch.exp2(g_last)[..., None]
        if gkp is not None:
            gk_last = gkp.gather(2, last.view(N, 1, 1, 1).expand(N, HV, 1, K))  # [N, HV, 1, K]
            hn = hn * torch.exp2(gk_last).transpose(-1, -2)  # per-K-row decay
        hn = hn + kp[:, :, s:e].transpose(-1, -2) @ _round_to(vn, k.dtype, emulate_rounding)
        h = torch.where(active.view(N, 1, 1, 1), hn, h)

    if state_v_first:
        hs = hs.transpose(-1, -2).contiguous()
    final_state = None
    if output_final_state:
        final_state = h.transpose(-1, -2).contiguous() if state_v_first else h
    v_new = seqs.scatter(vnp) if save_new_value else None
    return hs, v_new, final_state


def rel_err(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius, float64); inf if ``out`` has NaN/Inf.

    Both None gives 0.0; exactly one None, or a shape mismatch, raises ValueError.
    A zero ``ref`` gives ‖out‖ (absolute error) so that an all-zero reference still
    discriminates.
    """
    if out is None and ref is None:
        return 0.0
    if out is None or ref is None:
        raise ValueError("rel_err: one of out/ref is None and the other is not")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"rel_err: shape mismatch {tuple(out.shape)} vs {tuple(ref.shape)}")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    return num / den if den > 0 else num
