"""The forward scan's kernel (``_core._fwd_h_probe``: the register-state kernel's FWD
instance on a stage-4 call carrying the forward call) against fla's
``chunk_gated_delta_rule_fwd_h`` on KDA shapes (gk, bf16, K = V = 128), same process,
fla's autotuning included (its first calls tune), with the bandwidth floor: the fewest
bytes (k, w, u and the last gk row of each chunk read, h and v_new written, the initial
and final states) over the device-to-device copy bandwidth of the same run.

    python3 benches/fwd_h_probe.py [--shapes b8_t4096_h32,b1_t65536_h32] [--nwg 1,2] [--out DIR]

With --nwg, the kernel is timed under each KDA_DHU_SM90_NWG value (per_nwg; kernel_ms is
the fastest of them).

A measurement of the kernel before the forward op has a host path of its own (issue
"The forward state scan"); writes DIR/fwd_h_probe.json. GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import sys

# name: B, T, H, HV
SHAPES = {
    "b8_t4096_h32": (8, 4096, 32, 32),
    "b16_t8192_h32": (16, 8192, 32, 32),
    "b1_t65536_h32": (1, 65536, 32, 32),
    "b1_t65536_h16": (1, 65536, 16, 16),
}
K = V = 128
BT = 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="b8_t4096_h32,b1_t65536_h32")
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--nwg",
        default="",
        help="comma-separated KDA_DHU_SM90_NWG values, each timed (default: the planner's)",
    )
    args = ap.parse_args(argv)
    import torch
    from fla.ops.common import chunk_delta_h
    from kda_dhu import _core
    from kda_dhu import _measure as m
    from kda_dhu.testing import make_inputs

    fla = inspect.unwrap(chunk_delta_h.chunk_gated_delta_rule_fwd_h)
    bw = m.copy_bandwidth()

    def measure(name: str) -> dict:
        B, T, H, HV = SHAPES[name]
        s4 = make_inputs(B, T, H, HV, K, V, torch.bfloat16, "gk", device="cuda")
        k, w, u, gk, h0 = s4["k"], s4["w"], s4["dv"], s4["gk"], s4["dht"]
        NT = -(-T // BT)
        h = torch.empty(B, NT, HV, K, V, dtype=k.dtype, device="cuda")
        v_new = torch.empty_like(u)
        final = torch.empty_like(h0)
        stream = torch.cuda.current_stream().cuda_stream

        def ours():
            _core._fwd_h_probe(k, k, w, u, u, None, gk, h0, h0, None, False, None, 64,
                               dh=h, dh0=final, dv2=v_new, stream=stream)  # fmt: skip

        def theirs():
            return fla(k=k, w=w, u=u, gk=gk, initial_state=h0, output_final_state=True)

        ref = theirs()
        ours()
        torch.cuda.synchronize()
        err = {
            n: float((a.double() - b.double()).norm() / b.double().norm())
            for n, a, b in (("h", h, ref[0]), ("v_new", v_new, ref[1]), ("final_state", final, ref[2]))
        }
        per_nwg = {}
        for n in [x for x in args.nwg.split(",") if x]:
            os.environ["KDA_DHU_SM90_NWG"] = n
            ours()
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for a, b in ((h, ref[0]), (v_new, ref[1]), (final, ref[2])))
            per_nwg[n] = dict(kernel_ms=m.time_ms(ours, warmup=5, reps=30), bit_equal_to_fla=same)
        t_ours = (
            min(x["kernel_ms"] for x in per_nwg.values()) if per_nwg else m.time_ms(ours, warmup=5, reps=30)
        )
        t_fla = m.time_ms(theirs, warmup=5, reps=30)
        nbytes = 2 * (k.numel() + w.numel() + u.numel() + h.numel() + v_new.numel())
        nbytes += 4 * (B * NT * HV * K) + 4 * 2 * h0.numel()
        floor = nbytes / (bw * 1e9) * 1e3
        return dict(shape=name, B=B, T=T, H=H, HV=HV, K=K, V=V, kernel_ms=t_ours, fla_ms=t_fla,
                    floor_ms=floor, over_floor=t_ours / floor, fla_over_floor=t_fla / floor,
                    speedup_vs_fla=t_fla / t_ours, rel_err_vs_fla=err, per_nwg=per_nwg)  # fmt: skip

    rows = []
    for name in args.shapes.split(","):
        rows.append(measure(name))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    record = {
        "what": "the forward scan's kernel (_core._fwd_h_probe) against fla's chunk_gated_delta_rule_fwd_h, "
        "gk, bf16, initial and final state, same process (benches/fwd_h_probe.py)",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "copy_bw_GBs": bw,
        "rows": rows,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fwd_h_probe.json"), "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
