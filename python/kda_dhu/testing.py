"""Random inputs for every SPEC.md variant of fla's stage 4, and an independent
per-token float64 loop: shared by the tests (CPU and GPU), ``python -m kda_dhu`` and
anyone checking an installation.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os

import torch
import torch.nn.functional as F

GATES = (None, "g", "gk")


def _chunk_local_cumsum(
    x: torch.Tensor, lengths: list[int], starts: list[int], chunk_size: int
) -> torch.Tensor:
    """Cumulative sum of x [T, ...] along dim 0 restarting at every chunk of every sequence.

    Sequence i covers rows [starts[i], starts[i] + lengths[i]); its chunks start at its
    first row (fla's chunk_local_cumsum with cu_seqlens).  Rows outside every sequence
    are returned unchanged.
    """
    out = x.clone()
    for s0, n in zip(starts, lengths):
        for c0 in range(s0, s0 + n, chunk_size):
            c1 = min(c0 + chunk_size, s0 + n)
            out[c0:c1] = x[c0:c1].cumsum(0)
    return out


def make_inputs(
    B: int,
    T: int | None,
    H: int,
    HV: int,
    K: int,
    V: int,
    dtype: torch.dtype = torch.bfloat16,
    gate: str | None = "gk",
    varlen_lengths: list[int] | None = None,
    dht: bool = True,
    h0: bool = True,
    state_v_first: bool = False,
    device: str | torch.device = "cpu",
    *,
    chunk_size: int = 64,
    generator: torch.Generator | None = None,
) -> dict:
    """Fresh random keyword arguments for ``chunk_gated_delta_rule_bwd_dhu``.

    * gate: None (delta rule), "g" (scalar gate, GDN) or "gk" (per-K gate, KDA).
      Gates are fp32 chunk-local cumulative sums of per-token log2 decays in about
      (-0.15, 0) (``-softplus`` shaped), so exp2(gate) lies in (0, 1], like fla's.
    * varlen_lengths: packs sequences of these lengths at B == 1 and returns
      ``cu_seqlens`` (int64).  ``T`` may be None (= sum of lengths) or larger than the
      sum: a padded packed batch whose padding rows hold large random garbage that no
      implementation may read.
    * q, k are L2-normalized per head (fla's use_qk_l2norm), w is small (|w_t| ~ 0.25),
      do, dv standard normal: the reverse scan stays O(1) over long sequences.
    * dht / h0: fp32, [N, HV, K, V] ([N, HV, V, K] with state_v_first), or None.
    * scale = K ** -0.5.

    Random numbers come from ``generator`` (a CPU torch.Generator) or torch's global
    RNG; tensors are drawn on the CPU and then moved to ``device`` so a seed gives the
    same inputs on every device.
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if HV % H:
        raise ValueError(f"H ({H}) must divide HV ({HV})")
    gen = generator

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    if varlen_lengths is not None:
        if B != 1:
            raise ValueError("varlen inputs need B == 1")
        total = sum(varlen_lengths)
        T = total if T is None else T
        if T < total:
            raise ValueError(f"T = {T} < sum(varlen_lengths) = {total}")
        cu = [0]
        for n in varlen_lengths:
            cu.append(cu[-1] + n)
        N, lengths, starts = len(varlen_lengths), list(varlen_lengths), cu[:-1]
    else:
        if T is None:
            raise ValueError("T is required without varlen_lengths")
        cu, N, lengths, starts = None, B, [T] * B, None

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    w = 0.25 * F.normalize(randn(B, T, HV, K), dim=-1)
    do = randn(B, T, HV, V)
    dv = randn(B, T, HV, V)

    g = gk = None
    if gate is not None:
        gshape = (B, T, HV) if gate == "g" else (B, T, HV, K)
        # per-token log2 decay in (-0.15, 0): -softplus(x - 3) / ln 2 / 2 is ~ -0.035 typical
        step = -F.softplus(randn(*gshape) - 3.0) / math.log(2) / 2
        step = step.clamp(min=-0.15)
        if cu is None:
            cs = torch.stack([_chunk_local_cumsum(step[b], [T], [0], chunk_size) for b in range(B)])
        else:
            cs = _chunk_local_cumsum(step[0], lengths, starts, chunk_size)[None]
        if gate == "g":
            g = cs
        else:
            gk = cs

    state = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    dht_t = randn(*state) if dht else None
    h0_t = randn(*state) if h0 else None

    if cu is not None and T > cu[-1]:
        # padding rows of a padded packed batch: garbage nobody may read
        for x in (q, k, w, do, dv):
            x[:, cu[-1] :] = 1e4 * randn(*x[:, cu[-1] :].shape)
        for x in (g, gk):
            if x is not None:
                x[:, cu[-1] :] = 50.0  # exp2(50) would blow up anything that reads it

    def to(x: torch.Tensor | None, dt: torch.dtype | None) -> torch.Tensor | None:
        if x is None:
            return None
        return x.to(device=device, dtype=dt if dt is not None else x.dtype)

    return dict(
        q=to(q, dtype),
        k=to(k, dtype),
        w=to(w, dtype),
        do=to(do, dtype),
        dv=to(dv, dtype),
        g=to(g, torch.float32),
        gk=to(gk, torch.float32),
        h0=to(h0_t, torch.float32),
        dht=to(dht_t, torch.float32),
        scale=K**-0.5,
        state_v_first=state_v_first,
        cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.long, device=device),
        chunk_size=chunk_size,
    )


def chunk_tables(cu_seqlens: torch.Tensor, T: int | None = None, dtype: torch.dtype | None = None):
    """fla's chunk tables of a packed batch without fla: ``(chunk_indices, chunk_offsets)``.

    chunk_indices [NT, 2] holds (sequence, chunk within the sequence) rows and
    chunk_offsets [N + 1] the first chunk of each sequence (the last entry is NT), as
    fla's ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` give them for chunk_size
    64; on cu_seqlens' device, in ``dtype`` (default: cu_seqlens' dtype). ``T``: the
    packed batch's length (default: cu_seqlens[-1]).

    For tests and drivers that keep fla out: it reads cu_seqlens on the host (one
    synchronization) and counts the chunks with the core's checker
    (``kda_dhu._core.check_tables``), which raises ValueError on a bad table.
    """
    from . import _core

    cu = [int(x) for x in cu_seqlens.tolist()]
    offsets = _core.check_tables(cu, cu[-1] if T is None else int(T))
    rows = [(n, c) for n in range(len(cu) - 1) for c in range(offsets[n + 1] - offsets[n])]
    dtype = cu_seqlens.dtype if dtype is None else dtype
    indices = torch.tensor(rows, dtype=dtype).reshape(len(rows), 2)
    return indices.to(cu_seqlens.device), torch.tensor(offsets, dtype=dtype, device=cu_seqlens.device)


# Packed batches whose tables break the conditions the kernels check on the device
# (src/varlen.rs), for the GPU tests and the sanitizer driver. Each is the good batch
# GOOD_BATCH (T = 300 tokens, sequences of 100, 130 and 70 tokens: chunk offsets 0, 2, 5,
# 7) with one table replaced: "cu" (cu_seqlens), "chunk_offsets" ([N + 1]), "nt" (dh's
# rows: len(chunk_indices)). "seq": the one failing sequence (None: several fail, garbage
# values); "dh_rows" / "dv2_rows": the rows [start, end) where its outputs must be NaN
# (None: its entries bound none); every other sequence's outputs are those of the good
# batch. Values that fit int32, but for "garbage_int64".
GOOD_BATCH = dict(lengths=[100, 130, 70], cu=[0, 100, 230, 300], T=300, nt=7)
BAD_BATCHES = {
    "first_offset": dict(cu=[5, 100, 230, 300], seq=0, dh_rows=(0, 2), dv2_rows=(5, 100)),
    "decreasing": dict(cu=[0, 100, 230, 200], seq=2, dh_rows=None, dv2_rows=None),
    "past_t": dict(cu=[0, 100, 230, 350], seq=2, dh_rows=(5, 7), dv2_rows=(230, 300)),
    "chunk_offsets": dict(chunk_offsets=[0, 2, 5, 8], seq=2, dh_rows=(5, 7), dv2_rows=(230, 300)),
    "past_nt": dict(nt=6, seq=2, dh_rows=(5, 6), dv2_rows=(230, 300)),
    "garbage_int32": dict(cu=[0, 2**31 - 1, -(2**31), 300], chunk_offsets=[0, -5, 2**31 - 1, 3], seq=None),
    "garbage_int64": dict(cu=[0, 2**40, 5, -(2**62)], seq=None),
}


def bad_batch(name: str) -> dict:
    """``BAD_BATCHES[name]`` with the good batch's tables filled in: cu, chunk_offsets
    (None where the case has none), nt, T, seq, dh_rows, dv2_rows."""
    case = dict(BAD_BATCHES[name])
    out = dict(cu=GOOD_BATCH["cu"], chunk_offsets=None, nt=GOOD_BATCH["nt"], T=GOOD_BATCH["T"])
    out.update(case)
    out.setdefault("dh_rows", None)
    out.setdefault("dv2_rows", None)
    return out


# Memory layouts of one input that a caller may hand stage 4 (``relayout``): each holds the
# values of a contiguous tensor (``expanded`` its own: one index repeated), none is packed
# the way fla's function reads tensors but the aligned offset.
LAYOUTS = (
    "permuted",  # dims 1 and 2 swapped in memory: x.transpose(1, 2).contiguous().transpose(1, 2)
    "slice_dim1",  # a slice of a larger tensor along dim 1 (T; HV of a state)
    "slice_dim2",  # along dim 2 (heads; K of a state)
    "slice_last",  # along the last dim (K or V; 4-D tensors)
    "offset_misaligned",  # contiguous, one element past a 16-byte boundary
    "offset_aligned",  # contiguous, 16 bytes into its storage
    "expanded",  # stride 0 along dim 2 (index 0 repeated)
)


def relayout(x: torch.Tensor, layout: str, fill: float = float("nan")) -> torch.Tensor | None:
    """``x``'s values in another memory layout (one of ``LAYOUTS``), in new storage whose
    elements outside the view hold ``fill`` (NaN by default: whatever reads them shows).
    ``expanded`` holds index 0 of dim 2 repeated (its own values, not x's). None where the
    layout does not apply to x's shape (a dim of size 1 to permute, slice or expand: a
    size-1 dim's stride is no layout at all; ``slice_last`` of a 3-D tensor). The result
    is a view; ``x`` is not modified."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shape = tuple(x.shape)
    if layout == "permuted":
        if x.dim() < 3 or shape[1] < 2 or shape[2] < 2:
            return None
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout.startswith("slice_"):
        d = {"slice_dim1": 1, "slice_dim2": 2, "slice_last": x.dim() - 1}[layout]
        if x.dim() < 3 or (layout == "slice_last" and x.dim() != 4) or shape[d] < 2:
            return None
        big = list(shape)
        big[d] += 2
        out = torch.full(big, fill, dtype=x.dtype, device=x.device).narrow(d, 1, shape[d])
        return out.copy_(x)
    if layout.startswith("offset_"):
        skip = 1 if layout == "offset_misaligned" else 16 // x.element_size()
        flat = torch.full((x.numel() + skip,), fill, dtype=x.dtype, device=x.device)
        return flat[skip:].view(shape).copy_(x)
    # expanded
    if x.dim() < 3 or shape[2] < 2:
        return None
    return x.narrow(2, 0, 1).clone().expand(shape)


def naive_bwd_dhu(
    q,
    k,
    w,
    do,
    dv,
    g=None,
    gk=None,
    h0=None,
    dht=None,
    scale=None,
    state_v_first=False,
    cu_seqlens=None,
    chunk_size=64,
    round_dtype=None,
    **_,
):
    """Independent, deliberately plain implementation: loops over sequences, heads, chunks
    and tokens, one token's vectors at a time, in float64.

    If ``round_dtype`` is given, b is rounded to it before each k[t] @ b and dv2[t]
    before it enters the b update (fla's two operand casts).  Returns (dh, dh0, dv2)
    shaped like fla's outputs, float64.
    """
    f = torch.float64
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    BT = chunk_size
    scale = K**-0.5 if scale is None else scale
    rnd = (lambda x: x.to(round_dtype).to(f)) if round_dtype is not None else (lambda x: x)
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        seqs = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    nts = [-(-(e - s) // BT) for _, s, e in seqs]
    NT = -(-T // BT) if cu_seqlens is None else sum(nts)
    dh = torch.zeros(B, NT, HV, K, V, dtype=f)
    dv2 = torch.zeros(B, T, HV, V, dtype=f)
    dh0 = torch.zeros(len(seqs), HV, K, V, dtype=f)
    base = 0
    for n, (bi, s0, e0) in enumerate(seqs):
        for h in range(HV):
            hq = h // (HV // H)
            if dht is None:
                b = torch.zeros(K, V, dtype=f)
            else:
                b = dht[n, h].to(f)
                if state_v_first:
                    b = b.t()
                b = b.clone()
            chunk_starts = list(range(s0, e0, BT))
            for ci in reversed(range(len(chunk_starts))):
                cs = chunk_starts[ci]
                ce = min(cs + BT, e0)
                off = ci if cu_seqlens is None else base + ci
                dh[bi, off, h] = b
                upd = torch.zeros(K, V, dtype=f)
                for t in range(cs, ce):
                    kt = k[bi, t, hq].to(f)
                    val = kt @ rnd(b)
                    if g is not None:
                        val = val * 2.0 ** (float(g[bi, ce - 1, h]) - float(g[bi, t, h]))
                    val = val + dv[bi, t, h].to(f)
                    dv2[bi, t, h] = val
                    qt = q[bi, t, hq].to(f)
                    if g is not None:
                        qt = qt * 2.0 ** float(g[bi, t, h])
                    upd += scale * torch.outer(qt, do[bi, t, h].to(f))
                    upd -= torch.outer(w[bi, t, h].to(f), rnd(val))
                if g is not None:
                    b = b * 2.0 ** float(g[bi, ce - 1, h])
                if gk is not None:
                    decay = torch.tensor([2.0 ** float(x) for x in gk[bi, ce - 1, h]], dtype=f)
                    b = decay[:, None] * b
                b = b + upd
            dh0[n, h] = b
        base += nts[n]
    if state_v_first:
        dh = dh.transpose(-1, -2)
        dh0 = dh0.transpose(-1, -2)
    return dh, (dh0 if h0 is not None else None), dv2


# ----------------------------------------------------------------------------- routing probes
# Shared by benches/e2e.py and benches/cp_check.py: switch kda-dhu's fla backend per call
# and count what the dispatcher did.


def _call(args: dict):
    """A ``make_inputs`` dict as the dispatcher's general path carries a call."""
    from . import _dispatch

    a = args
    return _dispatch._Call(
        a["q"], a["k"], a["w"], a["do"], a["dv"], a.get("g"), a.get("gk"), a.get("h0"), a.get("dht"),
        a.get("scale", a["q"].shape[-1] ** -0.5), a.get("state_v_first", False), a.get("cu_seqlens"),
        a.get("chunk_size", 64), a.get("chunk_indices"), a.get("chunk_offsets"), a.get("use_graph", False),
    )  # fmt: skip


def plan(args: dict, rule: str = "capable") -> tuple[bool, str]:
    """The planner's verdict (use_kernel, reason) on a call's keyword arguments
    (``make_inputs``' dict) under ``rule`` ("capable", "extended", "b2a"), as the
    dispatcher's general path decides it. Raises what validation raises."""
    from . import _dispatch

    return _dispatch.verdict_of(rule, _call(args))


def run_kernel(args: dict, poison: bool = False, rule: str = "capable"):
    """kda-dhu's kernel on a call's keyword arguments (``make_inputs``' dict), whatever the
    extended rule would choose: the planner's "capable" rule (or ``rule``: "extended",
    "b2a"), on the inputs' device.

    Returns (dh, dh0, dv2). ``poison``: every output is filled with NaN first, so that an
    element the kernel does not write stays NaN. Raises RuntimeError (with the planner's
    reason) where the rule sends the call to fla, and what validation raises.
    """
    from . import _dispatch

    return _dispatch.run_kernel(rule, _call(args), poison=poison)


from .fla_backend import ENV_VAR as BACKEND_ENV  # noqa: E402  (FLA_KDA_DHU, read by fla at every call)


def set_backend(mode: str) -> None:
    """kda-dhu's fla backend on for mode "kda_dhu" (FLA_KDA_DHU unset), off for any other
    mode name ("fla", "fla_again": FLA_KDA_DHU=0)."""
    if mode == "kda_dhu":
        os.environ.pop(BACKEND_ENV, None)
    else:
        os.environ[BACKEND_ENV] = "0"


@contextlib.contextmanager
def restored_backend():
    """Restores FLA_KDA_DHU to its value on entry when the block exits."""
    before = os.environ.get(BACKEND_ENV)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before


@contextlib.contextmanager
def backend_mode(mode: str):
    """``set_backend(mode)`` for the duration of the block."""
    with restored_backend():
        set_backend(mode)
        yield


class KernelProbe:
    """Counts kda-dhu kernel launches (``kda_dhu._core.launch_count()``: every route, the
    one-crossing path included) and records the fla backend verifier's verdicts
    (``kda_dhu._dispatch.verify``, rebound for the duration of the block: the verifier
    looks it up in that module at call time). Subclasses add rebindings through
    ``_wrappers``."""

    def __init__(self):
        self.dispatch = importlib.import_module("kda_dhu._dispatch")
        self.reset()

    def reset(self):
        self._base = self._count()
        self.verdicts = []

    @staticmethod
    def _count() -> int:
        from . import _core

        return _core.launch_count()

    @property
    def launches(self) -> int:
        return self._count() - self._base

    def _wrappers(self) -> list:
        """(module, name, wrapper factory taking the original) triples to rebind."""

        def verify(original):
            def wrapper(*args, **kwargs):
                verdict = original(*args, **kwargs)
                self.verdicts.append(verdict[:2])
                return verdict

            return wrapper

        return [(self.dispatch, "verify", verify)]

    def __enter__(self):
        self.reset()
        self._bound = []
        for module, name, make in self._wrappers():
            original = module.__dict__[name]
            ours = make(original)
            ours.__wrapped__ = original
            setattr(module, name, ours)
            self._bound.append((module, name, original, ours))
        return self

    def __exit__(self, *exc):
        for module, name, original, ours in reversed(self._bound):
            if module.__dict__.get(name) is ours:
                setattr(module, name, original)
        return False
