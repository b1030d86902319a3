"""Benchmark (the lab's): kda-dhu against fla in the same run, on the project's shape
table (``kda_dhu._measure.SHAPES``), its records, tables, plots and README blocks.

    python benches/bench.py                 # the quick default: prod8192 only
    python benches/bench.py --all --out DIR # every shape; writes DIR/<date>-<gpu>.json
    python benches/bench.py --op fwd_h --all --out DIR  # the forward scan's rows instead:
                                            # DIR/bench-fwd_h-<date>-<gpu>.json
    python benches/bench.py --table JSON [--plot PNG]   # a record's table (and plot)
    python benches/bench.py --readme README.md          # README's tables from their records

--op picks the function: "dhu" (the default) is stage 4, fla's chunk_gated_delta_rule_bwd_dhu
(records <date>-<gpu>.json, latest.json, latest.md, latest.png); "fwd_h" is the forward
state scan, fla's chunk_gated_delta_rule_fwd_h (kda_dhu._forward's against fla's, on the
same shapes and stage-4 inputs, ``_measure.fwd_h_row_args``: k and w rescaled, u = dv, the
gate, initial_state = dht, the final state output; rows tagged "op": "fwd_h", errors
against fla's outputs, "launches" 1 where kda-dhu's kernel ran the call, 0 where it went
to fla; records bench-fwd_h-<date>-<gpu>.json, bench-fwd_h-latest.json, .md, .png);
"both" runs every stage-4 row, then every forward row, and writes both records (stage
4's as "dhu" writes it).

The measurement itself (``run_shape``, ``run_fwd_h_shape``: times, floor, errors) is the
package's (``kda_dhu._measure``, which the main job runs); this script sweeps shapes and
writes records. Not shipped in the wheel.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time

from kda_dhu._measure import SHAPES, copy_bandwidth, run_shape  # noqa: F401 - the table, for the tools

# --op's functions: a row's "op" (stage-4 rows have none), fla's function, its records' prefix
OPS = ("dhu", "fwd_h")
OP_FUNCTION = {"dhu": "chunk_gated_delta_rule_bwd_dhu", "fwd_h": "chunk_gated_delta_rule_fwd_h"}
OP_PREFIX = {"dhu": "", "fwd_h": "bench-fwd_h-"}


def row_op(row: dict) -> str:
    """A record row's function: its "op", "dhu" (stage 4) for a row without one."""
    return row.get("op", "dhu")


def git_commit() -> str:
    c = os.environ.get("KDA_DHU_COMMIT")
    if c:
        return c
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def _path_cell(path: str) -> str:
    """A row's route for the table: "kernel-sm90a", or "fla: <the planner's condition>".

    The record keeps the planner's whole reason, as it read at the record's commit; its
    clause after the first ": " quotes an older measurement of the loss that made the
    rule, so the table leaves it out (the measurements are records of their own)."""
    if path.startswith("fla (") and path.endswith(")"):
        return "fla: " + path[len("fla (") : -1].split(": ", 1)[0]
    return path


def markdown_table(record: dict) -> str:
    """The README's table of a benchmark record (never typed by hand): a line naming the
    GPU, versions, commit, date and copy bandwidth, then one row per shape: stage 4's rows
    (those without an "op"), then, where the record has any, a table of its forward-scan
    rows ("op": "fwd_h") headed "fwd_h". A record of stage-4 rows only gives stage 4's
    table alone, as before the forward rows."""
    head = (
        f"{record['gpu']}, fla {record['fla_version']}, torch {record['torch']}, kda_dhu "
        f"{record['kda_dhu_commit']}, {record['date']}; copy bandwidth "
        f"{record['copy_bw_GBs']:.0f} GB/s\n\n"
    )
    dhu = [r for r in record["rows"] if row_op(r) == "dhu"]
    fwd = [r for r in record["rows"] if row_op(r) == "fwd_h"]
    parts = []
    if dhu or not fwd:
        parts.append(_dhu_table(dhu))
    if fwd:
        parts.append(_fwd_h_table(fwd))
    return head + "\n".join(parts)


def _dhu_table(rows: list) -> str:
    """Stage 4's rows as a markdown table (errors against the record's reference)."""
    lines = [
        "| shape | B | T | H | HV | K | V | kda-dhu ms | fla ms | vs fla | kda-dhu / floor "
        "| fla / floor | err dh (fla) | path |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fe = r.get("fla_rel_err") or {}
        lines.append(
            f"| {r['shape']} | {r['B']} | {r['T']} | {r['H']} | {r['HV']} | {r['K']} | {r['V']} "
            f"| {r['kda_dhu_ms']:.3f} | {r['fla_ms']:.3f} | {r['speedup_vs_fla']:.2f}x "
            f"| {r['over_floor']:.2f} | {r['fla_over_floor']:.2f} "
            f"| {r['rel_err']['dh']:.1e} ({fe.get('dh', float('nan')):.1e}) | {_path_cell(r['path'])} |"
        )
    return "\n".join(lines) + "\n"


def _fwd_h_table(rows: list) -> str:
    """The forward scan's rows as a markdown table headed "fwd_h" (errors against fla's
    outputs: h, v_new, final_state)."""
    lines = [
        f"**fwd_h** (`{OP_FUNCTION['fwd_h']}`, the forward state scan; errors against fla's outputs)",
        "",
        "| shape | B | T | H | HV | K | V | kda-dhu ms | fla ms | vs fla | kda-dhu / floor "
        "| fla / floor | err h / v_new / final (vs fla) | path |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r["rel_err"]
        lines.append(
            f"| {r['shape']} | {r['B']} | {r['T']} | {r['H']} | {r['HV']} | {r['K']} | {r['V']} "
            f"| {r['kda_dhu_ms']:.3f} | {r['fla_ms']:.3f} | {r['speedup_vs_fla']:.2f}x "
            f"| {r['over_floor']:.2f} | {r['fla_over_floor']:.2f} "
            f"| {e['h']:.1e} / {e['v_new']:.1e} / {e['final_state']:.1e} | {_path_cell(r['path'])} |"
        )
    return "\n".join(lines) + "\n"


# A generated block of a markdown file: the table of the record named in its first line
# (a path relative to the markdown file), up to the end line.
_BLOCK = re.compile(
    r"(?P<start><!-- bench-table: (?P<src>[^ ]+) -->\n)(?P<body>.*?)(?P<end><!-- /bench-table -->)", re.S
)


def render_readme(text: str, root: str) -> str:
    """``text`` (a markdown file's) with each generated block's table made anew from the
    record it names (paths relative to ``root``, the file's folder).

    A block is ``<!-- bench-table: RECORD.json -->``, a blank line, ``markdown_table`` of
    the record, a blank line, ``<!-- /bench-table -->``. Raises ValueError when the text
    has no block, OSError / ValueError / KeyError when a named record cannot be read."""
    if not _BLOCK.search(text):
        raise ValueError("no '<!-- bench-table: RECORD.json -->' ... '<!-- /bench-table -->' block")

    def fill(m: re.Match) -> str:
        with open(os.path.join(root, m["src"])) as f:
            table = markdown_table(json.load(f))
        return f"{m['start']}\n{table}\n{m['end']}"

    return _BLOCK.sub(fill, text)


def update_readme(path: str, check: bool = False) -> bool:
    """Regenerates the bench-table blocks of the markdown file ``path`` (render_readme);
    returns whether its text changed. ``check``: only compare, never write."""
    with open(path) as f:
        text = f.read()
    new = render_readme(text, os.path.dirname(os.path.abspath(path)))
    if new != text and not check:
        with open(path, "w") as f:
            f.write(new)
    return new != text


PLOT_NEEDS = "matplotlib (pip install 'kda-dhu[bench]')"


def plot(record: dict, path: str, source: str | None = None, op: str | None = None) -> None:
    """A PNG of a benchmark record at ``path``: time over the bandwidth floor per shape,
    kda-dhu and fla side by side (1.0 is the floor; lower is better), titled with the
    record (``source``, its file name, where given; GPU, kda_dhu commit, date, fla) and
    the function. ``op``: the rows of that function ("dhu", stage 4, or "fwd_h"); by
    default stage 4's where the record has any, else the forward scan's.

    A row whose path is fla (the planner sent kda-dhu's call to fla's function, so both
    bars time fla) is marked: its kda-dhu bar hatched and grey, "(ran fla)" under its
    name and "ran fla" over its bar in place of the speed-up.

    Raises ImportError (naming the ``bench`` extra) without matplotlib, and OSError when
    ``path`` cannot be written; nothing is written then."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(f"plotting needs {PLOT_NEEDS}: {err}") from err
    if op is None:
        op = "dhu" if any(row_op(r) == "dhu" for r in record["rows"]) or not record["rows"] else "fwd_h"
    rows = [r for r in record["rows"] if row_op(r) == op]
    if not rows:
        raise ValueError(f"no {op} rows in the record")
    ran_fla = [r["path"].startswith("fla") for r in rows]
    names = [r["shape"] + ("\n(ran fla)" if f else "") for r, f in zip(rows, ran_fla)]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.6), dpi=110)
    ours = ax.bar([i - 0.2 for i in x], [r["over_floor"] for r in rows], 0.4, label="kda-dhu")
    for bar, f in zip(ours, ran_fla):
        if f:
            bar.set_facecolor("0.75")
            bar.set_hatch("//")
            bar.set_edgecolor("0.35")
    ax.bar(
        [i + 0.2 for i in x], [r["fla_over_floor"] for r in rows], 0.4, label=f"fla {record['fla_version']}"
    )
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("time / bandwidth floor (lower is better)")
    what = source or f"record {record['date']}-{record['gpu'].replace(' ', '_')}"
    ax.set_title(
        f"{what}: {OP_FUNCTION[op]} on {record['gpu']}\n"
        f"kda_dhu {record['kda_dhu_commit']}, {record['date']}, fla {record['fla_version']}, "
        f"torch {record['torch']}; dashed: the floor; over the bars: fla ms / kda-dhu ms",
        fontsize=9,
    )
    for i, (r, f) in enumerate(zip(rows, ran_fla)):
        label = "ran fla" if f else f"{r['speedup_vs_fla']:.2f}x"
        ax.text(i - 0.2, r["over_floor"], label, ha="center", va="bottom", fontsize=7)
    handles, _ = ax.get_legend_handles_labels()
    if any(ran_fla):
        handles.append(
            Patch(
                facecolor="0.75",
                hatch="//",
                edgecolor="0.35",
                label="kda-dhu's call routed to fla by the planner (both bars time fla)",
            )
        )
    top = max(max(r["over_floor"], r["fla_over_floor"]) for r in rows)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)


def write_record(record: dict, out: str, table: str, prefix: str = "", with_commit: bool = False) -> None:
    """Writes a run's record to ``out``: <prefix><date>-<gpu>.json (<prefix><date>-<gpu>-<commit>.json
    with ``with_commit``, the commit from record["kda_dhu_commit"]), <prefix>latest.json and the
    markdown table as <prefix>latest.md (``record`` has "date" and "gpu")."""
    os.makedirs(out, exist_ok=True)
    tag = record["gpu"].replace(" ", "_")
    if with_commit:
        tag += f"-{record['kda_dhu_commit']}"
    for fname in (f"{prefix}{record['date']}-{tag}.json", f"{prefix}latest.json"):
        with open(os.path.join(out, fname), "w") as f:
            json.dump(record, f, indent=1)
    with open(os.path.join(out, f"{prefix}latest.md"), "w") as f:
        f.write(table)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python benches/bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--all", action="store_true", help="every shape of the table (SHAPES)")
    ap.add_argument(
        "--shapes", default="", help="comma-separated shape names: " + ", ".join(r[0] for r in SHAPES)
    )
    ap.add_argument(
        "--op",
        choices=("dhu", "fwd_h", "both"),
        default="dhu",
        help="the function measured: dhu (stage 4, fla's chunk_gated_delta_rule_bwd_dhu; the "
        "default), fwd_h (the forward state scan, chunk_gated_delta_rule_fwd_h; records "
        "bench-fwd_h-*.json) or both (stage 4's rows, then the forward's; both records)",
    )
    ap.add_argument(
        "--out",
        default="",
        help="folder for <date>-<gpu>.json and latest.json (--op fwd_h: bench-fwd_h-<date>-<gpu>.json "
        "and bench-fwd_h-latest.json)",
    )
    ap.add_argument(
        "--no-ref", action="store_true", help="skip the float64 reference (stage 4; fwd_h checks against fla)"
    )
    ap.add_argument("--cooldown", type=float, default=2.0, help="idle seconds before each row (default 2)")
    ap.add_argument(
        "--table",
        default="",
        metavar="JSON",
        help="print the markdown table of a recorded run and exit (no GPU needed)",
    )
    ap.add_argument(
        "--plot",
        default="",
        metavar="PNG",
        help=f"with --table: also draw the record as a PNG (needs {PLOT_NEEDS}; exit 1 without)",
    )
    ap.add_argument(
        "--readme",
        default="",
        metavar="MD",
        help="regenerate the bench-table blocks of a markdown file (README.md) from the records "
        "their first lines name, and exit (no GPU needed)",
    )
    ap.add_argument(
        "--check", action="store_true", help="with --readme: exit 1 if a block is stale; write nothing"
    )
    return ap


def _record_tools(ap: argparse.ArgumentParser, args) -> int:
    """--table / --plot / --readme: records and files only (no torch)."""
    if args.plot and not args.table:
        ap.error("--plot draws the record of --table JSON")
    if args.table:
        try:
            with open(args.table) as f:
                record = json.load(f)
            table = markdown_table(record)
        except (OSError, ValueError, KeyError, TypeError) as err:
            ap.error(f"--table {args.table}: not a benchmark record ({type(err).__name__}: {err})")
        print(table, end="")
        if args.plot:
            try:
                plot(record, args.plot, source=os.path.basename(args.table))
            except (ImportError, OSError, ValueError, KeyError, TypeError) as err:
                print(f"bench.py: --plot {args.plot}: no plot: {err}", file=sys.stderr)
                return 1
    if args.readme:
        try:
            changed = update_readme(args.readme, check=args.check)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"bench.py: --readme {args.readme}: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
        if args.check and changed:
            print(f"bench.py: {args.readme}: a bench-table block differs from its record", file=sys.stderr)
            return 1
        what = "unchanged" if not changed else ("stale" if args.check else "rewritten")
        print(f"bench.py: {args.readme}: bench-table blocks {what}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.table or args.readme or args.plot:
        return _record_tools(ap, args)
    rows = SHAPES if args.all else SHAPES[:1]
    if args.shapes:
        want = set(args.shapes.split(","))
        unknown = want - {r[0] for r in SHAPES}
        if unknown:
            ap.error(f"unknown shape(s) {sorted(unknown)}; one of: {', '.join(r[0] for r in SHAPES)}")
        rows = [r for r in SHAPES if r[0] in want]

    import torch

    if not torch.cuda.is_available():
        print("bench.py: no CUDA device; the benchmark needs a GPU.", file=sys.stderr)
        return 2
    import fla
    import kda_dhu

    bw = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(
        f"{gpu}  torch {torch.__version__}  fla {fla.__version__}  kda_dhu {kda_dhu.__version__} "
        f"({git_commit()})  copy bandwidth {bw:.0f} GB/s",
        flush=True,
    )
    ops = OPS if args.op == "both" else (args.op,)
    jobs = [(op, row) for op in ops for row in rows]
    results = []
    partial = os.path.join(args.out, f"{OP_PREFIX[ops[0]]}partial.json") if args.out else ""
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    try:
        from tqdm import tqdm

        progress = tqdm(jobs, desc="shapes", unit="shape", file=sys.stderr, leave=False)
    except ImportError:
        progress = jobs
    for i, (op, row) in enumerate(progress):
        # An idle pause before each row: at 5a4bf4a and c99b8b5 b8_t4096_h32 timed
        # 0.644-0.653 ms right after prod8192's float64 reference (seconds of fp64 work on
        # the GPU) and 0.575 ms in a run of its own (fla's time moved less).
        time.sleep(args.cooldown)
        if op == "dhu":
            r = run_shape(row, bw, check_ref=not args.no_ref)
        else:
            from kda_dhu._measure import run_fwd_h_shape

            r = run_fwd_h_shape(row, bw)
        results.append(r)
        if args.out:  # the rows so far, should the run be cut short (never latest.json)
            with open(partial, "w") as f:
                json.dump(
                    {
                        "gpu": gpu,
                        "kda_dhu_commit": git_commit(),
                        "copy_bw_GBs": bw,
                        "complete": False,
                        "rows": results,
                    },
                    f,
                    indent=1,
                )
        if op == "dhu":
            errs = (
                f"err[{r['ref']}] dh {r['rel_err']['dh']:.2e} dv2 {r['rel_err']['dv2']:.2e} "
                f"dh0 {r['rel_err']['dh0']:.2e}"
            )
        else:
            errs = (
                f"err[fla] h {r['rel_err']['h']:.2e} v_new {r['rel_err']['v_new']:.2e} "
                f"final {r['rel_err']['final_state']:.2e}  launches {r['launches']}"
            )
        print(
            f"[{i + 1}/{len(jobs)}] {(r['shape'] if op == 'dhu' else 'fwd_h ' + r['shape']):<26} "
            f"ours {r['kda_dhu_ms']:.3f} ms  fla {r['fla_ms']:.3f} ms  "
            f"x{r['speedup_vs_fla']:.2f} vs fla  {r['over_floor']:.2f}x floor (fla {r['fla_over_floor']:.2f}x)  "
            f"latency {r['kda_dhu_latency_ms']:.3f} / {r['fla_latency_ms']:.3f} ms  "
            f"{errs}  {r['path']}",
            flush=True,
        )
    if args.out and os.path.exists(partial):
        os.remove(partial)
    for op in ops:
        record = {
            "date": datetime.date.today().isoformat(),
            "gpu": gpu,
            "fla_version": fla.__version__,
            "torch": torch.__version__,
            "kda_dhu_commit": git_commit(),
            "copy_bw_GBs": bw,
            "rows": [r for r in results if row_op(r) == op],
        }
        if op != "dhu":
            record = {"op": op, **record}
        if args.out:
            write_record(record, args.out, markdown_table(record), prefix=OP_PREFIX[op])
            try:  # the record is the run's result; its picture is a convenience here
                plot(record, os.path.join(args.out, f"{OP_PREFIX[op]}latest.png"), op=op)
            except ImportError as err:
                print(f"bench.py: no {OP_PREFIX[op]}latest.png: {err}", file=sys.stderr)
    bad = [
        r["shape"]
        for r in results
        if not all(math.isfinite(v) for v in r["rel_err"].values() if v is not None)
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
