"""Entry points: fla's full signature, the original dispatcher, and the planner's verdict.

Every call is decided once, in Rust (``kda_dhu._core``): the inputs read through DLPack
and validated, the plan (kernel or fla's function, and why), the inputs to copy, the
output shapes. The common call (plain torch tensors, packed inputs, chunk_indices given
with cu_seqlens) runs in one crossing (``_core.run``: decide, allocate with torch,
launch on torch's current stream). Everything else takes the general path here: layout
copies, a packed batch's chunk count, KDA_DHU_FORCE, the host check of
KDA_DHU_CHECK_INPUTS, fla's CUDA-graph buffers, the sm_100a self-check, fla's function.

No path synchronizes the host with the GPU, but for the chunk count of a packed batch
given without chunk_indices (one read per distinct cu_seqlens tensor, through fla's
cache, as fla's own function does) and KDA_DHU_CHECK_INPUTS=1. A packed batch's values
are checked on the device; a bad one is raised by the next call (or ``check_errors``).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from . import _driver
from ._fla import chunk_count, fla_function
from ._selfcheck import SelfCheck, signature_of

try:
    from . import _core
except ImportError as _err:  # a source checkout without the compiled extension
    _core = None
    _core_error = _err

__all__ = [
    "chunk_gated_delta_rule_bwd_dhu",
    "kda_dhu_b2a",
    "plan_call",
    "plan_b2a",
    "fla_function",
    "check_errors",
]

FORCE_ENV = "KDA_DHU_FORCE"


def _require_core():
    if _core is None:
        raise ImportError(f"kda_dhu's compiled extension (kda_dhu._core) is not built: {_core_error}")
    return _core


_NO_CTX = contextlib.nullcontext()  # stateless: one for every call

# torch's current CUDA device, without torch.cuda.current_device()'s lazy-init check
# (a CUDA tensor exists, so CUDA is initialized).
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device

# torch's current raw stream of a device, as an int (torch's own compiled kernels launch
# through it; no Stream object built).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _device_ctx(q):
    """torch exports a CUDA tensor through DLPack only on its current device."""
    if isinstance(q, torch.Tensor) and q.is_cuda and q.get_device() != _cuda_get_device():
        return torch.cuda.device(q.device)
    return _NO_CTX


def _current_stream(q) -> int:
    if _raw_stream is not None:
        return _raw_stream(q.get_device())
    return torch.cuda.current_stream(q.device).cuda_stream


def _default_scale(q, scale):
    """K ** -0.5 when scale is None; left None for a q the validator will reject by name."""
    if scale is None:
        try:
            return q.shape[-1] ** -0.5
        except Exception:  # noqa: BLE001 - not a usable q: _core names the argument
            return None
    return scale


# The call's arguments in fla's order; ``_Call`` carries them through the general path.
_TENSORS = ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht", "cu_seqlens", "chunk_indices", "chunk_offsets")


class _Call:
    """One call's arguments (fla's signature), as the general path passes them around."""

    __slots__ = (*_TENSORS, "scale", "state_v_first", "chunk_size", "use_graph")

    def __init__(self, q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size,
                 chunk_indices, chunk_offsets, use_graph):  # fmt: skip
        self.q, self.k, self.w, self.do, self.dv = q, k, w, do, dv
        self.g, self.gk, self.h0, self.dht = g, gk, h0, dht
        self.scale, self.state_v_first, self.cu_seqlens, self.chunk_size = (
            scale,
            state_v_first,
            cu_seqlens,
            chunk_size,
        )
        self.chunk_indices, self.chunk_offsets, self.use_graph = chunk_indices, chunk_offsets, use_graph

    def prepare(self, rule: str, nt=None):
        """``_core.prepare`` of these arguments: (ok, reason, PreparedCall)."""
        return _require_core().prepare(
            rule, self.q, self.k, self.w, self.do, self.dv, self.g, self.gk, self.h0, self.dht, self.scale,
            self.state_v_first, self.cu_seqlens, self.chunk_size, self.chunk_indices, self.chunk_offsets, nt,
        )  # fmt: skip

    def fla(self):
        """fla's own function on these arguments."""
        return fla_function()(
            q=self.q, k=self.k, w=self.w, do=self.do, dv=self.dv, g=self.g, gk=self.gk, h0=self.h0, dht=self.dht,
            scale=self.scale, state_v_first=self.state_v_first, cu_seqlens=self.cu_seqlens,
            chunk_size=self.chunk_size, chunk_indices=self.chunk_indices, chunk_offsets=self.chunk_offsets,
            use_graph=self.use_graph,
        )  # fmt: skip

    def uncopyable(self, names):
        """The error for the first of ``names`` that kda-dhu cannot copy (an array of
        another library: the copy is torch's), or None. Negative strides are named as
        such (a producer's DLPack export may not carry them faithfully)."""
        for name in names:
            x = getattr(self, name)
            if isinstance(x, torch.Tensor):
                continue
            strides, itemsize = getattr(x, "strides", None), getattr(x, "itemsize", None)
            if strides is not None and itemsize and any(s < 0 for s in strides):
                got = [s // itemsize for s in strides]
                return ValueError(f"{name}: expected non-negative strides, got strides {got}")
            return TypeError(
                f"{name}: expected a packed (contiguous, 16-byte aligned) tensor or a torch.Tensor that "
                f"kda_dhu can copy, got a {type(x).__module__}.{type(x).__name__} with another layout"
            )
        return None

    def packed(self, names) -> _Call:
        """A copy of the call whose named inputs are packed (contiguous, 16-byte aligned):
        fla's function reads every tensor as if contiguous, the kernel also needs the
        alignment. h0 is never read (its shape and dtype are): a fresh tensor, no copy.
        The caller's tensors are left as they are."""
        c = _Call.__new__(_Call)
        for slot in _Call.__slots__:
            setattr(c, slot, getattr(self, slot))
        err = self.uncopyable(names)
        if err is not None:
            raise err
        for name in names:
            x = getattr(self, name)
            if name == "h0":
                packed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            elif x.is_contiguous():  # misaligned: contiguous() would return it as it is
                packed = x.clone(memory_format=torch.contiguous_format)
            else:
                packed = x.contiguous()
            setattr(c, name, packed)
        return c


def _empty_outputs(c: _Call, call):
    """A packed batch with no chunks at all (every sequence empty): nothing for a kernel
    to walk. dh has no rows, dh0 = dht (zeros without dht), dv2's rows are all padding
    (zeros, as the kernel writes padding)."""
    dh_shape, dh0_shape, _ = call.out_shapes()
    dh = c.q.new_empty(dh_shape)
    dh0 = None
    if dh0_shape is not None:
        dh0 = c.dht.float().clone() if c.dht is not None else c.q.new_zeros(dh0_shape, dtype=torch.float32)
    return dh, dh0, torch.zeros_like(c.dv, memory_format=torch.contiguous_format)


def _alloc(c: _Call, call, poison: bool):
    """dh, dh0 (or None), dv2 as the prepared call sizes them: torch's caching allocator, or
    fla's static buffers under use_graph (the names fla's own function uses)."""
    dh_shape, dh0_shape, dv2_shape = call.out_shapes()
    if c.use_graph:
        from fla.ops.utils.graph import get_static_buffer

        dev = c.q.device
        dh = get_static_buffer("dhu_dh_vf" if c.state_v_first else "dhu_dh", tuple(dh_shape), c.q.dtype, dev)
        dh0 = get_static_buffer("dhu_dh0", tuple(dh0_shape), torch.float32, dev) if dh0_shape else None
        dv2 = get_static_buffer("dhu_dv2", tuple(dv2_shape), c.dv.dtype, dev)
    else:
        dh = (
            c.q.new_empty(dh_shape)
            if type(c.q) is torch.Tensor
            else torch.empty(dh_shape, dtype=c.q.dtype, device=c.q.device)
        )
        dh0 = torch.empty(dh0_shape, dtype=torch.float32, device=c.q.device) if dh0_shape else None
        dv2 = torch.empty(dv2_shape, dtype=c.dv.dtype, device=c.q.device)
    if poison:  # tests: an element the kernel does not write stays NaN
        for out in (dh, dh0, dv2):
            if out is not None:
                out.fill_(float("nan"))
    return dh, dh0, dv2


def _launch(c: _Call, call, poison: bool = False):
    """Allocates the outputs and launches the prepared call on torch's current stream."""
    dh, dh0, dv2 = _alloc(c, call, poison)
    call.launch(dh, dh0, dv2, _current_stream(c.q))
    return dh, dh0, dv2


def _kernel_or_fla(c: _Call, call):
    """``_launch``, or fla's function where the launch finds that the device cannot run
    the kernel image (KernelUnavailableError: one warning per device, see _driver)."""
    try:
        return _launch(c, call)
    except _require_core().KernelUnavailableError as err:
        _driver.note_unavailable(err, stacklevel=5)
        return c.fla()


def _host_check(c: _Call, nt) -> None:
    """KDA_DHU_CHECK_INPUTS=1: a packed batch's tables checked on the host, now (reads
    them: one synchronization), by the same checker the device runs."""
    if c.cu_seqlens is None:
        return
    n1 = c.cu_seqlens.shape[0]
    offsets = (
        c.chunk_offsets.tolist() if c.chunk_offsets is not None and c.chunk_offsets.shape[0] == n1 else None
    )
    _core.check_tables(c.cu_seqlens.tolist(), c.q.shape[1], offsets, nt)


# The sm_100a kernel has never run on real hardware: guard it (see _selfcheck).
SM100_CHECK = SelfCheck("sm_100a")


def _force():
    """KDA_DHU_FORCE, read once per call where its route is decided: None, "kernel" or
    "fla"; ValueError naming the switch for another value (src/env.rs reads it)."""
    return _require_core().force()


def _decide(rule: str, c: _Call, force):
    """(ok, reason, PreparedCall, call): the plan of the call as it will run under
    ``force`` (the caller's snapshot of KDA_DHU_FORCE), after the copies its layout needs
    (``call`` is then the packed copy) and, for a packed batch given without
    chunk_indices, with its chunk count. Raises on input that neither the kernel nor fla
    takes, naming the argument, and RuntimeError for KDA_DHU_FORCE=kernel on a call the
    kernel cannot compute."""
    ok, reason, call = c.prepare(rule)
    nt = None
    if call.nt is None:  # a packed batch without chunk_indices: count its chunks (validated)
        if call.copies:
            c = c.packed(call.copies)
        nt = chunk_count(c.cu_seqlens, c.q.shape[1])
        ok, reason, call = c.prepare(rule, nt)
    if call.copies:
        c = c.packed(call.copies)
        ok, reason, call = c.prepare(rule, nt)
    if _check_inputs():
        _host_check(c, call.nt)
    if not ok:  # a device that cannot run the kernel image: one warning per device, then fla
        _driver.note_unavailable(reason, stacklevel=5)
    if force == "fla":
        return False, f"{FORCE_ENV}=fla", call, c
    if force == "kernel" and not ok:
        ok, reason = call.replan("capable")
        if not ok:
            raise RuntimeError(f"{FORCE_ENV}=kernel, but the kernel cannot run this call: {reason}")
    return ok, reason, call, c


def _check_inputs() -> bool:
    return _core.switch("KDA_DHU_CHECK_INPUTS") is not None


def _on_cpu(q) -> bool:
    """q in host memory (a CPU torch tensor, a numpy array): the Rust core's CPU path."""
    if isinstance(q, torch.Tensor):
        return not q.is_cuda
    try:
        return q.__dlpack_device__()[0] == 1  # kDLCPU
    except Exception:  # noqa: BLE001 - not a DLPack producer: validation names it
        return False


def _cpu(c: _Call):
    """The call on the CPU, in fla's precision (``kda_dhu._cpu``): the same validation and
    messages; an input on another device raises, naming it."""
    from ._cpu import chunk_gated_delta_rule_bwd_dhu_cpu

    return chunk_gated_delta_rule_bwd_dhu_cpu(
        c.q, c.k, c.w, c.do, c.dv, c.g, c.gk, c.h0, c.dht, c.scale, c.state_v_first, c.cu_seqlens, c.chunk_size,
        c.chunk_indices, c.chunk_offsets, c.use_graph, mode="fla",
    )  # fmt: skip


def _general(rule: str, c: _Call, force):
    """The general path under ``force`` (the call's one reading of KDA_DHU_FORCE): decide,
    then the kernel (guarded on sm_100a) or fla's function; inputs in host memory run on
    the CPU whatever the switch says (neither kernel runs there)."""
    if isinstance(force, Exception):  # a bad KDA_DHU_FORCE value, read by the backend's verifier
        raise force
    if _on_cpu(c.q):
        return _cpu(c)
    with _device_ctx(c.q):
        ok, reason, call, c = _decide(rule, c, force)
        if call.nt == 0:  # nothing for either implementation to walk
            return _empty_outputs(c, call)
        if not ok:
            return c.fla()
        if call.nt is None:  # capturing a graph with no chunk_indices: fla decides (and raises)
            return c.fla()
        if reason == "kernel-sm100a":
            sig = signature_of(
                rule, c.q, c.do, g=c.g, gk=c.gk, h0=c.h0, dht=c.dht,
                state_v_first=c.state_v_first, cu_seqlens=c.cu_seqlens,
            )  # fmt: skip
            return SM100_CHECK.run(sig, lambda: _kernel_or_fla(c, call), c.fla)
        return _kernel_or_fla(c, call)


def _host_verdict(c: _Call) -> tuple[bool, str]:
    """The verdict on a call whose q is in host memory: every check of the CPU path
    (kda-dhu's CPU implementation runs it, whatever KDA_DHU_FORCE says), then why."""
    _require_core().cpu_bwd_dhu(
        "fla", c.q, c.k, c.w, c.do, c.dv, c.g, c.gk, c.h0, c.dht, c.scale, c.state_v_first, c.cu_seqlens,
        c.chunk_size, c.chunk_indices, c.chunk_offsets, check_only=True,
    )  # fmt: skip
    # True of the direct entry points; fla's registry, which rejects such calls, runs fla's own function
    return False, "cpu: inputs in host memory (kda-dhu's entry points run them on its CPU implementation)"


def _verify(c: _Call, force):
    """(accepted, reason, PreparedCall or None) of a CUDA call under ``force``: where the
    kernel runs it, and where an input must be copied first (fla's function would read it
    as if contiguous). Raises on invalid input."""
    if force == "fla":
        return False, f"{FORCE_ENV}=fla", None
    rule = "capable" if force == "kernel" else "extended"
    with _device_ctx(c.q):
        ok, reason, call = c.prepare(rule)
        if call.nt is None:  # a packed batch without chunk_indices: count its chunks (validated)
            ok, reason, call = c.prepare(rule, chunk_count(c.cu_seqlens, c.q.shape[1]))
    if force == "kernel" and not ok:
        raise RuntimeError(f"{FORCE_ENV}=kernel, but the kernel cannot run this call: {reason}")
    if not ok:  # a device that cannot run the kernel image: one warning per device, then fla
        _driver.note_unavailable(reason, stacklevel=5)
    if call.copies:
        err = c.uncopyable(call.copies)
        if err is not None:  # the implementation could not copy it: fla's function decides
            raise err
        return (
            True,
            f"{reason} after copying {', '.join(call.copies)} (fla's function reads inputs as contiguous)",
            call,
        )
    return ok, reason, call


class Forced:
    """The fla backend verifier's reading of KDA_DHU_FORCE, handed to its implementation
    (``run_decided``) so that the call reads the switch once: "kernel", or the ValueError
    of a value that is not kernel / fla / unset."""

    __slots__ = ("force",)

    def __init__(self, force):
        self.force = force


def verify(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False, cu_seqlens=None,
           chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False):  # fmt: skip
    """The fla backend's decision on a call: (accepted, reason, handoff). Never raises.

    KDA_DHU_FORCE is read here, once for the call (the implementation does not read it
    again): unset, accepted where the kernel runs the call and where an input must be
    copied first (the implementation copies, then runs the kernel or fla's function);
    invalid input, host inputs and calls the kernel does not cover are rejections whose
    reason says why (fla then runs, and raises its own error). ``fla``: rejected, so
    fla's own kernel runs. ``kernel``: accepted, so kda-dhu runs the call and raises
    where the kernel cannot compute it, as the direct entry points do. A bad value:
    accepted, so the implementation raises the ValueError naming the switch, as every
    route does.

    ``handoff``, for the implementation: the PreparedCall to launch, a ``Forced`` (run
    through ``run_decided``), or None on a rejection.
    """
    try:
        force = _force()
    except ValueError as err:
        return True, f"{type(err).__name__}: {err}", Forced(err)
    if force == "kernel":
        return True, f"{FORCE_ENV}=kernel", Forced(force)
    try:
        c = _Call(q, k, w, do, dv, g, gk, h0, dht, _default_scale(q, scale), state_v_first, cu_seqlens, chunk_size,
                  chunk_indices, chunk_offsets, use_graph)  # fmt: skip
        if _on_cpu(c.q):
            return (*_host_verdict(c), None)
        ok, reason, call = _verify(c, force)
    except Exception as err:  # noqa: BLE001 - the verifier reports, fla decides
        return False, f"{type(err).__name__}: {err}", None
    return ok, reason, (call if ok else None)


def run_decided(values: tuple, force):
    """The fla backend's implementation of an accepted call that did not run in one
    crossing: fla's signature's 16 arguments, under the verifier's reading of
    KDA_DHU_FORCE (not read again)."""
    c = _Call(*values[:9], _default_scale(values[0], values[9]), *values[10:])
    return _general("extended", c, force)


def _plan(rule: str, c: _Call) -> tuple[bool, str]:
    """(the kernel runs the call, why) as the entry point of ``rule`` would run it now
    (KDA_DHU_FORCE included); invalid input is (False, "TypeError: ...") . Never raises."""
    try:
        force = _force()
        if _on_cpu(c.q):
            return _host_verdict(c)
        if rule == "extended":
            ok, reason, call = _verify(c, force)
            if call is not None and call.copies:  # accepted for the copy: the verdict on the copy
                ok = call.verdict[0]
            return ok, reason
        with _device_ctx(c.q):
            ok, reason, _, _ = _decide(rule, c, force)
        return ok, reason
    except Exception as err:  # noqa: BLE001 - a verdict, not a call
        return False, f"{type(err).__name__}: {err}"


def plan_call(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False, cu_seqlens=None,
              chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False):  # fmt: skip
    """What ``chunk_gated_delta_rule_bwd_dhu`` would run for this call; no side effects,
    never raises.

    Returns ``(True, "kernel-sm90a")`` (or ``-sm100a``) when kda-dhu's kernel runs the
    call, else ``(False, reason)``: the planner's failing clause (fla's function runs),
    ``"KDA_DHU_FORCE=fla"``, ``"cpu: ..."`` for inputs in host memory (kda-dhu's CPU
    implementation runs), or ``"TypeError: ..."`` / ``"ValueError: ..."`` / ``"RuntimeError:
    ..."`` with the message the call would raise (invalid input; KDA_DHU_FORCE=kernel on a
    call the kernel cannot compute). A call whose inputs are copied first says so after
    the verdict. Reads a packed batch's cu_seqlens when chunk_indices is not given (the
    chunk count, through fla's cache, as the call does).
    """
    c = _Call(q, k, w, do, dv, g, gk, h0, dht, _default_scale(q, scale), state_v_first, cu_seqlens, chunk_size,
              chunk_indices, chunk_offsets, use_graph)  # fmt: skip
    return _plan("extended", c)


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
            None. Its values are checked where the kernel reads them, on the device.
        chunk_size: 64 on the kernel path (fla handles others).
        chunk_indices: fla's chunk table [NT, 2] of a packed batch (fla's backward passes
            it); its length is dh's NT. Without it, NT is counted from cu_seqlens through
            fla's cache (one host read per distinct cu_seqlens tensor).
        chunk_offsets: fla's [N + 1] first chunk of each sequence (int32 or int64), or None
            (the kernel sums the chunk counts itself). Checked against cu_seqlens on the device.
        use_graph: fla's static output buffers for CUDA-graph capture (its fixed-size chunk
            tables: rows of dh past the real chunks are left as fla leaves them, unwritten).

    Returns:
        (dh, dh0, dv2): dh [B, NT, HV, K, V] in q's dtype (NT = ceil(T / 64), or
        len(chunk_indices) / the chunk count of the packed batch; [B, NT, HV, V, K] with
        state_v_first), dh0 fp32 shaped like h0 or None, dv2 like dv (contiguous). With
        cu_seqlens whose last offset is short of T, dv2's padding rows are zeros.

    Raises:
        TypeError / ValueError: a tensor's dtype, shape, device or strides (negative) is
            not what the op takes, or scale is not finite (the message names the argument
            and the expectation). Strided, expanded or misaligned inputs are copied, not
            refused; the caller's tensors are never modified.
        ValueError naming cu_seqlens / chunk_offsets / chunk_indices: bad packed-batch
            values found on the device by an earlier call on that device (that call's
            outputs for the failing sequence are NaN), or by this call with
            KDA_DHU_CHECK_INPUTS=1.
        RuntimeError: a CUDA driver or launch failure; KDA_DHU_FORCE=kernel on a call the
            kernel cannot run.

    Calls the kernel where ``plan_call`` accepts; otherwise fla's own function with the
    same (packed) arguments, so results match fla's to rounding either way.
    """
    if not use_graph and _core is not None:
        out = _core.run("extended", q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size,
                        chunk_indices, chunk_offsets)  # fmt: skip
        if out is not None:
            return out
    c = _Call(q, k, w, do, dv, g, gk, h0, dht, _default_scale(q, scale), state_v_first, cu_seqlens, chunk_size,
              chunk_indices, chunk_offsets, use_graph)  # fmt: skip
    return _general("extended", c, _force())


chunk_gated_delta_rule_bwd_dhu._kda_dhu_entry = True


def kda_dhu_b2a(qg, kg, w, g2, h0, dht, do, dv, scale, chunk_size):
    """The original stage-4 dispatcher, argument for argument fla's call with q=qg, k=kg, gk=g2.

    Runs kda-dhu's kernel only when all of the original envelope's clauses hold (SPEC.md):
    chunk_size == 64, T % 64 == 0, K in (64, 128), V % 64 == 0, dtype bf16 or fp16, dht
    given, and B * HV * (V // 64) >= 256 CTAs; otherwise it returns fla's own result for
    the same arguments. Shapes: qg, kg [B, T, H, K]; w [B, T, HV, K]; g2 [B, T, HV, K]
    fp32; h0, dht [B, HV, K, V] fp32 (h0 only decides whether dh0 is returned); do, dv
    [B, T, HV, V].

    Returns (dh [B, NT, HV, K, V] in qg's dtype, dh0 fp32 or None if h0 is None, dv2).
    Raises as ``chunk_gated_delta_rule_bwd_dhu`` does.
    """
    if _core is not None:
        out = _core.run("b2a", qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size)
        if out is not None:
            return out
    c = _Call(qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size, None, None, False)
    return _general("b2a", c, _force())


def plan_b2a(qg, kg, w, g2, h0, dht, do, dv, scale, chunk_size) -> tuple[bool, str]:
    """What ``kda_dhu_b2a`` would run for this call: (use_kernel, reason), as
    ``plan_call`` answers (KDA_DHU_FORCE, host inputs and invalid input included); never
    raises."""
    c = _Call(qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size, None, None, False)
    return _plan("b2a", c)


def run_kernel(rule: str, c: _Call, poison: bool = False):
    """The kernel on a call under ``rule`` ("capable": wherever it can compute it), outputs
    poisoned with NaN first if asked; RuntimeError where the plan is not the kernel."""
    with _device_ctx(c.q):
        ok, reason, call, c = _decide(rule, c, None)
        if not ok:
            raise RuntimeError(f"the kernel cannot run this call: {reason}")
        return _launch(c, call, poison)


_errors_lock = threading.Lock()


def check_errors(device=None) -> None:
    """Raises a bad packed batch that kda-dhu's kernel found on ``device`` (default: the
    current CUDA device) since the last look: ValueError naming cu_seqlens, chunk_offsets
    or chunk_indices, with the first failing sequence. Synchronizes the device first, so
    every launch queued before it is looked at: for CUDA-graph replays, whose calls never
    pass through a later call's check. Each error is raised once."""
    core = _require_core()
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with _errors_lock:
        torch.cuda.synchronize(dev)
        core.check_input_errors(dev.index if dev.index is not None else torch.cuda.current_device())
