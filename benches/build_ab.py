"""Two or more builds of kda-dhu on one GPU (an A/B across commits): each wheel installed
into a folder of its own, then one process per build and round, the builds alternating in
each round, each process timing stage 4 through the default route
(``kda_dhu.chunk_gated_delta_rule_bwd_dhu``) on bench rows; ``--op fwd_h`` the forward scan
(``kda_dhu.chunk_gated_delta_rule_fwd_h`` with KDA_DHU_FWD_H=on, on the rows' forward inputs,
``_measure.fwd_h_row_args``: builds from 472c10c on).

    python3 benches/build_ab.py --wheels old=DIR_OR_WHL new=DIR_OR_WHL [--shapes a,b] [--rounds 3] [--out DIR]
    python3 benches/build_ab.py --op fwd_h --wheels old=... new=... [--shapes b1_t65536_h32,b8_t4096_h32]
    python3 benches/build_ab.py --wheels old=x.whl new=y.whl --plan   # what would run; no GPU

Why: benches/variants.py compares the variants of one build (an environment switch). A
kernel change that adds a runtime switch can slow the switch's off path too, so the
variants' A/B says nothing about the build before the change. On 2026-12-03 FLAG_DV_INIT's
off path was ~9 % slower than the kernel before it: its own A/B (on 1.05-1.09x over off)
compared two paths of a slower kernel, and this A/B (the build before against the build
with the switch on) measured the change 1.04x slower (benches/NOTES.md).

Both wheels come from this machine's checkouts: `bash scripts/device/device_prepare.sh`
builds the current one into .carry/; an older commit's by `git worktree add /tmp/wt COMMIT`
and `CARGO_TARGET_DIR=/tmp/wt-target python -m maturin build --release --out
.carry/old` there. Each build's figure is the median of its processes (each the median of
--reps calls queued behind a sleep kernel, kda_dhu._measure.time_ms, from that build's own
kda_dhu). Writes DIR/build_ab.json (the GPU, versions, date, every process's times, the
medians, each build's ratio to the first) and prints the table.

Exit status: 0; 1 a process failed or timed out; 2 bad arguments or no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys

DEFAULT_SHAPES = "b1_t65536_h32,b1_t65536_h16,gva_b1_t11264_h16_hv32,b8_t1096_h4_tail,b8_t4096_h32"
CHILD_TIMEOUT_S = 120


def parse_wheels(items: list) -> list:
    """[(label, wheel path)] from LABEL=PATH items, PATH a .whl or a folder holding exactly
    one kda_dhu wheel. Raises ValueError naming the item that is wrong."""
    out = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label.isidentifier() or not path:
            raise ValueError(f"--wheels: {item!r} is not LABEL=PATH (LABEL a Python identifier)")
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "kda_dhu-*.whl")))
            if len(found) != 1:
                raise ValueError(f"--wheels: {path!r} holds {len(found)} kda_dhu wheels, expected one")
            path = found[0]
        elif not (path.endswith(".whl") and os.path.isfile(path)):
            raise ValueError(f"--wheels: {path!r} is neither a .whl file nor a folder with one")
        if label in [lab for lab, _ in out]:
            raise ValueError(f"--wheels: label {label!r} given twice")
        out.append((label, path))
    if len(out) < 2:
        raise ValueError("--wheels: expected at least two LABEL=PATH items")
    return out


def child(label: str, shapes: str, reps: int, op: str = "dhu") -> int:
    """One process of one build: the rows' GPU times (`op`: stage 4 or the forward scan) as
    one JSON line on stdout."""
    import kda_dhu
    import torch
    from kda_dhu import _measure as m

    rows = {r[0]: r for r in m.SHAPES}
    out = {
        "label": label,
        "op": op,
        "kda_dhu": os.path.dirname(kda_dhu.__file__),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        # the build's compiler flags (experiment macros included: build.rs, KDA_DHU_KERNEL_DEFINES)
        "build_flags": [ln for ln in kda_dhu._core.build_info().splitlines() if " flags: " in ln],
    }
    for name in shapes.split(","):
        if op == "fwd_h":
            a, _ = m.fwd_h_row_args(rows[name])
            fn = kda_dhu.chunk_gated_delta_rule_fwd_h
        else:
            a, _ = m.row_inputs(rows[name])
            fn = kda_dhu.chunk_gated_delta_rule_bwd_dhu
        out[name] = m.time_ms(lambda a=a, fn=fn: fn(**a), warmup=5, reps=reps)
        del a
        torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benches/build_ab.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--wheels", nargs="+", default=[], metavar="LABEL=PATH", help="the builds, the first the baseline"
    )
    ap.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="comma-separated rows of kda_dhu._measure.SHAPES"
    )
    ap.add_argument(
        "--op", choices=("dhu", "fwd_h"), default="dhu", help="stage 4 (default) or the forward scan"
    )
    ap.add_argument("--rounds", type=int, default=3, help="processes per build, alternating")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per row and process")
    ap.add_argument(
        "--site", default="/tmp/build_ab", help="where each build is installed (a folder per label)"
    )
    ap.add_argument("--out", default=None, help="folder for build_ab.json")
    ap.add_argument("--plan", action="store_true", help="print what would run and exit (no GPU)")
    ap.add_argument("--child", nargs=2, metavar=("LABEL", "SHAPES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1], args.reps, args.op)
    try:
        wheels = parse_wheels(args.wheels)
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 1 or args.reps < 1:
        ap.error("--rounds and --reps must be >= 1")
    try:  # the shape table of the kda_dhu this process sees, if any (the builds' own may differ)
        from kda_dhu import _measure as m
    except ImportError:
        m = None
    if m is not None:
        known = {r[0] for r in m.SHAPES}
        unknown = [s for s in args.shapes.split(",") if s not in known]
        if unknown:
            ap.error(f"unknown shape(s) {unknown}; one of: {', '.join(sorted(known))}")
    if args.plan:
        for label, path in wheels:
            print(f"{label}: {path} -> {os.path.join(args.site, label)}")
        print(
            f"{args.rounds} round(s) of {', '.join(lab for lab, _ in wheels)}; {args.op}; rows {args.shapes}"
        )
        return 0

    for label, path in wheels:
        target = os.path.join(args.site, label)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--upgrade", "--target", target, path]
        subprocess.run(cmd, check=True)
    procs, failed = [], 0
    for r in range(args.rounds):
        for label, _ in wheels:
            env = dict(os.environ, PYTHONPATH=os.path.join(args.site, label))
            env.setdefault("KDA_DHU_NO_AUTOREGISTER", "1")
            if args.op == "fwd_h":
                env["KDA_DHU_FWD_H"] = "on"
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                label,
                args.shapes,
                "--reps",
                str(args.reps),
                "--op",
                args.op,
            ]
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"round {r + 1} {label}: timed out after {CHILD_TIMEOUT_S} s", file=sys.stderr)
                failed += 1
                continue
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                print(f"round {r + 1} {label}: rc {p.returncode}\n{p.stderr[-2000:]}", file=sys.stderr)
                failed += 1
                continue
            rec = json.loads(lines[-1])
            procs.append(rec)
            print(json.dumps(rec), flush=True)
    if not procs:
        return 1
    names = args.shapes.split(",")
    base = wheels[0][0]
    med = {
        lab: {n: statistics.median(p[n] for p in procs if p["label"] == lab) for n in names}
        for lab, _ in wheels
        if any(p["label"] == lab for p in procs)
    }
    # Ratios to the baseline, where its processes ran.
    ratio_labs = [lab for lab in med if lab != base] if base in med else []
    head = ["shape", *med, *(f"{lab} / {base}" for lab in ratio_labs)]
    print(f"\n{procs[0]['gpu']}, torch {procs[0]['torch']}; GPU ms, median of processes")
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for n in names:
        cells = [
            n,
            *(f"{med[lab][n]:.4f}" for lab in med),
            *(f"{med[lab][n] / med[base][n]:.3f}" for lab in ratio_labs),
        ]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = {
            "what": ("the forward scan" if args.op == "fwd_h" else "stage 4")
            + " through the default route, builds in alternating processes (benches/build_ab.py)",
            "op": args.op,
            "gpu": procs[0]["gpu"],
            "torch": procs[0]["torch"],
            "date": datetime.date.today().isoformat(),
            "wheels": {lab: os.path.basename(path) for lab, path in wheels},
            "rounds": args.rounds,
            "reps": args.reps,
            "median_ms": med,
            "processes": procs,
            "failed_processes": failed,
        }
        with open(os.path.join(args.out, "build_ab.json"), "w") as f:
            json.dump(record, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
