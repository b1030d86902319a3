"""The forward scan's kernel (fla's ``chunk_gated_delta_rule_fwd_h``; the register-state
kernel's FWD instance, cuda/dhu_sm90_regstate.cuh) against the float64 reference and fla.

The kernel's own tests run it through ``_core._fwd_h_probe`` (a stage-4 call that carries
the forward call: k, w as themselves, dv = u, dht = initial_state, h0 given for a final
state written to dh0; outputs dh = h, dv2 = v_new), the later ones through the op's entry
points (``kda_dhu.chunk_gated_delta_rule_fwd_h``, fla's registry, ``patch()``). Outputs are
poisoned with NaN first; every output is compared: h, v_new and final_state within the
16-bit rounding of the reference that models fla's two operand casts, and no farther from
it than fla is; the sequence split (KDA_DHU_SM90_SPLIT) against the exact float64
reference, within 1.25x fla's error.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from helpers import make_inputs
from kda_dhu import _core
from kda_dhu.reference import chunk_gated_delta_rule_fwd_h_ref, rel_err

pytestmark = pytest.mark.gpu

BT = 64

# name: make_inputs arguments (stage-4 inputs; the forward call takes k, w, u = dv,
# initial_state = dht, the gates and the packing).
CASES = {
    "none": dict(B=2, T=512, H=4, HV=4, K=128, V=128, gate=None),
    "g": dict(B=2, T=512, H=4, HV=4, K=128, V=128, gate="g"),
    "gk": dict(B=2, T=512, H=4, HV=4, K=128, V=128, gate="gk"),
    "gk-k64": dict(B=2, T=256, H=2, HV=2, K=64, V=128, gate="gk"),
    "gk-fp16": dict(B=2, T=256, H=2, HV=2, K=128, V=128, gate="gk", dtype=torch.float16),
    "gk-gva-tail": dict(B=2, T=300, H=2, HV=4, K=128, V=64, gate="gk"),
    "gk-varlen-padded": dict(B=1, T=600, H=2, HV=2, K=128, V=128, gate="gk", varlen_lengths=[70, 64, 1, 300]),
    "g-varlen": dict(B=1, T=None, H=2, HV=2, K=128, V=128, gate="g", varlen_lengths=[130, 0, 63, 200]),
    "none-varlen": dict(B=1, T=None, H=2, HV=2, K=64, V=64, gate=None, varlen_lengths=[5, 128, 77]),
    "gk-svf": dict(B=2, T=256, H=2, HV=2, K=128, V=128, gate="gk", state_v_first=True),
    "g-svf-k64": dict(B=2, T=200, H=2, HV=2, K=64, V=128, gate="g", state_v_first=True),
    "gk-no-state": dict(B=2, T=256, H=2, HV=2, K=128, V=128, gate="gk", dht=False, h0=False),
}


def _forward_args(case: str, rng) -> dict:
    return _forward_inputs(CASES[case], rng)


def _forward_inputs(spec: dict, rng) -> dict:
    """The forward call (k, w, u = dv, the gates, initial_state = dht, the packing) of the
    stage-4 inputs make_inputs draws for `spec` (its arguments, dtype among them)."""
    kw = dict(spec)
    dtype = kw.pop("dtype", torch.bfloat16)
    s4 = make_inputs(**kw, dtype=dtype, device="cuda", generator=rng)
    return dict(
        k=s4["k"], w=s4["w"], u=s4["dv"], g=s4["g"], gk=s4["gk"], initial_state=s4["dht"],
        state_v_first=s4["state_v_first"], cu_seqlens=s4["cu_seqlens"],
    )  # fmt: skip


def _chunks(a: dict) -> int:
    cu = a["cu_seqlens"]
    if cu is None:
        return -(-a["k"].shape[1] // BT)
    lens = (cu[1:] - cu[:-1]).tolist()
    return sum(-(-n // BT) for n in lens)


def run_probe(a: dict, output_final_state: bool = True):
    """(h, v_new, final_state or None) from the forward kernel, outputs NaN-poisoned first."""
    k, u = a["k"], a["u"]
    B, _, _, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    N = B if a["cu_seqlens"] is None else a["cu_seqlens"].shape[0] - 1
    svf = a["state_v_first"]
    state = (N, HV, V, K) if svf else (N, HV, K, V)
    h = torch.full((B, _chunks(a), *state[1:]), float("nan"), dtype=k.dtype, device=k.device)
    v_new = torch.full_like(u, float("nan"))
    final = (
        torch.full(state, float("nan"), dtype=torch.float32, device=k.device) if output_final_state else None
    )
    h0 = torch.zeros(state, dtype=torch.float32, device=k.device) if output_final_state else None
    _core._fwd_h_probe(
        k, k, a["w"], u, u, a["g"], a["gk"], h0, a["initial_state"], None, svf, a["cu_seqlens"], 64,
        dh=h, dh0=final, dv2=v_new, stream=torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip
    torch.cuda.synchronize()
    return h, v_new, final


def _fla_fwd_h():
    mod = pytest.importorskip("fla.ops.common.chunk_delta_h")
    return inspect.unwrap(mod.chunk_gated_delta_rule_fwd_h)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_kernel_matches_the_reference_and_fla(case, rng):
    a = _forward_args(case, rng)
    _check_forward(a, run_probe(a))


def _check_forward(a: dict, got) -> None:
    """Every output (h, v_new, final_state, computed with a final state) within the 16-bit
    rounding of the reference that models fla's casts, close to fla's, and no farther from
    the reference than fla's."""
    emu = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=True, emulate_rounding=True)
    for name, o, e in zip(("h", "v_new", "final_state"), got, emu):
        if o is None:
            continue
        assert o.shape == e.shape, (name, o.shape, e.shape)
        assert bool(torch.isfinite(o).all()), f"{name}: an element left unwritten (NaN) or not finite"
        # within the output's 16-bit rounding of the reference (final_state is fp32)
        assert rel_err(o, e) < 4e-3, (name, rel_err(o, e))
        assert rel_err(o, e.to(o.dtype)) < 1e-3, (name, rel_err(o, e.to(o.dtype)))
    fla = list(_fla_fwd_h()(**a, output_final_state=True, save_new_value=True))
    cu = a["cu_seqlens"]
    if cu is not None:  # fla leaves v_new's rows past cu_seqlens[-1] unwritten
        fla[1] = fla[1].clone()
        fla[1][:, int(cu[-1]) :] = 0
    for name, o, f, e in zip(("h", "v_new", "final_state"), got, fla, emu):
        if o is None:
            continue
        assert rel_err(o, f) < 4e-3, (name, "vs fla", rel_err(o, f))
        # no farther from the reference than fla, up to the sums' order
        assert rel_err(o, e) <= 1.25 * rel_err(f, e) + 1e-5, (name, rel_err(o, e), rel_err(f, e))


def test_forward_kernel_without_a_final_state_writes_h_and_v_new(rng):
    a = _forward_args("gk-gva-tail", rng)
    h, v_new, final = run_probe(a, output_final_state=False)
    emu = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=False, emulate_rounding=True)
    assert final is None and emu[2] is None
    assert rel_err(h, emu[0]) < 4e-3 and rel_err(v_new, emu[1]) < 4e-3


def test_forward_kernel_is_deterministic(rng):
    a = _forward_args("gk-varlen-padded", rng)
    first = run_probe(a)
    again = run_probe(a)
    for x, y in zip(first, again):
        assert torch.equal(x, y)


# ---- the entry point, kda_dhu.chunk_gated_delta_rule_fwd_h (src/forward.rs)


@pytest.fixture(autouse=True)
def _forward_scan_on(monkeypatch):
    """The forward scan on (KDA_DHU_FWD_H=on), whatever its default; tests of the switch
    set it themselves."""
    monkeypatch.setenv("KDA_DHU_FWD_H", "on")


def _public(a: dict, **extra):
    from kda_dhu import chunk_gated_delta_rule_fwd_h

    before = _core.launch_count()
    out = chunk_gated_delta_rule_fwd_h(**a, **extra)
    torch.cuda.synchronize()
    return out, _core.launch_count() - before


@pytest.mark.parametrize(
    "case", ["none", "g", "gk", "gk-k64", "gk-gva-tail", "gk-svf", "gk-varlen-padded", "g-varlen"]
)
def test_the_entry_point_runs_the_kernel_and_matches_fla(case, rng):
    from kda_dhu.testing import chunk_tables

    a = _forward_args(case, rng)
    if a["cu_seqlens"] is not None:  # fla's backward and forward pass chunk_indices
        a["chunk_indices"], a["chunk_offsets"] = chunk_tables(a["cu_seqlens"], a["k"].shape[1])
    out, launches = _public(a, output_final_state=True)
    assert launches == 1, "the kernel did not run"
    emu = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=True, emulate_rounding=True)
    fla = list(_fla_fwd_h()(**a, output_final_state=True))
    if a["cu_seqlens"] is not None:
        fla[1] = fla[1].clone()
        fla[1][:, int(a["cu_seqlens"][-1]) :] = 0
    for name, o, f, e in zip(("h", "v_new", "final_state"), out, fla, emu):
        assert o.shape == e.shape and o.dtype == f.dtype, (name, o.shape, o.dtype)
        assert rel_err(o, e.to(o.dtype)) < 1e-3, (name, rel_err(o, e.to(o.dtype)))
        assert rel_err(o, f) < 4e-3, (name, rel_err(o, f))


def test_the_entry_point_s_optional_outputs(rng):
    a = _forward_args("gk-no-state", rng)
    (h, v_new, final), launches = _public(a)
    assert launches == 1 and final is None and v_new is not None
    (h2, v_none, final2), launches = _public(a, save_new_value=False, output_final_state=True)
    assert launches == 1 and v_none is None and final2 is not None
    assert torch.equal(h, h2)


def test_calls_the_kernel_leaves_to_fla_match_fla(rng, monkeypatch):
    """A packed batch without chunk_indices, a strided input, KDA_DHU_FORCE=fla: fla's
    function runs (no launch), with fla's results; KDA_DHU_FORCE=kernel on the first raises."""
    a = _forward_args("gk-varlen-padded", rng)
    out, launches = _public(a, output_final_state=True)
    assert launches == 0
    fla = _fla_fwd_h()(**a, output_final_state=True)
    end = int(a["cu_seqlens"][-1])  # fla leaves v_new's rows past cu_seqlens[-1] unwritten
    for name, o, f in zip(("h", "v_new", "final_state"), out, fla):
        if name == "v_new":
            o, f = o[:, :end], f[:, :end]
        assert torch.equal(o, f), name
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")
    with pytest.raises(RuntimeError, match="packed batch without chunk_indices"):
        _public(a)
    monkeypatch.setenv("KDA_DHU_FORCE", "fla")
    b = _forward_args("gk", rng)
    assert _public(b)[1] == 0
    monkeypatch.delenv("KDA_DHU_FORCE")
    b["u"] = b["u"].transpose(1, 2).contiguous().transpose(1, 2)  # strided: copied by fla's route
    out, launches = _public(b)
    assert launches == 0
    packed = _fla_fwd_h()(**{**b, "u": b["u"].contiguous()})
    for o, f in zip(out, packed):
        assert (o is None and f is None) or torch.equal(o, f)


def test_fla_s_registry_runs_the_kernel_under_the_switch(rng, monkeypatch):
    """fla's own (decorated) chunk_gated_delta_rule_fwd_h: with KDA_DHU_FWD_H=on its
    dispatch takes kda-dhu's backend (one launch, the entry point's results); off, fla's
    own kernel runs (no launch), and so does the entry point."""
    import fla.ops.common.chunk_delta_h as mod
    from kda_dhu import fla_backend

    if not fla_backend.register_backend():
        pytest.skip("fla without a backend registry")
    a = _forward_args("gk", rng)
    monkeypatch.setenv("KDA_DHU_FWD_H", "on")
    before = _core.launch_count()
    got = mod.chunk_gated_delta_rule_fwd_h(**a, output_final_state=True)
    torch.cuda.synchronize()
    assert _core.launch_count() - before == 1
    want, _ = _public(a, output_final_state=True)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    monkeypatch.setenv("KDA_DHU_FWD_H", "off")
    before = _core.launch_count()
    off = mod.chunk_gated_delta_rule_fwd_h(**a, output_final_state=True)
    assert _core.launch_count() == before
    out, launches = _public(a, output_final_state=True)
    assert launches == 0
    for x, y in zip(off, out):
        assert torch.equal(x, y)


def test_patch_routes_fla_s_forward_scan_to_the_kernel(rng):
    """kda_dhu.patched(): fla's KDA forward module's name runs the kernel (one launch, the
    entry point's results); after it, fla's own again (no launch)."""
    import fla.ops.kda.chunk_fwd as kda_fwd
    import kda_dhu

    a = _forward_args("gk", rng)
    want, _ = _public(a, output_final_state=True)
    with kda_dhu.patched():
        before = _core.launch_count()
        got = kda_fwd.chunk_gated_delta_rule_fwd_h(**a, output_final_state=True)
        torch.cuda.synchronize()
        assert _core.launch_count() - before == 1
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    from kda_dhu import fla_backend

    was = fla_backend.is_registered()
    kda_dhu.unregister_backend()  # fla's registry would route the name to the kernel too
    try:
        before = _core.launch_count()
        kda_fwd.chunk_gated_delta_rule_fwd_h(**a, output_final_state=True)
        torch.cuda.synchronize()
        assert _core.launch_count() == before
    finally:
        if was:
            kda_dhu.register_backend()


def test_a_16_bit_initial_state_runs_fla_s_function(rng):
    """fla casts a bf16 initial_state on load; the kernel reads fp32: fla runs the call."""
    a = _forward_args("gk", rng)
    a["initial_state"] = a["initial_state"].to(torch.bfloat16)
    out, launches = _public(a, output_final_state=True)
    assert launches == 0
    for x, y in zip(out, _fla_fwd_h()(**a, output_final_state=True)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("case", ["gk", "g", "none", "gk-varlen-padded", "gk-svf", "gk-no-state"])
def test_the_two_warpgroup_forward_kernel_matches_one_warpgroup(case, rng, monkeypatch):
    """KDA_DHU_SM90_NWG=2: the FWD instance with two warpgroups per CTA (the two V tiles of a
    head sharing the stage's w and k) gives the one-warpgroup kernel's outputs bit for bit
    (each tile's chain is the same arithmetic) and launches the _wg2 entry point."""
    a = _forward_args(case, rng)
    final = a["initial_state"] is not None
    monkeypatch.setenv("KDA_DHU_SM90_NWG", "1")
    one = run_probe(a, output_final_state=final)
    monkeypatch.setenv("KDA_DHU_SM90_NWG", "2")
    two = run_probe(a, output_final_state=final)
    for name, x, y in zip(("h", "v_new", "final_state"), one, two):
        if x is None:
            assert y is None
            continue
        assert bool(torch.isfinite(y).all()), f"{name}: left unwritten"
        assert torch.equal(x, y), name


# ---- the forward scan's sequence split (src/split.rs; on by default where the rule splits: DEFAULT_ON_FWD)

# name: (make_inputs arguments, segments forced by KDA_DHU_SM90_SPLIT=N); each asks for
# enough chunks that the N segments are N (a first pass with summarized segments and
# identity tiles, a merge that iterates), but "gk-s2" (two segments: the indexing alone).
SPLIT_CASES = {
    "gk": (dict(B=2, T=512, H=4, HV=4, K=128, V=128, gate="gk"), 3),  # 8 chunks: 3 + 3 + 2
    "gk-s2": (dict(B=2, T=512, H=4, HV=4, K=128, V=128, gate="gk"), 2),
    "none": (dict(B=2, T=512, H=4, HV=4, K=128, V=128, gate=None), 4),
    "g": (dict(B=2, T=512, H=4, HV=4, K=128, V=128, gate="g"), 3),
    "gk-k64": (dict(B=2, T=640, H=2, HV=2, K=64, V=128, gate="gk"), 3),
    "gk-fp16": (dict(B=2, T=640, H=2, HV=2, K=128, V=128, gate="gk", dtype=torch.float16), 3),
    "gk-gva-tail": (dict(B=2, T=300, H=2, HV=4, K=128, V=64, gate="gk"), 3),  # 5 chunks, the last short
    "gk-svf": (dict(B=2, T=640, H=2, HV=2, K=128, V=128, gate="gk", state_v_first=True), 3),
    "g-svf-k64": (dict(B=2, T=200, H=2, HV=2, K=64, V=128, gate="g", state_v_first=True), 4),  # a chunk each
    "gk-no-state": (dict(B=2, T=640, H=2, HV=2, K=128, V=128, gate="gk", dht=False, h0=False), 3),
}


def _split_args(case: str, rng) -> dict:
    return _forward_inputs(SPLIT_CASES[case][0], rng)


# A long dense call: 128 chunks (stage 4's rule: 4 segments of 32).
LONG = dict(B=1, T=8192, H=2, HV=2, K=128, V=128, gate="gk")


def _check_forward_split(a: dict, got, final: bool = False, tol_factor: float = 1.25) -> None:
    """A split call (h, v_new, and final_state where `final` asked for it) rounds its partial
    states (a summarized segment's state and P_s) where fla rounds the true state, so it is
    held to stage 4's split bar: every output within 1.25x fla's error against the exact
    float64 reference (no emulated rounding), and close to fla's."""
    assert (got[2] is not None) == final
    exact = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=final, emulate_rounding=False)
    fla = _fla_fwd_h()(**a, output_final_state=final, save_new_value=True)
    for name, o, f, r in zip(("h", "v_new", "final_state"), got, fla, exact):
        if o is None:
            assert f is None and r is None, name
            continue
        assert o.shape == f.shape == r.shape, (name, o.shape, f.shape, r.shape)
        assert bool(torch.isfinite(o).all()), f"{name}: an element left unwritten (NaN) or not finite"
        e_ours, e_fla = rel_err(o, r), rel_err(f, r)
        assert e_ours <= tol_factor * e_fla + 1e-6, (name, e_ours, e_fla)
        assert rel_err(o, f) < 4e-3, (name, "vs fla", rel_err(o, f))


@pytest.mark.parametrize("final", [False, True], ids=["no-final", "final"])
@pytest.mark.parametrize("nwg", ["1", "2"])
@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_the_forward_split_matches_the_reference_and_fla(case, nwg, final, rng, monkeypatch):
    """KDA_DHU_SM90_SPLIT=N: the first pass (segment 0 with its outputs, the middle segments
    summarized from [0 | I]), the oldest-first merge and the second pass (segments 1 .., its
    last writing final_state where asked), every output poisoned first; the second pass on
    one or two warpgroups; the three launches by count."""
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", str(SPLIT_CASES[case][1]))
    monkeypatch.setenv("KDA_DHU_SM90_NWG", nwg)
    a = _split_args(case, rng)
    before = _core.launch_count()
    got = run_probe(a, output_final_state=final)
    assert _core.launch_count() - before == 3
    _check_forward_split(a, got, final)


def test_the_forward_split_launches_its_three_kernels_where_the_rule_or_the_switch_asks(rng, monkeypatch):
    """Forced: the forward first pass, the forward merge, the forward kernel, in that order,
    with a final state or without. Unset, the forward scan is split where stage 4's rule
    splits (B1 H2 T8192: DEFAULT_ON_FWD); `off` never."""
    from test_gpu_kernel import _launched_kernels

    three = [
        "kda_dhu_sm90_fwd_k128_bf16_sum",
        "kda_dhu_sm90_fwd_seg_merge_k128",
        "kda_dhu_sm90_fwd_k128_bf16",
    ]
    a = _split_args("gk", rng)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "3")
    monkeypatch.setenv("KDA_DHU_SM90_NWG", "1")
    assert _launched_kernels(lambda: run_probe(a, output_final_state=False)) == three
    assert _launched_kernels(lambda: run_probe(a)) == three
    long = _forward_inputs(LONG, rng)
    monkeypatch.delenv("KDA_DHU_SM90_SPLIT")
    for final in (False, True):
        got = []
        names = _launched_kernels(
            lambda got=got, final=final: got.append(run_probe(long, output_final_state=final))
        )
        assert names[0] == "kda_dhu_sm90_fwd_k128_bf16_sum" and len(names) == 3, (final, names)
        _check_forward_split(long, got[0], final)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "off")
    for final in (False, True):
        assert _launched_kernels(lambda final=final: run_probe(long, output_final_state=final)) == [
            "kda_dhu_sm90_fwd_k128_bf16"
        ]


@pytest.mark.skipif(
    "-DKDA_DHU_EXP_SPLIT_LIVE" not in _core.build_info()
    or "-DKDA_DHU_EXP_SPLIT_LIVE=0" in _core.build_info(),
    reason="the build lacks KDA_DHU_EXP_SPLIT_LIVE (benches/NOTES.md)",
)
@pytest.mark.parametrize(
    "case, value",
    [
        ("gk", "6:2"),
        ("gk", "3:2"),
        ("g", "8:3"),
        ("gk-k64", "4:2"),
        ("gk-gva-tail", "5:2"),
        ("gk-svf", "5:2"),
    ],
)
def test_the_forward_split_with_a_long_live_segment(case, value, rng, monkeypatch):
    """`N:L` (the KDA_DHU_EXP_SPLIT_LIVE experiment's wheel): the first pass's live CTA runs
    segments 0 .. L - 1 with their outputs, the others summarize one each, pass 2 runs L ..;
    every output held to the split's bar, three launches. The segments are of
    ceil(NT / N) chunks, so "gk" (8 chunks) with 6:2 is four of two, two live."""
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", value)
    a = _forward_inputs(SPLIT_CASES[case][0], rng)
    before = _core.launch_count()
    got = run_probe(a)
    assert _core.launch_count() - before == 3
    _check_forward_split(a, got, final=True)
    # L live segments, not one: with one live the same segments' boundary states are
    # rounded elsewhere, so h differs.
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", value.split(":")[0])
    one = run_probe(a)
    assert not torch.equal(got[0], one[0]), "N:L ran as N segments with one live"


def test_the_forward_split_is_close_to_the_unsplit_kernel_and_repeatable(rng, monkeypatch):
    """The split and the unsplit forward scan differ only where fp32 sums are rounded: h,
    v_new and final_state agree to 16-bit rounding; the split itself is bitwise repeatable."""
    a = _forward_inputs(dict(LONG, T=4096), rng)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "off")
    plain = run_probe(a)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "4")
    split = run_probe(a)
    again = run_probe(a)
    for name, x, y, z in zip(("h", "v_new", "final_state"), plain, split, again):
        assert torch.equal(y, z), f"{name}: not repeatable"
        assert rel_err(y, x) < 1e-2, f"{name}: {rel_err(y, x):.3e} from the unsplit kernel"


@pytest.mark.parametrize("route", ["entry-dense", "entry-varlen", "registry-dense", "patch-varlen"])
def test_no_forward_route_synchronizes_the_host(rng, route):
    """After a warm-up call, a call returns while a sleep queued ahead of it still runs,
    under sync debug mode "error", with one kernel launch: the entry point, fla's registry
    and the patched name, dense and packed (fla's chunk tables)."""
    import fla.ops.common.chunk_delta_h as mod
    import kda_dhu
    from kda_dhu import fla_backend
    from kda_dhu.testing import chunk_tables

    a = _forward_args("gk" if route.endswith("dense") else "gk-varlen-padded", rng)
    if a["cu_seqlens"] is not None:
        a["chunk_indices"], a["chunk_offsets"] = chunk_tables(a["cu_seqlens"], a["k"].shape[1])
    if route.startswith("registry") and not fla_backend.register_backend():
        pytest.skip("fla without a backend registry")
    if route.startswith("registry"):
        call = mod.chunk_gated_delta_rule_fwd_h
    elif route.startswith("patch"):
        kda_dhu.patch()
        call = importlib.import_module("fla.ops.kda.chunk_fwd").chunk_gated_delta_rule_fwd_h
    else:
        call = kda_dhu.chunk_gated_delta_rule_fwd_h
    try:
        call(**a, output_final_state=True)
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        before = _core.launch_count()
        torch.cuda._sleep(200_000_000)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = call(**a, output_final_state=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        busy = not stream.query()
        launches = _core.launch_count() - before
    finally:
        if route.startswith("patch"):
            kda_dhu.unpatch()
    torch.cuda.synchronize()
    assert busy, "the call returned after the GPU drained"
    assert launches == 1, launches
    assert all(bool(torch.isfinite(x).all()) for x in out if x is not None)
