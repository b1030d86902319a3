"""GPU host path: the host time of an eager call; the one-crossing path (``_core.run``)
against the general path (``_core.decide`` + ``Call.launch``) and the stateless
``_core.launch``, bit for bit; what ``_core.run`` hands back; the outputs a prepared call
checks; and the TMA descriptor cache (a hit with new addresses computes what a fresh
encode computes; nothing kept alive; shared by threads).

The host-time test prints its figure (run with -s to see it); its bound is loose
(25 us median, against a goal of 10 us) so that a busy machine does not fail it.
``python benches/host_overhead.py`` breaks the figure down by step.

    bash scripts/device/device_run.sh --tests-only -k test_gpu_host   # this file alone
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref

import helpers
import kda_dhu
import pytest
import torch
from helpers import make_inputs, run_in_threads
from kda_dhu import _core, _dispatch
from kda_dhu.testing import chunk_tables, relayout, run_kernel

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
NAMES = helpers.OUTPUTS
TENSOR_KEYS = ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht", "cu_seqlens")

# The smallest call the kernel takes under the "extended" rule on sm_90 and sm_100
# (K = 128; gk, H == HV, dht, T % 64 == 0: the
# sm_100 envelope). One CTA: the kernel is a few microseconds, the call is host time.
TINY = dict(B=1, T=64, H=1, HV=1, K=128, V=64)
# Bound on the best of 30 batches of 50 calls: the best batch is the code's own cost, the
# median is the machine's load (under 8 parallel test shards and the sanitizers on 16
# cores the median reached 191 us while the best batch took 30 us, the quiet machine's
# 28 us). 60 us still catches a lost descriptor cache or a per-call module lookup.
HOST_US_BOUND = 60.0


def _tiny(rng, **over) -> dict:
    s = {**TINY, **over}
    return make_inputs(
        s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"], BF16, "gk", device="cuda", generator=rng
    )


def _assert_outputs_bitwise(got, expect, what: str) -> None:
    for name, a, b in zip(NAMES, got, expect):
        if a is None or b is None:
            assert a is None and b is None, f"{what}: {name} is None on one side"
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape)
        bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
        assert torch.equal(a.view(bits), b.view(bits)), f"{what}: {name} differs bitwise"


def _kernel_planned(args: dict) -> None:
    ok, reason = kda_dhu.plan_call(**args)
    assert ok, f"the plan sends this call to fla: {reason}"


def test_eager_call_host_time_is_small(rng, monkeypatch):
    """Host time per eager call at the tiny shape, launches queued (the GPU is synchronized
    outside the timed loops): the best batch's mean is held to HOST_US_BOUND, the median
    is printed. ~1 s."""
    monkeypatch.delenv(_dispatch.FORCE_ENV, raising=False)
    args = _tiny(rng)
    _kernel_planned(args)
    f = kda_dhu.chunk_gated_delta_rule_bwd_dhu
    for _ in range(200):  # module load, descriptor cache miss, allocator warm
        f(**args)
    torch.cuda.synchronize()
    per_call = []
    calls = 50
    for _ in range(30):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            f(**args)
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        per_call.append((t1 - t0) / calls / 1e3)
    median = statistics.median(per_call)
    print(
        f"\nhost time per eager call (B1 T64 H1 K128 V64 bf16 gk): median {median:.1f} us, "
        f"best {min(per_call):.1f} us ({torch.cuda.get_device_name()}); "
        f"descriptor cache {_core.tma_cache_info()}"
    )
    best = min(per_call)
    assert best < HOST_US_BOUND, f"{best:.1f} us per eager call in the best batch (bound {HOST_US_BOUND} us)"


def test_a_cache_hit_with_new_addresses_equals_a_fresh_encode(rng):
    """Two calls of one signature with different inputs and outputs: the second is a
    cache hit (addresses replaced) and its results are bitwise those of the same call
    made on an empty cache (descriptors encoded from its own addresses). Dense, tail,
    GVA and varlen signatures, interleaved. < 2 s."""
    cases = [
        dict(B=1, T=64, H=1, HV=1, K=128, V=64, gate="gk"),
        dict(B=2, T=200, H=2, HV=2, K=128, V=128, gate="g"),
        dict(B=1, T=256, H=1, HV=4, K=128, V=64, gate=None),
        dict(B=1, T=None, H=2, HV=2, K=128, V=64, gate="gk", varlen_lengths=[100, 30, 70]),
    ]

    def inputs(c):
        c = dict(c)
        return make_inputs(
            c.pop("B"),
            c.pop("T"),
            c.pop("H"),
            c.pop("HV"),
            c.pop("K"),
            c.pop("V"),
            BF16,
            c.pop("gate"),
            device="cuda",
            generator=rng,
            **c,
        )

    def run(a):  # the kernel under the "capable" rule, outputs poisoned with NaN
        return run_kernel(a, poison=True)

    def capable(a):
        return _core.decide(
            "capable",
            a["q"],
            a["k"],
            a["w"],
            a["do"],
            a["dv"],
            a["g"],
            a["gk"],
            a["h0"],
            a["dht"],
            a["scale"],
            False,
            a["cu_seqlens"],
        ).verdict[0]

    first = [inputs(c) for c in cases]
    keep = [i for i, a in enumerate(first) if capable(a)]  # sm_100: its envelope only
    assert keep, "no case the kernel can run on this device"
    cases = [cases[i] for i in keep]
    first = [first[i] for i in keep]
    second = [inputs(c) for c in cases]
    _core.tma_cache_clear()
    outs_first = [run(a) for a in first]  # one miss per signature
    info = _core.tma_cache_info()
    assert (info["misses"], info["hits"]) == (len(cases), 0), info
    outs_hit = [run(a) for a in second]  # hits: other inputs, other outputs
    info = _core.tma_cache_info()
    assert (info["misses"], info["hits"]) == (len(cases), len(cases)), info
    for a, b in zip(outs_hit, outs_first):
        assert a[0].data_ptr() != b[0].data_ptr()
    torch.cuda.synchronize()
    for i, (hit, before) in enumerate(zip(outs_hit, outs_first)):
        assert not torch.equal(hit[2], before[2]), f"case {i}: the hit read the first call's inputs"
    _core.tma_cache_clear()
    outs_fresh = [run(a) for a in second]  # misses again: encoded from these addresses
    torch.cuda.synchronize()
    for i, (hit, fresh) in enumerate(zip(outs_hit, outs_fresh)):
        _assert_outputs_bitwise(hit, fresh, f"case {i}")
        assert all(torch.isfinite(x).all() for x in hit if x is not None), f"case {i}: unwritten"
    # and the public entry point, after the hits, agrees with them where it plans the kernel
    for i, a in enumerate(second):
        if kda_dhu.plan_call(**a)[0]:
            _assert_outputs_bitwise(kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a), outs_hit[i], f"public {i}")


# fla's positional order of the call arguments (_core.decide / _core.run after the rule)
POS = helpers.POS
DEFAULTS = dict(state_v_first=False, chunk_size=64)


def _pos(a: dict) -> tuple:
    """The call's arguments in POS order (None / the defaults for those it lacks)."""
    return tuple(a.get(n, DEFAULTS.get(n)) for n in POS)


def _with_tables(a: dict, dtype=None) -> dict:
    """A packed batch's call with fla's chunk_indices and chunk_offsets [N + 1] (built
    without fla, in ``dtype``; cu_seqlens too)."""
    dtype = a["cu_seqlens"].dtype if dtype is None else dtype
    cu = a["cu_seqlens"].to(dtype)
    ci, co = chunk_tables(cu, a["q"].shape[1])
    return dict(a, cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co)


def _poisoned_outputs(call, a: dict):
    """(dh, dh0 or None, dv2) shaped as the prepared call says, filled with NaN."""
    dh_shape, dh0_shape, dv2_shape = call.out_shapes()
    q, dv = a["q"], a["dv"]
    nan = float("nan")
    dh = torch.full(dh_shape, nan, dtype=q.dtype, device=q.device)
    dh0 = torch.full(dh0_shape, nan, dtype=torch.float32, device=q.device) if dh0_shape else None
    dv2 = torch.full(dv2_shape, nan, dtype=dv.dtype, device=q.device)
    return dh, dh0, dv2


def _prepared_launch(call, a: dict):
    """Call.launch into poisoned outputs on torch's current stream."""
    outs = _poisoned_outputs(call, a)
    call.launch(*outs, torch.cuda.current_stream().cuda_stream)
    return outs


def test_prepared_launch_equals_the_stateless_launch(rng):
    """Call.launch (inputs read once) and _core.launch (everything read and
    validated again: chunk_indices before chunk_offsets) write the same bits, dense and
    packed (int32 cu_seqlens and chunk tables, chunk_offsets of N + 1 entries). < 1 s."""
    cases = [
        _tiny(rng, B=2, T=130, H=2, HV=2),
        _with_tables(
            make_inputs(
                1, None, 2, 2, 128, 64, BF16, "g", varlen_lengths=[1, 63, 65, 7], device="cuda", generator=rng
            ),
            torch.int32,
        ),
    ]
    stream = torch.cuda.current_stream().cuda_stream
    for i, a in enumerate(cases):
        call = _core.decide("capable", *_pos(a))
        assert call.action == "kernel", call.reason
        prepared = _prepared_launch(call, a)
        dh, dh0, dv2 = _poisoned_outputs(call, a)
        stateless = dh, dh0, dv2
        _core.launch(*_pos(a), dh=dh, dh0=dh0, dv2=dv2, stream=stream)
        torch.cuda.synchronize()
        assert all(torch.isfinite(x).all() for x in prepared if x is not None), f"case {i}: unwritten"
        _assert_outputs_bitwise(prepared, stateless, f"case {i}: prepared vs stateless")


# _core.run's cases: (rule, make_inputs arguments, chunk tables); each must plan the sm_90a
# kernel under its rule ("capable": wherever the kernel can run, past the policy clauses
# that "extended" would apply). Packed batches carry fla's
# chunk_indices (the one-crossing path needs NT without a host read) in int64 or int32.
RUN_CASES = [
    ("extended", dict(B=1, T=64, H=1, HV=1, K=128, V=64, gate="gk"), None),
    ("capable", dict(B=2, T=200, H=2, HV=4, K=64, V=128, gate="g", dtype=torch.float16), None),
    ("capable", dict(B=1, T=130, H=2, HV=2, K=128, V=64, gate=None, h0=False, dht=False), None),
    ("capable", dict(B=2, T=192, H=2, HV=2, K=128, V=128, gate="gk", state_v_first=True), None),
    ("b2a", dict(B=4, T=128, H=64, HV=64, K=128, V=64, gate="gk"), None),
    (
        "extended",
        dict(B=1, T=None, H=2, HV=2, K=128, V=64, gate="gk", varlen_lengths=[1, 63, 65, 7]),
        torch.int64,
    ),
    (
        "extended",
        dict(B=1, T=300, H=2, HV=2, K=128, V=128, gate="g", varlen_lengths=[100, 0, 30, 70]),
        torch.int32,
    ),
]


def _run_case(c: dict, rng, tables=None) -> dict:
    c = dict(c)
    a = make_inputs(
        c.pop("B"),
        c.pop("T"),
        c.pop("H"),
        c.pop("HV"),
        c.pop("K"),
        c.pop("V"),
        c.pop("dtype", BF16),
        c.pop("gate"),
        device="cuda",
        generator=rng,
        **c,
    )
    return a if tables is None else _with_tables(a, tables)


@pytest.mark.parametrize(
    "rule,case,tables", RUN_CASES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(RUN_CASES)]
)
def test_one_crossing_run_equals_the_general_path(rng, rule, case, tables):
    """_core.run (read, validate, plan, allocate and launch in one call: the eager entry
    points' path for packed inputs, packed batches with chunk_indices included) writes the
    bits of the general path (_core.decide, outputs allocated and poisoned in Python,
    Call.launch), with its outputs shaped, typed and placed as the general path's,
    and one kernel launch counted. < 1 s."""
    a = _run_case(case, rng, tables)
    if _core.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("_core.run launches the verified sm_90a kernel only")
    call = _core.decide(rule, *_pos(a))
    assert call.action == "kernel", call.reason
    assert call.copies == [] and call.nt is not None, (call.copies, call.nt)
    before = _core.launch_count()
    got = _core.run(rule, *_pos(a))
    assert type(got) is tuple, f"run handed a kernel-planned call back: {got!r}"
    assert _core.launch_count() == before + 1
    expect = _prepared_launch(call, a)
    torch.cuda.synchronize()
    for name, x, y in zip(NAMES, got, expect):
        if y is None:
            assert x is None, name
            continue
        assert type(x) is torch.Tensor and x.is_contiguous(), name
        assert (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device), name
        assert torch.isfinite(x).all(), f"{name}: an element left unwritten"
    _assert_outputs_bitwise(got, expect, f"run vs general, {rule} {case}")


def test_one_crossing_run_hands_back_what_it_does_not_launch(rng, monkeypatch):
    """The decision (a _core.Call), and no launch, for what the Python layer carries out:
    a fallback plan (K = 256, a b2a call below 256 CTAs: "fla"), an input to copy
    ("copy"), a packed batch without chunk_indices (NT unknown without a host read:
    "count"), KDA_DHU_FORCE=fla ("fla") and KDA_DHU_CHECK_INPUTS (the host check first);
    KDA_DHU_FORCE=kernel launches where the kernel runs the call; a packed batch with no
    chunks at all gets its outputs without a launch. Invalid input raises as decide does.
    The public entry point takes _core.run for dense and packed kernel calls (the general
    path is not entered)."""
    monkeypatch.delenv(_dispatch.FORCE_ENV, raising=False)
    monkeypatch.delenv("KDA_DHU_CHECK_INPUTS", raising=False)
    before = _core.launch_count()

    def handed_back(rule, a, action):
        call = _core.run(rule, *_pos(a))
        assert type(call) is _core.Call and call.action == action, (call, action)
        return call

    a = _run_case(dict(B=1, T=64, H=1, HV=1, K=256, V=64, gate="gk"), rng)
    handed_back("extended", a, "fla")
    a = _tiny(rng)
    handed_back("b2a", a, "fla")  # 1 CTA < the seed's 256
    misaligned = dict(a, q=relayout(a["q"], "offset_misaligned"))
    assert handed_back("extended", misaligned, "copy").copies == ["q"]  # q must be copied
    v = _run_case(dict(B=1, T=None, H=1, HV=1, K=128, V=64, gate="gk", varlen_lengths=[100, 30]), rng)
    handed_back("extended", v, "count")  # no chunk_indices
    empty = _with_tables(
        _run_case(dict(B=1, T=64, H=1, HV=1, K=128, V=64, gate="gk", varlen_lengths=[0, 0]), rng)
    )
    assert empty["chunk_indices"].shape[0] == 0
    dh, dh0, dv2 = _core.run("extended", *_pos(empty))  # NT = 0: the outputs, nothing to launch
    assert dh.shape[1] == 0 and dh0 is not None and bool((dh0 == empty["dht"]).all()) and not dv2.any()
    tables = _with_tables(v)
    monkeypatch.setenv("KDA_DHU_FORCE", "fla")
    assert handed_back("extended", tables, "fla").verdict == (False, "KDA_DHU_FORCE=fla")
    monkeypatch.delenv("KDA_DHU_FORCE")
    monkeypatch.setenv("KDA_DHU_CHECK_INPUTS", "1")
    assert handed_back("extended", tables, "kernel").check_tables
    monkeypatch.delenv("KDA_DHU_CHECK_INPUTS")
    assert _core.launch_count() == before, "a handed-back call launched"
    if _core.device_arch(torch.cuda.current_device()) == "sm_90":
        monkeypatch.setenv("KDA_DHU_FORCE", "kernel")
        assert type(_core.run("b2a", *_pos(a))) is tuple  # the capable plan: the kernel, launched
        monkeypatch.delenv("KDA_DHU_FORCE")
        assert _core.launch_count() == before + 1
        before += 1
    with pytest.raises(TypeError, match=r"^dv: expected dtype bfloat16"):
        _core.run("extended", *_pos(dict(a, dv=a["dv"].half())))
    if _core.device_arch(torch.cuda.current_device()) == "sm_90":

        def no_general_path(*args, **kw):
            raise AssertionError("the general path ran")

        monkeypatch.setattr(_dispatch, "_general", no_general_path)
        for args in (a, tables):
            out = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
            torch.cuda.synchronize()
            assert all(torch.isfinite(x).all() for x in out)
        assert _core.launch_count() == before + 2


def test_prepared_launch_checks_the_outputs(rng):
    """What Call.launch reads, it checks, naming the argument; no launch happens."""
    a = _tiny(rng)
    call = _core.decide(
        "extended", a["q"], a["k"], a["w"], a["do"], a["dv"], None, a["gk"], a["h0"], a["dht"], a["scale"]
    )
    stream = torch.cuda.current_stream().cuda_stream
    dh = torch.empty(1, 1, 1, 128, 64, dtype=BF16, device="cuda")
    dh0 = torch.empty_like(a["h0"])
    dv2 = torch.empty_like(a["dv"])
    before = _core.launch_count()
    with pytest.raises(ValueError, match=r"^dh: expected shape \[B=1, NT=1, HV=1, K=128, V=64\]"):
        call.launch(dh[:, :, :, :64], dh0, dv2, stream)
    with pytest.raises(TypeError, match=r"^dh0: expected a tensor"):
        call.launch(dh, None, dv2, stream)
    with pytest.raises(TypeError, match=r"^dv2: expected dtype bfloat16 like dv, got float32$"):
        call.launch(dh, dh0, dv2.float(), stream)
    with pytest.raises(ValueError, match=r"^dv2: expected a tensor on cuda:0 like q, got a tensor on cpu$"):
        call.launch(dh, dh0, dv2.cpu(), stream)
    flat = torch.empty(dv2.numel() + 1, dtype=BF16, device="cuda")
    with pytest.raises(ValueError, match=r"^dv2: expected a 16-byte aligned data pointer"):
        call.launch(dh, dh0, flat[1:].view(dv2.shape), stream)
    with pytest.raises(ValueError, match=r"^dh: expected a contiguous output tensor"):
        call.launch(dh.transpose(-1, -2).contiguous().transpose(-1, -2), dh0, dv2, stream)
    assert _core.launch_count() == before, "a refused launch was counted"
    with pytest.raises(ValueError, match=r"^rule: expected 'b2a', 'extended' or 'capable'"):
        call.replan("fast")
    assert call.replan("capable")[0] is True


def test_the_cache_keeps_no_tensor_alive(rng):
    """After a call, dropping the inputs and outputs frees them: weak references die
    and the allocator's count is back where it was (the cache holds numbers only)."""
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    a = _tiny(rng, T=128)
    _kernel_planned(a)
    out = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    torch.cuda.synchronize()
    assert _core.tma_cache_info()["size"] >= 1
    refs = [
        weakref.ref(t)
        for t in [*(a[k] for k in TENSOR_KEYS if a.get(k) is not None), *(o for o in out if o is not None)]
    ]
    del a, out
    gc.collect()
    assert all(r() is None for r in refs), "a tensor outlived the call"
    assert torch.cuda.memory_allocated() == before


def test_threads_share_the_cache_and_get_their_own_addresses(rng):
    """Four threads, three signatures, new inputs and outputs every call: bitwise the
    serial results (each thread's descriptors point at its own tensors). < 2 s."""
    shapes = [dict(T=64), dict(T=192), dict(B=2, T=128, H=2, HV=2)]
    inputs = [[_tiny(rng, **s) for s in shapes] for _ in range(4)]
    f = kda_dhu.chunk_gated_delta_rule_bwd_dhu
    serial = [[f(**a) for a in per_thread] for per_thread in inputs]
    torch.cuda.synchronize()
    got = [[None] * len(shapes) for _ in range(4)]

    def worker(i):
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(20):
                for j, a in enumerate(inputs[i]):
                    got[i][j] = f(**a)
            torch.cuda.current_stream().synchronize()

    run_in_threads(worker, 4)
    for i in range(4):
        for j in range(len(shapes)):
            _assert_outputs_bitwise(got[i][j], serial[i][j], f"thread {i}, shape {j}")
