"""The main job: ``python -m kda_dhu``.

On a CUDA GPU: stage 4 on a real training shape (default prod8192: B16 T8192 H32
K=V=128 bf16, KDA's gk path) through ``kda_dhu_b2a``, against fla's own function in the
same run: both times (median of CUDA events), the bandwidth floor, and the error of
each against the float64 reference (computed on the GPU, on a random sample of 16
(batch, head) pairs; --full-reference for all) and of one against the other. A line
with the seconds since the start comes before each step.

Without one: says so, and checks the float64 reference on the CPU against an
independent per-token loop on small random problems of every variant.

--doctor: what this machine gives kda-dhu (versions, driver, GPUs, fla's registry,
the routes of the README's shapes), section by section; --doctor --verbose adds the
build log (compilers, flags, registers per kernel entry point).
"""

from __future__ import annotations

import argparse
import sys


def _cpu_check() -> int:
    import torch

    from .reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
    from .testing import make_inputs, naive_bwd_dhu

    gen = torch.Generator().manual_seed(0)
    cases = [
        ("kda gk, B2 T130 H2 K=V=32", dict(B=2, T=130, H=2, HV=2, K=32, V=32, gate="gk")),
        ("gdn g, GVA H1 HV2, tail", dict(B=1, T=100, H=1, HV=2, K=16, V=32, gate="g")),
        (
            "delta rule, varlen 1/63/65",
            dict(B=1, T=None, H=2, HV=2, K=16, V=16, gate=None, varlen_lengths=[1, 63, 65]),
        ),
    ]
    worst = 0.0
    for name, kw in cases:
        inp = make_inputs(dtype=torch.bfloat16, generator=gen, **kw)
        ref = chunk_gated_delta_rule_bwd_dhu_ref(**inp)
        loop = naive_bwd_dhu(**inp, round_dtype=torch.bfloat16)
        errs = {n: rel_err(a, b) for n, a, b in zip(("dh", "dh0", "dv2"), ref, loop)}
        worst = max(worst, *errs.values())
        print(
            f"  {name:<30} reference vs per-token loop: " + "  ".join(f"{n} {e:.1e}" for n, e in errs.items())
        )
    ok = worst < 1e-10
    print(f"CPU reference check: {'passed' if ok else 'FAILED'} (worst relative difference {worst:.1e})")
    return 0 if ok else 1


def main(argv=None) -> int:
    from ._measure import SHAPES  # the shape table only: no torch yet

    ap = argparse.ArgumentParser(
        prog="python -m kda_dhu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shape",
        default="prod8192",
        choices=[r[0] for r in SHAPES],
        metavar="SHAPE",
        help="the shape to run on a GPU (default prod8192), one of: " + ", ".join(r[0] for r in SHAPES),
    )
    ap.add_argument(
        "--doctor",
        action="store_true",
        help="print versions, driver, GPUs, fla's backend registry and the README shapes' routes, and exit",
    )
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="with --doctor: also the build log (compiler paths, flags, registers per kernel entry point)",
    )
    ap.add_argument(
        "--full-reference",
        action="store_true",
        help="check the float64 reference on every (batch, head) pair, not on a sample of 16",
    )
    args = ap.parse_args(argv)
    if args.verbose and not args.doctor:
        ap.error("--verbose goes with --doctor")
    if args.doctor:
        from . import doctor

        return doctor.main(verbose=args.verbose)

    import time

    t0 = time.monotonic()

    def step(line: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f} s] {line}", flush=True)

    step("importing torch")
    import torch

    import kda_dhu

    usable, msg = kda_dhu.cuda_status()
    if not torch.cuda.is_available() or not usable:
        print(
            f"kda_dhu: no CUDA GPU here ({msg}); the kernel needs an sm_90 (Hopper) or sm_100 "
            "(Blackwell) GPU."
        )
        print("Running the CPU check of the float64 reference instead:")
        return _cpu_check()

    from . import _measure as bench

    rows = [r for r in SHAPES if r[0] == args.shape]
    step("importing fla (fla.ops imports every op, and torch's compiler: seconds)")
    import fla
    import fla.ops  # noqa: F401 - imported here, where the line above says so

    step("measuring the copy bandwidth")
    bw = bench.copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  fla {fla.__version__}  "
        f"kda_dhu {kda_dhu.__version__}  copy bandwidth {bw:.0f} GB/s",
        flush=True,
    )
    r = bench.run_shape(
        rows[0], bw, entry="b2a", progress=step, ref_pairs=None if args.full_reference else 16
    )
    step("done")
    print(
        f"{r['shape']}: B={r['B']} T={r['T']} H={r['H']} HV={r['HV']} K={r['K']} V={r['V']} bf16 "
        f"({r['path']})"
    )
    print(
        f"  kda_dhu {r['kda_dhu_ms']:.3f} ms ({r['over_floor']:.2f}x floor)   fla {r['fla_ms']:.3f} ms "
        f"({r['fla_over_floor']:.2f}x floor)   speed-up {r['speedup_vs_fla']:.2f}x"
    )
    for who, errs in (("kda_dhu", r["rel_err"]), ("fla", r["fla_rel_err"])):
        if errs:
            print(f"  {who:<8} error vs {r['ref']}: " + "  ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    print("  kda_dhu vs fla: " + "  ".join(f"{k} {v:.2e}" for k, v in r["vs_fla"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
