"""Entry points: fla's full signature, the original dispatcher, and the planner's verdict.

Every call is decided once, in Rust (``kda_dhu._core.decide`` / ``_core.run``): the
inputs read through DLPack and validated, one reading of the switches, the plan (kernel
or fla's function, and why), the inputs to copy, the output shapes, and from these the
one thing the call does (``Call.action``): "kernel", "fla", "copy" first, "count" the
chunks first, "cpu" or "empty". The common call (plain torch tensors, packed inputs,
chunk_indices given with cu_seqlens) is decided and launched in one crossing
(``_core.run``). This module only carries a decision out: torch copies and fla's chunk
count (then one more decision, the final one), fla's function, the CPU path, the host
check of KDA_DHU_CHECK_INPUTS, the sm_100a self-check.

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

# The switch that forces a route (src/env.rs names and reads it), for messages.
FORCE_ENV = _core.FORCE_ENV if _core is not None else None


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

    def decide(self, rule: str, nt=None, switches=None):
        """``_core.decide`` of these arguments (a ``_core.Call``): under ``switches``
        (None: read now), with ``nt`` chunks of a packed batch counted by the caller."""
        return _require_core().decide(
            rule, self.q, self.k, self.w, self.do, self.dv, self.g, self.gk, self.h0, self.dht, self.scale,
            self.state_v_first, self.cu_seqlens, self.chunk_size, self.chunk_indices, self.chunk_offsets, nt, switches,
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


def _settle(rule: str, c: _Call, call):
    """(c, call) once a "copy" or "count" decision is carried out: the named inputs
    copied, the chunks of the packed batch counted (fla's cache), and the call decided
    again under the same switches (that decision is final). Other decisions as they are."""
    if call.action not in ("copy", "count"):
        return c, call
    if call.copies:
        c = c.packed(call.copies)
    nt = chunk_count(c.cu_seqlens, c.q.shape[1]) if call.count_chunks else None
    return c, c.decide(rule, nt, call.switches)


def _kernel_or_fla(c: _Call, call):
    """The kernel (``Call.run``: outputs allocated, launched on torch's current stream),
    or fla's function where the launch finds that the device cannot run the kernel image
    (KernelUnavailableError: one warning per device, see _driver)."""
    try:
        return call.run(c.use_graph)
    except _require_core().KernelUnavailableError as err:
        _driver.note_unavailable(err, stacklevel=6)
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


def _cpu(c: _Call):
    """The call on the CPU, in fla's precision (``kda_dhu._cpu``): the same validation and
    messages; an input on another device raises, naming it."""
    from ._cpu import chunk_gated_delta_rule_bwd_dhu_cpu

    return chunk_gated_delta_rule_bwd_dhu_cpu(
        c.q, c.k, c.w, c.do, c.dv, c.g, c.gk, c.h0, c.dht, c.scale, c.state_v_first, c.cu_seqlens, c.chunk_size,
        c.chunk_indices, c.chunk_offsets, c.use_graph, mode="fla",
    )  # fmt: skip


def _carry_out(rule: str, c: _Call, call):
    """Does what the decision ``call`` (a ``_core.Call`` of ``c``) says, under the inputs'
    device: after a copy or a chunk count, the final decision; then the host check of the
    tables where asked, and the kernel (through the self-check on sm_100a), fla's
    function, the CPU path or the empty outputs."""
    with _device_ctx(c.q):
        c, call = _settle(rule, c, call)
        if call.unavailable is not None:  # the device cannot run the kernel image: warn once
            _driver.note_unavailable(call.unavailable, stacklevel=5)
        if call.check_tables:
            _host_check(c, call.nt)
        action = call.action
        if action == "kernel":
            if call.guarded:
                sig = signature_of(
                    rule, c.q, c.do, g=c.g, gk=c.gk, h0=c.h0, dht=c.dht,
                    state_v_first=c.state_v_first, cu_seqlens=c.cu_seqlens,
                )  # fmt: skip
                return SM100_CHECK.run(sig, lambda: _kernel_or_fla(c, call), c.fla)
            return _kernel_or_fla(c, call)
        if action == "fla":
            return c.fla()
        if action == "cpu":
            return _cpu(c)
        return call.run()  # "empty": nothing for either implementation to walk


def _general(rule: str, c: _Call, call=None):
    """A call that did not finish in one crossing: decided under the inputs' device
    (unless ``call`` is its decision already), then carried out."""
    if call is None:
        with _device_ctx(c.q):
            call = c.decide(rule)
    return _carry_out(rule, c, call)


def verify(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False, cu_seqlens=None,
           chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False):  # fmt: skip
    """The fla backend's decision on a call: (accepted, reason, handoff). Never raises.

    The switches are read here, once for the call (the implementation does not read them
    again). KDA_DHU_FORCE unset: accepted where the kernel runs the call and where an
    input must be copied first (the implementation copies, then runs the kernel or fla's
    function); invalid input, host inputs and calls the kernel does not cover are
    rejections whose reason says why (fla then runs, and raises its own error). ``fla``:
    rejected, so fla's own kernel runs. ``kernel``: accepted, so kda-dhu runs the call
    and raises where the kernel cannot compute it, as the direct entry points do. A bad
    value: accepted, so the implementation raises the ValueError naming the switch, as
    every route does.

    ``handoff``, for the implementation (``run_decided``): the decision (a
    ``_core.Call``), the switches (KDA_DHU_FORCE=kernel: decided there), the ValueError
    of a bad switch, or None on a rejection.
    """
    try:
        sw = _require_core().Switches.now()
    except ValueError as err:
        return True, f"{type(err).__name__}: {err}", err
    except ImportError as err:
        return False, f"{type(err).__name__}: {err}", None
    force = sw.force
    if force == "kernel":
        return True, f"{FORCE_ENV}=kernel", sw
    if force == "fla":
        return False, f"{FORCE_ENV}=fla", None
    try:
        scale = _default_scale(q, scale)
        args = (q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_indices,
                chunk_offsets)  # fmt: skip
        with _device_ctx(q):
            call = _core.decide("extended", *args, None, sw)
            action = call.action
            if action == "count":  # a packed batch without chunk_indices: count its chunks (validated)
                call = _core.decide("extended", *args, chunk_count(cu_seqlens, q.shape[1]), sw)
                action = call.action
        if action == "copy":
            err = _Call(*args, use_graph).uncopyable(call.copies)
            if err is not None:  # the implementation could not copy it: fla's function decides
                raise err
            return True, call.reason, call
        ok, reason = call.verdict
        if not ok and call.unavailable is not None:  # the device cannot run the kernel image
            _driver.note_unavailable(call.unavailable, stacklevel=4)
    except Exception as err:  # noqa: BLE001 - the verifier reports, fla decides
        return False, f"{type(err).__name__}: {err}", None
    return ok, reason, (call if ok else None)


def run_decided(values: tuple, handoff):
    """The fla backend's implementation of a call ``verify`` accepted: fla's signature's
    16 arguments and the verifier's handoff (its decision is carried out, nothing is
    decided twice; the switches are not read again)."""
    if isinstance(handoff, Exception):  # a bad KDA_DHU_FORCE value, read by the verifier
        raise handoff
    core = _require_core()
    if type(handoff) is core.Call and handoff.launch_only:
        try:  # the verifier's work, not redone: allocate and launch in one crossing
            return handoff.run(values[15])
        except core.KernelUnavailableError:
            pass  # carried out below: the warning, then fla's function
    c = _Call(*values[:9], _default_scale(values[0], values[9]), *values[10:])
    if type(handoff) is core.Switches:  # KDA_DHU_FORCE=kernel: decided here, under the verifier's reading
        with _device_ctx(c.q):
            handoff = c.decide("extended", None, handoff)
    return _carry_out("extended", c, handoff)


def _plan(rule: str, c: _Call) -> tuple[bool, str]:
    """(the kernel runs the call, why) as the entry point of ``rule`` would run it now
    (the switches included); invalid input is (False, "TypeError: ...") . Never raises."""
    try:
        sw = _require_core().Switches.now()
        with _device_ctx(c.q):
            call = c.decide(rule, None, sw)
            if call.count_chunks:  # a packed batch without chunk_indices: count its chunks (validated)
                call = c.decide(rule, chunk_count(c.cu_seqlens, c.q.shape[1]), sw)
        if call.unavailable is not None:
            _driver.note_unavailable(call.unavailable, stacklevel=4)
        return call.verdict[0], call.reason
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
    call = _require_core().run(
        "extended", q, k, w, do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_indices,
        chunk_offsets, use_graph,
    )  # fmt: skip
    if type(call) is tuple:
        return call
    c = _Call(q, k, w, do, dv, g, gk, h0, dht, _default_scale(q, scale), state_v_first, cu_seqlens, chunk_size,
              chunk_indices, chunk_offsets, use_graph)  # fmt: skip
    return _general("extended", c, call)


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
    call = _require_core().run("b2a", qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size)
    if type(call) is tuple:
        return call
    c = _Call(qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size, None, None, False)
    return _general("b2a", c, call)


def plan_b2a(qg, kg, w, g2, h0, dht, do, dv, scale, chunk_size) -> tuple[bool, str]:
    """What ``kda_dhu_b2a`` would run for this call: (use_kernel, reason), as
    ``plan_call`` answers (KDA_DHU_FORCE, host inputs and invalid input included); never
    raises."""
    c = _Call(qg, kg, w, do, dv, None, g2, h0, dht, scale, False, None, chunk_size, None, None, False)
    return _plan("b2a", c)


def _unforced():
    """The switches now, less KDA_DHU_FORCE: what the testing helpers decide under (they
    ask for a rule's plan whatever the switch says)."""
    core = _require_core()
    return core.Switches(check_inputs=core.Switches.now().check_inputs)


def verdict_of(rule: str, c: _Call) -> tuple[bool, str]:
    """The plan's verdict on a call under ``rule`` after its copies and chunk count, with
    KDA_DHU_FORCE not read (tests). Raises what validation raises."""
    with _device_ctx(c.q):
        return _settle(rule, c, c.decide(rule, None, _unforced()))[1].verdict


def run_kernel(rule: str, c: _Call, poison: bool = False):
    """The kernel on a call under ``rule`` ("capable": wherever it can compute it), outputs
    poisoned with NaN first if asked; RuntimeError where the plan is not the kernel.
    KDA_DHU_FORCE is not read (KDA_DHU_CHECK_INPUTS is)."""
    with _device_ctx(c.q):
        c, call = _settle(rule, c, c.decide(rule, None, _unforced()))
        if call.action == "cpu":
            return call.run()  # raises the device check's error, naming the input
        if not call.verdict[0]:
            raise RuntimeError(f"the kernel cannot run this call: {call.reason}")
        if call.check_tables:
            _host_check(c, call.nt)
        if call.action == "empty":
            return call.run()
        return call.run(c.use_graph, poison)


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
