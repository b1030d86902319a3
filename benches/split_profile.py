"""Where a split call's time goes (GPU machine): per-kernel GPU times of the sequence
split's three launches (first pass, merge, second pass; src/split.rs) and of the unsplit
kernel, for one-long-sequence shapes and forced segment counts.

    python3 benches/split_profile.py [--heads 16,8] [--T 65536] [--segments off,on,3,4,5] [--reps 10]

Each (heads, segments) runs --reps calls of the kernel path back to back (fla is not
imported) under torch.profiler; prints each kernel's median duration in microseconds and
the sum per call. CUPTI sees the driver-API launches, as in tests/gpu/test_gpu_kernel.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv=None) -> int:
    os.environ.setdefault("KDA_DHU_NO_AUTOREGISTER", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="16,8")
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--segments", default="off,on,3,4")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("split_profile: no CUDA device", file=sys.stderr)
        return 2
    from kda_dhu import _measure
    from kda_dhu.testing import run_kernel
    from torch.profiler import ProfilerActivity, profile

    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  kda_dhu {os.environ.get('KDA_DHU_COMMIT', '?')}"
    )
    for h in (int(x) for x in args.heads.split(",")):
        a = _measure.make_inputs(1, args.T, h, h, 128, 128, torch.bfloat16, "gk")
        for seg in args.segments.split(","):
            os.environ["KDA_DHU_SM90_SPLIT"] = seg
            for _ in range(3):
                run_kernel(a)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    run_kernel(a)
                torch.cuda.synchronize()
            times: dict = {}
            for e in prof.events():
                if e.name.startswith("kda_dhu_") and e.device_type.name == "CUDA":
                    times.setdefault(e.name, []).append(e.device_time)
            parts = {n: statistics.median(v) for n, v in times.items()}
            line = ", ".join(f"{n.replace('kda_dhu_sm90_', '')} {t:.1f}" for n, t in parts.items())
            print(
                f"B1 T{args.T} H{h} split={seg}: {sum(parts.values()):.1f} us per call ({line})", flush=True
            )
    os.environ.pop("KDA_DHU_SM90_SPLIT", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
