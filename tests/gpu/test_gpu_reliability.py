"""GPU reliability: sizes past 2^31 elements, determinism, streams, devices,
memory over many calls, inputs left alone, CUDA graphs and torch.compile.

Every test draws fresh random inputs (the ``rng`` fixture, or a CUDA generator for the
big case), and where it runs the kernel directly its outputs are poisoned with NaN first
(``kda_dhu.testing.run_kernel(args, poison=True)``) so an element the kernel does not write
shows. "Bitwise" means equal bit patterns (NaN included), not ``==``.

Expected times on an H200 are in each test's docstring; none needs more than a minute
once fla's Triton kernel is compiled (the first fla call of a shape key compiles and
autotunes it: ~10-30 s, once per process). The two-device tests skip with one GPU.

    bash scripts/device/device_run.sh --tests-only -k test_gpu_reliability   # this file alone
    (device tool: kind nvidia-h200, or nvidia-h200-x2 for the cuda:1 tests; carry .carry)
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import helpers
import kda_dhu
import pytest
import torch
from helpers import make_inputs
from kda_dhu import _dispatch

pytestmark = pytest.mark.gpu

NAMES = helpers.OUTPUTS
TENSOR_KEYS = (
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
BF16, FP16 = torch.bfloat16, torch.float16
GiB = 1 << 30
MiB = 1 << 20


def _two_gpus() -> bool:
    try:
        return torch.cuda.device_count() >= 2
    except Exception:  # noqa: BLE001 - no driver: the gpu marker skips these anyway
        return False


needs_two_gpus = pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")


# ---------------------------------------------------------------------------- helpers


def _case(name: str, rng: torch.Generator, device="cuda") -> dict:
    """Keyword arguments of one small call, fresh from ``rng`` (drawn on the CPU)."""
    mk = lambda *a, **kw: make_inputs(*a, device=device, generator=rng, **kw)  # noqa: E731
    if name == "dense_gk":
        return mk(2, 256, 4, 4, 128, 128, BF16, "gk")
    if name == "dense_gk_big":  # 64 CTAs of 32 chunks: long enough to overlap
        return mk(4, 2048, 8, 8, 128, 128, BF16, "gk")
    if name == "dense_g_tail":
        return mk(2, 200, 2, 2, 128, 64, BF16, "g")
    if name == "dense_none_k64":
        return mk(2, 130, 2, 2, 64, 128, FP16, None)
    if name == "dense_g_tail_many":  # 256 CTAs, T % 64 = 40
        return mk(8, 1000, 16, 16, 128, 128, BF16, "g")
    if name == "gva_gk":
        return mk(1, 192, 2, 8, 128, 128, BF16, "gk")
    if name == "gva_none_tail":
        return mk(2, 100, 1, 4, 128, 64, BF16, None)
    if name == "varlen_gk":
        return mk(1, None, 2, 2, 128, 64, BF16, "gk", varlen_lengths=[1, 63, 65, 128, 200, 64, 7])
    if name == "varlen_g":
        return mk(1, None, 2, 2, 128, 128, BF16, "g", varlen_lengths=[1, 63, 65, 7])
    if name == "varlen_padded_g":
        return mk(1, 320, 2, 2, 128, 64, BF16, "g", varlen_lengths=[100, 30, 70])
    if name == "varlen_padded_gk":
        return mk(1, 300, 2, 2, 64, 64, BF16, "gk", varlen_lengths=[100, 30, 70])
    if name == "varlen_many_gva_g":  # 24 sequences x 8 heads x 2 V tiles = 384 CTAs
        lengths = torch.randint(1, 300, (24,), generator=rng).tolist()
        return mk(1, None, 4, 8, 128, 128, BF16, "g", varlen_lengths=lengths)
    raise KeyError(name)


def _with_tables(args: dict) -> dict:
    """fla's own chunk_indices / chunk_offsets for a varlen call (what fla's callers pass)."""
    from fla.ops.utils import prepare_chunk_indices, prepare_chunk_offsets

    out = dict(args)
    out["chunk_indices"] = prepare_chunk_indices(args["cu_seqlens"], 64)
    out["chunk_offsets"] = prepare_chunk_offsets(args["cu_seqlens"], 64)
    return out


def _to(args: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _kernel_poisoned(args: dict):
    """The kernel path with every output prefilled with NaN (the plan must allow it)."""
    from kda_dhu.testing import run_kernel

    return run_kernel(args, poison=True)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(_INT_OF_SIZE[x.element_size()])


def _assert_bitwise(a, b, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is None"
        return
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.device != b.device:
        b = b.to(a.device)
    same = _bits(a) == _bits(b)
    if not bool(same.all()):
        idx = (~same).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {a.numel()} elements differ "
            f"bitwise, first at {idx}: {a[tuple(idx)].item()} vs {b[tuple(idx)].item()}"
        )


def _assert_outputs_bitwise(got, expect, what: str) -> None:
    assert len(got) == len(expect) == 3
    for name, a, b in zip(NAMES, got, expect):
        _assert_bitwise(a, b, f"{what}: {name}")


def _rel(a, b) -> float:
    from kda_dhu.reference import rel_err

    return rel_err(a, b)


def _valid_rows(args: dict, outs):
    """(dh, dh0, dv2) with dv2 cut to the packed tokens: fla leaves a padded batch's
    padding rows of dv2 unwritten (torch.empty), kda-dhu writes zeros there."""
    cu = args.get("cu_seqlens")
    if cu is None:
        return tuple(outs)
    end = int(cu[-1])
    return outs[0], outs[1], outs[2][:, :end]


def _assert_close_to_fla(args, got, fla, tol=1e-2, what="") -> None:
    got, fla = _valid_rows(args, got), _valid_rows(args, fla)
    for name, a, b in zip(NAMES, got, fla):
        if b is None:
            assert a is None, f"{what} {name}"
            continue
        e = _rel(a, b)
        assert e < tol, f"{what} {name}: relative difference to fla {e:.3e} >= {tol}"


def _inputs_snapshot(args: dict) -> dict:
    return {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}


def _rss() -> int:
    """Resident set size of this process in bytes (psutil, else /proc/self/statm)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _free_all() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ------------------------------------------------- 1. outputs past 2^31 elements

# B=64 T=8192 H=HV=32 K=V=128 bf16 with gk: dh is [64, 128, 32, 128, 128] = 2^32 elements
# (8 GiB; B=32 would give exactly 2^31). Inputs 28 GiB (q, k, w, do, dv 4 GiB each, gk
# 8 GiB), each output set 12 GiB (ours and fla's), generation transients ~24 GiB: peak
# ~52 GiB of device memory.
BIG = dict(B=64, T=8192, H=32, K=128, V=128)
BIG_FREE_BYTES = 64 * GiB


def _rel_by_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over dim 0 slices (float64 sums; never a float64 copy of the whole);
    inf if ``a`` has a non-finite element (an unwritten, NaN-poisoned one)."""
    num = den = 0.0
    for i in range(a.shape[0]):
        x, y = a[i].float(), b[i].float()
        if not bool(torch.isfinite(x).all()):
            return math.inf
        num += float(torch.linalg.vector_norm(x - y, dtype=torch.float64)) ** 2
        den += float(torch.linalg.vector_norm(y, dtype=torch.float64)) ** 2
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def _close_report(a: torch.Tensor, b: torch.Tensor, what: str, rtol=2e-2, atol_rms=5e-2):
    """None if every element of a is within atol + rtol * |b| of b (atol = atol_rms * rms(b)),
    else a one-line description of the first miss."""
    x, y = a.float(), b.float()
    if not bool(torch.isfinite(x).all()):
        return f"{what}: {int((~torch.isfinite(x)).sum())} non-finite elements"
    atol = atol_rms * float(y.square().mean().sqrt())
    bad = (x - y).abs() > atol + rtol * y.abs()
    n = int(bad.sum())
    if n == 0:
        return None
    idx = tuple(bad.nonzero()[0].tolist())
    return (
        f"{what}: {n} of {x.numel()} elements off (atol {atol:.3e}, rtol {rtol}); first at "
        f"{list(idx)}: {x[idx].item():.6g} vs fla {y[idx].item():.6g}"
    )


def _big_compare(ours, theirs) -> list:
    """Failure messages (empty if all is well). Takes no reference from the caller's frame
    into a traceback: the test asserts after freeing the 50 GiB."""
    failures = []
    for name, o, f in zip(NAMES, ours, theirs):
        if o.shape != f.shape or o.dtype != f.dtype:
            failures.append(f"{name}: {tuple(o.shape)} {o.dtype} vs fla {tuple(f.shape)} {f.dtype}")
            continue
        e = _rel_by_rows(o, f)
        if not e < 1e-2:
            failures.append(f"{name}: relative difference to fla {e:.3e} (bar 1e-2)")
    dh, fdh = ours[0], theirs[0]
    if dh.numel() != 2**32:
        failures.append(f"dh has {dh.numel()} elements, expected 2^32")
    # dh[-1] holds flat elements [63 * 2^26, 2^32): past 2^31 and past 2^32 bytes * 2.
    for what, a, b in (
        ("dh[-1] (last batch row)", dh[-1], fdh[-1]),
        ("dh[:, -1] (last chunk)", dh[:, -1], fdh[:, -1]),
        ("dh[-1, -1, -1] (last head of the last chunk)", dh[-1, -1, -1], fdh[-1, -1, -1]),
        ("dv2[-1]", ours[2][-1], theirs[2][-1]),
        ("dh0[-1]", ours[1][-1], theirs[1][-1]),
    ):
        msg = _close_report(a, b, what)
        if msg:
            failures.append(msg)
    return failures


def test_outputs_past_2_31_elements_match_fla():
    """dh with 2^32 elements (8 GiB) on the kernel path vs fla: relative difference of
    dh/dh0/dv2 < 1e-2, every element written (NaN-poisoned beforehand), and the last
    batch row and last chunk of dh elementwise close to fla. ~5 s on an H200 (plus fla's
    compile/autotune on the small warm-up call if no earlier test did it: ~20 s)."""
    from kda_dhu import _measure as bench

    _free_all()
    free, _total = torch.cuda.mem_get_info()
    if free < BIG_FREE_BYTES:
        pytest.skip(f"needs {BIG_FREE_BYTES / GiB:.0f} GiB of free device memory, {free / GiB:.1f} GiB free")
    B, T, H, K, V = BIG["B"], BIG["T"], BIG["H"], BIG["K"], BIG["V"]
    fla = kda_dhu.fla_function()
    # fla autotunes per (H, HV, K, V, ...): do it on a tiny call, not on the 8 GiB one.
    small = bench.make_inputs(1, 64, H, H, K, V, BF16, "gk", seed=1)
    fla(**small)
    del small
    a = ours = theirs = None
    failures = []
    try:
        a = bench.make_inputs(B, T, H, H, K, V, BF16, "gk", seed=20261130)
        ok, reason = kda_dhu.plan_call(**a)
        assert ok, f"the planner sends the 2^32-element call to fla: {reason}"
        ours = _kernel_poisoned(a)
        theirs = fla(**a)
        torch.cuda.synchronize()
        failures = _big_compare(ours, theirs)
    finally:
        del a, ours, theirs
        _free_all()
    assert not failures, "\n".join(failures)


# ------------------------------------------------------- 2. bitwise repeatability


@pytest.mark.parametrize(
    "case",
    [
        "varlen_gk",
        "varlen_padded_g",
        "varlen_many_gva_g",
        "dense_g_tail_many",
        "dense_none_k64",
        "gva_none_tail",
    ],
)
def test_repeated_runs_are_bitwise_identical(rng, case):
    """Five poisoned kernel runs of the same inputs give the same bits (varlen, padded
    batch, g gate, no gate, GVA, multi-wave grids). < 1 s each."""
    args = _case(case, rng)
    first = _kernel_poisoned(args)
    assert all(torch.isfinite(x).all() for x in first if x is not None), "non-finite output"
    for run in range(2, 6):
        _assert_outputs_bitwise(_kernel_poisoned(args), first, f"{case}, run {run}")
    # and through the public entry point (kernel where planned, else fla: deterministic too)
    public = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    again = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    _assert_outputs_bitwise(again, public, f"{case}, public entry")


# ------------------------------------------------------------------- 3. streams


@pytest.mark.parametrize("case", ["dense_gk", "varlen_padded_gk", "gva_gk"])
def test_non_default_stream_matches_default_stream_and_fla(rng, monkeypatch, case):
    """On a side stream: bitwise the default stream's result, and close to fla. < 1 s."""
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")  # the kernel on every rule that computes it
    args = _case(case, rng)
    expect = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    fla = kda_dhu.fla_function()(**args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    _assert_outputs_bitwise(got, expect, f"{case} on a side stream")
    _assert_close_to_fla(args, got, fla, what=case)


STREAM_CASES = ["dense_gk_big", "dense_g_tail", "varlen_gk", "gva_gk"]


def test_four_streams_concurrently_equal_serial(rng, monkeypatch):
    """Four different problems launched round-robin on four streams, three times each,
    with no synchronization between them: every result is bitwise the same problem run
    serially on the default stream. < 2 s."""
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")
    problems = [_case(c, rng) for c in STREAM_CASES]
    serial = [kda_dhu.chunk_gated_delta_rule_bwd_dhu(**p) for p in problems]
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in problems]
    for s in streams:
        s.wait_stream(main)
    results = [[] for _ in problems]
    for _rep in range(3):
        for i, (s, p) in enumerate(zip(streams, problems)):
            with torch.cuda.stream(s):
                results[i].append(kda_dhu.chunk_gated_delta_rule_bwd_dhu(**p))
    for s in streams:
        main.wait_stream(s)
    torch.cuda.synchronize()
    for c, expect, outs in zip(STREAM_CASES, serial, results):
        for rep, got in enumerate(outs):
            _assert_outputs_bitwise(got, expect, f"{c}, stream round {rep}")


def test_threads_with_their_own_streams_equal_serial(rng, monkeypatch):
    """Four Python threads, each with its own stream and problem, calling five times at
    once (the host core's per-thread context handling): bitwise the serial results. < 2 s."""
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")
    problems = [_case(c, rng) for c in STREAM_CASES]
    serial = [kda_dhu.chunk_gated_delta_rule_bwd_dhu(**p) for p in problems]
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    barrier = threading.Barrier(len(problems))

    def worker(i):
        torch.cuda.set_device(device)
        s = torch.cuda.Stream()
        barrier.wait(timeout=60)
        with torch.cuda.stream(s):
            outs = [kda_dhu.chunk_gated_delta_rule_bwd_dhu(**problems[i]) for _ in range(5)]
        s.synchronize()
        return outs

    with ThreadPoolExecutor(len(problems)) as ex:
        results = list(ex.map(worker, range(len(problems))))
    for c, expect, outs in zip(STREAM_CASES, serial, results):
        for rep, got in enumerate(outs):
            _assert_outputs_bitwise(got, expect, f"{c}, thread call {rep}")


SLEEP_CYCLES = 500_000_000  # ~0.25 s at the H200's 1.98 GHz


@pytest.mark.parametrize("case", ["dense_gk", "varlen_gk", "varlen_gk_tables"])
def test_the_callers_current_stream_orders_the_call(rng, case):
    """Inputs are written on stream s behind a ~0.25 s sleep kernel, then the call is made
    under ``torch.cuda.stream(s)`` with no synchronization: it must read the new values
    (a launch on another stream reads the NaN / zero placeholders; cu_seqlens and the
    chunk tables included). An event recorded on s after the call orders a consumer on
    the default stream. A dense call and a packed batch with fla's chunk tables must also
    return before s has drained (no hidden synchronization; a packed batch without
    chunk_indices counts its chunks through fla's helper, which reads cu_seqlens). ~0.5 s."""
    if case == "varlen_gk_tables":
        args = _with_tables(_case("varlen_gk", rng))
    else:
        args = _case(case, rng)
    expect = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    # placeholders: NaN for float inputs, zeros for cu_seqlens (all sequences empty)
    placeholders = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            placeholders[k] = (
                torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
            )
    kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)  # warm: module loaded, nothing lazy left
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for k, buf in placeholders.items():
            buf.copy_(args[k])
        got = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**{**args, **placeholders})
        still_busy = not s.query()
        done = torch.cuda.Event()
        done.record(s)
    # a consumer on the default stream, ordered by the event alone
    main.wait_event(done)
    checks = [
        torch.equal(_bits(a), _bits(b)) if a is not None else None for a, b in zip(got, expect)
    ]  # host-synchronizes main, which waits on `done`
    torch.cuda.synchronize()
    _assert_outputs_bitwise(got, expect, f"{case} under torch.cuda.stream(s)")
    assert all(c is None or c for c in checks)
    if args.get("cu_seqlens") is None or args.get("chunk_indices") is not None:
        assert still_busy, (
            f"the {case} call returned after stream s drained: it synchronized (or the sleep was too short)"
        )


# ------------------------------------------------------------------- 4. devices


class _Sub(torch.Tensor):
    pass


def _synchronized_on_cuda1(outs):
    """Both GPUs synchronized; every output (dh, dh0, dv2) that is not None on cuda:1."""
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for name, x in zip(NAMES, outs):
        if x is not None:
            assert x.device == torch.device("cuda", 1), f"{name} on {x.device}"


@needs_two_gpus
@pytest.mark.parametrize("subclass", [False, True])
def test_one_crossing_path_on_cuda1_while_current_device_is_cuda0(rng, monkeypatch, subclass):
    """KDA_DHU_FORCE unset, inputs on cuda:1, cuda:0 current: the eager entry point (the
    one-crossing path for plain tensors; the general path, under cuda:1, for a subclass
    input, whose __dlpack__ exports only from the current device) returns outputs on
    cuda:1, bitwise the poisoned kernel run on cuda:0. < 1 s."""
    monkeypatch.delenv("KDA_DHU_FORCE", raising=False)
    args0 = _case("dense_gk", rng, device="cuda:0")
    args1 = _to(args0, "cuda:1")
    if subclass:
        args1["k"] = args1["k"].as_subclass(_Sub)
    with torch.cuda.device(0):
        on0 = _kernel_poisoned(args0)
        got = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args1)
        assert torch.cuda.current_device() == 0
    _synchronized_on_cuda1(got)
    _assert_outputs_bitwise(got, on0, f"dense_gk (subclass={subclass}): cuda:1 vs cuda:0")


@needs_two_gpus
@pytest.mark.parametrize("case", ["dense_gk", "varlen_padded_g", "gva_gk"])
def test_inputs_on_cuda1_while_current_device_is_cuda0(rng, monkeypatch, case):
    """Inputs on cuda:1 with cuda:0 current: outputs on cuda:1, bitwise the poisoned
    kernel run of the same inputs on cuda:0, close to fla on cuda:1; the current device
    is left alone. < 2 s."""
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")  # the kernel on every rule that computes it
    args0 = _case(case, rng, device="cuda:0")
    args1 = _to(args0, "cuda:1")
    with torch.cuda.device(0):
        on0 = _kernel_poisoned(args0)
        got = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args1)
        assert torch.cuda.current_device() == 0, "the call changed the current device"
        poisoned1 = _kernel_poisoned(args1)
        assert torch.cuda.current_device() == 0
    _synchronized_on_cuda1(got)
    _assert_outputs_bitwise(got, on0, f"{case}: cuda:1 vs cuda:0")
    _assert_outputs_bitwise(poisoned1, on0, f"{case}: poisoned cuda:1 vs cuda:0")
    with torch.cuda.device(1):
        fla = kda_dhu.fla_function()(**args1)
        torch.cuda.synchronize(1)
    _assert_close_to_fla(args1, got, fla, what=f"{case} on cuda:1")


@needs_two_gpus
@pytest.mark.parametrize(
    "case,moved,named",
    [
        ("dense_gk", "k", "k"),
        ("dense_gk", "w", "w"),
        ("dense_gk", "do", "do"),
        ("dense_gk", "dv", "dv"),
        ("dense_gk", "gk", "gk"),
        ("dense_gk", "h0", "h0"),
        ("dense_gk", "dht", "dht"),
        ("dense_gk", "q", "k"),  # q sets the device: the first other tensor is named
        ("varlen_g", "g", "g"),
        ("varlen_g", "cu_seqlens", "cu_seqlens"),
    ],
)
def test_mixed_devices_raise_value_error_naming_the_argument(rng, case, moved, named):
    """One tensor on cuda:1, the rest on cuda:0: ValueError naming it, from the entry
    point; plan_call reports it. Instant."""
    args = _case(case, rng, device="cuda:0")
    args[moved] = args[moved].to("cuda:1")
    with pytest.raises(ValueError, match=rf"^{named}: .*cuda:"):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    ok, reason = kda_dhu.plan_call(**args)
    assert not ok and f"{named}:" in reason, reason


@needs_two_gpus
def test_mixed_devices_through_b2a_op_and_a_fallback_call(rng):
    """The same ValueError from the seed dispatcher, the custom op, and a state_v_first call
    (a layout the seed's dispatcher cannot express): the device check comes before the
    plan. Instant."""
    a = _case("dense_gk", rng, device="cuda:0")
    a["dht"] = a["dht"].to("cuda:1")
    with pytest.raises(ValueError, match=r"^dht: .*cuda:1"):
        kda_dhu.kda_dhu_b2a(
            a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], 64
        )
    with pytest.raises((ValueError, RuntimeError), match=r"dht|device"):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu_op(**a)
    with pytest.raises(ValueError, match=r"^dht: .*cuda:1"):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**{**a, "state_v_first": True})


# -------------------------------------------------------------------- 5. memory


def _memory_problems(rng) -> list:
    mk = lambda *a, **kw: make_inputs(*a, device="cuda", generator=rng, **kw)  # noqa: E731
    return [
        mk(2, 128, 2, 2, 128, 64, BF16, "gk"),
        mk(2, 100, 2, 2, 128, 64, BF16, "g"),  # tail
        mk(1, 65, 1, 1, 64, 64, FP16, None),  # K 64, fp16
        mk(1, None, 2, 2, 128, 64, BF16, "gk", varlen_lengths=[1, 63, 65, 7]),
        mk(1, 256, 2, 2, 64, 64, BF16, "g", varlen_lengths=[100, 30, 70]),  # padded
        mk(1, 192, 1, 4, 128, 64, BF16, "gk"),  # GVA
        mk(2, 64, 2, 2, 128, 128, BF16, "gk", dht=False, h0=False),
        mk(3, 1, 1, 1, 128, 64, BF16, "gk"),  # T = 1
        mk(1, None, 1, 2, 64, 128, FP16, None, varlen_lengths=[64, 128, 5]),
        mk(2, 300, 2, 2, 128, 192, BF16, "gk", h0=False),  # V = 192
    ]


def test_ten_thousand_calls_release_device_and_host_memory(rng, monkeypatch):
    """10,000 kernel calls cycling over 10 shapes (dense, tails, varlen, padded, GVA,
    K 64, fp16, no states), outputs dropped each time: afterwards
    torch.cuda.memory_allocated() is back to its value before the loop, host RSS grew by
    < 50 MiB between call 1,000 and call 10,000, and the last call of every shape is
    bitwise its first. ~5 s (host-bound; a varlen call without chunk_indices counts its
    chunks through fla's cache, read once per cu_seqlens tensor)."""
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")  # K 64 and small GVA too, never fla
    fn = kda_dhu.chunk_gated_delta_rule_bwd_dhu
    problems = _memory_problems(rng)
    first = [fn(**p) for p in problems]
    n = len(problems)
    calls = 10_000
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    rss_1000 = None
    t0 = time.perf_counter()
    for i in range(calls):
        out = fn(**problems[i % n])
        if i >= calls - n:
            _assert_outputs_bitwise(out, first[i % n], f"shape {i % n}, call {i + 1}")
        del out
        if i + 1 == 1000:
            torch.cuda.synchronize()
            gc.collect()
            rss_1000 = _rss()
            allocated_1000 = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    gc.collect()
    elapsed = time.perf_counter() - t0
    rss_end = _rss()
    allocated = torch.cuda.memory_allocated()
    print(
        f"{calls} calls in {elapsed:.1f} s; allocated {base} -> {allocated_1000} (call 1000) "
        f"-> {allocated}; RSS {rss_1000 / MiB:.1f} -> {rss_end / MiB:.1f} MiB"
    )
    assert allocated == base, (
        f"torch.cuda.memory_allocated() {allocated} after the loop, "
        f"{base} before (call 1000: {allocated_1000})"
    )
    assert rss_end - rss_1000 < 50 * MiB, (
        f"host RSS grew {(rss_end - rss_1000) / MiB:.1f} MiB between call 1,000 and call {calls}"
    )


# --------------------------------------------------------- 6. inputs never modified


@pytest.mark.parametrize("path", ["kernel", "fla", "op"])
@pytest.mark.parametrize(
    "case", ["dense_g_tail", "dense_none_k64", "gva_gk", "varlen_padded_gk", "varlen_g_tables"]
)
def test_inputs_are_never_modified(rng, monkeypatch, path, case):
    """Every input tensor (padding garbage of padded batches, fla's chunk tables
    included) is bitwise unchanged after a call, on the kernel path, the fla path and
    through the custom op; no output aliases an input. < 1 s."""
    if case == "varlen_g_tables":
        args = _with_tables(_case("varlen_g", rng))
    else:
        args = _case(case, rng)
    monkeypatch.setenv("KDA_DHU_FORCE", "fla" if path == "fla" else "kernel")
    before = _inputs_snapshot(args)
    if path == "op":
        out = kda_dhu.chunk_gated_delta_rule_bwd_dhu_op(**args)
    else:
        out = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    torch.cuda.synchronize()
    for k, v in before.items():
        _assert_bitwise(args[k], v, f"input {k} after a {path} call")
    ptrs = {v.data_ptr() for v in before.values()} | {
        v.data_ptr() for k, v in args.items() if isinstance(v, torch.Tensor)
    }
    for name, o in zip(NAMES, out):
        if o is not None:
            assert o.data_ptr() not in ptrs, f"{name} aliases an input"


def test_inputs_are_never_modified_by_the_seed_dispatcher(rng, monkeypatch):
    """kda_dhu_b2a on its kernel path (forced past its 256-CTA floor) and on fla's. < 1 s."""
    a = _case("dense_gk", rng)
    for force in ("kernel", "fla"):
        monkeypatch.setenv("KDA_DHU_FORCE", force)
        before = _inputs_snapshot(a)
        kda_dhu.kda_dhu_b2a(
            a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], 64
        )
        torch.cuda.synchronize()
        for k, v in before.items():
            _assert_bitwise(a[k], v, f"input {k} after kda_dhu_b2a ({force})")


# --------------------------------------------------------------- 7. CUDA graphs


def _capture(fn):
    """torch's recipe: warm up on a side stream, then capture one call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _copy_inputs(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, torch.Tensor):
            dst[k].copy_(v)


def _replay_equals_eager(call, static: dict, fresh: dict, what: str):
    """Eager on ``static`` and on ``fresh``; one call on ``static`` captured; its replay is
    bitwise the eager result, and again after ``fresh`` is copied into ``static``.
    Returns the two eager results."""
    eager_static = call(**static)
    eager_fresh = call(**fresh)
    graph, outs = _capture(lambda: call(**static))
    graph.replay()
    torch.cuda.synchronize()
    _assert_outputs_bitwise(outs, eager_static, f"{what}: replay")
    _copy_inputs(static, fresh)
    graph.replay()
    torch.cuda.synchronize()
    _assert_outputs_bitwise(outs, eager_fresh, f"{what}: replay on new inputs")
    return eager_static, eager_fresh


@pytest.mark.parametrize("entry", ["function", "op"])
@pytest.mark.parametrize("case", ["dense_gk", "dense_g_tail", "gva_none_tail"])
def test_cuda_graph_replay_equals_eager(rng, monkeypatch, entry, case):
    """Capture one dense call in torch.cuda.graph with static inputs; replay equals eager
    on the same inputs, then, after copying new inputs in, eager on the new ones (bitwise).
    < 1 s."""
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")  # capture the kernel, not fla's Triton
    call = (
        kda_dhu.chunk_gated_delta_rule_bwd_dhu
        if entry == "function"
        else kda_dhu.chunk_gated_delta_rule_bwd_dhu_op
    )
    static = _case(case, rng)
    fresh = _case(case, rng)
    eager_static, eager_fresh = _replay_equals_eager(call, static, fresh, f"{case} {entry}")
    assert not torch.equal(_bits(eager_fresh[0]), _bits(eager_static[0])), "inputs did not change"


@pytest.mark.parametrize("case", ["dense_gk", "dense_g_tail"])
def test_cuda_graph_replay_through_the_one_crossing_path(rng, monkeypatch, case):
    """KDA_DHU_FORCE unset: the eager entry point takes _core.run (the general path is
    made to fail), under capture too (outputs from the graph's pool, the capture
    stream); replay equals eager, on the static inputs and on new ones (bitwise). < 1 s."""
    monkeypatch.delenv("KDA_DHU_FORCE", raising=False)
    static = _case(case, rng)
    fresh = _case(case, rng)
    assert kda_dhu.plan_call(**static)[0], "the extended rule sends this case to fla"

    def no_general_path(*a, **kw):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(_dispatch, "_general", no_general_path)
    _replay_equals_eager(kda_dhu.chunk_gated_delta_rule_bwd_dhu, static, fresh, case)


@pytest.mark.parametrize("via", ["kda_dhu", "fla_dispatch"])
def test_cuda_graph_with_fla_use_graph_static_buffers(rng, monkeypatch, via):
    """``use_graph=True`` (fla's static output buffers), called directly or through fla's
    own dispatching function with kda-dhu registered as its backend: captured, replayed
    on new inputs, bitwise eager (the kernel's bits: fla's Triton kernel would differ);
    the outputs are fla's static buffers. < 1 s."""
    from fla.ops.utils.graph import get_static_buffer

    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")

    if via == "fla_dispatch":
        import fla.ops.common.chunk_delta_h as m
        from kda_dhu import fla_backend

        if not kda_dhu.register_backend() and not fla_backend.is_registered():
            pytest.skip("kda-dhu cannot register as an fla backend here")
        fn = m.chunk_gated_delta_rule_bwd_dhu
    else:
        fn = kda_dhu.chunk_gated_delta_rule_bwd_dhu
    static = _case("dense_gk", rng)
    fresh = _case("dense_gk", rng)
    assert kda_dhu.plan_call(**static)[0]
    eager_static = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**static)
    eager_fresh = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**fresh)
    graph, outs = _capture(lambda: fn(**static, use_graph=True))
    q, dv = static["q"], static["dv"]
    B, T, _H, K = q.shape
    HV, V = dv.shape[2], dv.shape[3]
    buf = get_static_buffer("dhu_dh", (B, (T + 63) // 64, HV, K, V), q.dtype, q.device)
    assert outs[0].data_ptr() == buf.data_ptr(), "dh is not fla's static buffer"
    graph.replay()
    torch.cuda.synchronize()
    _assert_outputs_bitwise(outs, eager_static, f"use_graph via {via}: replay")
    _copy_inputs(static, fresh)
    graph.replay()
    torch.cuda.synchronize()
    _assert_outputs_bitwise(outs, eager_fresh, f"use_graph via {via}: replay on new inputs")


_VARLEN_CAPTURE = textwrap.dedent("""
    import os
    import torch, kda_dhu
    from kda_dhu import _core
    from kda_dhu.testing import make_inputs
    os.environ.pop("KDA_DHU_FORCE", None)
    def inputs(seed):
        return make_inputs(1, None, 2, 2, 128, 64, torch.bfloat16, "gk", varlen_lengths=[1, 63, 65, 7],
                           device="cuda", generator=torch.Generator().manual_seed(seed))
    a, fresh = inputs(1), inputs(2)
    fresh["cu_seqlens"] = a["cu_seqlens"]  # the same tensor (and values)
    expect = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**fresh)  # eager: fla's cache counts its chunks
    kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    torch.cuda.synchronize()
    launches = _core.launch_count()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            out = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    except Exception as e:
        msgs, x = [], e
        while x is not None and len(msgs) < 4:
            msgs.append(type(x).__name__ + ": " + " ".join(str(x).split()))
            x = x.__context__ or x.__cause__
        print("RAISED | " + " || ".join(msgs), flush=True)
    else:
        captured = _core.launch_count() - launches
        for k in ("q", "k", "w", "do", "dv", "gk", "dht"):
            a[k].copy_(fresh[k])
        g.replay()
        torch.cuda.synchronize()
        bits = lambda x: x.view(torch.int16 if x.element_size() == 2 else torch.int32)
        equal = all(torch.equal(bits(o), bits(e)) for o, e in zip(out, expect))
        print(f"CAPTURED launches={captured} equal={equal}", flush=True)
""")


def test_varlen_call_without_chunk_indices_is_captured_on_the_kernel():
    """A packed batch given without chunk_indices, whose chunk count fla's cache holds
    from an eager call on the same cu_seqlens tensor, is captured in a CUDA graph with one
    kernel launch (no host read during capture: cu_seqlens is read on the device), and the
    replay after new values are copied into the inputs is bitwise the eager call on them.
    (In a child process: a capture that synchronizes fails and can leave a process's CUDA
    state unusable.) ~10 s (the child imports torch, fla and kda_dhu)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run(
        [sys.executable, "-c", _VARLEN_CAPTURE], capture_output=True, text=True, timeout=150, env=env
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("RAISED", "CAPTURED"))]
    assert lines, f"child rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert lines[0] == "CAPTURED launches=1 equal=True", lines[0]


# ------------------------------------------------------------- 8. torch.compile


@pytest.mark.parametrize("case", ["gva_gk_tail", "dense_g", "varlen_tables", "varlen_dynamic"])
def test_torch_compile_fullgraph_matches_eager(rng, monkeypatch, case):
    """torch.compile(fullgraph=True) (inductor) over a function calling the custom op with
    CUDA tensors and using its outputs: op outputs bitwise the eager function's (and the
    eager dispatcher's). Varlen with fla's chunk_indices (static chunk count) and without
    (a data-dependent size). ~10 s each (inductor compiles)."""
    from kda_dhu.ops import chunk_gated_delta_rule_bwd_dhu_op as op

    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")  # small GVA / K 64: the kernel all the same
    torch._dynamo.reset()
    if case == "gva_gk_tail":
        a = make_inputs(2, 200, 2, 4, 128, 64, BF16, "gk", device="cuda", generator=rng)
    elif case == "dense_g":
        a = make_inputs(2, 128, 2, 2, 64, 128, BF16, "g", h0=False, device="cuda", generator=rng)
    else:
        a = make_inputs(
            1, None, 2, 2, 128, 64, BF16, "gk", varlen_lengths=[1, 63, 65, 7], device="cuda", generator=rng
        )
    ci = _with_tables(a)["chunk_indices"] if case == "varlen_tables" else None
    scale = a["scale"]

    def step(q, k, w, do, dv, g, gk, h0, dht, cu, chunk_indices):
        dh, dh0, dv2 = op(
            q,
            k,
            w,
            do,
            dv,
            g=g,
            gk=gk,
            h0=h0,
            dht=dht,
            scale=scale,
            cu_seqlens=cu,
            chunk_indices=chunk_indices,
        )
        return dh, dh0, dv2, dv2.float() - dv.float()

    inputs = (
        a["q"],
        a["k"],
        a["w"],
        a["do"],
        a["dv"],
        a["g"],
        a["gk"],
        a["h0"],
        a["dht"],
        a["cu_seqlens"],
        ci,
    )
    eager = step(*inputs)
    compiled = torch.compile(step, fullgraph=True)(*inputs)
    torch.cuda.synchronize()
    _assert_outputs_bitwise(compiled[:3], eager[:3], f"{case}: compiled vs eager")
    torch.testing.assert_close(compiled[3], eager[3], rtol=0, atol=0)
    direct = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    _assert_outputs_bitwise(compiled[:3], direct, f"{case}: compiled vs the eager dispatcher")
