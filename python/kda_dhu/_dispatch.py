"""Entry points: fla's full signature, the seed's dispatcher, and the planner's verdict.

Every entry point asks the Rust planner (``kda_dhu._core.prepare``) whether the kernel
covers the call. It says kernel or fallback, and why; a call it cannot accept at all
(bad dtype, shape, device, scale, ...) raises there, naming the argument. Outputs are
allocated here with torch (the caching allocator, on the inputs' device) and the
kernel is launched on torch's current stream of that device, through the prepared
call: the inputs are read and validated once per call (issue #7, host overhead).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import warnings

import torch

from ._selfcheck import SelfCheck, signature_of

try:
    from . import _core
except ImportError as _err:  # a source checkout without the compiled extension
    _core = None
    _core_error = _err

BT = 64

# Debugging switch: KDA_DHU_FORCE=kernel runs the kernel wherever it is able to (the
# planner's "capable" rule: past the policy clauses, such as the seed's 256-CTA floor
# or the measured K = 64 loss) and raises where it is not; KDA_DHU_FORCE=fla always
# calls fla's own function. Read at every call.
FORCE_ENV = "KDA_DHU_FORCE"


def _env_reader(name: str):
    """A function returning os.environ.get(name), at a tenth of its cost.

    ``os.environ.get`` encodes the key and decodes the value on every call (~0.6 us);
    this looks the pre-encoded key up in the mapping's own dict, which every change
    through ``os.environ`` (``monkeypatch.setenv`` included) updates. Falls back to
    ``os.environ.get`` where that dict is not there, or when ``os.environ`` itself was
    replaced.
    """
    env = os.environ
    data = getattr(env, "_data", None)
    try:
        key = env.encodekey(name)
        decode = env.decodevalue
    except AttributeError:
        data = None
    if not isinstance(data, dict):
        return lambda: os.environ.get(name)

    def read():
        if os.environ is not env:
            return os.environ.get(name)
        raw = data.get(key)
        return None if raw is None else decode(raw)

    return read


_read_force = _env_reader(FORCE_ENV)
# KDA_DHU_FORCE values that mean "unset" (as no variable at all)
_FORCE_UNSET = ("", "0", "auto")

# torch's current raw stream of a device, as an int: what
# ``torch.cuda.current_stream(device).cuda_stream`` returns, without building a Stream
# object (~1 us less; torch's own compiled kernels launch through it).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

_fla_lock = threading.Lock()
_fla_fn = None


def fla_function():
    """fla's own ``chunk_gated_delta_rule_bwd_dhu``, undecorated.

    The function under fla's backend-dispatch wrapper, so that a fallback never routes
    back into kda-dhu's fla backend or patch. Raises ImportError if fla is not installed.
    """
    global _fla_fn
    if _fla_fn is None:
        with _fla_lock:
            if _fla_fn is None:
                try:
                    import fla.ops.common.chunk_delta_h as mod
                except ImportError as err:  # pragma: no cover - depends on the environment
                    raise ImportError(
                        "kda_dhu falls back to flash-linear-attention for calls its kernel does "
                        "not cover, and fla is not importable: pip install fla-core"
                    ) from err
                fn = mod.chunk_gated_delta_rule_bwd_dhu
                if getattr(fn, "_kda_dhu_entry", False):
                    from .patch import original_function

                    fn = original_function()
                _fla_fn = inspect.unwrap(fn)
    return _fla_fn


_NO_CTX = contextlib.nullcontext()  # stateless: one for every call

# torch's current CUDA device, without torch.cuda.current_device()'s lazy-init check
# (a CUDA tensor exists, so CUDA is initialized).
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _device_ctx(q):
    """torch exports a CUDA tensor through DLPack only on its current device."""
    if isinstance(q, torch.Tensor) and q.is_cuda and q.get_device() != _cuda_get_device():
        return torch.cuda.device(q.device)
    return _NO_CTX


_warned_force = set()


def _force() -> str | None:
    raw = _read_force()
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _FORCE_UNSET:
        return None
    if value not in ("kernel", "fla"):
        # Raised on a direct call; through fla's backend the verifier would swallow it,
        # so it is also warned about, once per value.
        if value not in _warned_force:
            _warned_force.add(value)
            warnings.warn(
                f"{FORCE_ENV}={value!r}: expected 'kernel', 'fla' or unset", RuntimeWarning, stacklevel=3
            )
        raise ValueError(f"{FORCE_ENV}: expected 'kernel', 'fla' or unset, got {value!r}")
    return value


def _fast_path() -> bool:
    """Whether a call without cu_seqlens may take ``_core.run``: the kernel path in one
    crossing into Rust (read, validate, plan, allocate, launch; issue #7). Not under
    KDA_DHU_FORCE (whose rules the general path applies); ``_core.run`` itself hands
    back to the general path whatever is not the verified sm_90a kernel."""
    if _core is None:
        return False
    raw = _read_force()
    return raw is None or raw.strip().lower() in _FORCE_UNSET


def _default_scale(q, scale: float | None) -> float | None:
    """K ** -0.5 when scale is None; left None for a q the validator will reject by name."""
    if scale is None:
        try:
            return q.shape[-1] ** -0.5
        except Exception:  # noqa: BLE001 - not a usable q: _core names the argument
            return None
    return scale


def _prepare(
    rule: str, q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_offsets
) -> tuple[bool, str, object]:
    """(use_kernel, reason, prepared call or None). Raises on input that is invalid for
    fla and kernel alike.

    The prepared call (``_core.PreparedCall``) holds the validated inputs: launching it
    (``_run_kernel``) reads only the outputs. None under KDA_DHU_FORCE=fla.
    """
    if _core is None:
        raise ImportError(f"kda_dhu's compiled extension (kda_dhu._core) is not built: {_core_error}")
    force = _force()
    if force == "fla":
        _core.validate(
            q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_offsets
        )
        return False, f"{FORCE_ENV}=fla", None
    ok, reason, call = _core.prepare(
        rule, q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_offsets
    )
    if force == "kernel" and not ok:
        ok, reason = call.replan("capable")
        if not ok:
            raise RuntimeError(f"{FORCE_ENV}=kernel, but the kernel cannot run this call: {reason}")
    return ok, reason, call


def _decide(
    rule: str, q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_offsets
) -> tuple[bool, str]:
    """(use_kernel, reason). Raises on input that is invalid for fla and kernel alike."""
    ok, reason, _ = _prepare(
        rule, q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_offsets
    )
    return ok, reason


def _index64(t):
    """An int32 index tensor (cu_seqlens, chunk_offsets) as int64 for the kernel, which reads
    int64: fla takes either (its context-parallel path builds int32 cu_seqlens). Only a
    plain 1-D contiguous tensor is widened; anything else (a view the validator refuses,
    an expanded giant) is returned as it is, for the validator to judge by name."""
    if (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.int32
        and t.dim() == 1
        and t.is_contiguous()
        and not t.is_neg()
    ):
        return t.to(torch.int64)
    return t


def _varlen_chunks(cu_seqlens: torch.Tensor, T: int):
    """Checks cu_seqlens' values and returns (NT total, chunk_offsets as int64 [N+1]).

    Reads cu_seqlens on the host (one synchronization, as fla's own varlen path does
    when it prepares its chunk indices).
    """
    lens_host = cu_seqlens.tolist()
    if lens_host[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {lens_host[0]}")
    for i in range(len(lens_host) - 1):
        if lens_host[i + 1] < lens_host[i]:
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{i}] = "
                f"{lens_host[i]} > cu_seqlens[{i + 1}] = {lens_host[i + 1]}"
            )
    if lens_host[-1] > T:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] <= T = {T}, got {lens_host[-1]}")
    chunks = [(lens_host[i + 1] - lens_host[i] + BT - 1) // BT for i in range(len(lens_host) - 1)]
    NT = sum(chunks)
    # Always the offsets of these cu_seqlens: a caller's chunk_offsets (fla's
    # prepare_chunk_offsets, the same numbers) are not trusted to steer the kernel's stores.
    offs = [0]
    for c in chunks:
        offs.append(offs[-1] + c)
    chunk_offsets = torch.tensor(offs, dtype=torch.int64).to(cu_seqlens.device, non_blocking=True)
    return NT, chunk_offsets


def _empty(q, shape, dtype):
    """torch.empty(shape, dtype=dtype, device=q.device): a plain tensor.

    ``q.new_empty`` where q is a plain tensor (~0.3 us less: no device object); a
    subclass's new_empty could return the subclass.
    """
    if type(q) is torch.Tensor:
        return q.new_empty(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device=q.device)


def _alloc(shape, dtype, device, use_graph: bool, name: str):
    if use_graph:
        from fla.ops.utils.graph import get_static_buffer

        return get_static_buffer(name, tuple(shape), dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


# The sm_100a kernel has never run on real hardware: guard it (see _selfcheck).
SM100_CHECK = SelfCheck("sm_100a")


def _guarded(reason: str, signature, run_kernel, run_fla):
    """Run the planned kernel; on an architecture whose kernel is unverified, self-check it.

    ``signature()`` gives the call's shape signature (computed only for that check).
    """
    if reason == "kernel-sm100a":
        return SM100_CHECK.run(signature(), run_kernel, run_fla)
    return run_kernel()


def _current_stream(q) -> int:
    if _raw_stream is not None:
        return _raw_stream(q.get_device())
    return torch.cuda.current_stream(q.device).cuda_stream


def _run_kernel(
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
    cu_seqlens,
    chunk_indices,
    chunk_offsets,
    use_graph,
    poison=False,
    call=None,
    state_v_first=False,
):
    """Allocates the outputs and launches the kernel; None where fla's function must run.

    ``call``: the ``_core.PreparedCall`` of these arguments (from ``_prepare``), which
    launches without reading the inputs again; None launches through ``_core.launch``
    (reads and validates everything). ``state_v_first``: dh is [B, NT, HV, V, K].
    """
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if cu_seqlens is not None:
        NT, chunk_offsets = _varlen_chunks(cu_seqlens, T)
        if NT == 0:  # every sequence empty: nothing for a kernel to walk
            return None
        if chunk_indices is not None and len(chunk_indices) != NT:
            # fla sizes dh by its chunk table, which may be longer than these sequences'
            # chunks (fla's CUDA-graph mode pads it): fla's own function keeps its shapes.
            return None
    else:
        NT, chunk_offsets = (T + BT - 1) // BT, None
    dh_shape = (B, NT, HV, V, K) if state_v_first else (B, NT, HV, K, V)
    if use_graph:
        dh = _alloc(dh_shape, q.dtype, q.device, use_graph, "dhu_dh")
        dh0 = (
            _alloc(tuple(h0.shape), torch.float32, q.device, use_graph, "dhu_dh0") if h0 is not None else None
        )
        dv2 = _alloc(tuple(dv.shape), dv.dtype, q.device, use_graph, "dhu_dv2")
    else:
        dh = _empty(q, dh_shape, q.dtype)
        dh0 = _empty(q, h0.shape, torch.float32) if h0 is not None else None
        dv2 = _empty(q, dv.shape, dv.dtype)
    if poison:  # tests: an element the kernel does not write stays NaN
        for out in (dh, dh0, dv2):
            if out is not None:
                out.fill_(float("nan"))
    stream = _current_stream(q)
    if call is not None:
        call.launch(dh, dh0, dv2, chunk_offsets, stream)
    else:
        _core.launch(
            q,
            k,
            w,
            do,
            dv,
            g,
            gk,
            h0,
            dht,
            float(scale),
            state_v_first,
            cu_seqlens,
            BT,
            chunk_offsets,
            dh,
            dh0,
            dv2,
            stream,
        )
    return dh, dh0, dv2


def _graph_clause(cu_seqlens, use_graph) -> str | None:
    """The one clause the Python side adds to the plan (it alone knows use_graph and
    whether a CUDA graph is being captured)."""
    if cu_seqlens is None:
        return None
    if use_graph:
        return (
            "use_graph with cu_seqlens: the kernel path reads cu_seqlens on the host, "
            "which a CUDA graph cannot capture"
        )
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return (
            "cu_seqlens during CUDA-graph capture: the kernel path reads cu_seqlens on "
            "the host, which a graph cannot capture"
        )
    return None


def plan_call(
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
    chunk_indices=None,
    chunk_offsets=None,
    use_graph=False,
) -> tuple[bool, str | None]:
    """The planner's verdict on a call of ``chunk_gated_delta_rule_bwd_dhu``; no side effects.

    Returns ``(True, "kernel-sm90a")`` when kda-dhu's kernel runs the call, else
    ``(False, reason)``. Invalid input is reported as ``(False, message)`` rather than
    raised: this is the verifier of kda-dhu's fla backend, and fla then runs the call
    itself (and raises its own error if it must).
    """
    try:
        with _device_ctx(q):
            ok, reason = _decide(
                "extended",
                q,
                k,
                w,
                do,
                dv,
                g,
                gk,
                h0,
                dht,
                _default_scale(q, scale),
                state_v_first,
                _index64(cu_seqlens),
                chunk_size,
                _index64(chunk_offsets),
            )
    except Exception as err:  # noqa: BLE001 - the verifier reports, fla decides
        return False, f"{type(err).__name__}: {err}"
    graph = _graph_clause(cu_seqlens, use_graph)
    return (False, graph) if ok and graph else (ok, reason)


def chunk_gated_delta_rule_bwd_dhu(
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Stage 4 of the chunked gated delta rule backward: fla's signature, kda-dhu's kernel.

    The reverse state scan of ``fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_dhu``
    (fla-core 0.6; the math is SPEC.md's recurrence): for each sequence and value head,
    walking chunks of 64 tokens newest first, it stores the state gradient entering each
    chunk (dh), the corrected value gradient dv2, and the gradient of the initial state.

    Args:
        q, k: [B, T, H, K] bf16/fp16 (KDA passes its gated qg, kg).
        w: [B, T, HV, K], q's dtype (WY representation).
        do, dv: [B, T, HV, V], the output gradient and stage 3's dv.
        g: [B, T, HV] fp32 scalar log2-space gate, chunk-local cumsum (GDN), or None.
        gk: [B, T, HV, K] fp32 per-key log2-space gate, chunk-local cumsum (KDA), or None.
        h0: initial state [N, HV, K, V] (or [N, HV, V, K] with state_v_first); only its
            presence matters: dh0 is returned iff h0 is given.
        dht: fp32 gradient of the final state, shaped like h0, or None (zeros).
        scale: multiplies the fp32 q^T do dot; None means K ** -0.5.
        state_v_first: dh, dht, h0, dh0 keep V before K.
        cu_seqlens: int64 or int32 [N + 1] sequence offsets of a packed batch (B == 1), or
            None (int32 is widened to int64 for the kernel).
        chunk_size: 64 on the kernel path (fla handles others).
        chunk_indices, chunk_offsets: fla's precomputed varlen chunk tables, optional.
        use_graph: fla's static output buffers for CUDA-graph capture. With cu_seqlens the
            call runs fla's function: the kernel path reads cu_seqlens on the host (to
            check it and size dh), which a graph cannot capture.

    Returns:
        (dh, dh0, dv2): dh [B, NT, HV, K, V] in q's dtype (NT = ceil(T / 64), or the
        total chunk count of all sequences with cu_seqlens; [B, NT, HV, V, K] with
        state_v_first), dh0 fp32 shaped like h0 or None, dv2 like dv. With cu_seqlens
        whose last offset is short of T, dv2's padding rows are zeros.

    Raises:
        TypeError / ValueError: a tensor's dtype, shape, device, stride or alignment is
            not what the op takes (the message names the argument and the expectation);
            cu_seqlens not starting at 0, decreasing, past T, or B != 1; scale not finite.
        RuntimeError: a CUDA driver or launch failure; KDA_DHU_FORCE=kernel on a call the
            kernel cannot run.

    Calls the kernel where ``plan_call`` accepts; otherwise fla's own function with the
    same arguments, so results match fla's to rounding either way.
    """
    if cu_seqlens is None and not use_graph and _fast_path():
        out = _core.run("extended", q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, chunk_size)
        if out is not None:
            return out
    scale = _default_scale(q, scale)

    def run_fla():
        return fla_function()(
            q=q,
            k=k,
            w=w,
            do=do,
            dv=dv,
            g=g,
            gk=gk,
            h0=h0,
            dht=dht,
            scale=scale,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
            use_graph=use_graph,
        )

    with _device_ctx(q):
        # int32 cu_seqlens / chunk_offsets (fla accepts them) reach the kernel as int64;
        # fla's function, if it runs, gets the caller's tensors.
        cu64, offsets64 = _index64(cu_seqlens), _index64(chunk_offsets)
        use_kernel, reason, call = _prepare(
            "extended", q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu64, chunk_size, offsets64
        )
        if use_kernel and not _graph_clause(cu_seqlens, use_graph):

            def run_kernel():
                out = _run_kernel(
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
                    cu64,
                    chunk_indices,
                    offsets64,
                    use_graph,
                    call=call,
                    state_v_first=state_v_first,
                )
                return run_fla() if out is None else out

            def signature():
                return signature_of(
                    "extended",
                    q,
                    do,
                    g=g,
                    gk=gk,
                    h0=h0,
                    dht=dht,
                    state_v_first=state_v_first,
                    cu_seqlens=cu_seqlens,
                )

            return _guarded(reason, signature, run_kernel, run_fla)
    return run_fla()


chunk_gated_delta_rule_bwd_dhu._kda_dhu_entry = True


def kda_dhu_b2a(qg, kg, w, g2, h0, dht, do, dv, scale, chunk_size):
    """The seed's stage-4 dispatcher, argument for argument fla's call with q=qg, k=kg, gk=g2.

    Runs kda-dhu's kernel only when all of the seed's clauses hold (SPEC.md): chunk_size
    == 64, T % 64 == 0, K in (64, 128), V % 64 == 0, dtype bf16 or fp16, dht given, and
    B * HV * (V // 64) >= 256 CTAs; otherwise it returns fla's own result for the same
    arguments. Shapes: qg, kg [B, T, H, K]; w [B, T, HV, K]; g2 [B, T, HV, K] fp32;
    h0, dht [B, HV, K, V] fp32 (h0 only decides whether dh0 is returned); do, dv
    [B, T, HV, V].

    Returns (dh [B, NT, HV, K, V] in qg's dtype, dh0 fp32 or None if h0 is None, dv2).
    Raises as ``chunk_gated_delta_rule_bwd_dhu`` does.
    """
    if _fast_path():
        out = _core.run("b2a", qg, kg, w, do, dv, None, g2, h0, dht, scale, False, chunk_size)
        if out is not None:
            return out

    def run_fla():
        return fla_function()(
            q=qg, k=kg, w=w, gk=g2, h0=h0, dht=dht, do=do, dv=dv, scale=scale, chunk_size=chunk_size
        )

    with _device_ctx(qg):
        use_kernel, reason, call = _prepare(
            "b2a", qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size, None
        )
        if use_kernel:

            def run_kernel():
                return _run_kernel(
                    qg, kg, w, do, dv, None, g2, h0, dht, scale, None, None, None, False, call=call
                )

            def signature():
                return signature_of("b2a", qg, do, gk=g2, h0=h0, dht=dht)

            return _guarded(reason, signature, run_kernel, run_fla)
    return run_fla()


def plan_b2a(qg, kg, w, g2, h0, dht, do, dv, scale, chunk_size) -> tuple[bool, str]:
    """The seed dispatcher's verdict for a ``kda_dhu_b2a`` call: (use_kernel, reason)."""
    with _device_ctx(qg):
        return _decide("b2a", qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size, None)
