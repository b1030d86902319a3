"""GPU parity of the KDA_DHU_EXP_QD_PARTNER experiment (cuda/dhu_sm90_regstate.cuh): stage
4's one-warpgroup kernel as a 2-CTA cluster per V tile, QD^T computed by the partner CTA and
handed over through distributed shared memory. These run only on a wheel built with
KDA_DHU_KERNEL_DEFINES=KDA_DHU_EXP_QD_PARTNER=1 (benches/NOTES.md, "QD on a partner CTA").

The pair does the one-CTA kernel's arithmetic (the same wgmma for QD on the other SM, its
fp32 fragment moved exactly), and the two-warpgroup kernel (one CTA, no cluster) does it
too (test_gpu_kernel.test_two_warpgroups_equal_one_warpgroup_bitwise): so where V allows two
warpgroups the pair's outputs must be bitwise the two-warpgroup kernel's; every case is also
held to the kernel's bar against the float64 reference and fla (test_gpu_kernel._check).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs
from test_gpu_kernel import _check, _launched_kernels, _run_poisoned

pytestmark = pytest.mark.gpu


def _built() -> bool:
    from kda_dhu import _core

    info = _core.build_info()
    return "-DKDA_DHU_EXP_QD_PARTNER" in info and "-DKDA_DHU_EXP_QD_PARTNER=0" not in info


needs_qdp = pytest.mark.skipif(
    not _built(), reason="the build lacks KDA_DHU_EXP_QD_PARTNER (benches/NOTES.md)"
)

# name: make_inputs arguments. Short chunks (tails, packed sequences of 1 .. 200 tokens), both
# gates and none, GVA, [V, K] states, no states, K = 64, fp16.
CASES = {
    "gk_k128": dict(B=2, T=320, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, gate="gk"),
    "g_tail": dict(B=2, T=200, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, gate="g"),
    "none_tail": dict(B=1, T=130, H=2, HV=2, K=128, V=256, dtype=torch.bfloat16, gate=None),
    "varlen_gk": dict(
        B=1,
        T=None,
        H=2,
        HV=2,
        K=128,
        V=128,
        dtype=torch.bfloat16,
        gate="gk",
        varlen_lengths=[1, 63, 65, 128, 200, 7],
    ),
    "varlen_g_k64": dict(
        B=1,
        T=None,
        H=2,
        HV=2,
        K=64,
        V=128,
        dtype=torch.bfloat16,
        gate="g",
        varlen_lengths=[1, 63, 65, 128, 200, 7],
    ),
    "gva_h1_hv4": dict(B=1, T=192, H=1, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="gk"),
    "svf": dict(B=2, T=256, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, gate="gk", state_v_first=True),
    "no_states": dict(
        B=2, T=128, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, gate="gk", dht=False, h0=False
    ),
    "fp16_k64": dict(B=2, T=256, H=2, HV=2, K=64, V=128, dtype=torch.float16, gate="gk"),
    "v64": dict(B=2, T=256, H=2, HV=2, K=128, V=64, dtype=torch.bfloat16, gate="gk"),
}


def _args(rng, case):
    spec = dict(CASES[case])
    return make_inputs(
        *(spec.pop(n) for n in ("B", "T", "H", "HV", "K", "V", "dtype", "gate")),
        device="cuda",
        generator=rng,
        **spec,
    )


@needs_qdp
@pytest.mark.parametrize("case", sorted(CASES))
def test_pair_matches_reference_and_fla(rng, monkeypatch, case):
    monkeypatch.setenv("KDA_DHU_SM90_NWG", "1")
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "off")
    _check(_args(rng, case))


@needs_qdp
@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c]["V"] % 128 == 0))
def test_pair_equals_two_warpgroups_bitwise(rng, monkeypatch, case):
    args = _args(rng, case)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "off")
    outs = {}
    for nwg in ("1", "2"):
        monkeypatch.setenv("KDA_DHU_SM90_NWG", nwg)
        outs[nwg] = _run_poisoned(args)
    for name, a, b in zip(("dh", "dh0", "dv2"), outs["1"], outs["2"]):
        assert torch.equal(a, b), name


@needs_qdp
def test_split_second_pass_as_pairs(rng, monkeypatch):
    """A split's second pass is the one-warpgroup kernel: pairs there too."""
    monkeypatch.setenv("KDA_DHU_SM90_NWG", "1")
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "3")
    _check(make_inputs(1, 640, 2, 2, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng))


@needs_qdp
def test_pair_launch_is_the_one_warpgroup_entry_point(rng, monkeypatch):
    from kda_dhu.testing import run_kernel

    monkeypatch.setenv("KDA_DHU_SM90_NWG", "1")
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "off")
    args = _args(rng, "gk_k128")
    names = _launched_kernels(lambda: run_kernel(args))
    assert names == ["kda_dhu_sm90_rs_k128_bf16"], names
