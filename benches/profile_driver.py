"""One kernel launch per shape for Nsight Compute (scripts/device/profile.sh): the bench table's
inputs, the kernel path only, warm-up launches first so that the profiled launch
(ncu --launch-skip) is a steady-state one.

    python3 benches/profile_driver.py --shapes b4_t8192_h16,b8_t4096_h32 [--nwg 1|2] [--warmup 3]
    python3 benches/profile_driver.py --op fwd_h --shapes b1_t65536_h32   # the forward scan
    python3 benches/profile_driver.py --list      # the shape names (no GPU needed)

Each shape runs ``--warmup`` + 1 launches of kda-dhu's kernel (fla is not imported, so
no Triton kernel appears in the profile: a packed row carries its chunk tables, built by
kda_dhu.testing.chunk_tables, as fla's backward passes them); with --nwg the warpgroup
variant is forced (KDA_DHU_SM90_NWG). Prints one line per shape: the plan. With ``--op
fwd_h`` the launches are the forward scan's (``kda_dhu.chunk_gated_delta_rule_fwd_h`` on
the row's forward inputs, ``_measure.fwd_h_row_args``, as ``bench.py --op fwd_h`` times
them; KDA_DHU_FWD_H=on).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    os.environ.setdefault("KDA_DHU_NO_AUTOREGISTER", "1")
    from kda_dhu import _measure as bench

    names = [r[0] for r in bench.SHAPES]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes",
        default="b4_t8192_h16,b8_t4096_h32,prod8192",
        help="comma-separated names of the bench table (kda_dhu._measure.SHAPES)",
    )
    ap.add_argument("--nwg", choices=("1", "2"), default=None, help="force the warpgroups per CTA")
    ap.add_argument(
        "--op", choices=("dhu", "fwd_h"), default="dhu", help="stage 4 (default) or the forward scan"
    )
    ap.add_argument("--warmup", type=int, default=3, help="launches before the profiled one")
    ap.add_argument("--list", action="store_true", help="print the shape names and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(names))
        return 0
    want = args.shapes.split(",")
    unknown = [w for w in want if w not in names]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; one of: {', '.join(names)}")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")

    import torch

    if not torch.cuda.is_available():
        print("profile_driver: no CUDA device", file=sys.stderr)
        return 2
    if args.nwg:
        os.environ["KDA_DHU_SM90_NWG"] = args.nwg
    if args.op == "fwd_h":
        os.environ["KDA_DHU_FWD_H"] = "on"
        return _forward_launches(bench, want, args)
    from kda_dhu import _dispatch
    from kda_dhu.testing import chunk_tables, run_kernel

    for row in (r for r in bench.SHAPES if r[0] in want):
        name = row[0]
        a, lengths = bench.row_inputs(row)
        if lengths is not None:
            ci, co = chunk_tables(a["cu_seqlens"], a["q"].shape[1])
            a.update(chunk_indices=ci, chunk_offsets=co)
        try:
            for _ in range(args.warmup + 1):
                run_kernel(a)
        except RuntimeError as err:
            print(f"{name}: {err}", file=sys.stderr)
            return 1
        torch.cuda.synchronize()
        print(
            f"{name}: {args.warmup} + 1 launches, warpgroups "
            f"{os.environ.get('KDA_DHU_SM90_NWG', 'by the planner')}; "
            f"plan {_dispatch.plan_call(**a)}",
            flush=True,
        )
        del a
        torch.cuda.empty_cache()
    return 0


def _forward_launches(bench, want, args) -> int:
    """--op fwd_h: warm-up + 1 forward-scan launches per shape, each checked to be the
    kernel's (one launch per call), then a line per shape."""
    import torch
    from kda_dhu import _core
    from kda_dhu._forward import chunk_gated_delta_rule_fwd_h

    for row in (r for r in bench.SHAPES if r[0] in want):
        name = row[0]
        kw, _ = bench.fwd_h_row_args(row)
        before = _core.launch_count()
        for _ in range(args.warmup + 1):
            chunk_gated_delta_rule_fwd_h(**kw)
        torch.cuda.synchronize()
        launched = _core.launch_count() - before
        if launched != args.warmup + 1:
            print(
                f"{name}: {launched} kernel launches for {args.warmup + 1} calls (fla ran some)",
                file=sys.stderr,
            )
            return 1
        print(
            f"{name}: forward scan, {args.warmup} + 1 launches, warpgroups "
            f"{os.environ.get('KDA_DHU_SM90_NWG', 'by the planner')}",
            flush=True,
        )
        del kw
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
