"""The float64 reference of stage 4's forward twin, ``chunk_gated_delta_rule_fwd_h_ref``
(kda_dhu.reference), against a token-by-token loop written here from SPEC.md ("The
twin"), on fresh random data: every gate (gk, g, none), GVA, tails, packed batches with
empty and one-token sequences and a padded end, fla's chunk tables, state_v_first, the
optional initial and final states and v_new, with and without the rounding model; a split
sequence chained through final_state -> initial_state; and its input errors (CPU only).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from kda_dhu.reference import chunk_gated_delta_rule_fwd_h_ref, rel_err

BF16, F64 = torch.bfloat16, torch.float64


def _inputs(gen, B, T, H, HV, K, V, gate, dtype=BF16, lengths=None, h0=True, svf=False):
    def randn(*shape, s=1.0):
        return torch.randn(*shape, generator=gen, dtype=F64) * s

    N = B if lengths is None else len(lengths)
    a = dict(
        k=(randn(B, T, H, K) / math.sqrt(K)).to(dtype),
        w=(randn(B, T, HV, K) / math.sqrt(K)).to(dtype),
        u=randn(B, T, HV, V).to(dtype),
        g=None,
        gk=None,
        initial_state=randn(N, HV, *((V, K) if svf else (K, V))).float() if h0 else None,
        state_v_first=svf,
    )
    if gate is not None:
        # log2-space chunk-local cumulative sums of negative steps, as fla's callers pass
        step = -torch.rand(B, T, HV, *((K,) if gate == "gk" else ()), generator=gen, dtype=F64) * 0.2
        a[gate] = step.cumsum(1).float()  # chunk-local in fla; any log2 values exercise the same math
    if lengths is not None:
        a["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    return a


def _naive(a, chunk_size, emulate_rounding):
    """SPEC.md's loop, one sequence, value head and token at a time."""
    k, w, u, g, gk = a["k"], a["w"], a["u"], a.get("g"), a.get("gk")
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    cu = a.get("cu_seqlens")
    seqs = [(b, 0, T) for b in range(B)] if cu is None else [(0, int(s), int(e)) for s, e in zip(cu, cu[1:])]
    nts = [-(-(e - s) // chunk_size) for _, s, e in seqs]
    NT = -(-T // chunk_size) if cu is None else sum(nts)
    offs = [b * NT for b in range(B)] if cu is None else [sum(nts[:i]) for i in range(len(seqs))]
    svf = a["state_v_first"]

    def rnd(x, dt):
        return x.to(dt).to(F64) if emulate_rounding else x

    hs = torch.zeros(B * NT if cu is None else NT, HV, K, V, dtype=F64)
    vn = torch.zeros(B, T, HV, V, dtype=F64)
    fin = torch.zeros(len(seqs), HV, K, V, dtype=F64)
    for n, (b, bos, eos) in enumerate(seqs):
        for hv in range(HV):
            hk = hv // (HV // H)
            h = torch.zeros(K, V, dtype=F64)
            if a["initial_state"] is not None:
                h0 = a["initial_state"][n, hv].to(F64)
                h = h0.T.clone() if svf else h0.clone()
            for c in range(nts[n]):
                s, e = bos + c * chunk_size, min(bos + (c + 1) * chunk_size, eos)
                hs[offs[n] + c, hv] = h
                upd = []
                for t in range(s, e):
                    v_t = u[b, t, hv].to(F64) - w[b, t, hv].to(F64) @ rnd(h, w.dtype)
                    vn[b, t, hv] = v_t
                    if g is not None:
                        v_t = v_t * 2.0 ** (g[b, e - 1, hv].double() - g[b, t, hv].double())
                    upd.append((t, v_t))
                if g is not None:
                    h = h * 2.0 ** g[b, e - 1, hv].double()
                if gk is not None:
                    h = h * (2.0 ** gk[b, e - 1, hv].double())[:, None]
                for t, v_t in upd:
                    h = h + torch.outer(k[b, t, hk].to(F64), rnd(v_t, k.dtype))
            fin[n, hv] = h
    hs = hs.reshape(B, NT, HV, K, V) if cu is None else hs.reshape(1, NT, HV, K, V)
    if svf:
        hs, fin = hs.transpose(-1, -2), fin.transpose(-1, -2)
    return hs, vn, fin


CASES = {
    "gk": dict(B=2, T=128, H=2, HV=2, K=16, V=8, gate="gk"),
    "g": dict(B=2, T=128, H=2, HV=2, K=16, V=8, gate="g"),
    "no_gate": dict(B=1, T=128, H=1, HV=1, K=16, V=8, gate=None),
    "gva_tail": dict(B=2, T=100, H=1, HV=3, K=16, V=8, gate="gk"),
    "varlen_empty_one_token_padded": dict(B=1, T=150, H=2, HV=2, K=16, V=8, gate="g", lengths=[40, 0, 1, 70]),
    "state_v_first": dict(B=1, T=90, H=2, HV=2, K=16, V=8, gate="gk", svf=True),
    "no_initial_state": dict(B=1, T=64, H=1, HV=2, K=16, V=8, gate="gk", h0=False),
}


@pytest.mark.parametrize("emulate", [True, False], ids=["rounded", "exact"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_is_the_recurrence(case, emulate):
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    spec = dict(CASES[case])
    a = _inputs(gen, **spec)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h_ref(
        **a, output_final_state=True, chunk_size=32, emulate_rounding=emulate
    )
    want_h, want_v, want_ht = _naive(a, 32, emulate)
    assert h.dtype == F64 and h.shape == want_h.shape
    for name, got, want in (("h", h, want_h), ("v_new", v_new, want_v), ("final_state", ht, want_ht)):
        assert rel_err(got, want) < 1e-12, (case, name, rel_err(got, want))
    # the optional outputs
    h2, v2, ht2 = chunk_gated_delta_rule_fwd_h_ref(
        **a, output_final_state=False, save_new_value=False, chunk_size=32, emulate_rounding=emulate
    )
    assert v2 is None and ht2 is None and torch.equal(h2, h)


def test_the_rounding_model_changes_the_values_of_16_bit_inputs():
    a = _inputs(torch.Generator().manual_seed(3), 1, 256, 2, 2, 32, 16, "gk")
    r = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=True, emulate_rounding=True)
    x = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=True, emulate_rounding=False)
    assert 1e-5 < rel_err(r[2], x[2]) < 3e-2
    f64 = {
        n: (v.to(F64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for n, v in a.items()
    }
    r = chunk_gated_delta_rule_fwd_h_ref(**f64, output_final_state=True, emulate_rounding=True)
    x = chunk_gated_delta_rule_fwd_h_ref(**f64, output_final_state=True, emulate_rounding=False)
    assert torch.equal(r[2], x[2]), "float64 inputs: the casts are no-ops"


def test_a_split_sequence_chains_through_the_final_state():
    """Chunks [0, 2) then [2, 4) of one sequence, the first call's final_state the second's
    initial_state, equal one call over all four chunks."""
    a = _inputs(torch.Generator().manual_seed(5), 1, 256, 2, 2, 16, 8, "gk")
    h, v, ht = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=True, emulate_rounding=False)

    def part(x, s, e):
        return None if x is None else x[:, s:e]

    first = {n: part(a[n], 0, 128) for n in ("k", "w", "u", "g", "gk")}
    h1, v1, ht1 = chunk_gated_delta_rule_fwd_h_ref(
        **first, initial_state=a["initial_state"], output_final_state=True, emulate_rounding=False
    )
    second = {n: part(a[n], 128, 256) for n in ("k", "w", "u", "g", "gk")}
    h2, v2, ht2 = chunk_gated_delta_rule_fwd_h_ref(
        **second, initial_state=ht1, output_final_state=True, emulate_rounding=False
    )
    assert rel_err(torch.cat([h1, h2], 1), h) < 1e-12
    assert rel_err(torch.cat([v1, v2], 1), v) < 1e-12
    assert rel_err(ht2, ht) < 1e-12


def test_fla_s_chunk_tables_place_the_chunks():
    """chunk_indices sets h's chunk count (fla allocates len(chunk_indices) rows),
    chunk_offsets where each sequence's chunks go; rows no sequence writes stay zero."""
    a = _inputs(torch.Generator().manual_seed(7), 1, 200, 1, 1, 16, 8, "gk", lengths=[100, 0, 37])
    h, _, _ = chunk_gated_delta_rule_fwd_h_ref(**a)
    assert h.shape[1] == 2 + 0 + 1
    h_tab, _, _ = chunk_gated_delta_rule_fwd_h_ref(
        **a, chunk_indices=torch.zeros(6, 2, dtype=torch.long), chunk_offsets=torch.tensor([1, 3, 4, 5])
    )
    assert h_tab.shape[1] == 6
    assert torch.equal(h_tab[:, 1:3], h[:, 0:2]) and torch.equal(h_tab[:, 4], h[:, 2])
    assert not h_tab[:, [0, 3, 5]].any()


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(w=torch.zeros(1, 64, 3, 16)), "w must be"),
        (dict(u=torch.zeros(1, 63, 2, 8)), "u must be"),
        (dict(g=torch.zeros(1, 64, 3)), "g must be"),
        (dict(gk=torch.zeros(1, 64, 2, 15)), "gk must be"),
        (dict(initial_state=torch.zeros(1, 2, 8, 16)), "initial_state must be"),
        (dict(cu_seqlens=torch.tensor([0, 70])), "cu_seqlens must be"),
        (dict(chunk_size=0), "chunk_size must be positive"),
    ],
)
def test_bad_input_is_named(change, match):
    a = _inputs(torch.Generator().manual_seed(1), 1, 64, 1, 2, 16, 8, None)
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule_fwd_h_ref(**{**a, **change})
