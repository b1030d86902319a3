"""Kernel-only driver for compute-sanitizer (run by scripts/device/sanitize.sh; GPU machine).

A handful of small calls covering the kernel's code paths: the envelope (K 64 / 128,
bf16), a dense tail, varlen with lengths [1, 63, 65, 7] (fla's chunk tables, int64 and
int32), a padded packed batch, GVA, the g gate, no gate without states, one fp16 call,
two warpgroups, state_v_first, the sequence split, inputs in strided, sliced, expanded and misaligned
layouts (copied before the kernel reads them), and more of the same kinds of calls on
other shapes (the ``rs_`` cases: the dh / dv2 staging reuse, the do rows weighted in place
with g, short chunks of packed batches). Each case runs the
kernel twice: once
directly with NaN-poisoned outputs (``kda_dhu.testing.run_kernel(args, poison=True)``),
once through the public entry point with ``KDA_DHU_FORCE=kernel``, and checks both
against the float64 reference (so a sanitizer run that "passes" on wrong results
does not).

Then the bad packed batches of ``kda_dhu.testing.BAD_BATCHES`` (cu_seqlens[0] != 0,
decreasing, past T, a wrong chunk_offsets table, chunks past NT, garbage int32 and int64
values), each launched through ``_core.decide`` + ``Call.launch`` into outputs of
their exact size (every allocation its own cudaMalloc: memcheck sees a store outside
them): the failing sequence's outputs must be NaN where its entries bound them, the other
sequences' must match the reference of the good batch, and ``kda_dhu.check_errors()`` must
raise ValueError naming cu_seqlens, chunk_offsets or chunk_indices.

fla is never imported or called (``KDA_DHU_NO_AUTOREGISTER=1``; packed batches carry
their chunk tables, built by ``kda_dhu.testing.chunk_tables``): sanitizing Triton is slow
and not this project's code.

Prints one ``case <name>: ...`` line per case and ``sanitize_driver: N cases OK`` at the
end; exits 3 on a failed check (compute-sanitizer's own errors exit 1 under
``--error-exitcode 1``).

    python3 scripts/device/sanitize_driver.py [--cases name,name]
"""

from __future__ import annotations

import os

os.environ["KDA_DHU_FORCE"] = "kernel"
os.environ.setdefault("KDA_DHU_NO_AUTOREGISTER", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

# name, make_inputs arguments (B, T, H, HV, K, V, dtype, gate, ...); "tables": fla's chunk
# tables of a packed batch in that index dtype; "layouts": {input: kda_dhu.testing layout}
CASES = [
    ("envelope_k64_bf16", dict(B=2, T=128, H=2, HV=2, K=64, V=64, gate="gk")),
    ("envelope_k128_bf16", dict(B=2, T=128, H=2, HV=2, K=128, V=128, gate="gk")),
    ("dense_tail_t100", dict(B=2, T=100, H=2, HV=2, K=128, V=64, gate="gk")),
    (
        "varlen_1_63_65_7",
        dict(B=1, T=None, H=2, HV=2, K=128, V=64, gate="gk", varlen_lengths=[1, 63, 65, 7], tables=torch.int64),
    ),
    (
        "varlen_padded_int32",
        dict(B=1, T=256, H=2, HV=2, K=64, V=64, gate="gk", varlen_lengths=[100, 30, 0, 70], tables=torch.int32),
    ),
    ("gva_h1_hv4", dict(B=1, T=128, H=1, HV=4, K=128, V=64, gate="gk")),
    ("g_gate_tail_t130", dict(B=2, T=130, H=2, HV=2, K=128, V=64, gate="g")),
    ("no_gate_no_states", dict(B=1, T=150, H=1, HV=1, K=64, V=128, gate=None, dht=False, h0=False)),
    (
        "fp16_varlen_g",
        dict(
            B=1, T=None, H=1, HV=2, K=128, V=64, gate="g", varlen_lengths=[70, 5], dtype=torch.float16,
            tables=torch.int64,
        ),
    ),
    # Two consumer warpgroups per CTA (KDA_DHU_SM90_NWG=2; V % 128 == 0).
    ("wg2_envelope_k128", dict(B=2, T=128, H=2, HV=2, K=128, V=128, gate="gk", nwg=2)),
    (
        "wg2_varlen_padded_g",
        dict(B=1, T=256, H=2, HV=2, K=64, V=128, gate="g", varlen_lengths=[100, 30, 70], nwg=2, tables=torch.int32),
    ),
    ("wg2_gva_tail_v256", dict(B=1, T=130, H=1, HV=2, K=128, V=256, gate="gk", nwg=2)),
    # The sequence split (KDA_DHU_SM90_SPLIT=N segments; src/split.rs): its first pass with
    # identity tiles, the merge, the second pass on one and two warpgroups.
    ("split3_k128_gk", dict(B=1, T=640, H=2, HV=2, K=128, V=128, gate="gk", split=3, nwg=1)),
    ("split4_k64_g_tail_wg2", dict(B=2, T=900, H=1, HV=2, K=64, V=128, gate="g", split=4, nwg=2)),
    ("split3_svf_none", dict(B=1, T=700, H=2, HV=2, K=128, V=64, gate=None, split=3, state_v_first=True)),
    (
        "svf_varlen_k128",
        dict(
            B=1, T=None, H=2, HV=2, K=128, V=64, gate="gk", state_v_first=True, varlen_lengths=[1, 63, 65, 7],
            tables=torch.int64,
        ),
    ),
    ("svf_wg2_tail_g", dict(B=2, T=100, H=2, HV=2, K=64, V=128, gate="g", state_v_first=True, nwg=2)),
    # Inputs the caller laid out otherwise: copied (packed) before the kernel reads them.
    (
        "strided_dense",
        dict(
            B=2, T=130, H=2, HV=2, K=128, V=128, gate="gk",
            layouts=dict(q="permuted", k="slice_dim1", w="offset_misaligned", do="slice_last", dv="expanded",
                         gk="slice_dim2", dht="permuted", h0="offset_misaligned"),
        ),
    ),
    (
        "strided_varlen_g",
        dict(
            B=1, T=None, H=2, HV=2, K=64, V=128, gate="g", varlen_lengths=[1, 63, 65, 7], tables=torch.int64,
            layouts=dict(q="slice_dim2", k="offset_misaligned", w="permuted", do="expanded", dv="slice_dim1",
                         g="slice_dim1", dht="slice_last", h0="permuted"),
        ),
    ),
    # More shapes for the kernel's own barriers (the dh / dv2 staging reuse, the do rows
    # weighted in place with g), stmatrix / ldmatrix, the short chunk of a packed batch, two
    # warpgroups, state_v_first.
    ("rs_envelope_k64", dict(B=2, T=128, H=2, HV=2, K=64, V=64, gate="gk")),
    ("rs_envelope_k128", dict(B=2, T=192, H=2, HV=2, K=128, V=128, gate="gk")),
    (
        "rs_varlen_1_63_65_7_g",
        dict(B=1, T=None, H=2, HV=2, K=128, V=64, gate="g", varlen_lengths=[1, 63, 65, 7], tables=torch.int64),
    ),
    (
        "rs_varlen_padded_none",
        dict(B=1, T=256, H=2, HV=2, K=64, V=64, gate=None, varlen_lengths=[100, 30, 0, 70], tables=torch.int32),
    ),
    ("rs_gva_tail_t130", dict(B=1, T=130, H=1, HV=4, K=128, V=64, gate="gk")),
    (
        "rs_fp16_no_states",
        dict(B=1, T=150, H=1, HV=1, K=128, V=64, gate=None, dht=False, h0=False, dtype=torch.float16),
    ),
    (
        "rs_wg2_varlen_padded_g",
        dict(B=1, T=256, H=2, HV=2, K=128, V=128, gate="g", varlen_lengths=[100, 30, 70], nwg=2, tables=torch.int32),
    ),
    (
        "rs_svf_varlen_k128",
        dict(B=1, T=None, H=2, HV=2, K=128, V=64, gate="gk", state_v_first=True, varlen_lengths=[1, 63, 65, 7],
             tables=torch.int64),
    ),
    (
        "rs_svf_wg2_tail_g_k64",
        dict(B=2, T=100, H=2, HV=2, K=64, V=128, gate="g", state_v_first=True, nwg=2),
    ),
    # The forward scan (fla's chunk_gated_delta_rule_fwd_h; the FWD instances): the make_inputs
    # call's k, w, u = dv, initial_state = dht, run through _core._fwd_h_probe into NaN-poisoned
    # outputs and through the (private) entry point.
    ("fwd_envelope_k128_gk", dict(B=2, T=192, H=2, HV=2, K=128, V=128, gate="gk", fwd=True)),
    ("fwd_k64_g_tail", dict(B=2, T=130, H=2, HV=2, K=64, V=64, gate="g", fwd=True)),
    (
        "fwd_varlen_padded_none",
        dict(B=1, T=256, H=2, HV=2, K=128, V=64, gate=None, varlen_lengths=[100, 1, 0, 70], tables=torch.int32,
             fwd=True),
    ),
    ("fwd_gva_svf_fp16", dict(B=1, T=130, H=1, HV=2, K=128, V=64, gate="gk", state_v_first=True,
                              dtype=torch.float16, fwd=True)),
    ("fwd_wg2_varlen_g", dict(B=1, T=None, H=2, HV=2, K=128, V=128, gate="g", varlen_lengths=[1, 63, 65, 7],
                              tables=torch.int64, nwg=2, fwd=True)),
    ("fwd_wg2_no_state_k64", dict(B=2, T=100, H=1, HV=1, K=64, V=128, gate="gk", dht=False, h0=False, nwg=2,
                                  fwd=True)),
    # The forward scan's split (KDA_DHU_SM90_SPLIT=N; with a final state where the case has
    # an initial state): its first pass, the oldest-first merge, the second pass (one and two
    # warpgroups).
    ("fwd_split3_k128_gk", dict(B=1, T=640, H=2, HV=2, K=128, V=128, gate="gk", split=3, nwg=1, fwd=True)),
    ("fwd_split4_k64_g_tail_wg2", dict(B=2, T=900, H=1, HV=2, K=64, V=128, gate="g", split=4, nwg=2, fwd=True)),
    ("fwd_split3_svf_none", dict(B=1, T=700, H=2, HV=2, K=128, V=64, gate=None, split=3, state_v_first=True,
                                 fwd=True)),
    # A long live segment (KDA_DHU_SM90_SPLIT=N:L): the live CTA over two of six segments on a
    # build with KDA_DHU_EXP_SPLIT_LIVE, six segments of one live elsewhere.
    ("split_live6_2_k128_gk", dict(B=1, T=768, H=2, HV=2, K=128, V=128, gate="gk", split="6:2", nwg=1)),
    ("fwd_split_live6_2_k128_gk", dict(B=1, T=768, H=2, HV=2, K=128, V=128, gate="gk", split="6:2", nwg=1,
                                       fwd=True)),
]  # fmt: skip

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def run_case(name: str, spec: dict, gen: torch.Generator) -> str:
    import kda_dhu
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
    from kda_dhu.testing import chunk_tables, make_inputs, relayout, run_kernel

    spec = dict(spec)
    dtype = spec.pop("dtype", torch.bfloat16)
    nwg = spec.pop("nwg", None)
    split = spec.pop("split", None)
    tables = spec.pop("tables", None)
    layouts = spec.pop("layouts", {})
    fwd = spec.pop("fwd", False)
    if nwg is None:
        os.environ.pop("KDA_DHU_SM90_NWG", None)
    else:
        os.environ["KDA_DHU_SM90_NWG"] = str(nwg)
    if split is None:
        os.environ.pop("KDA_DHU_SM90_SPLIT", None)
    else:
        os.environ["KDA_DHU_SM90_SPLIT"] = str(split)
    a = make_inputs(dtype=dtype, device="cuda", generator=gen, **spec)
    if tables is not None:
        cu = a["cu_seqlens"].to(tables)
        ci, co = chunk_tables(cu, a["q"].shape[1])
        a.update(cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co)
    for input_name, layout in layouts.items():
        x = relayout(a[input_name], layout)
        if x is None:
            raise AssertionError(
                f"{name}: layout {layout} does not apply to {input_name} {tuple(a[input_name].shape)}"
            )
        a[input_name] = x
    if fwd:
        return run_forward_case(name, a, dtype, split=split is not None)
    try:
        poisoned = run_kernel(a, poison=True)
    except RuntimeError as err:
        raise AssertionError(f"{name}: {err}") from None
    torch.cuda.synchronize()
    public = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    torch.cuda.synchronize()
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**a)
    parts = []
    for label, outs in (("poisoned", poisoned), ("public", public)):
        for out_name, o, r in zip(("dh", "dh0", "dv2"), outs, ref):
            if r is None:
                if o is not None:
                    raise AssertionError(f"{name} {label}: {out_name} should be None")
                continue
            e = rel_err(o, r)
            if not e < TOL[dtype]:
                raise AssertionError(
                    f"{name} {label}: {out_name} relative error {e:.3e} "
                    f"(bar {TOL[dtype]:.0e}; inf = non-finite / unwritten)"
                )
            if label == "poisoned":
                parts.append(f"{out_name} {e:.1e}")
        if a["cu_seqlens"] is not None:
            end = int(a["cu_seqlens"][-1])
            if end < a["q"].shape[1] and int(torch.count_nonzero(outs[2][:, end:])):
                raise AssertionError(f"{name} {label}: dv2 padding rows are not zero")
    return ", ".join(parts)


def run_forward_case(name: str, s4: dict, dtype, split: bool = False) -> str:
    """The forward scan on a stage-4 case's inputs: _core._fwd_h_probe into NaN-poisoned
    outputs, then kda_dhu._forward.chunk_gated_delta_rule_fwd_h (KDA_DHU_FORCE=kernel),
    both against the float64 reference with fla's casts (bar 1e-3); a split call (three
    launches) rounds its partial states where fla does not: against the exact float64
    reference at the stage-4 cases' bar (TOL)."""
    from kda_dhu import _core
    from kda_dhu._forward import chunk_gated_delta_rule_fwd_h
    from kda_dhu.reference import chunk_gated_delta_rule_fwd_h_ref, rel_err

    k, w, u, h0 = s4["k"], s4["w"], s4["dv"], s4["dht"]
    svf, cu = s4["state_v_first"], s4["cu_seqlens"]
    a = dict(k=k, w=w, u=u, g=s4["g"], gk=s4["gk"], initial_state=h0, state_v_first=svf, cu_seqlens=cu,
             chunk_indices=s4.get("chunk_indices"), chunk_offsets=s4.get("chunk_offsets"))  # fmt: skip
    final_wanted = h0 is not None  # a split call's second pass writes it from its last segment
    ref = chunk_gated_delta_rule_fwd_h_ref(**a, output_final_state=final_wanted, emulate_rounding=not split)
    bar, launches = (TOL[dtype], 3) if split else (1e-3, 1)
    B, T, HV, V = u.shape
    K = k.shape[3]
    N = B if cu is None else cu.shape[0] - 1
    state = (N, HV, V, K) if svf else (N, HV, K, V)
    h = torch.full(ref[0].shape, float("nan"), dtype=k.dtype, device="cuda")
    v_new = torch.full_like(u, float("nan"))
    final = torch.full(state, float("nan"), dtype=torch.float32, device="cuda") if final_wanted else None
    zero = torch.zeros(state, dtype=torch.float32, device="cuda") if final_wanted else None
    _core._fwd_h_probe(
        k, k, w, u, u, a["g"], a["gk"], zero, h0, None, svf, cu, 64,
        dh=h, dh0=final, dv2=v_new, stream=torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip
    torch.cuda.synchronize()
    before = _core.launch_count()
    public = chunk_gated_delta_rule_fwd_h(**a, output_final_state=final_wanted)
    torch.cuda.synchronize()
    if _core.launch_count() - before != launches:
        raise AssertionError(f"{name}: the entry point did not make its {launches} kernel launch(es)")
    parts = []
    for label, outs in (("poisoned", (h, v_new, final)), ("public", public)):
        for out_name, o, r in zip(("h", "v_new", "final_state"), outs, ref):
            if r is None:
                if o is not None:
                    raise AssertionError(f"{name} {label}: {out_name} should be None")
                continue
            e = rel_err(o, r if split else r.to(o.dtype))
            if not e < bar:
                raise AssertionError(
                    f"{name} {label}: {out_name} relative error {e:.3e} (bar {bar:.0e}; inf = non-finite / unwritten)"
                )
            if label == "poisoned":
                parts.append(f"{out_name} {e:.1e}")
    return ", ".join(parts)


# _core.decide's positional arguments after the rule (fla's order)
POS = (
    "q", "k", "w", "do", "dv", "g", "gk", "h0", "dht", "scale", "state_v_first", "cu_seqlens", "chunk_size",
    "chunk_indices", "chunk_offsets",
)  # fmt: skip
SENTINEL = -7.0


def good_batch(gen: torch.Generator) -> tuple:
    """kda_dhu.testing.GOOD_BATCH's call (B1 T300 H2 K128 V64 gk, fla's chunk tables) and
    its float64 reference."""
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref
    from kda_dhu.testing import GOOD_BATCH, chunk_tables, make_inputs

    a = make_inputs(
        1, GOOD_BATCH["T"], 2, 2, 128, 64, torch.bfloat16, "gk", varlen_lengths=GOOD_BATCH["lengths"],
        device="cuda", generator=gen,
    )  # fmt: skip
    ci, co = chunk_tables(a["cu_seqlens"], GOOD_BATCH["T"])
    a.update(chunk_indices=ci, chunk_offsets=co)
    return a, chunk_gated_delta_rule_bwd_dhu_ref(**a)


def run_bad_case(name: str, good: dict, ref) -> str:
    """One bad packed batch of BAD_BATCHES, launched into exact-size outputs filled with a
    sentinel: NaN where the failing sequence's entries bound its outputs, the reference
    elsewhere, and check_errors() naming the argument."""
    import kda_dhu
    from kda_dhu import _core
    from kda_dhu.reference import rel_err
    from kda_dhu.testing import GOOD_BATCH, bad_batch

    bad = bad_batch(name)
    index = (
        torch.int32 if name.endswith("int32") or name in ("first_offset", "chunk_offsets") else torch.int64
    )
    cu = torch.tensor(bad["cu"], dtype=index, device="cuda")
    co = (
        None
        if bad["chunk_offsets"] is None
        else torch.tensor(bad["chunk_offsets"], dtype=index, device="cuda")
    )
    a = dict(good, cu_seqlens=cu, chunk_indices=good["chunk_indices"][: bad["nt"]], chunk_offsets=co)
    call = _core.decide("capable", *(a.get(k) for k in POS))
    ok, reason = call.verdict
    if not ok:
        raise AssertionError(f"bad_{name}: the kernel does not take the call: {reason}")
    dh_shape, dh0_shape, dv2_shape = call.out_shapes()
    dh = torch.full(dh_shape, SENTINEL, dtype=a["q"].dtype, device="cuda")
    dh0 = torch.full(dh0_shape, SENTINEL, dtype=torch.float32, device="cuda")
    dv2 = torch.full(dv2_shape, SENTINEL, dtype=a["dv"].dtype, device="cuda")
    call.launch(dh, dh0, dv2, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    seq = bad["seq"]
    if seq is not None:
        nan = [("dh0", dh0[seq])]
        if bad["dh_rows"] is not None:
            nan.append(("dh rows", dh[:, slice(*bad["dh_rows"])]))
        if bad["dv2_rows"] is not None:
            nan.append(("dv2 rows", dv2[:, slice(*bad["dv2_rows"])]))
        for what, x in nan:
            if not bool(torch.isnan(x).all()):
                raise AssertionError(f"bad_{name}: sequence {seq}'s {what} are not all NaN")
        cu_good = GOOD_BATCH["cu"]
        offsets = _core.check_tables(cu_good, GOOD_BATCH["T"])
        for n in range(len(cu_good) - 1):
            if n == seq:
                continue
            for what, o, r in (
                ("dh", dh[:, offsets[n] : offsets[n + 1]], ref[0][:, offsets[n] : offsets[n + 1]]),
                ("dh0", dh0[n], ref[1][n]),
                ("dv2", dv2[:, cu_good[n] : cu_good[n + 1]], ref[2][:, cu_good[n] : cu_good[n + 1]]),
            ):
                e = rel_err(o, r)
                if not e < TOL[torch.bfloat16]:
                    raise AssertionError(f"bad_{name}: sequence {n}'s {what}: relative error {e:.3e}")
    try:
        kda_dhu.check_errors()
    except ValueError as err:
        msg = str(err)
    else:
        raise AssertionError(f"bad_{name}: check_errors() raised nothing")
    if not msg.startswith(("cu_seqlens: ", "chunk_offsets: ", "chunk_indices: ")):
        raise AssertionError(f"bad_{name}: the error names no table: {msg}")
    return f"{index}, raised {msg.split(':')[0]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    from kda_dhu.testing import BAD_BATCHES

    names = [c[0] for c in CASES] + [f"bad_{n}" for n in BAD_BATCHES]
    wanted = [c for c in args.cases.split(",") if c]
    cases = [n for n in names if not wanted or n in wanted]
    if wanted and len(cases) != len(wanted):
        known = ", ".join(names)
        print(f"sanitize_driver: unknown case in {wanted}; known: {known}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sanitize_driver: no CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(8)
    t0 = time.time()
    try:
        specs = dict(CASES)
        good = None
        for name in cases:
            t = time.time()
            if name in specs:
                detail = run_case(name, specs[name], gen)
            else:
                # the planner's own warpgroups, whatever the cases before set
                os.environ.pop("KDA_DHU_SM90_NWG", None)
                os.environ.pop("KDA_DHU_SM90_SPLIT", None)
                good = good or good_batch(gen)
                detail = run_bad_case(name[len("bad_") :], *good)
            print(f"case {name}: OK ({detail}; {time.time() - t:.1f} s)", flush=True)
    except Exception:  # noqa: BLE001 - report and exit with the driver's own code
        traceback.print_exc()
        print("sanitize_driver: FAILED", flush=True)
        return 3
    print(f"sanitize_driver: {len(cases)} cases OK in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
