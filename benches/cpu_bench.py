"""The op on the CPU (the Rust core's ``cpu_bwd_dhu``): wall time per call, both modes.

    python benches/cpu_bench.py                       # prints the table
    python benches/cpu_bench.py --out benches/results # and writes <date>-cpu-<commit>.json

The target shape is B2 T4096 H8 K = V = 128 bf16 (gk gate, h0 and dht), which must run in
under 5 s in float64 mode on the project's 2-core CPU machine; the other rows show the
variants' costs (g gate, no gate, a packed batch, GVA, K = 64, state_v_first).

Each figure is the best and the median of ``--reps`` timed calls (torch CPU tensors in,
torch tensors out, outputs allocated in the call), after one untimed call. Threads: rayon's
default, one per core (``RAYON_NUM_THREADS`` overrides). The record keeps the load average
before and after: other work on the machine shows there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

# benches/ on the path: bench.py's record tools (git_commit, write_record), also where
# this file is loaded by path (the tests).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

TARGET_S = 5.0
TARGET = "b2_t4096_h8_k128_v128"

# name, B, T, H, HV, K, V, gate, varlen lengths or None, state_v_first
SHAPES = [
    (TARGET, 2, 4096, 8, 8, 128, 128, "gk", None, False),
    ("g_b2_t4096_h8", 2, 4096, 8, 8, 128, 128, "g", None, False),
    ("nogate_b2_t4096_h8", 2, 4096, 8, 8, 128, 128, None, None, False),
    (
        "varlen_t8192_h8_8seqs",
        1,
        None,
        8,
        8,
        128,
        128,
        "gk",
        [1500, 700, 1300, 64, 2000, 900, 1, 1727],
        False,
    ),
    ("gva_b1_t4096_h4_hv16", 1, 4096, 4, 16, 128, 128, "gk", None, False),
    ("k64_b2_t4096_h8", 2, 4096, 8, 8, 64, 128, "gk", None, False),
    ("svf_b2_t4096_h8", 2, 4096, 8, 8, 128, 128, "gk", None, True),
]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run(shapes, modes, reps: int) -> list:
    from kda_dhu._cpu import chunk_gated_delta_rule_bwd_dhu_cpu
    from kda_dhu.testing import make_inputs

    rows = []
    for name, B, T, H, HV, K, V, gate, lengths, svf in shapes:
        args = make_inputs(
            B,
            T,
            H,
            HV,
            K,
            V,
            torch.bfloat16,
            gate,
            varlen_lengths=lengths,
            state_v_first=svf,
            generator=torch.Generator().manual_seed(0),
        )
        row = dict(name=name, B=B, T=args["q"].shape[1], H=H, HV=HV, K=K, V=V, gate=gate, state_v_first=svf)
        if lengths:
            row["lengths"] = lengths
        for mode in modes:
            chunk_gated_delta_rule_bwd_dhu_cpu(**args, mode=mode)  # untimed first call
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                chunk_gated_delta_rule_bwd_dhu_cpu(**args, mode=mode)
                times.append(time.perf_counter() - t0)
            row[mode] = dict(best_s=min(times), median_s=statistics.median(times), times_s=times)
        rows.append(row)
        cells = "  ".join(f"{m} {row[m]['best_s']:.3f} s (median {row[m]['median_s']:.3f})" for m in modes)
        print(f"{name:26s} {cells}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for the JSON record")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target-only", action="store_true", help=f"only {TARGET}")
    args = ap.parse_args(argv)

    import kda_dhu
    import numpy
    from bench import git_commit

    shapes = SHAPES[:1] if args.target_only else SHAPES
    modes = ("float64", "fla")
    load_before = _load()
    rows = run(shapes, modes, args.reps)
    target = next(r for r in rows if r["name"] == TARGET)
    ok = target["float64"]["best_s"] < TARGET_S
    record = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        machine=dict(cpu=_cpu_model(), arch=platform.machine(), cores=os.cpu_count(), os=platform.platform()),
        threads=int(os.environ.get("RAYON_NUM_THREADS", "0")) or os.cpu_count(),
        versions=dict(
            python=platform.python_version(),
            torch=torch.__version__,
            numpy=numpy.__version__,
            kda_dhu=kda_dhu.__version__,
        ),
        load_average=dict(before=load_before, after=_load()),
        reps=args.reps,
        dtype="bfloat16",
        target=dict(
            shape=TARGET, mode="float64", limit_s=TARGET_S, best_s=target["float64"]["best_s"], ok=ok
        ),
        rows=rows,
        command=" ".join(["python", "benches/cpu_bench.py", *(argv if argv is not None else sys.argv[1:])]),
    )
    print(
        f"target {TARGET} float64: {target['float64']['best_s']:.3f} s (limit {TARGET_S} s): {'ok' if ok else 'FAILED'}"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{record['date'][:10]}-cpu-{record['commit']}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
