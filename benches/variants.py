"""Kernel variants side by side on the H200: sm_90a with one or two consumer warpgroups
per CTA (KDA_DHU_SM90_NWG = 1 / 2), fla in the same run, on bench.SHAPES plus extra rows.

The measurement behind the planner's policy (src/plan.rs: `warpgroups`, the K = 64 and
GVA clauses). Times the kernel directly (kda_dhu._dispatch._run_kernel, past the
planner's policy), so a variant the planner would not pick is still timed.

    python3 benches/variants.py [--out DIR] [--shapes name,name]
Writes DIR/variants.json and prints a markdown table.

    python3 benches/variants.py --kernels [--nwg 1|2] [--out DIR] [--shapes name,name]
The two sm_90a kernels instead (KDA_DHU_SM90_VARIANT = smem / regstate: the default
kernel and the register-state one, cuda/dhu_sm90_regstate.cuh), each with the planner's
warpgroups (or --nwg), timed interleaved in 5 rounds so that a drift of the machine falls
on both; fla in the same run. Writes DIR/kernels.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

EXTRA = [
    # name, B, T, H, HV, K, V, gate, varlen
    ("b16_t4096_h32", 16, 4096, 32, 32, 128, 128, "gk", None),
    ("b2_t8192_h32", 2, 8192, 32, 32, 128, 128, "gk", None),
    ("gdn_b8_t4096_h16_hv32_g", 8, 4096, 16, 32, 128, 128, "g", None),
    ("k64_b16_t4096_h32", 16, 4096, 32, 32, 64, 128, "gk", None),
    ("k64_b4_t8192_h16", 4, 8192, 16, 16, 64, 128, "gk", None),
    ("varlen_t32768_h32_avg1k", 1, 32768, 32, 32, 128, 128, "gk", "avg1k"),
]


def main(argv=None) -> int:
    from kda_dhu import _dispatch, bench
    from kda_dhu.reference import rel_err
    from kda_dhu.testing import run_kernel

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--all", action="store_true", help="every row (the default)")
    ap.add_argument("--kernels", action="store_true", help="the default vs the register-state sm_90a kernel")
    ap.add_argument("--nwg", choices=("1", "2"), default=None, help="with --kernels: force the warpgroups")
    args = ap.parse_args(argv)
    rows = bench.SHAPES + EXTRA
    if args.shapes:
        want = args.shapes.split(",")
        rows = [r for r in rows if r[0] in want]
    bw = bench.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s", flush=True)
    if args.kernels:
        return compare_kernels(rows, bw, args.nwg, args.out)
    results = []
    print("| shape | fla ms | wg1 ms | wg2 ms | fla/floor | wg1/floor | wg2/floor | best vs fla |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        name, B, T, H, HV, K, V, gate, varlen = r
        a, lengths = bench.row_inputs(r)
        fla_fn = _dispatch.fla_function()
        fla_out = fla_fn(**a)

        kernel = functools.partial(run_kernel, a)

        row = {
            "shape": name,
            "B": B,
            "T": T,
            "H": H,
            "HV": HV,
            "K": K,
            "V": V,
            "gate": gate,
            "varlen": lengths is not None,
        }
        NT_total = fla_out[0].shape[1]
        N = B if lengths is None else len(lengths)
        floor_ms = bench.floor_bytes(B, T, H, HV, K, V, NT_total, N, gate=gate) / (bw * 1e9) * 1e3
        row["floor_ms"] = floor_ms
        row["fla_ms"] = bench.time_ms(functools.partial(fla_fn, **a))
        for nwg in ("1", "2"):
            os.environ["KDA_DHU_SM90_NWG"] = nwg
            out = kernel()
            torch.cuda.synchronize()
            row[f"err_vs_fla_wg{nwg}"] = max(rel_err(o, f) for o, f in zip(out, fla_out) if o is not None)
            row[f"wg{nwg}_ms"] = bench.time_ms(kernel)
            del out
        os.environ.pop("KDA_DHU_SM90_NWG", None)
        best = min(row["wg1_ms"], row["wg2_ms"])
        print(
            f"| {name} | {row['fla_ms']:.3f} | {row['wg1_ms']:.3f} | {row['wg2_ms']:.3f} | "
            f"{row['fla_ms'] / floor_ms:.2f} | {row['wg1_ms'] / floor_ms:.2f} | "
            f"{row['wg2_ms'] / floor_ms:.2f} | {row['fla_ms'] / best:.2f}x |",
            flush=True,
        )
        results.append(row)
        a = fla_out = None
        torch.cuda.empty_cache()
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": bench.git_commit(),
        "copy_bandwidth_GBs": bw,
        "rows": results,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "variants.json"), "w") as f:
            json.dump(record, f, indent=1)
    return 0


def compare_kernels(rows, bw, nwg, out_dir) -> int:
    """The default sm_90a kernel against the register-state one on `rows`, in one process."""
    from kda_dhu import _core, _dispatch, bench
    from kda_dhu.reference import rel_err
    from kda_dhu.testing import run_kernel

    var = "KDA_DHU_SM90_VARIANT"
    if nwg is None:
        os.environ.pop("KDA_DHU_SM90_NWG", None)
    else:
        os.environ["KDA_DHU_SM90_NWG"] = nwg

    def on(variant, a):
        os.environ[var] = variant
        return run_kernel(a)

    results = []
    print(f"warpgroups: {nwg or 'by the planner'}; switches: {_core.switches()}")
    print(
        "| shape | fla ms | smem ms | regstate ms | smem/floor | regstate/floor | regstate vs smem | regstate vs fla |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        name, B, T, H, HV, K, V, gate, varlen = r
        a, lengths = bench.row_inputs(r)
        fla_fn = _dispatch.fla_function()
        fla_out = fla_fn(**a)
        NT_total = fla_out[0].shape[1]
        N = B if lengths is None else len(lengths)
        floor_ms = bench.floor_bytes(B, T, H, HV, K, V, NT_total, N, gate=gate) / (bw * 1e9) * 1e3
        row = {"shape": name, "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "gate": gate}
        row["varlen"] = lengths is not None
        row["floor_ms"] = floor_ms
        row["fla_ms"] = bench.time_ms(functools.partial(fla_fn, **a))
        for v in ("smem", "regstate"):
            out = on(v, a)
            torch.cuda.synchronize()
            row[f"err_vs_fla_{v}"] = max(rel_err(o, f) for o, f in zip(out, fla_out) if o is not None)
            del out
        smem_ms, rs_ms, smem_late = bench.time_interleaved(
            functools.partial(on, "smem", a), functools.partial(on, "regstate", a)
        )
        row.update(smem_ms=smem_ms, regstate_ms=rs_ms, smem_ms_late_rounds=smem_late)
        print(
            f"| {name} | {row['fla_ms']:.3f} | {smem_ms:.3f} | {rs_ms:.3f} | {smem_ms / floor_ms:.2f} | "
            f"{rs_ms / floor_ms:.2f} | {smem_ms / rs_ms:.2f}x | {row['fla_ms'] / rs_ms:.2f}x |",
            flush=True,
        )
        results.append(row)
        a = fla_out = None
        torch.cuda.empty_cache()
    os.environ.pop(var, None)
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": bench.git_commit(),
        "copy_bandwidth_GBs": bw,
        "nwg": nwg,
        "rows": results,
    }
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "kernels.json"), "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
