"""Kernel variants side by side (A/B) on the GPU: the same calls with an environment switch
set to each variant in turn, interleaved in rounds, fla's output in the same run as the
correctness anchor.

    python3 benches/variants.py --variants 1,2 [--shapes a,b] [--out DIR]   # warpgroups per CTA
    python3 benches/variants.py --variants "default KDA_DHU_SM90_NWG=1"
    python3 benches/variants.py --variants "1 2" --plan   # the variants' settings; no GPU

A variant is one of:
  VALUE          --switch (default KDA_DHU_SM90_NWG, read by the core at each plan; a kernel
                 variant under development brings a switch of its own) set to VALUE;
  default        every switch the variants name unset (the shipped kernel);
  NAME=VALUE     explicit settings, several joined by '+' (KDA_DHU_SM90_NWG=2+KDA_DHU_CHECK_INPUTS=1).
Variants are separated by commas or spaces. A switch a variant does not set is unset for it.

Each shape (rows of kda_dhu._measure.SHAPES plus EXTRA below) runs the kernel directly
(kda_dhu.testing.run_kernel: the planner's "capable" rule, past its policy, so a variant
the planner would not pick is still timed). Per variant: the largest relative error of dh,
dh0, dv2 against fla's output (over --tol, or non-finite, fails the run), and the GPU time
(kda_dhu._measure.time_ms: each call queued behind a sleep kernel, median of --reps) in each of
--rounds rounds, the variants' order rotated per round; the row's figure is the median of
the rounds. --fla-time also times fla (its stage-4 autotuning redone for the row, as the
benchmark does); without it fla's autotuner keeps one config (one compile, no tuning: fla's
output is only the reference).

Writes DIR/variants.json (the record: GPU, versions, commit, the variants' settings, the
core's view of the switches, per-row times and errors, raw rounds) and DIR/variants.md.
Exit status: 0; 1 a variant's output over --tol or a row that raised; 2 bad arguments or
no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_SWITCH = "KDA_DHU_SM90_NWG"
EXTRA = [
    # name, B, T, H, HV, K, V, gate, varlen
    ("b16_t4096_h32", 16, 4096, 32, 32, 128, 128, "gk", None),
    ("b2_t8192_h32", 2, 8192, 32, 32, 128, 128, "gk", None),
    ("gdn_b8_t4096_h16_hv32_g", 8, 4096, 16, 32, 128, 128, "g", None),
    ("k64_b16_t4096_h32", 16, 4096, 32, 32, 64, 128, "gk", None),
    ("k64_b4_t8192_h16", 4, 8192, 16, 16, 64, 128, "gk", None),
    ("varlen_t32768_h32_avg1k", 1, 32768, 32, 32, 128, 128, "gk", "avg1k"),
]
_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def parse_variants(text: str, switch: str = DEFAULT_SWITCH) -> list:
    """[(label, {NAME: VALUE or None})] for --variants (see the module's docstring): every
    variant names every switch any variant sets (None: unset for that variant). Raises
    ValueError for an empty list, a bad NAME=VALUE, or a label given twice."""
    if not _NAME.match(switch):
        raise ValueError(f"--switch: expected an environment variable name, got {switch!r}")
    tokens = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    if not tokens:
        raise ValueError("--variants: expected at least one variant")
    parsed = []
    for tok in tokens:
        if tok == "default":
            settings = {}
        elif "=" in tok:
            settings = {}
            for part in tok.split("+"):
                name, sep, value = part.partition("=")
                if not sep or not _NAME.match(name) or not value:
                    raise ValueError(f"--variants: {part!r} in {tok!r} is not NAME=VALUE")
                settings[name] = value
        else:
            settings = {switch: tok}
        parsed.append((tok, settings))
    labels = [label for label, _ in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--variants: a variant is given twice in {labels}")
    names = sorted({n for _, s in parsed for n in s})
    return [(label, {n: s.get(n) for n in names}) for label, s in parsed]


def apply(settings: dict) -> None:
    for name, value in settings.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def rotated(seq, r: int) -> list:
    seq = list(seq)
    k = r % len(seq) if seq else 0
    return seq[k:] + seq[:k]


def markdown_table(record: dict) -> str:
    labels = [v["label"] for v in record["variants"]]
    head = (
        f"{record['gpu']}, torch {record['torch']}, fla {record['fla_version']}, kda_dhu {record['commit']}, "
        f"{record['date']}; GPU ms (median of {record['settings']['rounds']} rounds x "
        f"{record['settings']['reps']} queued calls), kernel forced (capable rule)\n\n"
    )
    cols = "".join(f" {lab} ms | err {lab} |" for lab in labels)
    lines = [f"| shape | fla ms |{cols} best |", "|---|---|" + "---|---|" * len(labels) + "---|"]
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | raised: {r['error']} |" + " |" * (2 * len(labels)))
            continue
        fla = "-" if r.get("fla_ms") is None else f"{r['fla_ms']:.3f}"
        cells = "".join(f" {r['ms'][lab]:.3f} | {r['err_vs_fla'][lab]:.1e} |" for lab in labels)
        best = min(labels, key=lambda lab: r["ms"][lab])
        lines.append(f"| {r['shape']} | {fla} |{cells} {best} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--variants",
        default="KDA_DHU_SM90_NWG=1,KDA_DHU_SM90_NWG=2",
        help="the variants (default: one and two consumer warpgroups)",
    )
    ap.add_argument(
        "--switch", default=DEFAULT_SWITCH, help=f"the switch a bare VALUE sets (default {DEFAULT_SWITCH})"
    )
    ap.add_argument("--shapes", default="", help="comma-separated rows (default: every row)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative error against fla (default 2e-2)")
    ap.add_argument(
        "--fla-time", action="store_true", help="also time fla (tunes its stage-4 kernel per row)"
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--plan", action="store_true", help="print the variants' settings and the rows; no GPU")
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.variants, args.switch)
    except ValueError as err:
        ap.error(str(err))
    from kda_dhu import _measure as bench

    rows = bench.SHAPES + EXTRA
    if args.shapes:
        want = [s for s in re.split(r"[,\s]+", args.shapes) if s]
        unknown = [s for s in want if s not in {r[0] for r in rows}]
        if unknown:
            ap.error(f"unknown shape(s) {unknown}; one of: {', '.join(r[0] for r in rows)}")
        rows = [r for r in rows if r[0] in want]
    if args.rounds < 1 or args.reps < 1:
        ap.error("--rounds and --reps must be >= 1")
    if args.plan:
        for label, settings in variants:
            print(
                f"variant {label}: "
                + " ".join(f"{n}={'(unset)' if v is None else v}" for n, v in settings.items())
            )
        print("shapes: " + ", ".join(r[0] for r in rows))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("variants: no CUDA device", file=sys.stderr)
        return 2
    import fla
    from bench import git_commit
    from kda_dhu import _core
    from kda_dhu.reference import rel_err
    from kda_dhu.testing import run_kernel

    known = {name: value for name, _, value in _core.switches()}
    unknown = sorted({n for _, s in variants for n in s if n not in known})
    if unknown:
        print(
            f"variants: warning: the core does not list {unknown} among its switches (_core.switches()); "
            "variants differing only there run the same kernel",
            file=sys.stderr,
        )
    if not args.fla_time:  # fla's values only (the error column): one config, no tuning
        bench.pin_fla_stage4()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}  torch {torch.__version__}  fla {fla.__version__}  kda_dhu {git_commit()}", flush=True)
    for label, settings in variants:
        print(f"variant {label}: {settings}", flush=True)
    labels = [label for label, _ in variants]
    results, failures = [], []
    t_start = time.time()

    def record() -> dict:
        return {
            "date": datetime.date.today().isoformat(),
            "gpu": gpu,
            "torch": torch.__version__,
            "fla_version": fla.__version__,
            "commit": git_commit(),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "settings": {
                "rounds": args.rounds,
                "reps": args.reps,
                "tol": args.tol,
                "fla_time": args.fla_time,
            },
            "variants": [{"label": label, "env": settings} for label, settings in variants],
            "core_switches": known,
            "switches_unknown_to_core": unknown,
            "rows": results,
            "failures": failures,
            "total_s": time.time() - t_start,
        }

    def write(rec: dict) -> None:
        # after every row: a run cut by its time limit leaves the rows it finished
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "variants.json"), "w") as f:
                json.dump(rec, f, indent=1)
            with open(os.path.join(args.out, "variants.md"), "w") as f:
                f.write(markdown_table(rec))

    saved = {n: os.environ.get(n) for _, s in variants for n in s}
    try:
        for r in rows:
            name = r[0]
            try:
                results.append(run_row(r, variants, args, bench, run_kernel, rel_err))
            except Exception as err:  # noqa: BLE001 - report, go on with the next row
                traceback.print_exc()
                results.append({"shape": name, "error": f"{type(err).__name__}: {err}"})
                failures.append(f"{name}: raised {type(err).__name__}: {err}")
                torch.cuda.empty_cache()
                write(record())
                continue
            row = results[-1]
            bad = [lab for lab in labels if not row["err_vs_fla"][lab] < args.tol]
            if bad:
                failures.append(f"{name}: {bad} over {args.tol:g} against fla: {row['err_vs_fla']}")
            print(
                f"{name:<26} "
                + ("" if row["fla_ms"] is None else f"fla {row['fla_ms']:.3f}  ")
                + "  ".join(
                    f"{lab} {row['ms'][lab]:.3f} ms (err {row['err_vs_fla'][lab]:.1e})" for lab in labels
                ),
                flush=True,
            )
            write(record())
    finally:
        apply(saved)
    rec = record()
    print(markdown_table(rec), end="")
    write(rec)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def run_row(r, variants, args, bench, run_kernel, rel_err) -> dict:
    """One shape: fla's output (and time with --fla-time), then every variant's error and
    its time per round."""
    import functools

    import kda_dhu
    import torch

    name, B, T, H, HV, K, V, gate, varlen = r
    a, lengths = bench.row_inputs(r)
    fla_fn = kda_dhu.fla_function()
    if args.fla_time:
        bench.reset_fla_autotune()
    fla_out = fla_fn(**a)
    torch.cuda.synchronize()
    row = {"shape": name, "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "gate": gate,
           "varlen": lengths is not None}  # fmt: skip
    kernel = functools.partial(run_kernel, a)
    row["err_vs_fla"] = {}
    for label, settings in variants:
        apply(settings)
        out = kernel()
        torch.cuda.synchronize()
        row["err_vs_fla"][label] = max(rel_err(o, f) for o, f in zip(out, fla_out) if f is not None)
        del out
    rounds = {label: [] for label, _ in variants}
    fla_rounds = []
    for i in range(args.rounds):
        for label, settings in rotated(variants, i):
            apply(settings)
            rounds[label].append(bench.time_ms(kernel, warmup=2, reps=args.reps))
        if args.fla_time:
            fla_rounds.append(bench.time_ms(functools.partial(fla_fn, **a), warmup=2, reps=args.reps))
    row["ms"] = {label: statistics.median(t) for label, t in rounds.items()}
    row["ms_rounds"] = rounds
    row["fla_ms"] = statistics.median(fla_rounds) if fla_rounds else None
    row["fla_ms_rounds"] = fla_rounds or None
    del a, fla_out
    torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    sys.exit(main())
