"""kda_dhu._core: the Rust host core (src/), built by maturin.

Tensors are read through DLPack (``__dlpack__``; torch, JAX, CuPy ...); a torch
tensor that requires grad is read through ``.detach()``. torch only exports a CUDA
tensor on its *current* device: call these inside ``torch.cuda.device(q.device)``.

Errors: TypeError for a non-tensor or a wrong dtype; ValueError for shapes, strides,
alignment, devices, scalar values, and for ``launch`` on a call the kernel does not
cover; RuntimeError for CUDA driver failures (including "no CUDA driver (libcuda)
found"); KernelUnavailableError (a RuntimeError) where the device's driver or GPU
cannot run the kernel image. Every message names the argument and what was expected.

A device whose driver or GPU cannot run the kernel image is found out once, when
``decide`` / ``run`` first meet it (that loads the image): from then on every plan on
it is ``(False, reason)`` with ``reason`` starting with
``UNAVAILABLE_PREFIX`` (``kernel_unavailable`` gives the same reason).
"""

from typing import Any

Tensor = Any  # any object with __dlpack__

MIN_CTAS_EXTENDED: int
"""CTA floor of the Extended rule (N*HV*(V/64)); 1 until set from measurement."""
MIN_CTAS_B2A: int
"""CTA floor of the seed's rule (B*HV*(V/64) >= 256)."""
TMA_CACHE_CAPACITY: int
"""Entries of the TMA descriptor cache (64)."""
FORCE_ENV: str
"""The name of the switch that forces a route ("KDA_DHU_FORCE"; src/env.rs reads it)."""
UNAVAILABLE_PREFIX: str
"""How a reason for a device that cannot run the kernel image starts:
"kernel unavailable on cuda:" (then the ordinal, ": ", the GPU, the driver and what is
needed)."""

class KernelUnavailableError(RuntimeError):
    """This device's driver or GPU cannot run kda-dhu's kernel image; the message starts
    with UNAVAILABLE_PREFIX. Not a bug: the call belongs to fla."""

def validate(
    q: Tensor,
    k: Tensor,
    w: Tensor,
    do: Tensor,
    dv: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    h0: Tensor | None = None,
    dht: Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> None:
    """Raise if fla's ``chunk_gated_delta_rule_bwd_dhu`` could not take these arguments.

    Everything but the device is checked, so CPU tensors work (tests). Shapes (SPEC.md):
    q, k [B, T, H, K] (T >= 1, K <= 256); w [B, T, HV, K] with H dividing HV; do, dv
    [B, T, HV, V]; g [B, T, HV] fp32; gk [B, T, HV, K] fp32; h0 (any float dtype) and
    dht (fp32) [N, HV, K, V] ([N, HV, V, K] with state_v_first); cu_seqlens int64/int32
    [N + 1] with B == 1; chunk_indices int64/int32 [NT, 2] with NT at most
    ceil(T / 64) + N - 1; chunk_offsets int64/int32 [N] or [N + 1] (both read only with
    cu_seqlens). q, k, w share a dtype in {bf16, fp16, fp32}; so do do, dv. No negative
    strides; scale finite (None means K ** -0.5); chunk_size >= 1. The values of the
    packed-batch tables are not read (``check_tables``; the kernel checks them).
    """

class Switches:
    """One reading of the switches a call's decision depends on (KDA_DHU_FORCE,
    KDA_DHU_CHECK_INPUTS), taken once per call and handed to each of its decisions."""

    force: str | None
    """None, "kernel" or "fla"."""
    check_inputs: bool

    def __init__(self, force: str | None = None, check_inputs: bool = False) -> None: ...
    @staticmethod
    def now() -> Switches:
        """The switches now; ValueError naming KDA_DHU_FORCE for a value that is not
        kernel / fla / unset."""

class Call:
    """One call decided once (``decide``, ``run``): what it runs, the plan and why, the
    inputs to copy first, and for the kernel everything the launch needs but the outputs.
    Holds the call's numbers (addresses, extents) and references to its input objects;
    nothing of it outlives the object."""

    action: str
    """What the caller does: "kernel" (``run``; through the sm_100a self-check where
    ``guarded``), "fla" (fla's function), "copy" (copy ``copies``, count the chunks where
    ``count_chunks``, then decide again), "count" (count the chunks, then decide again),
    "cpu" (kda-dhu's CPU implementation) or "empty" (``run``: no chunks, no launch)."""
    verdict: tuple[bool, str]
    """(True, "kernel-sm90a") or (False, the first failing clause, or the switch)."""
    reason: str
    """The verdict's reason, naming the inputs copied first."""
    copies: list[str]
    """Inputs that are not packed (contiguous; 16-byte aligned where the kernel reads them
    through TMA; h0 contiguous) and must be copied before the kernel or fla reads them."""
    count_chunks: bool
    """A packed batch given without chunk_indices: its chunk count is unknown on the host."""
    check_tables: bool
    """KDA_DHU_CHECK_INPUTS on a packed batch: check its tables on the host first."""
    unavailable: str | None
    """Why the device cannot run the kernel image (warn once), or None."""
    guarded: bool
    """The kernel is the sm_100a one: run it through the self-check."""
    launch_only: bool
    """``run`` is all that is left (the unguarded kernel, no host check)."""
    switches: Switches
    """The switches this decision read (the next decision of the call takes them)."""
    nt: int | None
    """dh's NT, or None for a packed batch given without chunk_indices (until ``nt=``)."""

    def replan(self, rule: str) -> tuple[bool, str]:
        """The plan of this call under another rule (no re-validation)."""

    def out_shapes(self) -> tuple[list[int], list[int] | None, list[int]] | None:
        """(dh, dh0 or None, dv2) shapes once NT is known, else None."""

    def run(self, use_graph: bool = False, poison: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
        """Carry out a "kernel" decision (allocate the outputs with torch, or fla's static
        buffers under ``use_graph``; launch on torch's current stream;
        KernelUnavailableError where the device turns out unable to run the image) or an
        "empty" one (the outputs, no launch). ``poison``: outputs NaN-filled first (tests).
        ValueError for another action. Asynchronous."""

    def launch(self, dh: Tensor, dh0: Tensor | None, dv2: Tensor, stream: int) -> None:
        """Launch the decided inputs writing the outputs (as ``launch`` checks them) on
        ``stream``. ValueError when the "capable" plan is a fallback. Asynchronous."""

def decide(
    rule: str,
    q: Tensor,
    k: Tensor,
    w: Tensor,
    do: Tensor,
    dv: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    h0: Tensor | None = None,
    dht: Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    nt: int | None = None,
    switches: Switches | None = None,
) -> Call:
    """Read, validate and decide a call under ``rule`` and ``switches`` (None: read now):
    the one decision of the call (``Call.action``).

    rule "b2a": the original dispatcher exactly (chunk_size 64, T % 64 == 0, K in {64,
    128}, V % 64 == 0, bf16/fp16, dht given, B*HV*(V/64) >= 256) plus that kernel's limits
    (gk path, H == HV, no cu_seqlens). rule "capable": everything the kernel computes:
    tails, packed batches, GVA, g / gk / no gate, dht and h0 optional, state_v_first.
    rule "extended": "capable" less the measured clauses (``policy``). Layouts are not
    clauses: the plan is the packed call's (``Call.copies``). KDA_DHU_FORCE=fla: fla;
    =kernel: the "capable" plan. Inputs in host memory: "cpu", validated as the CPU path
    validates them.

    ``nt``: dh's NT of a packed batch given without chunk_indices, counted by the caller.
    Raises as ``validate``, RuntimeError without a CUDA driver and for KDA_DHU_FORCE=kernel
    on a call the kernel cannot compute, and first raises a bad packed batch a kernel on
    that device found since the last call (``check_input_errors``).
    """

def run(
    rule: str,
    q: Tensor,
    k: Tensor,
    w: Tensor,
    do: Tensor,
    dv: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    h0: Tensor | None = None,
    dht: Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    use_graph: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor] | Call | None:
    """One call in one crossing: the switches read, the call decided as ``decide`` does;
    where the decision is the unguarded kernel without a host check of the tables, the
    outputs allocated (fla's static buffers under ``use_graph``) and the kernel launched
    on torch's current stream of the inputs' device; where it is "empty", the outputs.
    Returns (dh, dh0 or None, dv2); else the ``Call`` for the caller to carry out; None
    where a tensor argument is not a plain torch.Tensor (the caller decides under the
    inputs' device). Raises as ``decide``. Does not synchronize."""

def dlpack_intake() -> str:
    """How torch tensors are read: "exchange" (DLPack's C exchange API), "capsule"
    (torch.utils.dlpack.to_dlpack; KDA_DHU_NO_EXCHANGE_API=1), or "none" before torch
    is imported."""

def launch(
    q: Tensor,
    k: Tensor,
    w: Tensor,
    do: Tensor,
    dv: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    h0: Tensor | None = None,
    dht: Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    *,
    dh: Tensor,
    dh0: Tensor | None,
    dv2: Tensor,
    stream: int,
) -> None:
    """Launch the kernel writing dh, dh0 and dv2; asynchronous, on ``stream`` (a CUstream
    as an int; 0: the legacy default stream). Reads and validates everything (a ``Call``
    reads the inputs once).

    The outputs are allocated by the caller, contiguous, 16-byte aligned, on q's device:
    dh [B, NT, HV, K, V] in q's dtype (NT = ceil(T / 64), or dh's rows of a packed batch:
    len(chunk_indices) where given), dh0 [N, HV, K, V] fp32 iff h0 is given (else None),
    dv2 like dv. A packed batch's values are read and checked on the device (a failing
    sequence's outputs NaN, the error raised by the next call). ValueError naming the
    reason when the "capable" plan would say fallback. Does not synchronize.
    """

def fwd_h_run(
    k: Tensor,
    w: Tensor,
    u: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    save_new_value: bool = True,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """fla's forward scan on the kernel in one crossing: (h, v_new or None, final_state or
    None), or None where the call is fla's to run (src/forward.rs says when). Raises
    TypeError / ValueError naming the argument; RuntimeError for KDA_DHU_FORCE=kernel where
    the kernel does not run the call. Does not synchronize."""

def fwd_h_on() -> bool:
    """Whether the forward scan runs kda-dhu's kernel now: KDA_DHU_FWD_H on / off, unset
    its default (src/env.rs). ValueError naming the switch for another value."""

def fwd_h_arguments() -> list[tuple[str, str | None]]:
    """fla's chunk_gated_delta_rule_fwd_h arguments in order, (name, default's repr or None)."""

def _fwd_h_probe(
    q: Tensor,
    k: Tensor,
    w: Tensor,
    do: Tensor,
    dv: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    h0: Tensor | None = None,
    dht: Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    *,
    dh: Tensor,
    dh0: Tensor | None,
    dv2: Tensor,
    stream: int,
) -> None:
    """Tests only: the forward scan's kernel (fla's chunk_gated_delta_rule_fwd_h) on a
    stage-4 call carrying a forward call: k, w; dv = u; dht = initial_state; h0 given for a
    final state (written to dh0); outputs dh = h, dv2 = v_new; q and do any tensors of their
    shapes; planned as the forward op plans it (warpgroups, KDA_DHU_SM90_SPLIT). Raises as
    ``launch``. Does not synchronize."""

def check_tables(
    cu_seqlens: list[int], t: int, chunk_offsets: list[int] | None = None, nt: int | None = None
) -> list[int]:
    """The one checker of a packed batch's tables (the kernel runs the same checks on the
    device): returns the chunk offsets [N + 1]; ValueError naming cu_seqlens,
    chunk_offsets or chunk_indices."""

def check_input_errors(ordinal: int) -> None:
    """Raise (once) a bad packed batch a kernel on cuda:``ordinal`` found; no sync."""

def launch_count() -> int:
    """Kernel launches of this process so far (every route)."""

BT: int
"""Tokens per chunk of every kernel (fla's BT on the kernel path): cuda/dhu_layout.h."""
BV: int
"""V columns per consumer warpgroup (sm_90a) / per CTA (sm_100a): cuda/dhu_layout.h."""

def kernel_facts() -> dict[str, object]:
    """The kernels' numbers, from cuda/dhu_layout.h (their one owner): BT, BV, WG_THREADS,
    SMEM_OPTIN_MAX_SM90, and per kernel family ("sm90", "sm90_fwd": the forward scan's
    unsplit kernels, "sm100") a list of {"k", "nwg", "stages", "threads", "smem_bytes"}
    (dynamic shared memory of a launch)."""

def force() -> str | None:
    """KDA_DHU_FORCE: None, "kernel" or "fla"; ValueError for another value."""

def switch(name: str) -> str | None:
    """A switch's value (trimmed, lower-cased; None when unset); ValueError for a name
    that is not one of kda-dhu's switches."""

def switches() -> list[tuple[str, str, str | None]]:
    """Every environment switch: (name, meaning, value or None)."""

def op_arguments() -> list[tuple[str, str | None]]:
    """The op's arguments in fla's order: (name, the default's Python repr, or None for a
    required one). The one description the entry points are checked against."""

def per_call_switches() -> list[str]:
    """The switches read at each call (they change what a call runs); the others are read
    once per process or device (on import, when a device first loads its kernels)."""

def policy(ordinal: int) -> list[tuple[str, str, str, str, str]]:
    """The Extended rule's measured clauses on cuda:``ordinal``: (name, when, measured on,
    record, what it means on this GPU)."""

def tma_cache_info() -> dict[str, int]:
    """The TMA descriptor cache: {"hits", "misses", "evictions", "size", "capacity"}.
    Keyed on (device ordinal, dtype, B, T, H, HV, K, V, NT); holds encoded descriptors
    and addresses only (no tensor); least recently used entry evicted at capacity."""

def tma_cache_clear() -> None:
    """Empty the TMA descriptor cache and zero its counters."""

def cuda_status() -> tuple[bool, str]:
    """(usable, message): whether libcuda loads and initializes, its version, the kernel
    images it loads (the CUDA 13 ones from driver 13.0 on, else the CUDA 12 ones), and the
    devices. Creates no context. Without a driver: (False, "no CUDA driver (libcuda) found")."""

def device_arch(ordinal: int) -> str:
    """Compute capability of CUDA device ``ordinal`` as "sm_90", "sm_100", ...
    RuntimeError without a driver; ValueError for an ordinal out of range."""

def build_info() -> str:
    """How the extension was built: each compiler (nvcc for the CUDA 13 images, NVRTC 12
    for the CUDA 12 ones) with its version and flags, the CUTLASS include path, and
    ptxas's line per kernel and image ("dhu_sm90 sm_90a cuda12 NAME: registers, static
    smem, stack frame")."""

def embedded_kernels() -> list[tuple[str, str, str]]:
    """The embedded cubins as (cuda/ file stem, SASS arch, image), e.g.
    ("dhu_sm90", "sm_90a", "cuda12")."""

def kernel_unavailable(ordinal: int) -> str | None:
    """Why CUDA device ``ordinal`` cannot run kda-dhu's kernels (a message starting with
    UNAVAILABLE_PREFIX that names the GPU, the driver and what is needed), or None when
    it can. The first call per device loads its kernel image (in the primary context);
    the answer is kept for the process. RuntimeError without a driver; ValueError for an
    ordinal out of range or a bad KDA_DHU_IMAGE / KDA_DHU_IMAGE_FILE."""

def kernel_image(ordinal: int) -> str | None:
    """The image CUDA device ``ordinal`` runs its kernels from, e.g. "dhu_sm90 sm_90a,
    CUDA 12 image" (KDA_DHU_IMAGE selects it), loading it as ``kernel_unavailable`` does;
    None where the device cannot run them. Raises as ``kernel_unavailable``."""

def cpu_bwd_dhu(
    mode: str,
    q: Tensor,
    k: Tensor,
    w: Tensor,
    do: Tensor,
    dv: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    h0: Tensor | None = None,
    dht: Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    *,
    poison: bool = False,
    check_only: bool = False,
) -> tuple[Any, Any | None, Any] | None:
    """Stage 4 on the CPU (src/cpu.rs), multi-threaded over (sequence, value head).

    ``mode``: "fla" (fp32 arithmetic with fla's rounding points; dh in q's dtype, dh0
    float32, dv2 in dv's dtype) or "float64" (the exact recurrence; every output
    float64, and float64 inputs taken). Arguments as ``validate`` takes them (with
    cu_seqlens, chunk_indices' length is dh's NT; a chunk_offsets table of N entries is
    not used); chunk_size must be 64. Every tensor in CPU memory. Outputs are torch tensors when q is a
    torch.Tensor, numpy arrays otherwise. ``poison``: fill the outputs with NaN before the
    run (tests). ``check_only``: every check below and nothing else, returning None.
    Raises as ``validate`` (the mode's dtypes), then ValueError for a tensor
    not in CPU memory, chunk_size != 64, an unknown mode, and cu_seqlens / chunk_offsets /
    chunk_indices values that do not describe the packed batch. Releases the GIL."""
