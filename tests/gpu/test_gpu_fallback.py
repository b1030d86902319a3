"""GPU: the fallback audit. Every kind of call that kda-dhu's planner sends to fla's
function, or answers without a kernel, is answered correctly: against the float64
reference, each output within the 16-bit bar (1e-2 relative for bf16 and TF32, 3e-3 for
fp16), through the public entry point; where fla computes it, bitwise fla's own function
on the same (contiguous) arguments, with no kernel launch.

Cases (``CASES``): g and gk together (dense, packed); K = 256 (dense; packed with int32
tables, with an N-entry chunk_offsets, without tables, with empty sequences; state_v_first;
g with a tail and no states; fla's CUDA-graph buffers, dense and packed with graph-mode
tables); K = 96 and V = 96; chunk_size 32; float32 inputs; 16-bit dtypes that differ;
scale=None; empty sequences on the kernel; every sequence empty (answered directly: dh
has no rows, dh0 = dht, dv2 zeros; through fla with K = 256; on the kernel with fla's
graph tables).

Where fla itself would be wrong or crash, kda-dhu fixes the input before calling it:
strided or misaligned inputs are copied and a strided h0 is replaced (fla allocates dh0
and dv2 with ``empty_like``, which keeps the strides, and writes them as if contiguous;
tests/gpu/test_gpu_layouts.py); ``scale=None`` becomes K ** -0.5 (fla's function takes scale
from its callers). Where kda-dhu refuses what fla computes, the test says so: T = 0
(``test_t_zero``) and, on the CPU, chunk_size < 64 with fla's chunk_indices
(tests/unit/test_fla_contract.py). ~10 s on an H200 once fla's kernels are compiled (K = 96,
V = 96, chunk_size 32, float32 and mixed dtypes each compile fla's kernel once).
"""

from __future__ import annotations

import helpers
import kda_dhu
import pytest
import torch
from helpers import make_inputs
from kda_dhu import _core
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
from kda_dhu.testing import KernelProbe, chunk_tables

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OUTPUTS = helpers.OUTPUTS
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
TOL = {BF16: 1e-2, FP16: 3e-3, FP32: 1e-2}  # fp32: fla's dots run in TF32
LENGTHS = helpers.VARLEN_LENGTHS
EMPTY_BETWEEN = [0, 100, 0, 64, 0]


@pytest.fixture(autouse=True)
def _hopper_and_no_switches(no_switches):
    if _core.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("needs an sm_90 device (H100 / H200): the plans below are the sm_90a kernel's")


def _mk(rng, B=2, T=130, H=2, HV=2, K=128, V=128, dtype=BF16, gate="gk", **kw):
    return make_inputs(B, T, H, HV, K, V, dtype, gate, device="cuda", generator=rng, **kw)


def _tables(a: dict, dtype=torch.int64, offsets="n+1") -> dict:
    cu = a["cu_seqlens"].to(dtype)
    ci, co = chunk_tables(cu, a["q"].shape[1])
    co = {"n+1": co, "n": co[:-1].clone(), None: None}[offsets]
    return dict(a, cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co)


def _both_gates(rng, **kw):
    a = _mk(rng, gate="gk", **kw)
    a["g"] = _mk(rng, gate="g", **kw)["g"]
    return a


def _graph(rng, lengths, K=128, n_max=7, T=448):
    """fla's CUDA-graph call: zero-length padding up to n_max sequences, fixed chunk
    budget ceil(T / 64) + n_max - 1 (prepare_chunk_indices_static), use_graph."""
    from fla.ops.utils.index import prepare_chunk_indices_static

    lengths = list(lengths) + [0] * (n_max - len(lengths))
    a = _mk(rng, B=1, T=T, K=K, varlen_lengths=lengths)
    ci, co = prepare_chunk_indices_static(a["cu_seqlens"], 64, -(-T // 64) + n_max - 1)
    return dict(a, chunk_indices=ci, chunk_offsets=co, use_graph=True)


def _mixed(rng):
    a = _mk(rng)
    return dict(a, do=a["do"].half(), dv=a["dv"].half())


# name -> (inputs(rng), route): "fla" (fla's function computes it), "kernel", or "direct"
# (answered without a kernel or fla: a packed batch with no chunks)
CASES = {
    "g_and_gk": (lambda rng: _both_gates(rng), "fla"),
    "g_and_gk_varlen": (lambda rng: _tables(_both_gates(rng, B=1, T=None, varlen_lengths=LENGTHS)), "fla"),
    "k256": (lambda rng: _mk(rng, K=256), "fla"),
    "k256_varlen_int32_tables": (
        lambda rng: _tables(_mk(rng, B=1, T=None, K=256, varlen_lengths=LENGTHS), torch.int32),
        "fla",
    ),
    "k256_varlen_offsets_n": (
        lambda rng: _tables(_mk(rng, B=1, T=None, K=256, varlen_lengths=LENGTHS), offsets="n"),
        "fla",
    ),
    "k256_varlen_no_tables": (lambda rng: _mk(rng, B=1, T=None, K=256, varlen_lengths=LENGTHS), "fla"),
    "k256_empty_sequences": (
        lambda rng: _tables(_mk(rng, B=1, T=200, K=256, varlen_lengths=EMPTY_BETWEEN)),
        "fla",
    ),
    "k256_state_v_first": (lambda rng: _mk(rng, K=256, state_v_first=True), "fla"),
    "k256_g_tail_no_states": (lambda rng: _mk(rng, T=100, K=256, gate="g", dht=False, h0=False), "fla"),
    "k256_use_graph": (lambda rng: dict(_mk(rng, K=256), use_graph=True), "fla"),
    "k256_use_graph_varlen": (lambda rng: _graph(rng, [100, 1, 0, 200, 37], K=256), "fla"),
    "k96": (lambda rng: _mk(rng, K=96), "fla"),
    "v96": (lambda rng: _mk(rng, V=96), "fla"),
    "chunk_size_32": (lambda rng: _mk(rng, gate="g", chunk_size=32), "fla"),
    "float32": (lambda rng: _mk(rng, dtype=FP32), "fla"),
    "mixed_16bit_dtypes": (_mixed, "fla"),
    # below one wave: the kernel's (no measured clause sends them to fla)
    "gva_below_a_wave": (lambda rng: _mk(rng, B=1, T=192, H=1, HV=4, V=64), "kernel"),
    "long_sequence_half_wave": (lambda rng: _mk(rng, B=1, T=1100, H=1, HV=1, V=64), "kernel"),
    "scale_none": (lambda rng: dict(_mk(rng, K=256), scale=None), "fla"),
    "empty_sequences": (lambda rng: _tables(_mk(rng, B=1, T=200, varlen_lengths=EMPTY_BETWEEN)), "kernel"),
    "all_sequences_empty": (lambda rng: _tables(_mk(rng, B=1, T=64, varlen_lengths=[0, 0, 0])), "direct"),
    "all_sequences_empty_no_tables": (lambda rng: _mk(rng, B=1, T=64, varlen_lengths=[0, 0, 0]), "direct"),
    "all_sequences_empty_no_states": (
        lambda rng: _tables(_mk(rng, B=1, T=64, varlen_lengths=[0, 0], dht=False)),
        "direct",
    ),
    "all_sequences_empty_k256": (
        lambda rng: _tables(_mk(rng, B=1, T=64, K=256, varlen_lengths=[0, 0, 0])),
        "fla",
    ),
    "all_sequences_empty_use_graph": (lambda rng: _graph(rng, [], n_max=3, T=128), "kernel"),
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(INT[x.element_size()])


def _cut(a: dict, outs):
    """(dh on the rows that hold chunks, dh0, dv2 on the packed tokens): fla leaves the
    rest of a graph-mode dh and of a padded batch's dv2 unwritten."""
    dh, dh0, dv2 = outs
    co = a.get("chunk_offsets")
    if a.get("cu_seqlens") is not None:
        if co is not None and co.shape[0] == a["cu_seqlens"].shape[0]:
            dh = dh[:, : int(co[-1])]
        dv2 = dv2[:, : int(a["cu_seqlens"][-1])]
    return dh, dh0, dv2


@pytest.mark.parametrize("case", list(CASES))
def test_fallback_answers_match_the_reference(rng, case):
    """The public entry point's answer against the float64 reference; the route as
    planned (no kernel launch where fla or the direct answer computes it); where fla
    computes it, bitwise fla's own function. < 1 s each (fla compiles a new shape once)."""
    make, route = CASES[case]
    a = make(rng)
    ok, reason = kda_dhu.plan_call(**a)
    if route == "fla":
        assert not ok, f"the planner takes {case} on the kernel now: update the audit ({reason})"
    with KernelProbe() as probe:
        outs = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
        outs = [None if x is None else x.clone() for x in outs]  # use_graph: fla's static buffers
    torch.cuda.synchronize()
    assert probe.launches == (1 if route == "kernel" else 0), f"{case}: {probe.launches} launches ({reason})"
    scale = a["q"].shape[-1] ** -0.5 if a.get("scale") is None else a["scale"]
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**dict(a, scale=scale), emulate_rounding=False)
    tol = max(TOL[a["q"].dtype], TOL[a["dv"].dtype])
    for name, o, r in zip(OUTPUTS, _cut(a, outs), _cut(a, ref)):
        if r is None:
            assert o is None, f"{case}: {name} is not None"
            continue
        assert o.shape == r.shape and o.is_contiguous(), (case, name, o.shape, r.shape, o.stride())
        e = rel_err(o, r)
        assert e < tol, f"{case}: {name} relative error {e:.3e} against the reference (bar {tol:.0e})"
    if route == "direct":
        dh, dh0, dv2 = outs
        assert dh.shape[1] == 0 and torch.count_nonzero(dv2) == 0
        if a.get("h0") is not None:
            want = a["dht"] if a.get("dht") is not None else torch.zeros_like(dh0)
            assert torch.equal(dh0, want), f"{case}: dh0 is not dht (zeros without it)"
    if route == "fla":
        fla = kda_dhu.fla_function()(**dict(a, scale=scale))
        for name, o, f in zip(OUTPUTS, _cut(a, outs), _cut(a, fla)):
            if f is None:
                assert o is None, name
                continue
            assert o.dtype == f.dtype and torch.equal(_bits(o), _bits(f)), f"{case}: {name} is not fla's"


def test_t_zero(rng):
    """T = 0: fla's function computes it (no chunks: dh0 = dht, dv2 empty); kda-dhu either
    answers it as the reference does or refuses it naming q (its validation asks T >= 1),
    never a wrong answer or an error that names nothing."""
    a = _mk(rng, T=0)
    try:
        outs = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    except ValueError as err:
        assert str(err).startswith("q: expected T >= 1"), err
        return
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**a, emulate_rounding=False)
    for name, o, r in zip(OUTPUTS, outs, ref):
        assert o.shape == r.shape and rel_err(o, r) < TOL[BF16], name
