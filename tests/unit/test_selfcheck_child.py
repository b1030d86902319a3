"""The check process's pieces that need no GPU: inputs of a signature, the sampled
reference (a slice of the call gives the slice of the full reference), the measurements
and their verdict on a right and on a wrong stand-in kernel, the input checksums."""

from __future__ import annotations

import pytest
import torch
from kda_dhu._selfcheck import Signature, judge, signature_of
from kda_dhu._selfcheck_child import (
    checksums,
    inputs_for,
    measure,
    reference_samples,
    sample_pairs,
    slice_outputs,
    varlen_lengths,
)
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref

SIGS = {
    "gva_gk": Signature("extended", 2, 130, 2, 4, 64, 64, "bfloat16", gk=True, h0=True, dht=True),
    "varlen_g": Signature("extended", 1, 300, 2, 2, 64, 64, "bfloat16", g=True, h0=True, dht=True, N=3),
    "svf_nogate": Signature("extended", 2, 64, 1, 1, 64, 128, "float16", h0=True, state_v_first=True),
    "b2a": Signature("b2a", 3, 128, 2, 2, 64, 64, "bfloat16", gk=True, h0=True, dht=True),
}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name", list(SIGS))
def test_inputs_have_the_signature(name):
    sig = SIGS[name]
    a = inputs_for(sig, "cpu", _gen())
    got = signature_of(
        sig.entry,
        a["q"],
        a["do"],
        g=a["g"],
        gk=a["gk"],
        h0=a["h0"],
        dht=a["dht"],
        state_v_first=a["state_v_first"],
        cu_seqlens=a["cu_seqlens"],
    )
    assert got == sig


def test_varlen_lengths():
    sig = SIGS["varlen_g"]
    lengths = varlen_lengths(sig, _gen(1))
    assert len(lengths) == 3 and sum(lengths) == 300 and min(lengths) > 0
    assert lengths == varlen_lengths(sig, _gen(1))  # seeded: reproducible
    short = Signature("extended", 1, 2, 1, 1, 64, 64, "bfloat16", N=5)
    assert sum(varlen_lengths(short, _gen())) == 2 and len(varlen_lengths(short, _gen())) == 5


def test_sample_pairs():
    sig = Signature("extended", 4, 128, 4, 4, 64, 64, "bfloat16", gk=True)
    pairs = sample_pairs(sig, _gen(2))
    assert len(pairs) == 8 and pairs[0] == (0, 0) and pairs[-1] == (3, 3) and len(set(pairs)) == 8
    assert pairs == sample_pairs(sig, _gen(2))
    assert sample_pairs(SIGS["gva_gk"], _gen()) == [(b, h) for b in range(2) for h in range(4)]
    long = Signature("extended", 1, 65536, 32, 32, 128, 128, "bfloat16", gk=True)
    assert len(sample_pairs(long, _gen())) == 2  # 1024 chunks of 128 x 128 float64: the budget
    assert len(sample_pairs(long, _gen(), budget=1)) == 1


@pytest.mark.parametrize("name", list(SIGS))
def test_the_sampled_reference_is_the_full_references_slice(name):
    """Slicing a call to one (batch, value head) pair (GVA: its q/k head; varlen: every
    sequence) gives exactly that pair's part of the full reference."""
    sig = SIGS[name]
    a = inputs_for(sig, "cpu", _gen(3))
    full = chunk_gated_delta_rule_bwd_dhu_ref(**a, emulate_rounding=False)
    pairs = sample_pairs(sig, _gen(3))
    for (b, hv), ref in zip(pairs, reference_samples(a, sig, pairs)):
        for i, (r, f) in enumerate(zip(ref, slice_outputs(full, sig, b, hv))):
            if f is None:
                assert r is None
                continue
            assert r.shape == f.shape, (i, r.shape, f.shape)
            assert torch.allclose(r, f, rtol=1e-12, atol=1e-12), (name, b, hv, i)


def _stand_ins(sig, seed=4):
    """fla and a right kernel: the exact reference with independent relative noise of
    1e-3 each (about fla's error), rounded to the output dtypes."""
    a = inputs_for(sig, "cpu", _gen(seed))
    full = chunk_gated_delta_rule_bwd_dhu_ref(**a, emulate_rounding=False)
    dtype = getattr(torch, sig.dtype)
    dts = (dtype, torch.float32, dtype)

    def noisy(gen):
        return tuple(
            None
            if x is None
            else (x * (1 + 1e-3 * torch.randn(x.shape, generator=gen, dtype=x.dtype))).to(dt)
            for x, dt in zip(full, dts)
        )

    return a, noisy(_gen(seed + 1)), noisy(_gen(seed + 2))


@pytest.mark.parametrize("name", ["gva_gk", "varlen_g"])
def test_measurements_pass_a_right_kernel_and_fail_wrong_ones(name):
    sig = SIGS[name]
    a, fla, ours = _stand_ins(sig)
    pairs = sample_pairs(sig, _gen(5))
    refs = reference_samples(a, sig, pairs)
    outcome, detail = judge({"outputs": measure(ours, fla, refs, pairs, sig), "plan": "stand-in"}, sig)
    assert outcome == "pass", detail

    wrong_head = [x.clone() for x in ours]  # one value head's dv2 wrong: sampled and compared
    wrong_head[2][:, :, -1] *= 2
    outcome, detail = judge({"outputs": measure(wrong_head, fla, refs, pairs, sig)}, sig)
    assert outcome == "fail" and "dv2" in detail, detail

    unwritten = [x.clone() for x in ours]  # one NaN anywhere: every element is checked
    unwritten[0].view(-1)[7] = float("nan")
    outcome, detail = judge({"outputs": measure(unwritten, fla, refs, pairs, sig)}, sig)
    assert outcome == "fail" and "dh: 1 non-finite" in detail, detail

    with pytest.raises(ValueError, match="dh0: the kernel returned None"):
        measure((ours[0], None, ours[2]), fla, refs, pairs, sig)


def test_checksums_see_a_changed_input():
    a = inputs_for(SIGS["gva_gk"], "cpu", _gen(6))
    before = checksums(a)
    assert set(before) == {"q", "k", "w", "do", "dv", "gk", "h0", "dht"}
    a["do"].view(-1)[3] += 1.0
    after = checksums(a)
    assert [k for k in before if before[k] != after[k]] == ["do"]
