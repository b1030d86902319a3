"""GPU: no host synchronization on any route, packed batches under CUDA graphs, and the
device-side checks of packed batches.

1. No host synchronization. After warm-up, each route's call returns while a ~0.2 s
   sleep kernel is still queued ahead of it on the current stream (the host did not wait
   for the GPU: this also catches a synchronizing driver call inside the extension), and
   it runs under ``torch.cuda.set_sync_debug_mode("error")`` (a synchronizing torch call
   raises). Routes: the direct entry point (dense; packed with chunk_indices in int64 and
   int32; packed without chunk_indices on a cu_seqlens tensor fla's cache has seen; an
   input that is copied; fla's CUDA-graph buffers, dense and packed; a call the planner
   sends to fla), ``kda_dhu_b2a`` (kernel and fla), fla's public function through the
   registry (dense, packed, a call fla keeps), the custom op. The one-crossing routes
   allocate their three outputs and nothing else (int32 tables are not widened), and
   every route's values are checked against the float64 reference (within 1.25x of fla's
   error), the outputs of the warm-up calls poisoned with NaN before they were freed.
   Without chunk_indices, the first call on a cu_seqlens tensor synchronizes no more
   often than fla's own function. The instruments are checked first: a synchronizing
   call raises under the debug mode, and drains the sleep. fla's KDA and GDN training
   steps: tests/gpu/test_gpu_fla_step.py.
2. Packed batches under CUDA graphs: a call with fla's graph-mode tables
   (``prepare_chunk_indices_static``: zero-length padding sequences up to a fixed N, a
   fixed chunk budget, int64 or int32) is captured (one kernel launch), replayed, and
   replayed again after new lengths and values are copied into its inputs: each replay
   matches the float64 reference of its data (the real chunks' rows of dh).
3. Device-side checks: each bad packed batch of ``kda_dhu.testing.BAD_BATCHES``
   (cu_seqlens[0] != 0, decreasing, past T, a wrong chunk_offsets table, chunks past NT,
   garbage values), launched through ``_core.decide`` + ``Call.launch`` into
   outputs placed inside larger buffers filled with a sentinel: the sentinel is intact
   (nothing written out of bounds), the failing sequence's outputs are NaN where its
   entries bound them, every other sequence's match the reference, and the next call
   raises ValueError naming the argument in the host checker's words (once);
   ``kda_dhu.check_errors()`` raises what a graph replay found; KDA_DHU_CHECK_INPUTS=1
   raises at once, with no launch.
4. ``kda_dhu.testing.KernelProbe`` counts launches on the one-crossing path too.

Every test leaves no device error behind (a fixture checks after each test). Expected time
on an H200, once fla's Triton kernels are compiled: ~25 s for the file (the sleeps are
0.2 s each).

    python -m pytest tests/gpu/test_gpu_nosync.py -q -m gpu
"""

from __future__ import annotations

import contextlib
import math
import re

import helpers
import kda_dhu
import pytest
import torch
from helpers import (
    SLEEP_CYCLES,
    count_syncs,
    make_inputs,
    register_or_skip,
    sync_debug,
    via_registry,
    without_sync,
)
from kda_dhu import _core, _dispatch
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
from kda_dhu.testing import (
    BAD_BATCHES,
    GOOD_BATCH,
    KernelProbe,
    backend_mode,
    bad_batch,
    chunk_tables,
    relayout,
)

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
NAMES = helpers.OUTPUTS
FLOAT_INPUTS = helpers.FLOAT_INPUTS
LENGTHS = helpers.VARLEN_LENGTHS


@pytest.fixture(autouse=True)
def _no_device_error_left():
    """No bad packed batch pending from before the test; none left by it (a test that
    makes one consumes its error itself)."""
    try:
        kda_dhu.check_errors()
    except ValueError:
        pass
    yield
    kda_dhu.check_errors()


@pytest.fixture(autouse=True)
def _hopper_and_no_switches(no_switches):
    """The routes and counts below are the verified sm_90a kernel's (the sm_100a one runs
    under a self-check, its envelope only); no environment switch set."""
    if _core.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("needs an sm_90 device (H100 / H200)")


# ------------------------------------------------------------------------ instruments


def test_the_instruments_catch_a_synchronization():
    """What the no-sync checks rely on: a host read of a CUDA tensor raises under sync
    debug mode "error" and warns under "warn"; after a sleep kernel the stream is busy
    when plain host work returns and drained when a synchronizing call returns."""
    x = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="synchroniz"):
        with sync_debug("error"):
            x.sum().item()
    _, n = count_syncs(lambda: x.sum().item())
    assert n >= 1
    _, n = count_syncs(lambda: x.sum())
    assert n == 0
    torch.cuda._sleep(SLEEP_CYCLES)
    sum(range(100_000))  # ~1 ms of host work
    assert not torch.cuda.current_stream().query(), "the sleep is too short to see a wait"
    x.sum().item()
    assert torch.cuda.current_stream().query()


# ------------------------------------------------------------------------ inputs


def _with_tables(a: dict, dtype=torch.int64) -> dict:
    cu = a["cu_seqlens"].to(dtype)
    ci, co = chunk_tables(cu, a["q"].shape[1])
    return dict(a, cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co)


def _dense(rng, **over):
    s = dict(B=2, T=256, H=2, HV=2, K=128, V=128, gate="gk")
    s.update(over)
    return make_inputs(
        s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"], BF16, s["gate"], device="cuda", generator=rng
    )


def _varlen(rng, tables=torch.int64, K=128):
    a = make_inputs(1, None, 2, 2, K, 128, BF16, "gk", varlen_lengths=LENGTHS, device="cuda", generator=rng)
    return a if tables is None else _with_tables(a, tables)


# fla's CUDA-graph varlen mode: real sequences, then zero-length padding up to N_MAX; a
# padded batch of T_GRAPH tokens; the chunk budget fla uses (ceil(T / 64) + N_MAX - 1).
GRAPH_LENGTHS = ([100, 1, 0, 200, 37], [30, 250, 0, 64, 65])
N_MAX, T_GRAPH = 7, 448
NT_MAX = -(-T_GRAPH // 64) + N_MAX - 1


def _graph_inputs(rng, lengths, dtype=torch.int64):
    from fla.ops.utils.index import prepare_chunk_indices_static

    lengths = list(lengths) + [0] * (N_MAX - len(lengths))
    a = make_inputs(
        1, T_GRAPH, 2, 2, 128, 128, BF16, "gk", varlen_lengths=lengths, device="cuda", generator=rng
    )
    cu = a["cu_seqlens"].to(dtype)
    ci, co = prepare_chunk_indices_static(cu, 64, NT_MAX)
    assert ci.shape[0] == NT_MAX and ci.dtype == dtype and co.shape[0] == N_MAX + 1
    return dict(a, cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co)


def _b2a(a: dict):
    return kda_dhu.kda_dhu_b2a(
        a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], 64
    )


def _direct(a):
    return kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)


def _op(a):
    return kda_dhu.chunk_gated_delta_rule_bwd_dhu_op(**a)


def _copied_q(rng):
    a = _dense(rng)
    return dict(a, q=relayout(a["q"], "permuted"))


# name -> (inputs(rng), call(args), kernel launches, torch allocations or None: not pinned)
ROUTES = {
    "direct-dense": (_dense, _direct, 1, 3),
    "direct-varlen": (_varlen, _direct, 1, 3),
    "direct-varlen-int32": (lambda rng: _varlen(rng, torch.int32), _direct, 1, 3),
    "direct-varlen-cached-count": (lambda rng: _varlen(rng, None), _direct, 1, 3),
    "direct-copied-input": (_copied_q, _direct, 1, 4),
    "direct-use_graph-dense": (_dense, lambda a: _direct(dict(a, use_graph=True)), 1, 0),
    "direct-use_graph-varlen": (
        lambda rng: _graph_inputs(rng, GRAPH_LENGTHS[0]),
        lambda a: _direct(dict(a, use_graph=True)),
        1,
        0,
    ),
    "direct-fla-k256-varlen": (lambda rng: _varlen(rng, K=256), _direct, 0, None),
    "b2a-kernel": (lambda rng: _dense(rng, B=2, T=128, H=32, HV=32, V=256), _b2a, 1, 3),
    "b2a-fla": (_dense, _b2a, 0, None),
    "registry-dense": (_dense, via_registry, 1, 3),
    "registry-varlen": (_varlen, via_registry, 1, 3),
    "registry-varlen-int32": (lambda rng: _varlen(rng, torch.int32), via_registry, 1, 3),
    "registry-fla-k256": (lambda rng: _dense(rng, K=256), via_registry, 0, None),
    "op-dense": (_dense, _op, 1, None),
    "op-varlen": (_varlen, _op, 1, None),
}


def _real_rows(a: dict) -> int | None:
    """dh's rows that hold chunks (fla's graph budget leaves the rest unwritten)."""
    co = a.get("chunk_offsets")
    if a.get("cu_seqlens") is None or co is None or co.shape[0] != a["cu_seqlens"].shape[0]:
        return None
    return int(co[-1])


def _assert_values(a: dict, outs, what: str, tol_factor: float = 1.25) -> None:
    """Every output finite and within tol_factor x fla's own error against the float64
    reference (dh on its real rows, dv2 on the packed tokens: fla writes no others); fla
    and the reference on contiguous copies of the inputs (fla's function reads every
    tensor as if contiguous)."""
    fla_args = {
        k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in a.items() if k != "use_graph"
    }
    fla = kda_dhu.fla_function()(**fla_args)
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**fla_args, emulate_rounding=False)
    rows = _real_rows(a)
    end = None if a.get("cu_seqlens") is None else int(a["cu_seqlens"][-1])
    for name, o, f, r in zip(NAMES, outs, fla, ref):
        if r is None:
            assert o is None, f"{what}: {name} is not None"
            continue
        assert o.shape == r.shape and o.dtype == f.dtype, (what, name, o.shape, r.shape, o.dtype, f.dtype)
        if name == "dh" and rows is not None:
            o, f, r = o[:, :rows], f[:, :rows], r[:, :rows]
        if name == "dv2" and end is not None:
            o, f, r = o[:, :end], f[:, :end], r[:, :end]
        assert torch.isfinite(o).all(), f"{what}: {name} has non-finite (unwritten?) elements"
        e, e_fla = rel_err(o, r), rel_err(f, r)
        assert e <= tol_factor * e_fla + 1e-6, f"{what}: {name} error {e:.3e} vs fla's {e_fla:.3e}"


def _refresh(a: dict, fresh: dict) -> None:
    """New values into the same input tensors (cu_seqlens and its tables stay the same
    objects: fla's cache and the captured addresses see the same tensors)."""
    for k in FLOAT_INPUTS:
        if a.get(k) is not None:
            a[k].copy_(fresh[k])


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_route_synchronizes_the_host(rng, route):
    """After two warm-up calls (their outputs poisoned with NaN, then freed: the next
    call's blocks), a call on new values returns while a sleep is queued ahead of it, under
    sync debug mode "error", with the route's kernel launches (1: kda-dhu's kernel, 0:
    fla's) and, where pinned, only its outputs allocated; its values match the reference
    (within 1.25x of fla's error). < 1 s each (fla's first call of a shape compiles)."""
    make, call, launches, allocs = ROUTES[route]
    a = make(rng)
    fresh = make(rng)
    registry = route.startswith("registry")
    with backend_mode("kda_dhu") if registry else contextlib.nullcontext():
        if registry:
            register_or_skip()
        warm = [call(a) for _ in range(2)]
        torch.cuda.synchronize()
        for outs in warm:
            for x in outs:
                if x is not None:
                    x.fill_(float("nan"))
        del warm, outs, x
        _refresh(a, fresh)
        with KernelProbe() as probe:
            outs, n_alloc = without_sync(lambda: call(a), route)
    assert probe.launches == launches, f"{route}: {probe.launches} kernel launches, expected {launches}"
    if allocs is not None:
        assert n_alloc == allocs, f"{route}: {n_alloc} allocations, expected {allocs} (the outputs)"
    if registry:
        assert [v[0] for v in probe.verdicts] == [bool(launches)], probe.verdicts
    _assert_values(a, outs, route)


def test_a_packed_batch_without_chunk_indices_synchronizes_no_more_than_fla(rng):
    """Without chunk_indices, NT needs cu_seqlens' values: kda-dhu reads them through fla's
    cached helper, at most as often as fla's own function does on a cu_seqlens tensor it
    has not seen (one read), and not at all on one it has."""
    a = _varlen(rng, None)
    fla = kda_dhu.fla_function()
    for fn in (fla, kda_dhu.chunk_gated_delta_rule_bwd_dhu):  # compiled, loaded, warm
        fn(**dict(a, cu_seqlens=a["cu_seqlens"].clone()))
    torch.cuda.synchronize()
    _, theirs = count_syncs(lambda: fla(**dict(a, cu_seqlens=a["cu_seqlens"].clone())))
    cu = a["cu_seqlens"].clone()
    outs, ours = count_syncs(lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**dict(a, cu_seqlens=cu)))
    assert theirs >= 1, "fla's helper read cu_seqlens without the instrument seeing it"
    assert ours <= theirs, f"kda-dhu synchronized {ours} times on a new cu_seqlens, fla {theirs}"
    _, again = count_syncs(lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**dict(a, cu_seqlens=cu)))
    assert again == 0, f"{again} synchronizations on a cu_seqlens tensor fla's cache holds"
    _assert_values(a, outs, "varlen without chunk_indices")


# ------------------------------------------------------------------- CUDA graphs


def _capture(fn):
    """torch's recipe: warm up on a side stream, then capture one call. Returns (graph,
    outputs, kernel launches made while capturing)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    before = _core.launch_count()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out, _core.launch_count() - before


def _copy_call(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, torch.Tensor):
            dst[k].copy_(v)


GRAPH_ROUTES = {
    "direct": _direct,
    "use_graph": lambda a: _direct(dict(a, use_graph=True)),
    "registry": via_registry,
}


@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
@pytest.mark.parametrize("route", list(GRAPH_ROUTES))
def test_packed_batch_captured_in_a_cuda_graph_replays_new_lengths(rng, route, index_dtype):
    """fla's graph-mode call (N_MAX sequences, zero-length padding, NT_MAX chunk rows) is
    captured with one kernel launch; its replay matches the reference; new lengths and
    values copied into the captured inputs (cu_seqlens, chunk tables, tensors), the replay
    matches the reference of the new data: cu_seqlens is read on the device, not frozen in
    at capture. < 1 s each."""
    dtype = getattr(torch, index_dtype)
    fn = GRAPH_ROUTES[route]
    static = _graph_inputs(rng, GRAPH_LENGTHS[0], dtype)
    fresh = _graph_inputs(rng, GRAPH_LENGTHS[1], dtype)
    assert not torch.equal(static["cu_seqlens"], fresh["cu_seqlens"])
    with backend_mode("kda_dhu"):
        if route == "registry":
            register_or_skip()
        graph, outs, captured = _capture(lambda: fn(static))
    assert captured == 1, f"{captured} kernel launches captured (fla's kernel instead?)"
    for data, what in ((None, "replay"), (fresh, "replay on new lengths")):
        if data is not None:
            _copy_call(static, data)
        for x in outs:
            if x is not None:
                x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_values(static, outs, f"{route} {index_dtype} {what}")
        end = int(static["cu_seqlens"][-1])
        assert torch.count_nonzero(outs[2][:, end:]) == 0, f"{what}: dv2's padding rows are not zero"


# --------------------------------------------------------- device-side checks


SENTINEL = -7.0
GUARD = 1024  # sentinel elements before and after each output (16-byte multiples)


def _guarded(shape, dtype):
    """(buffer, view): an output of ``shape`` inside a buffer of GUARD more elements on
    each side, all filled with SENTINEL."""
    n = math.prod(shape)
    buf = torch.full((GUARD + n + GUARD,), SENTINEL, dtype=dtype, device="cuda")
    return buf, buf[GUARD : GUARD + n].view(shape)


def _batch(rng, name: str, dtype):
    """(good call, bad call) of BAD_BATCHES[name]: B1 T300 H2 K128 V128 gk, dht and h0; the
    good one with fla's chunk tables (N + 1 offsets), the bad one with the case's tables."""
    bad = bad_batch(name)
    a = make_inputs(
        1, GOOD_BATCH["T"], 2, 2, 128, 128, BF16, "gk", varlen_lengths=GOOD_BATCH["lengths"], device="cuda",
        generator=rng,
    )  # fmt: skip
    good = _with_tables(a, dtype)
    assert (
        good["cu_seqlens"].tolist() == GOOD_BATCH["cu"] and good["chunk_indices"].shape[0] == GOOD_BATCH["nt"]
    )
    co = bad["chunk_offsets"]
    bad_call = dict(
        good,
        cu_seqlens=torch.tensor(bad["cu"], dtype=dtype, device="cuda"),
        chunk_indices=good["chunk_indices"][: bad["nt"]],
        chunk_offsets=None if co is None else torch.tensor(co, dtype=dtype, device="cuda"),
    )
    return good, bad_call, bad


def _host_message(bad: dict) -> str:
    """The host checker's words for the bad tables (the device reports the same)."""
    with pytest.raises(ValueError) as err:
        _core.check_tables(bad["cu"], bad["T"], bad["chunk_offsets"], bad["nt"])
    return str(err.value)


def _sequence_rows(cu, offsets, n):
    """(dh rows, dv2 rows) of sequence n of a good batch."""
    return (offsets[n], offsets[n + 1]), (cu[n], cu[n + 1])


BAD_CASES = [
    (n, d) for n in BAD_BATCHES for d in ("int64", "int32") if not (n == "garbage_int64" and d == "int32")
]


@pytest.mark.parametrize("name,index_dtype", BAD_CASES, ids=[f"{n}-{d}" for n, d in BAD_CASES])
def test_a_bad_packed_batch_is_contained_and_named_by_the_next_call(rng, name, index_dtype):
    """The bad batch launched into sentinel-guarded outputs: nothing written outside them;
    the failing sequence's dh0, and its dh and dv2 rows where its entries bound them, are
    NaN (written, not left as the sentinel); every other sequence's outputs are written and
    within 1.25x of fla's error (on the good batch) against the reference. The next call
    raises ValueError naming the argument in the host checker's words, without launching;
    the error is raised once. < 1 s each."""
    dtype = getattr(torch, index_dtype)
    good, bad_call, bad = _batch(rng, name, dtype)
    call = _core.decide("capable", *(bad_call.get(k) for k in _POS))
    ok, reason = call.verdict
    assert ok, reason
    dh_shape, dh0_shape, dv2_shape = call.out_shapes()
    bufs = [_guarded(dh_shape, BF16), _guarded(dh0_shape, torch.float32), _guarded(dv2_shape, BF16)]
    dh, dh0, dv2 = (v for _, v in bufs)
    call.launch(dh, dh0, dv2, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    for out, (buf, _) in zip(NAMES, bufs):
        for side, part in (("before", buf[:GUARD]), ("after", buf[-GUARD:])):
            assert bool((part == SENTINEL).all()), f"{name}: written {side} {out}'s memory"

    seq = bad["seq"]
    if seq is not None:
        assert torch.isnan(dh0[seq]).all(), f"{name}: dh0 of sequence {seq} is not NaN"
        if bad["dh_rows"] is not None:
            r0, r1 = bad["dh_rows"]
            assert torch.isnan(dh[:, r0:r1]).all(), f"{name}: dh rows {r0}:{r1} are not NaN"
        if bad["dv2_rows"] is not None:
            t0, t1 = bad["dv2_rows"]
            assert torch.isnan(dv2[:, t0:t1]).all(), f"{name}: dv2 rows {t0}:{t1} are not NaN"
        fla = kda_dhu.fla_function()(**good)
        ref = chunk_gated_delta_rule_bwd_dhu_ref(**good, emulate_rounding=False)
        cu, offsets = GOOD_BATCH["cu"], _core.check_tables(GOOD_BATCH["cu"], GOOD_BATCH["T"])
        for n in range(len(GOOD_BATCH["lengths"])):
            if n == seq:
                continue
            (r0, r1), (t0, t1) = _sequence_rows(cu, offsets, n)
            for out, o, f, r in (
                ("dh", dh[:, r0:r1], fla[0][:, r0:r1], ref[0][:, r0:r1]),
                ("dh0", dh0[n], fla[1][n], ref[1][n]),
                ("dv2", dv2[:, t0:t1], fla[2][:, t0:t1], ref[2][:, t0:t1]),
            ):
                assert torch.isfinite(o).all() and not (o == SENTINEL).any(), f"{name}: sequence {n}'s {out}"
                e, e_fla = rel_err(o, r), rel_err(f, r)
                assert e <= 1.25 * e_fla + 1e-6, f"{name}: sequence {n}'s {out}: {e:.3e} vs fla {e_fla:.3e}"

    before = _core.launch_count()
    with pytest.raises(ValueError) as err:
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**bad_call)
    msg = str(err.value)
    assert _core.launch_count() == before, "the call that raised launched"
    if seq is not None:
        assert msg.startswith(
            _host_message(bad) + f" (found on cuda:{torch.cuda.current_device()} by an earlier call"
        ), msg
    else:
        assert re.match(
            r"^(cu_seqlens|chunk_offsets|chunk_indices): expected .* \(found on cuda:\d+ ", msg
        ), msg
    kda_dhu.check_errors()  # raised once
    out = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**good)
    _assert_values(good, out, f"{name}: the good batch after")


_POS = helpers.POS


def test_check_errors_raises_what_a_graph_replay_found(rng):
    """A packed batch captured in a CUDA graph, replayed after a bad cu_seqlens is copied
    in: no later call passes through a check, so ``kda_dhu.check_errors()`` (which
    synchronizes) raises ValueError naming cu_seqlens in the host checker's words (the
    failing launch's T), once; replayed on the good batch
    again, the outputs are right and nothing is raised."""
    good, _, bad = _batch(rng, "past_t", torch.int64)
    cu_good = good["cu_seqlens"].clone()
    graph, outs, captured = _capture(lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**good))
    assert captured == 1
    graph.replay()
    kda_dhu.check_errors()
    good["cu_seqlens"].copy_(torch.tensor(bad["cu"], device="cuda"))
    graph.replay()
    with pytest.raises(ValueError) as err:
        kda_dhu.check_errors()
    # the failing launch's T and sequence, in the host checker's words
    assert str(err.value).startswith(_host_message(bad) + " (found on cuda:"), err.value
    kda_dhu.check_errors()
    good["cu_seqlens"].copy_(cu_good)
    graph.replay()
    kda_dhu.check_errors()
    _assert_values(good, outs, "replay on the good batch")


@pytest.mark.parametrize("entry", ["function", "op", "registry"])
@pytest.mark.parametrize("name", [n for n in BAD_BATCHES if BAD_BATCHES[n]["seq"] is not None])
def test_check_inputs_raises_a_bad_packed_batch_at_once(rng, monkeypatch, name, entry):
    """KDA_DHU_CHECK_INPUTS=1: the call raises the host checker's ValueError itself (the
    same words, naming the argument), launches nothing and leaves no device error."""
    monkeypatch.setenv("KDA_DHU_CHECK_INPUTS", "1")
    _, bad_call, bad = _batch(rng, name, torch.int64)
    fn = {"function": _direct, "op": _op, "registry": via_registry}[entry]
    register_or_skip()
    before = _core.launch_count()
    with backend_mode("kda_dhu"):
        with pytest.raises(ValueError) as err:
            fn(bad_call)
    assert str(err.value) == _host_message(bad)
    assert _core.launch_count() == before
    torch.cuda.synchronize()


# --------------------------------------------------------------- launch counting


def test_kernel_probe_counts_the_one_crossing_path(rng, monkeypatch):
    """KernelProbe.launches counts the kernel on every route: the one-crossing path of the
    direct entry point (dense and packed; the general path made to fail), kda_dhu_b2a,
    fla's registry (the verifier's prepared call run in one crossing); an input that is
    copied (the general path); none where fla computes."""
    register_or_skip()
    dense, varlen = _dense(rng), _varlen(rng)
    b2a = _dense(rng, B=2, T=128, H=32, HV=32, V=256)
    copied, fla_call = _copied_q(rng), _dense(rng, K=256)

    def no_general_path(*a, **kw):
        raise AssertionError("the general path ran")

    with KernelProbe() as probe:
        with monkeypatch.context() as m:
            m.setattr(_dispatch, "_general", no_general_path)
            for a in (dense, varlen):
                _direct(a)
            _b2a(b2a)
            with backend_mode("kda_dhu"):
                via_registry(dense)
                via_registry(varlen)
        assert probe.launches == 5, probe.launches
        _direct(copied)
        assert probe.launches == 6
        _direct(fla_call)
        assert probe.launches == 6
    assert [v[0] for v in probe.verdicts] == [True, True], probe.verdicts
    torch.cuda.synchronize()
