"""Host overhead of one kda-dhu call (issue #7): microseconds of CPU time per step.

    python benches/host_overhead.py            # CPU steps; the GPU steps too where CUDA is
    python benches/host_overhead.py --n 20000  # iterations per timing

The shape is the smallest the kernel covers under the "extended" rule (B=1, T=64,
H=HV=1, K=128, V=64, bf16, gk gate, h0 and dht): the kernel itself is a few
microseconds, so an eager call's cost is the host's.

CPU steps (any machine; the tensors are CPU tensors, so the planner stops at its last
check, the device, and raises there):
  validate          _core.validate: 8 tensors read through DLPack + every check but the device
  prepare->device   _core.prepare up to the device check (the same, plus planning's entry)
  force             _dispatch._force(): KDA_DHU_FORCE read and parsed (unset)
  public->device    kda_dhu.chunk_gated_delta_rule_bwd_dhu up to the device check
GPU steps (CUDA tensors; launches are asynchronous, synchronized outside the timing):
  prepare           _core.prepare: read, validate, plan
  launch(prepared)  PreparedCall.launch: outputs read and checked, descriptors from the
                    cache (addresses replaced), cuLaunchKernel
  launch(stateless) _core.launch: everything read and checked again
  run               _core.run: read, validate, plan, allocate and launch in one call (the
                    eager entry points' path without cu_seqlens)
  eager call        kda_dhu.chunk_gated_delta_rule_bwd_dhu, outputs allocated included
  ..., queued       the same with the GPU kept busy (a sleep kernel ahead of each batch):
                    host time alone, not the kernel's time nor a full launch queue

Each figure is the best of 5 repeats of the mean over ``--n`` calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import timeit
import warnings

import torch

SHAPE = dict(B=1, T=64, H=1, HV=1, K=128, V=64)


def _inputs(device: str) -> dict:
    from kda_dhu.testing import make_inputs

    s = SHAPE
    return make_inputs(
        s["B"],
        s["T"],
        s["H"],
        s["HV"],
        s["K"],
        s["V"],
        torch.bfloat16,
        "gk",
        device=device,
        generator=torch.Generator().manual_seed(0),
    )


def _time(fn, n: int, sync=None) -> float:
    """Microseconds per call: best of 5 repeats of n calls (host clock)."""

    def run():
        for _ in range(n):
            fn()
        if sync is not None:
            sync()

    best = min(timeit.repeat(run, number=1, repeat=5))
    return best / n * 1e6


def _time_queued(fn, n: int) -> float:
    """Host microseconds per call with the GPU kept busy: each batch of at most 200 calls
    is issued behind a sleep kernel longer than the batch, so that neither the kernel's
    own time nor a full launch queue enters the host clock (best of 5 x n calls)."""
    batch = min(n, 200)
    best = float("inf")
    for _ in range(5):
        total = 0.0
        for _ in range(max(1, n // batch)):
            torch.cuda._sleep(batch * 200_000)  # ~100 us of GPU time per call at ~2 GHz
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
        best = min(best, total / (max(1, n // batch) * batch))
    return best * 1e6


def _raises(fn):
    def call():
        try:
            fn()
        except ValueError:
            pass

    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10000, help="calls per timing (default 10000)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.pop("KDA_DHU_FORCE", None)

    import kda_dhu
    from kda_dhu import _core, _dispatch

    rows = []
    kw = _inputs("cpu")
    rows.append(("validate", _time(lambda: _core.validate(**kw), args.n)))
    prepare = getattr(_core, "prepare", _core.plan)  # _core.plan before issue #7
    rows.append(("prepare->device", _time(_raises(lambda: prepare("extended", **kw)), args.n)))
    rows.append(("force", _time(_dispatch._force, args.n)))
    rows.append(
        ("public->device", _time(_raises(lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)), args.n))
    )

    if torch.cuda.is_available():
        kw = _inputs("cuda")
        ok, reason = kda_dhu.plan_call(**kw)
        if not ok:
            print(f"the plan sends the benchmark shape to fla: {reason}", file=sys.stderr)
            return 1
        sync = torch.cuda.synchronize
        pos = [kw[n] for n in ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht")]
        scale, stream = kw["scale"], torch.cuda.current_stream().cuda_stream
        _, _, call = _core.prepare("extended", *pos, scale)
        q, dv, h0 = kw["q"], kw["dv"], kw["h0"]
        NT = (SHAPE["T"] + 63) // 64
        dh = torch.empty(1, NT, SHAPE["HV"], SHAPE["K"], SHAPE["V"], dtype=q.dtype, device=q.device)
        dh0 = torch.empty_like(h0)
        dv2 = torch.empty_like(dv)
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)  # module load, descriptor cache miss
        sync()
        rows.append(("prepare", _time(lambda: _core.prepare("extended", *pos, scale), args.n)))
        rows.append(("run (one crossing)", _time_queued(lambda: _core.run("extended", *pos, scale), args.n)))
        rows.append(
            ("launch(prepared)", _time(lambda: call.launch(dh, dh0, dv2, None, stream), args.n, sync))
        )
        rows.append(
            (
                "launch(stateless)",
                _time(
                    lambda: _core.launch(*pos, scale, False, None, 64, None, dh, dh0, dv2, stream),
                    args.n,
                    sync,
                ),
            )
        )
        rows.append(("eager call", _time(lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw), args.n, sync)))
        rows.append(
            ("eager call, queued", _time_queued(lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw), args.n))
        )
        rows.append(
            (
                "launch(prepared), queued",
                _time_queued(lambda: call.launch(dh, dh0, dv2, None, stream), args.n),
            )
        )
        rows.append(
            (
                "(torch.empty x3)",
                _time(lambda: (torch.empty_like(dh), torch.empty_like(dh0), torch.empty_like(dv2)), args.n),
            )
        )
        info = _core.tma_cache_info()
        device = torch.cuda.get_device_name()
    else:
        info = None
        device = "no CUDA device: CPU steps only"

    s = SHAPE
    print(
        f"host overhead, B={s['B']} T={s['T']} H={s['H']} HV={s['HV']} K={s['K']} V={s['V']} "
        f"bf16 gk ({device}; torch {torch.__version__})"
    )
    for name, us in rows:
        print(f"  {name:<20} {us:8.2f} us")
    if info is not None:
        print(f"  TMA descriptor cache: {info}")
    print(f"  DLPack intake: {_core.dlpack_intake()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
