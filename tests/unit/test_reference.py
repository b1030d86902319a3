"""The float64 reference (kda_dhu.reference) on hand-checked cases.

Each test compares the vectorized reference with something computed another way:
literal numbers, explicit matrix formulas, a plain per-token loop (helpers.naive_bwd_dhu),
or the reference on transformed inputs (per-sequence runs, repeated heads, transposes).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from helpers import make_inputs, naive_bwd_dhu

ref_mod = importlib.import_module("kda_dhu.reference")
ref = ref_mod.chunk_gated_delta_rule_bwd_dhu_ref
rel_err = ref_mod.rel_err

F64 = torch.float64


def _f64(inputs: dict) -> dict:
    """The same inputs with every floating tensor in float64 (exact)."""
    return {
        k: (v.to(F64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in inputs.items()
    }


def _close(a, b, tol=1e-12):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.shape == b.shape, (a.shape, b.shape)
    assert rel_err(a, b) <= tol, rel_err(a, b)


# ---------------------------------------------------------------- (a) by hand


def test_literal_two_token_chunk_with_scalar_gate():
    """K = V = 1, T = 2, one chunk, g gate: every number worked out by hand.

    g_last = -2; dv2[0] = 2^(-2+1)*(1*4) + 2 = 4; dv2[1] = 2^0*(0.5*4) + 3 = 5;
    dh0 = 2^-2 * 4 + 0.5*(2^-1*1*1 + 2^-2*2*(-1)) - (0.25*4 + 1*5) = 1 + 0 - 6 = -5.
    """
    t = lambda *x: torch.tensor(x, dtype=F64).view(1, 2, 1, 1)  # noqa: E731
    dh, dh0, dv2 = ref(
        q=t(1.0, 2.0),
        k=t(1.0, 0.5),
        w=t(0.25, 1.0),
        do=t(1.0, -1.0),
        dv=t(2.0, 3.0),
        g=torch.tensor([[[-1.0], [-2.0]]], dtype=F64),
        h0=torch.zeros(1, 1, 1, 1),
        dht=torch.full((1, 1, 1, 1), 4.0, dtype=F64),
        scale=0.5,
    )
    assert dh.shape == (1, 1, 1, 1, 1)
    assert dh.item() == 4.0
    assert dv2.flatten().tolist() == [4.0, 5.0]
    assert dh0.item() == -5.0


@pytest.mark.parametrize("gate", [None, "g", "gk"])
@pytest.mark.parametrize("T", [64, 37])
def test_one_chunk_matches_matrix_formulas(gate, T, rng):
    """One chunk (full, or short) per head, written as whole-chunk matrix products."""
    inp = _f64(make_inputs(2, T, 2, 2, 16, 8, F64, gate, generator=rng))
    dh, dh0, dv2 = ref(**inp)
    q, k, w, do, dv, dht, s = (inp[x] for x in ("q", "k", "w", "do", "dv", "dht", "scale"))
    for n in range(2):
        for h in range(2):
            Q, Kc, W, dO, dV, b = q[n, :, h], k[n, :, h], w[n, :, h], do[n, :, h], dv[n, :, h], dht[n, h]
            D = torch.eye(T, dtype=F64)  # diag(exp2(g_last - g_t))
            decay = torch.eye(16, dtype=F64)
            Qg = Q
            if gate == "g":
                gv = inp["g"][n, :, h]
                D = torch.diag(torch.exp2(gv[-1] - gv))
                decay = decay * torch.exp2(gv[-1])
                Qg = torch.diag(torch.exp2(gv)) @ Q
            elif gate == "gk":
                decay = torch.diag(torch.exp2(inp["gk"][n, -1, h]))
            dV2 = D @ (Kc @ b) + dV
            B0 = decay @ b + s * Qg.T @ dO - W.T @ dV2
            torch.testing.assert_close(dh[n, 0, h], b, rtol=0, atol=0)
            torch.testing.assert_close(dv2[n, :, h], dV2, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(dh0[n, h], B0, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------ (b) independent loop


@pytest.mark.parametrize("gate", [None, "g", "gk"])
def test_two_chunks_match_naive_token_loop(gate, rng):
    """Two chunks, B = 2, GVA (H=1, HV=2): the vectorized reference vs a plain loop over
    tokens and heads, exact arithmetic (emulate_rounding=False) on fp32 inputs."""
    inp = make_inputs(2, 128, 1, 2, 8, 4, torch.float32, gate, generator=rng)
    got = ref(**inp, emulate_rounding=False)
    want = naive_bwd_dhu(**inp)
    for a, b in zip(got, want):
        _close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["g", "gk"])
def test_rounding_model_matches_naive_loop_with_casts(dtype, gate, rng):
    """emulate_rounding=True models exactly two casts: b before k@b, dv2 before w^T dv2."""
    inp = make_inputs(1, 128, 2, 2, 16, 8, dtype, gate, generator=rng)
    got = ref(**inp, emulate_rounding=True)
    want = naive_bwd_dhu(**inp, round_dtype=dtype)
    for a, b in zip(got, want):
        _close(a, b)
    # and the casts matter: the exact recurrence differs by about the 16-bit epsilon
    exact = ref(**inp, emulate_rounding=False)
    assert rel_err(got[1], exact[1]) > 1e-5
    assert rel_err(got[1], exact[1]) < 0.05


def test_rounding_flag_is_a_noop_for_float64(rng):
    inp = _f64(make_inputs(1, 100, 1, 1, 8, 8, F64, "gk", generator=rng))
    for a, b in zip(ref(**inp, emulate_rounding=True), ref(**inp, emulate_rounding=False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------- (c) varlen


@pytest.mark.parametrize("gate", [None, "g", "gk"])
def test_varlen_equals_each_sequence_alone(gate, rng):
    lengths = [70, 64, 1, 130]
    inp = make_inputs(1, None, 2, 4, 16, 8, torch.bfloat16, gate, varlen_lengths=lengths, generator=rng)
    dh, dh0, dv2 = ref(**inp)
    assert dh.shape == (1, sum(-(-n // 64) for n in lengths), 4, 16, 8)
    cu, off = inp["cu_seqlens"].tolist(), 0
    for i, n in enumerate(lengths):
        s, e = cu[i], cu[i + 1]
        one = dict(inp, cu_seqlens=None)
        for name in ("q", "k", "w", "do", "dv", "g", "gk"):
            if one[name] is not None:
                one[name] = inp[name][:, s:e]
        one["dht"], one["h0"] = inp["dht"][i : i + 1], inp["h0"][i : i + 1]
        dh_i, dh0_i, dv2_i = ref(**one)
        nt = -(-n // 64)
        _close(dh[:, off : off + nt], dh_i, 1e-13)
        _close(dh0[i : i + 1], dh0_i, 1e-13)
        _close(dv2[:, s:e], dv2_i, 1e-13)
        off += nt


def test_varlen_zero_length_sequence_passes_dht_through(rng):
    inp = make_inputs(1, None, 1, 2, 8, 8, torch.bfloat16, "gk", varlen_lengths=[65, 0, 3], generator=rng)
    dh, dh0, dv2 = ref(**inp)
    assert dh.shape[1] == 2 + 0 + 1
    torch.testing.assert_close(dh0[1], inp["dht"][1].to(F64), rtol=0, atol=0)
    # the third sequence's single chunk sits right after the first sequence's two
    torch.testing.assert_close(dh[0, 2], inp["dht"][2].to(F64), rtol=0, atol=0)


def test_varlen_explicit_chunk_offsets_and_indices(rng):
    """chunk_offsets places each sequence's chunks; chunk_indices sets dh's length."""
    inp = make_inputs(1, None, 1, 1, 8, 8, torch.bfloat16, "g", varlen_lengths=[65, 10], generator=rng)
    base = ref(**inp)
    moved = ref(
        **inp, chunk_offsets=torch.tensor([3, 0, 3]), chunk_indices=torch.zeros(5, 2, dtype=torch.long)
    )
    assert moved[0].shape[1] == 5
    torch.testing.assert_close(moved[0][:, 3:5], base[0][:, 0:2], rtol=0, atol=0)
    torch.testing.assert_close(moved[0][:, 0], base[0][:, 2], rtol=0, atol=0)
    assert moved[0][:, 1:3].abs().sum() == 0  # chunks 1, 2: nobody's
    torch.testing.assert_close(moved[1], base[1], rtol=0, atol=0)
    torch.testing.assert_close(moved[2], base[2], rtol=0, atol=0)


# ---------------------------------------------------------------- (d) GVA


@pytest.mark.parametrize("gate", [None, "g", "gk"])
def test_gva_equals_repeated_qk_heads(gate, rng):
    inp = make_inputs(2, 100, 2, 6, 16, 8, torch.bfloat16, gate, generator=rng)
    rep = dict(inp, q=inp["q"].repeat_interleave(3, dim=2), k=inp["k"].repeat_interleave(3, dim=2))
    for a, b in zip(ref(**inp), ref(**rep)):
        _close(a, b, 1e-13)


# -------------------------------------------------------- (e) state_v_first


@pytest.mark.parametrize("varlen", [False, True])
def test_state_v_first_equals_transposing(varlen, rng):
    kw = dict(varlen_lengths=[30, 90]) if varlen else {}
    inp = make_inputs(
        1 if varlen else 2, None if varlen else 90, 1, 2, 16, 8, torch.bfloat16, "gk", generator=rng, **kw
    )
    kf = ref(**inp)
    vf = ref(
        **dict(
            inp,
            dht=inp["dht"].transpose(-1, -2).contiguous(),
            h0=inp["h0"].transpose(-1, -2).contiguous(),
            state_v_first=True,
        )
    )
    assert vf[0].shape == kf[0].shape[:-2] + (8, 16)
    assert vf[1].shape == (inp["dht"].shape[0], 2, 8, 16)
    _close(vf[0].transpose(-1, -2), kf[0], 1e-13)
    _close(vf[1].transpose(-1, -2), kf[1], 1e-13)
    _close(vf[2], kf[2], 1e-13)


# ----------------------------------------------------- (f) dht None, h0 None


def test_dht_none_equals_dht_zeros(rng):
    inp = make_inputs(2, 70, 1, 1, 8, 8, torch.bfloat16, "g", generator=rng)
    a = ref(**dict(inp, dht=None))
    b = ref(**dict(inp, dht=torch.zeros_like(inp["dht"])))
    for x, y in zip(a, b):
        _close(x, y, 1e-13)
    assert a[0][:, -1].abs().sum() == 0  # the newest chunk's dh is the (zero) dht
    assert a[1].abs().sum() > 0


def test_h0_none_gives_dh0_none(rng):
    inp = make_inputs(1, 64, 1, 1, 8, 8, torch.bfloat16, "gk", h0=False, generator=rng)
    dh, dh0, dv2 = ref(**inp)
    assert dh0 is None
    assert dh.dtype == F64 and dv2.dtype == F64


# ---------------------------------------------------------------- (g) tails


@pytest.mark.parametrize("T", [65, 63])
@pytest.mark.parametrize("gate", [None, "g", "gk"])
def test_tails_match_naive_token_loop(T, gate, rng):
    inp = make_inputs(2, T, 1, 2, 8, 4, torch.bfloat16, gate, generator=rng)
    got = ref(**inp)
    assert got[0].shape == (2, math.ceil(T / 64), 2, 8, 4)
    want = naive_bwd_dhu(**inp, round_dtype=torch.bfloat16)
    for a, b in zip(got, want):
        _close(a, b)


def test_gk_read_only_at_each_chunks_last_valid_row(rng):
    """gk is read at rows e-1 only: in a short last chunk that is row T-1, not s+63.
    Changing it there changes dh0 and the older chunks' outputs but not the newest
    chunk's dv2; changing any other row changes nothing."""
    inp = _f64(make_inputs(1, 65, 1, 1, 8, 8, F64, "gk", generator=rng))
    base = ref(**inp)
    gk2 = inp["gk"].clone()
    gk2[:, 64] -= 1.0
    changed = ref(**dict(inp, gk=gk2))
    assert rel_err(changed[1], base[1]) > 1e-3
    assert rel_err(changed[2][:, :64], base[2][:, :64]) > 1e-3
    torch.testing.assert_close(changed[2][:, 64:], base[2][:, 64:], rtol=0, atol=0)
    gk3 = inp["gk"].clone()
    gk3[:, :63] -= 1.0
    for a, b in zip(ref(**dict(inp, gk=gk3)), base):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------ (h) padded varlen


@pytest.mark.parametrize("gate", [None, "g", "gk"])
def test_padded_varlen_leaves_padding_zero(gate, rng):
    lengths = [40, 70]
    inp = make_inputs(1, 150, 2, 2, 8, 8, torch.bfloat16, gate, varlen_lengths=lengths, generator=rng)
    dh, dh0, dv2 = ref(**inp)
    assert dv2.shape == (1, 150, 2, 8)
    assert dv2[:, 110:].abs().sum() == 0
    assert bool(torch.isfinite(dh).all() and torch.isfinite(dh0).all() and torch.isfinite(dv2).all())
    trimmed = dict(inp)
    for name in ("q", "k", "w", "do", "dv", "g", "gk"):
        if trimmed[name] is not None:
            trimmed[name] = inp[name][:, :110]
    for a, b in zip((dh, dh0, dv2[:, :110]), ref(**trimmed)):
        _close(a, b, 1e-13)


# ------------------------------------------------------------------ misc


def test_realistic_size_runs_quickly(rng):
    """T = 2048, HV = 8, K = V = 128 on the CPU: vectorized over heads, must be fast."""
    import time

    inp = make_inputs(1, 2048, 4, 8, 128, 128, torch.bfloat16, "gk", generator=rng)
    t0 = time.perf_counter()
    dh, dh0, dv2 = ref(**inp)
    assert time.perf_counter() - t0 < 30.0
    assert dh.shape == (1, 32, 8, 128, 128)
    for x in (dh, dh0, dv2):
        assert bool(torch.isfinite(x).all())
    # O(1) magnitudes: the inputs keep the reverse scan from blowing up or vanishing
    assert 1e-2 < dh0.abs().mean().item() < 1e2


def test_rel_err():
    r = torch.tensor([3.0, 4.0], dtype=F64)
    assert rel_err(r, r) == 0.0
    assert rel_err(torch.tensor([3.0, 4.5]), r) == pytest.approx(0.1)
    assert rel_err(torch.tensor([float("nan"), 4.0]), r) == math.inf
    assert rel_err(torch.tensor([float("inf"), 4.0]), r) == math.inf
    assert rel_err(None, None) == 0.0
    with pytest.raises(ValueError):
        rel_err(torch.zeros(3), r)


# ------------------------------------------- (f) the sequence split's algebra (src/split.rs)


@pytest.mark.parametrize("gate", ["gk", "g", None])
def test_the_split_passes_compose_to_the_whole_scan(gate):
    """src/split.rs's three steps on the float64 reference: the newest segment from dht;
    each middle segment with V widened by K columns ([do | 0], [dv | 0] from [0 | I]) ends
    in [u_s | P_s]; x_{s-1} = P_s x_s + u_s; every segment from its x gives the whole
    scan's dh, dv2 and dh0 (tails included: T = 600, segments of 3 chunks)."""
    B, T, H, HV, K, V, sc = 1, 600, 2, 2, 64, 64, 3
    a = _f64(make_inputs(B, T, H, HV, K, V, torch.bfloat16, gate, generator=torch.Generator().manual_seed(5)))
    whole = ref(**a, emulate_rounding=False)
    nt = (T + 63) // 64
    S = (nt + sc - 1) // sc
    bounds = [(s * sc * 64, min((s + 1) * sc * 64, T)) for s in range(S)]

    def seg(s, dht, widen=False):
        lo, hi = bounds[s]
        x = {
            n: (v[:, lo:hi] if n in ("q", "k", "w", "do", "dv", "g", "gk") and v is not None else v)
            for n, v in a.items()
        }
        x["dht"] = dht
        if widen:
            zeros = torch.zeros(B, hi - lo, HV, K, dtype=F64)
            x["do"] = torch.cat([x["do"], zeros], -1)
            x["dv"] = torch.cat([x["dv"], zeros], -1)
            x["h0"] = torch.zeros(B, HV, K, V + K, dtype=F64)
        return ref(**x, emulate_rounding=False)

    eye = torch.eye(K, dtype=F64).expand(B, HV, K, K)
    # Pass 1: the newest from dht; segments 1 .. S - 2 widened, from [0 | I].
    x = {S - 1: a["dht"]}
    x[S - 2] = seg(S - 1, a["dht"])[1]
    summary = {
        s: seg(s, torch.cat([torch.zeros(B, HV, K, V, dtype=F64), eye], -1), widen=True)[1]
        for s in range(1, S - 1)
    }
    # Merge: x_{s-1} = P_s x_s + u_s.
    for s in range(S - 2, 0, -1):
        u, p = summary[s][..., :V], summary[s][..., V:]
        x[s - 1] = p @ x[s] + u
    # Pass 2: every segment from its state.
    runs = [seg(s, x[s]) for s in range(S)]
    _close(torch.cat([r[0] for r in runs], 1), whole[0])
    _close(runs[0][1], whole[1])
    _close(torch.cat([r[2] for r in runs], 1), whole[2])
