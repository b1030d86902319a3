"""A kernel's GPU time against the chunks per sequence at a fixed grid: the fixed cost of a
call (launch, prologue, the ring's first loads, the epilogue) and the time per chunk, as the
intercept and slope of a least-squares line.

    python3 benches/chunk_sweep.py                       # stage 4, B8 H4 K = V = 128, gk (the tail row's grid)
    python3 benches/chunk_sweep.py --op fwd_h --chunks 1,2,4,8,17.125,32
    python3 benches/chunk_sweep.py --no-states --out results/sweep.json

``--chunks`` lists sequence lengths in chunks of 64 tokens (a fraction makes the newest chunk
short: 17.125 = 1096 tokens, the tail row); one length times it without a line (for a
profiler's run). Each length is timed as ``bench.py`` times a row
(``_measure.time_ms``: each call queued behind a short sleep kernel, so the events time the
GPU's work, not the host's), kernel route only (fla is not called). A one-element fill is
timed the same way as the events' own floor. ``--no-states``: stage 4 without h0 / dht
(the forward scan without an initial state and final state), to see what the state's
read and write cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def fit(xs, ys):
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def add_call_args(ap, B: int, H: int) -> None:
    """The options that choose the call: the scan, the grid's batch and heads, K, V, the gate."""
    ap.add_argument("--op", choices=("dhu", "fwd_h"), default="dhu")
    ap.add_argument("--B", type=int, default=B)
    ap.add_argument("--H", type=int, default=H)
    ap.add_argument("--HV", type=int, default=None, help="value heads (default H)")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--gate", choices=("gk", "g", "none"), default="gk")


def call_of(args, T: int, no_states: bool = False):
    """The kernel route's call (a function of no arguments) for add_call_args's options and a
    sequence of T tokens, on the benchmark's inputs (kda_dhu._measure); no_states: stage 4
    without h0 / dht, the forward scan without initial and final state."""
    import kda_dhu
    from kda_dhu import _measure as m
    from kda_dhu._forward import chunk_gated_delta_rule_fwd_h

    gate = None if args.gate == "none" else args.gate
    row = (f"sweep_t{T}", args.B, T, args.H, args.HV or args.H, args.K, args.V, gate, None)
    if args.op == "dhu":
        a, _ = m.row_inputs(row)
        if no_states:
            a["h0"] = a["dht"] = None
        return lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    a, _ = m.fwd_h_row_args(row)
    if no_states:
        a["initial_state"] = None
        a["output_final_state"] = False
    return lambda: chunk_gated_delta_rule_fwd_h(**a)


def main(argv=None) -> int:
    os.environ.setdefault("KDA_DHU_NO_AUTOREGISTER", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(ap, B=8, H=4)
    ap.add_argument("--chunks", default="1,2,4,8,17.125,32,64")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--no-states", action="store_true")
    ap.add_argument("--out", default=None, help="a JSON file for the table")
    args = ap.parse_args(argv)
    try:
        lens = [float(c) for c in args.chunks.split(",")]
    except ValueError:
        ap.error(f"--chunks: {args.chunks!r} is not a comma-separated list of numbers")
    if not lens or any(c <= 0 for c in lens):
        ap.error("--chunks: the lengths must be positive")
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    import torch

    if not torch.cuda.is_available():
        print("chunk_sweep: no CUDA device", file=sys.stderr)
        return 2
    import kda_dhu
    from kda_dhu import _core
    from kda_dhu import _measure as m

    HV = args.HV or args.H
    x = torch.zeros(1, device="cuda")
    base_ms = m.time_ms(lambda: x.fill_(1.0), reps=args.reps)
    rows = []
    for c in lens:
        T = int(round(c * m.BT))
        fn = call_of(args, T, args.no_states)
        before = _core.launch_count()
        fn()
        torch.cuda.synchronize()
        launches = _core.launch_count() - before
        ms = m.time_ms(fn, reps=args.reps)
        nc = (T + m.BT - 1) // m.BT
        rows.append(dict(T=T, chunks=nc, ms=ms, launches=launches))
        print(f"T {T:6d}  chunks {nc:5d}  {ms * 1e3:9.2f} us  launches {launches}", flush=True)
        del fn  # its inputs
    xs = [r["chunks"] for r in rows]
    ys = [r["ms"] * 1e3 for r in rows]
    gpu = torch.cuda.get_device_name()
    if len(set(xs)) < 2:  # one length (a profiler's run): no line
        print(f"{gpu}: one length, no line")
        return 0
    a0, b0 = fit(xs, ys)
    print(
        f"{gpu}: {args.op} B{args.B} H{args.H} HV{HV} K{args.K} V{args.V} {args.gate}"
        f"{' no states' if args.no_states else ''}: {a0:.2f} us + {b0:.3f} us per chunk"
        f" (events' floor, a one-element fill: {base_ms * 1e3:.2f} us)"
    )
    if args.out:
        rec = dict(
            gpu=gpu,
            torch=torch.__version__,
            kda_dhu=kda_dhu.__version__,
            op=args.op,
            B=args.B,
            H=args.H,
            HV=HV,
            K=args.K,
            V=args.V,
            gate=args.gate,
            no_states=args.no_states,
            rows=rows,
            intercept_us=a0,
            per_chunk_us=b0,
            events_floor_us=base_ms * 1e3,
        )
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
