"""Kernel-only driver for compute-sanitizer (run by scripts/sanitize.sh; GPU machine).

A handful of small calls covering the kernel's code paths: the envelope (K 64 / 128,
bf16), a dense tail, varlen with lengths [1, 63, 65, 7], a padded packed batch, GVA,
the g gate, no gate without states, and one fp16 call; two warpgroups and
state_v_first; then the register-state variant (``rs_`` cases,
KDA_DHU_SM90_VARIANT=regstate) over the same kinds of calls. Each case runs the kernel twice:
once directly with NaN-poisoned outputs (``kda_dhu.testing.run_kernel(args, poison=True)``),
once through the public entry point with ``KDA_DHU_FORCE=kernel``, and checks both
against the float64 reference (so a sanitizer run that "passes" on wrong results
does not). fla is never imported or called (``KDA_DHU_NO_AUTOREGISTER=1``): sanitizing
Triton is slow and not this project's code.

Prints one ``case <name>: ...`` line per case and ``sanitize_driver: N cases OK`` at the
end; exits 3 on a failed check (compute-sanitizer's own errors exit 1 under
``--error-exitcode 1``).

    python3 scripts/sanitize_driver.py [--cases name,name]
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

# name, make_inputs arguments (B, T, H, HV, K, V, dtype, gate, ...)
CASES = [
    ("envelope_k64_bf16", dict(B=2, T=128, H=2, HV=2, K=64, V=64, gate="gk")),
    ("envelope_k128_bf16", dict(B=2, T=128, H=2, HV=2, K=128, V=128, gate="gk")),
    ("dense_tail_t100", dict(B=2, T=100, H=2, HV=2, K=128, V=64, gate="gk")),
    ("varlen_1_63_65_7", dict(B=1, T=None, H=2, HV=2, K=128, V=64, gate="gk", varlen_lengths=[1, 63, 65, 7])),
    ("varlen_padded", dict(B=1, T=256, H=2, HV=2, K=64, V=64, gate="gk", varlen_lengths=[100, 30, 70])),
    ("gva_h1_hv4", dict(B=1, T=128, H=1, HV=4, K=128, V=64, gate="gk")),
    ("g_gate_tail_t130", dict(B=2, T=130, H=2, HV=2, K=128, V=64, gate="g")),
    ("no_gate_no_states", dict(B=1, T=150, H=1, HV=1, K=64, V=128, gate=None, dht=False, h0=False)),
    (
        "fp16_varlen_g",
        dict(B=1, T=None, H=1, HV=2, K=128, V=64, gate="g", varlen_lengths=[70, 5], dtype=torch.float16),
    ),
    # Two consumer warpgroups per CTA (KDA_DHU_SM90_NWG=2; V % 128 == 0).
    ("wg2_envelope_k128", dict(B=2, T=128, H=2, HV=2, K=128, V=128, gate="gk", nwg=2)),
    (
        "wg2_varlen_padded_g",
        dict(B=1, T=256, H=2, HV=2, K=64, V=128, gate="g", varlen_lengths=[100, 30, 70], nwg=2),
    ),
    ("wg2_gva_tail_v256", dict(B=1, T=130, H=1, HV=2, K=128, V=256, gate="gk", nwg=2)),
    (
        "svf_varlen_k128",
        dict(
            B=1, T=None, H=2, HV=2, K=128, V=64, gate="gk", state_v_first=True, varlen_lengths=[1, 63, 65, 7]
        ),
    ),
    ("svf_wg2_tail_g", dict(B=2, T=100, H=2, HV=2, K=64, V=128, gate="g", state_v_first=True, nwg=2)),
    # The register-state variant (KDA_DHU_SM90_VARIANT=regstate): its own barriers (the
    # dh / dv2 staging reuse, the do rows weighted in place with g), stmatrix / ldmatrix
    # and the short chunk of a packed batch.
    ("rs_envelope_k64", dict(B=2, T=128, H=2, HV=2, K=64, V=64, gate="gk", variant="regstate")),
    ("rs_envelope_k128", dict(B=2, T=192, H=2, HV=2, K=128, V=128, gate="gk", variant="regstate")),
    (
        "rs_varlen_1_63_65_7_g",
        dict(
            B=1, T=None, H=2, HV=2, K=128, V=64, gate="g", varlen_lengths=[1, 63, 65, 7], variant="regstate"
        ),
    ),
    (
        "rs_varlen_padded_none",
        dict(B=1, T=256, H=2, HV=2, K=64, V=64, gate=None, varlen_lengths=[100, 30, 70], variant="regstate"),
    ),
    ("rs_gva_tail_t130", dict(B=1, T=130, H=1, HV=4, K=128, V=64, gate="gk", variant="regstate")),
    (
        "rs_fp16_no_states",
        dict(
            B=1,
            T=150,
            H=1,
            HV=1,
            K=128,
            V=64,
            gate=None,
            dht=False,
            h0=False,
            dtype=torch.float16,
            variant="regstate",
        ),
    ),
    (
        "rs_wg2_varlen_padded_g",
        dict(
            B=1,
            T=256,
            H=2,
            HV=2,
            K=128,
            V=128,
            gate="g",
            varlen_lengths=[100, 30, 70],
            nwg=2,
            variant="regstate",
        ),
    ),
    (
        "rs_svf_varlen_k128",
        dict(
            B=1,
            T=None,
            H=2,
            HV=2,
            K=128,
            V=64,
            gate="gk",
            state_v_first=True,
            varlen_lengths=[1, 63, 65, 7],
            variant="regstate",
        ),
    ),
    (
        "rs_svf_wg2_tail_g_k64",
        dict(B=2, T=100, H=2, HV=2, K=64, V=128, gate="g", state_v_first=True, nwg=2, variant="regstate"),
    ),
]

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def run_case(name: str, spec: dict, gen: torch.Generator) -> str:
    import kda_dhu
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
    from kda_dhu.testing import make_inputs, run_kernel

    spec = dict(spec)
    dtype = spec.pop("dtype", torch.bfloat16)
    nwg = spec.pop("nwg", None)
    if nwg is None:
        os.environ.pop("KDA_DHU_SM90_NWG", None)
    else:
        os.environ["KDA_DHU_SM90_NWG"] = str(nwg)
    variant = spec.pop("variant", None)
    if variant is None:
        os.environ.pop("KDA_DHU_SM90_VARIANT", None)
    else:
        os.environ["KDA_DHU_SM90_VARIANT"] = variant
    a = make_inputs(dtype=dtype, device="cuda", generator=gen, **spec)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    wanted = [c for c in args.cases.split(",") if c]
    cases = [c for c in CASES if not wanted or c[0] in wanted]
    if wanted and len(cases) != len(wanted):
        known = ", ".join(c[0] for c in CASES)
        print(f"sanitize_driver: unknown case in {wanted}; known: {known}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sanitize_driver: no CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(8)
    t0 = time.time()
    try:
        for name, spec in cases:
            t = time.time()
            detail = run_case(name, spec, gen)
            print(f"case {name}: OK ({detail}; {time.time() - t:.1f} s)", flush=True)
    except Exception:  # noqa: BLE001 - report and exit with the driver's own code
        traceback.print_exc()
        print("sanitize_driver: FAILED", flush=True)
        return 3
    print(f"sanitize_driver: {len(cases)} cases OK in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
