"""GPU parity of the K split (``KDA_DHU_SM90_KSPLIT=1``: two consumer warpgroups share
one V tile, each holding half of K = 128; cuda/dhu_sm90_regstate.cuh's
``ksplit_consumers``) against the float64 reference and fla, every output, outputs
poisoned first (test_gpu_kernel.py's ``_check``: at most 1.25 x fla's own error), on the
variants its code paths separate: the gates, dtypes, tails, packed batches with short,
one-token, zero-length sequences and padding, GVA, the optional states, state_v_first.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs
from test_gpu_kernel import _check, _launched_kernels, _rel, _run_poisoned

pytestmark = pytest.mark.gpu

SWITCH = "KDA_DHU_SM90_KSPLIT"
LENGTHS = [1, 63, 65, 128, 200, 64, 7, 0, 130]

CASES = {
    "bf16_gk_v128": dict(B=2, T=320, H=4, HV=4, V=128, dtype=torch.bfloat16, gate="gk"),
    "fp16_gk_v64": dict(B=2, T=256, H=2, HV=2, V=64, dtype=torch.float16, gate="gk"),
    "bf16_g_tail65": dict(B=2, T=65, H=2, HV=2, V=128, dtype=torch.bfloat16, gate="g"),
    "bf16_none_tail200": dict(B=2, T=200, H=2, HV=2, V=128, dtype=torch.bfloat16, gate=None),
    "fp16_g_tail63": dict(B=1, T=63, H=2, HV=2, V=64, dtype=torch.float16, gate="g"),
    "varlen_gk": dict(B=1, T=None, H=2, HV=2, V=128, dtype=torch.bfloat16, gate="gk", varlen_lengths=LENGTHS),
    "varlen_g": dict(B=1, T=None, H=2, HV=2, V=64, dtype=torch.bfloat16, gate="g", varlen_lengths=LENGTHS),
    "varlen_none_padded": dict(
        B=1, T=700, H=2, HV=2, V=64, dtype=torch.bfloat16, gate=None, varlen_lengths=LENGTHS
    ),
    "gva_h1_hv4": dict(B=1, T=192, H=1, HV=4, V=128, dtype=torch.bfloat16, gate="gk"),
    "gva_h2_hv4_g": dict(B=2, T=130, H=2, HV=4, V=64, dtype=torch.bfloat16, gate="g"),
    "no_states": dict(B=2, T=128, H=2, HV=2, V=128, dtype=torch.bfloat16, gate="gk", dht=False, h0=False),
    "dht_only": dict(B=2, T=128, H=2, HV=2, V=64, dtype=torch.bfloat16, gate="gk", h0=False),
    "h0_only": dict(B=2, T=128, H=2, HV=2, V=64, dtype=torch.bfloat16, gate="gk", dht=False),
    "long": dict(B=1, T=4096, H=2, HV=2, V=128, dtype=torch.bfloat16, gate="gk"),
    "svf_gk": dict(B=2, T=320, H=2, HV=2, V=128, dtype=torch.bfloat16, gate="gk", state_v_first=True),
    "svf_g_varlen_fp16": dict(
        B=1,
        T=None,
        H=2,
        HV=2,
        V=64,
        dtype=torch.float16,
        gate="g",
        varlen_lengths=LENGTHS,
        state_v_first=True,
    ),
}


def _inputs(rng, spec):
    spec = dict(spec)
    return make_inputs(
        spec.pop("B"),
        spec.pop("T"),
        spec.pop("H"),
        spec.pop("HV"),
        128,
        spec.pop("V"),
        spec.pop("dtype"),
        spec.pop("gate"),
        device="cuda",
        generator=rng,
        **spec,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_k_split(rng, monkeypatch, case):
    monkeypatch.setenv(SWITCH, "1")
    _check(_inputs(rng, CASES[case]))


@pytest.mark.parametrize("svf", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_switch_launches_the_k_split(rng, monkeypatch, svf, dtype):
    """KDA_DHU_SM90_KSPLIT=1 at K = 128 runs the ``_ksplit`` entry point (by the launched
    kernel's name), whatever KDA_DHU_SM90_NWG says; at K = 64 the one-warpgroup kernel."""
    from kda_dhu.testing import run_kernel

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("KDA_DHU_SM90_NWG", "2")
    args = make_inputs(2, 128, 2, 2, 128, 128, dt, "gk", state_v_first=svf, device="cuda", generator=rng)
    names = _launched_kernels(lambda: run_kernel(args))
    assert names == [f"kda_dhu_sm90_rs_k128_{dtype}_ksplit" + ("_svf" if svf else "")], names
    monkeypatch.delenv("KDA_DHU_SM90_NWG")
    args64 = make_inputs(2, 128, 2, 2, 64, 128, dt, "gk", state_v_first=svf, device="cuda", generator=rng)
    names = _launched_kernels(lambda: run_kernel(args64))
    assert names == [f"kda_dhu_sm90_rs_k64_{dtype}" + ("_svf" if svf else "")], names


def test_k_split_is_repeatable_and_close_to_one_warpgroup(rng, monkeypatch):
    """Two runs give the same bits; against the one-warpgroup kernel only DV's summation
    order differs (its two K halves are added after their dots): within bf16 rounding."""
    args = make_inputs(2, 1024, 2, 2, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng)
    monkeypatch.setenv(SWITCH, "1")
    a = _run_poisoned(args)
    b = _run_poisoned(args)
    for name, x, y in zip(("dh", "dh0", "dv2"), a, b):
        assert torch.equal(x, y), name
    monkeypatch.delenv(SWITCH)
    one = _run_poisoned(args)
    for name, x, y in zip(("dh", "dh0", "dv2"), a, one):
        assert _rel(x, y) < 2e-2, (name, _rel(x, y))


def test_k_split_nonfinite_memory_outside_sequences_does_not_leak(rng, monkeypatch):
    """A padded packed batch whose padding holds NaN / Inf and whose last sequence ends
    mid-chunk: each warpgroup zeroes its own half of q and w and half of do's rows."""
    monkeypatch.setenv(SWITCH, "1")
    lengths = [100, 30, 70]
    args = make_inputs(
        1, 320, 2, 2, 128, 128, torch.bfloat16, "gk", varlen_lengths=lengths, device="cuda", generator=rng
    )
    end = sum(lengths)
    for name, val in (("q", float("nan")), ("k", float("inf")), ("w", float("nan")), ("do", float("-inf"))):
        args[name][:, end:] = val
    args["dv"][:, end:] = float("nan")
    args["gk"][:, end:] = float("nan")
    dh, dh0, dv2 = _run_poisoned(args)
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref

    clean = dict(args)
    for name in ("q", "k", "w", "do", "dv", "gk"):
        clean[name] = args[name].clone()
        clean[name][:, end:] = 0
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**clean)
    assert torch.isfinite(dh).all() and torch.isfinite(dh0).all() and torch.isfinite(dv2).all()
    assert torch.count_nonzero(dv2[:, end:]) == 0
    assert _rel(dh, ref[0]) < 1e-2 and _rel(dh0, ref[1]) < 1e-2 and _rel(dv2, ref[2]) < 1e-2
