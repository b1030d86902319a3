"""Where a chunk's cycles go: the sections of the register-state kernel's chunk loop, in SM
clock cycles per chunk, from a build with the KDA_DHU_EXP_STAMPS probe
(cuda/dhu_sm90_regstate.cuh). Warp 0 of CTA (0, 0, 0) reads the clock at ten points of each
chunk (sixteen at KDA_DHU_EXP_STAMPS=2), lane k keeping section k's sum, and writes the sums
and the chunk count over the output dh's (forward scan: h's) first 34 bf16 elements; this
script calls the op, reads them back and prints each section's mean per chunk, the median
over --reps calls.

    KDA_DHU_SM90_SPLIT=off python3 benches/chain_stamps.py --B 1 --H 8 --chunks 256
    KDA_DHU_SM90_SPLIT=off python3 benches/chain_stamps.py --op fwd_h --gate none

The sections, in a chunk's order (each ends at the named point of the loop; ORDER below):
pack (the state packed to bf16; level 2), dv_issue (DV issued), store_wait (the leader's wait
for the previous bulk stores' reads and the barrier; level 2), stage_dh, stage_dv2,
fence_sync (the async-proxy fence and the barrier; level 2), stores (the bulk stores issued;
at level 1 the whole staging), qd_issue (QD issued, dv's tile read to registers), dv_wait (DV
complete), epilogue (dv2), qd_wait (QD complete), fold, wd_issue, next_stage (the next stage's
full barrier, do rows weighted with g; dv2 staged and stored here where it is not deferred),
wd_wait (WD complete), hand_back (the stage's empty barrier; level 2). A build without the
probe leaves dh as computed: the script says so (exit status 1). The probe's own clock reads
cost cycles too (~10 % at level 2 on an H100): compare the GPU time it prints with the plain
build's time per chunk (benches/chunk_sweep.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chunk_sweep import add_call_args, call_of  # noqa: E402

# Section k ends at the probe's point k; listed in the order a chunk runs them. Points 10-15
# exist at KDA_DHU_EXP_STAMPS=2 only (at level 1 their cycles fall in the next point's section:
# pack and hand_back in dv_issue, the staging's four in stores).
N_STAMPS = 16
ORDER = (
    (10, "pack"),
    (0, "dv_issue"),
    (11, "store_wait"),
    (12, "stage_dh"),
    (13, "stage_dv2"),
    (14, "fence_sync"),
    (1, "stores"),
    (2, "qd_issue"),
    (3, "dv_wait"),
    (4, "epilogue"),
    (5, "qd_wait"),
    (6, "fold"),
    (7, "wd_issue"),
    (8, "next_stage"),
    (9, "wd_wait"),
    (15, "hand_back"),
)


def sections(words):
    """The probe's words (dh's first N_STAMPS + 1 int32: the sums, then the chunk count) as
    (chunks, {name: mean cycles per chunk}) in ORDER, with "total"; a level-1 build's zero
    sections left out. Raises ValueError when the count is not positive (not a probe build)."""
    sums, nc = [w & 0xFFFFFFFF for w in words[:N_STAMPS]], words[N_STAMPS]
    if nc <= 0:
        raise ValueError(f"chunk count {nc}")
    out = {name: sums[k] / nc for k, name in ORDER if sums[k] or k < 10}
    out["total"] = sum(sums) / nc
    return nc, out


def main(argv=None) -> int:
    os.environ.setdefault("KDA_DHU_NO_AUTOREGISTER", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(ap, B=1, H=8)
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.reps < 1:
        ap.error("--chunks and --reps must be >= 1")

    import torch

    if not torch.cuda.is_available():
        print("chain_stamps: no CUDA device", file=sys.stderr)
        return 2
    from kda_dhu import _measure as m

    fn = call_of(args, args.chunks * m.BT)
    per = {}
    for _ in range(args.reps + 2):
        out = fn()
        torch.cuda.synchronize()
        words = out[0].reshape(-1)[: 2 * (N_STAMPS + 1)].contiguous().view(torch.int32).cpu().tolist()
        try:
            nc, sec = sections(words)
        except ValueError:
            nc, sec = None, None
        if nc != args.chunks:
            print(
                f"chain_stamps: dh's words say {nc} chunks, not {args.chunks}: not a KDA_DHU_EXP_STAMPS build"
            )
            return 1
        for k, v in sec.items():
            per.setdefault(k, []).append(v)
    ms = m.time_ms(fn, reps=args.reps)
    med = {k: statistics.median(v[2:]) for k, v in per.items()}
    print(
        f"{torch.cuda.get_device_name()}: {args.op} B{args.B} H{args.H} K{args.K} V{args.V} {args.gate}, "
        f"{args.chunks} chunks, warpgroups {os.environ.get('KDA_DHU_SM90_NWG', 'auto')}: cycles per chunk (median of {args.reps}):"
    )
    print("  " + "  ".join(f"{k} {v:.0f}" for k, v in med.items()))
    print(f"  GPU time {ms * 1e3:.1f} us, {ms * 1e6 / args.chunks:.0f} ns per chunk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
