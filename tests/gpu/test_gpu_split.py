"""GPU parity of the sequence split (src/split.rs): a dense call below one wave as S
segments, a first pass (the kernel with V widened by K identity columns), the fp32 merge of
the boundary states, a second pass over the segments.

`KDA_DHU_SM90_SPLIT=N` forces N segments wherever a split can run, so small shapes take it;
each case is held to the same bar as the unsplit kernel (test_gpu_kernel._check: every
output within 1.25x fla's error against the float64 reference, poisoned outputs, inputs
unchanged), and the launches are checked by name.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs
from test_gpu_kernel import DT, _check, _launched_kernels, _run_poisoned

pytestmark = pytest.mark.gpu

# name: (B, T, H, HV, K, V, dtype, gate, segments, extra make_inputs arguments)
CASES = {
    "k128_gk_s3": (1, 640, 2, 2, 128, 128, "bf16", "gk", 3, {}),
    "k128_gk_s2": (1, 640, 2, 2, 128, 128, "bf16", "gk", 2, {}),
    "k128_gk_s5_b2": (2, 1280, 2, 2, 128, 128, "bf16", "gk", 5, {}),
    "k128_g_tail_s3": (1, 700, 2, 2, 128, 128, "bf16", "g", 3, {}),
    "k128_none_tail_s4": (1, 1000, 2, 2, 128, 128, "bf16", None, 4, {}),
    "k64_fp16_gk_s3": (1, 640, 2, 2, 64, 64, "fp16", "gk", 3, {}),
    "k64_v256_g_s3": (1, 768, 1, 1, 64, 256, "bf16", "g", 3, {}),
    "k128_v64_fp16_s3": (1, 640, 2, 2, 128, 64, "fp16", "gk", 3, {}),
    "gva_h1_hv4_s3": (1, 640, 1, 4, 128, 128, "bf16", "gk", 3, {}),
    "no_dht_s3": (1, 640, 2, 2, 128, 128, "bf16", "gk", 3, {"dht": False}),
    "no_h0_s3": (1, 640, 2, 2, 128, 128, "bf16", "gk", 3, {"h0": False}),
    "no_states_s3": (1, 640, 2, 2, 128, 128, "bf16", "gk", 3, {"dht": False, "h0": False}),
    "one_chunk_segments": (1, 192, 2, 2, 128, 128, "bf16", "gk", 3, {}),
    "svf_k128_s3": (1, 640, 2, 2, 128, 128, "bf16", "gk", 3, {"state_v_first": True}),
    "svf_k64_g_tail_s4": (1, 900, 2, 2, 64, 128, "bf16", "g", 4, {"state_v_first": True}),
}


def _args(rng, case):
    B, T, H, HV, K, V, dt, gate, _, extra = CASES[case]
    return make_inputs(B, T, H, HV, K, V, DT[dt], gate, device="cuda", generator=rng, **extra)


@pytest.mark.parametrize("nwg", ["1", "2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_matches_reference_and_fla(rng, monkeypatch, case, nwg):
    """Every output of the split call within the kernel's bar; the second pass on one or
    two warpgroups (2 applies where V % 128 == 0)."""
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", str(CASES[case][8]))
    monkeypatch.setenv("KDA_DHU_SM90_NWG", nwg)
    _check(_args(rng, case))


def test_split_launches_its_three_kernels(rng, monkeypatch):
    """A split call runs the first pass, the merge and the second pass, in that order; off,
    one launch of the plain kernel."""
    from kda_dhu.testing import run_kernel

    args = _args(rng, "k128_gk_s3")
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "3")
    names = _launched_kernels(lambda: run_kernel(args))
    assert names == [
        "kda_dhu_sm90_rs_k128_bf16_sum",
        "kda_dhu_sm90_seg_merge_k128",
        "kda_dhu_sm90_rs_k128_bf16",
    ], names
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "off")
    assert _launched_kernels(lambda: run_kernel(args)) == ["kda_dhu_sm90_rs_k128_bf16"]


def test_split_is_close_to_the_unsplit_kernel_and_repeatable(rng, monkeypatch):
    """The split and the unsplit kernel differ only by where fp32 sums are rounded: dh and
    dv2 agree to bf16 rounding; the split call itself is bitwise repeatable."""
    from kda_dhu.reference import rel_err

    args = make_inputs(1, 4096, 2, 2, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "off")
    plain = _run_poisoned(args)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "4")
    split = _run_poisoned(args)
    again = _run_poisoned(args)
    for name, a, b, c in zip(("dh", "dh0", "dv2"), plain, split, again):
        assert torch.equal(b, c), f"{name}: not repeatable"
        assert rel_err(b, a) < 2e-2, f"{name}: {rel_err(b, a):.3e} from the unsplit kernel"


def test_the_rule_splits_a_long_sequence(rng, monkeypatch):
    """`on`: the rule's segments for B1 H2 T8192 (128 chunks: 4 segments of 32); the call
    matches the reference and fla."""
    import kda_dhu

    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "on")
    args = make_inputs(1, 8192, 2, 2, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng)
    assert kda_dhu.plan_call(**args)[0]
    from kda_dhu.testing import run_kernel

    names = _launched_kernels(lambda: run_kernel(args))
    assert names[0] == "kda_dhu_sm90_rs_k128_bf16_sum", names
    _check(args)


def test_split_in_a_cuda_graph(rng, monkeypatch):
    """The split's stream-ordered buffers are captured as graph memory nodes: the replay
    equals the eager call bitwise."""
    import kda_dhu

    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", "3")
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")
    args = _args(rng, "k128_gk_s3")
    eager = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    for o in outs:
        if o is not None:
            o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("dh", "dh0", "dv2"), outs, eager):
        assert torch.equal(a, b), name


# ---- a long live segment (the KDA_DHU_EXP_SPLIT_LIVE experiment; src/split.rs, `live`):
# these run only on a wheel built with KDA_DHU_KERNEL_DEFINES=KDA_DHU_EXP_SPLIT_LIVE=1.


def _live_built() -> bool:
    from kda_dhu import _core

    return (
        "-DKDA_DHU_EXP_SPLIT_LIVE" in _core.build_info()
        and "-DKDA_DHU_EXP_SPLIT_LIVE=0" not in _core.build_info()
    )


needs_live = pytest.mark.skipif(
    not _live_built(), reason="the build lacks KDA_DHU_EXP_SPLIT_LIVE (benches/NOTES.md)"
)

# name: (make_inputs arguments, KDA_DHU_SM90_SPLIT value "N:L"); each with a summarized
# segment (N - L >= 2) but "s3_l2" (the live CTA and pass 2 alone).
LIVE_CASES = {
    "gk_s6_l2": (dict(B=1, T=768, H=2, HV=2, K=128, V=128, gate="gk"), "6:2"),
    "gk_s5_l3_b2": (dict(B=2, T=640, H=2, HV=2, K=128, V=128, gate="gk"), "5:3"),
    "g_tail_s4_l2": (dict(B=1, T=700, H=2, HV=2, K=128, V=128, gate="g"), "4:2"),
    "none_k64_s4_l2": (dict(B=1, T=512, H=2, HV=2, K=64, V=128, gate=None), "4:2"),
    "gk_s3_l2": (dict(B=1, T=640, H=2, HV=2, K=128, V=128, gate="gk"), "3:2"),
    "svf_gk_s5_l2": (dict(B=1, T=640, H=2, HV=2, K=128, V=128, gate="gk", state_v_first=True), "5:2"),
}


@needs_live
@pytest.mark.parametrize("case", sorted(LIVE_CASES))
def test_split_with_a_long_live_segment_matches_reference_and_fla(rng, monkeypatch, case):
    """`N:L`: the first pass's live CTA runs the newest L segments, the others summarize one
    each; every output within the kernel's bar, three launches."""
    from kda_dhu.testing import run_kernel

    kw, value = LIVE_CASES[case]
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", value)
    args = make_inputs(**kw, dtype=torch.bfloat16, device="cuda", generator=rng)
    _check(args)
    names = _launched_kernels(lambda: run_kernel(args))
    assert len(names) == 3 and names[0].endswith(("_sum", "_sum_g", "_sum_svf")), names
    # L live segments, not one: the same N segments with one live (a summarized segment
    # where the live CTA ran) round the boundary states elsewhere, so dh differs.
    live = _run_poisoned(args)
    monkeypatch.setenv("KDA_DHU_SM90_SPLIT", value.split(":")[0])
    one = _run_poisoned(args)
    assert not torch.equal(live[0], one[0]), "N:L ran as N segments with one live"
