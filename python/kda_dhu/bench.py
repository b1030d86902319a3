"""Benchmark: kda-dhu against fla in the same run, on the project's shape table (SHAPES).

    python -m kda_dhu.bench                 # the quick default: prod8192 only
    python -m kda_dhu.bench --all --out DIR # every shape; writes DIR/<date>-<gpu>.json
    python -m kda_dhu.bench --table JSON [--plot PNG]   # a record's table (and plot)
    python -m kda_dhu.bench --readme README.md          # README's tables from their records

Times are medians of CUDA-event timings after warm-up, kda-dhu and fla alternating
in one process. The bandwidth floor is the fewest bytes (each input read once, each
output written once: ``floor_bytes``) over the device-to-device copy
bandwidth measured in the same run (bytes read + written). Errors are against the
float64 reference computed on the GPU where it fits, else against fla (the record's
"ref" field says which).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

from ._core import BT  # tokens per chunk of every kernel (cuda/dhu_layout.h)

# torch is imported inside the functions that use it: ``python -m kda_dhu.bench --help``,
# a mistyped shape name and ``--table`` answer without it.

# name, B, T, H, HV, K, V, gate, varlen (list of lengths or None)
SHAPES = [
    ("prod8192", 16, 8192, 32, 32, 128, 128, "gk", None),
    ("b8_t4096_h32", 8, 4096, 32, 32, 128, 128, "gk", None),
    ("b4_t8192_h16", 4, 8192, 16, 16, 128, 128, "gk", None),
    ("b1_t65536_h32", 1, 65536, 32, 32, 128, 128, "gk", None),
    ("gva_b1_t11264_h16_hv32", 1, 11264, 16, 32, 128, 128, "gk", None),
    ("b8_t1096_h4_tail", 8, 1096, 4, 4, 128, 128, "gk", None),
    ("k64_b8_t4096_h32", 8, 4096, 32, 32, 64, 128, "gk", None),
    ("varlen_t65536_h32_avg1k", 1, 65536, 32, 32, 128, 128, "gk", "avg1k"),
    ("svf_b8_t4096_h32", 8, 4096, 32, 32, 128, 128, "gk", None),
    # the other cases, each on a shape of its own: GDN's scalar gate, the delta rule
    ("gdn_g_b8_t4096_h32", 8, 4096, 32, 32, 128, 128, "g", None),
    ("delta_nogate_b8_t4096_h32", 8, 4096, 32, 32, 128, 128, None, None),
]
# Shapes run with state_v_first=True (dh, dht, h0, dh0 as [.., V, K]).
STATE_V_FIRST = {"svf_b8_t4096_h32"}


def varlen_lengths(T: int, n: int, seed: int = 0) -> list:
    """n positive lengths summing to T, spread around T / n (reproducible)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g) + 0.5
    lens = (w / w.sum() * T).floor().long().clamp(min=1)
    lens[-1] += T - int(lens.sum())
    return lens.tolist()


def make_inputs(B, T, H, HV, K, V, dtype, gate, lengths=None, device="cuda", seed=0, state_v_first=False):
    """Random inputs in fla's keyword form for one call (fresh data per seed)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=dtype, s=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * s).to(dt)

    N = B if lengths is None else len(lengths)
    state = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    args = dict(
        q=randn(B, T, H, K, s=K**-0.5),
        k=randn(B, T, H, K, s=K**-0.5),
        w=randn(B, T, HV, K, s=K**-0.5),
        do=randn(B, T, HV, V),
        dv=randn(B, T, HV, V),
        h0=torch.zeros(*state, device=device, dtype=torch.float32),
        dht=randn(*state, dt=torch.float32),
        scale=K**-0.5,
        chunk_size=BT,
    )
    if state_v_first:
        args["state_v_first"] = True
    # log2-space decays, chunk-local cumulative sums (as fla's recompute produces them)
    if gate in ("gk", "g"):
        shape = (B, T, HV, K) if gate == "gk" else (B, T, HV)
        step = -torch.rand(*shape, generator=gen, device=device) * 0.1 - 0.001
        if lengths is None:
            nt = (T + BT - 1) // BT
            pad = nt * BT - T
            x = torch.nn.functional.pad(step.movedim(1, -1), (0, pad)).movedim(-1, 1)
            x = x.reshape(B, nt, BT, *shape[2:]).cumsum(2).reshape(B, nt * BT, *shape[2:])[:, :T]
        else:
            parts, start = [], 0
            for L in lengths:
                seg = step[:, start : start + L]
                nt = (L + BT - 1) // BT
                pad = nt * BT - L
                s2 = torch.nn.functional.pad(seg.movedim(1, -1), (0, pad)).movedim(-1, 1)
                s2 = s2.reshape(B, nt, BT, *shape[2:]).cumsum(2).reshape(B, nt * BT, *shape[2:])[:, :L]
                parts.append(s2)
                start += L
            x = torch.cat(parts, 1)
        args[gate] = x.contiguous().float()
    if lengths is not None:
        cu = [0]
        for L in lengths:
            cu.append(cu[-1] + L)
        args["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64, device=device)
    return args


def row_inputs(row, seed=0, device="cuda") -> tuple:
    """(inputs, lengths) of a SHAPES row: packed lengths for "avg1k" rows (else None),
    state_v_first for the rows of STATE_V_FIRST."""
    import torch

    name, B, T, H, HV, K, V, gate, varlen = row
    lengths = varlen_lengths(T, 64, seed) if varlen == "avg1k" else None
    a = make_inputs(
        B,
        T,
        H,
        HV,
        K,
        V,
        torch.bfloat16,
        gate,
        lengths,
        device=device,
        seed=seed,
        state_v_first=name in STATE_V_FIRST,
    )
    return a, lengths


def floor_bytes(B, T, H, HV, K, V, NT_total, N, elem=2, gate="gk") -> int:
    """Fewest bytes: every input read once, every output written once."""
    b = (2 * B * T * H * K + B * T * HV * K) * elem  # q, k, w
    b += 3 * B * T * HV * V * elem  # do, dv, dv2
    if gate == "gk":
        b += B * NT_total * HV * K * 4  # gk's last rows
    elif gate == "g":
        b += B * T * HV * 4
    b += B * NT_total * HV * K * V * elem  # dh
    b += 2 * N * HV * K * V * 4  # dht, dh0
    return b


def copy_bandwidth(device="cuda", nbytes=4 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(functools.partial(dst.copy_, src), warmup=5, reps=20)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


# GPU cycles of the sleep kernel queued ahead of each timed call (~0.2 ms at the H200's
# 1.98 GHz): longer than either side's host time per call, so that the call's work is
# queued before its start event fires.
QUEUE_AHEAD_CYCLES = 400_000


def time_ms(fn, warmup=10, reps=50, queue_ahead=True) -> float:
    """Median milliseconds of ``fn`` between two CUDA events, after ``warmup`` calls.

    queue_ahead (the default): each timed call is queued behind a short sleep kernel, so
    the events time the GPU work of the call (as a training step, whose host work
    overlaps the GPU's, sees it), not the host's time to issue it. False: the GPU is idle
    when each call starts, so the time is the call's latency, host time included (both
    are recorded: see run_shape)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if queue_ahead:
        return statistics.median(_times_ms(fn, reps))
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_interleaved(fn_a, fn_b, rounds=5, reps=10) -> tuple:
    """(median ms of fn_a, of fn_b, of fn_a's second half of rounds) by ``time_ms``, the two
    functions alternating in ``rounds`` rounds of ``reps`` timed calls each: a drift of
    the machine (clocks, power, a neighbour) during the row falls on both sides alike.
    The third figure (fn_a over the last rounds only) shows such a drift when it differs
    from the first."""
    a_times, b_times = [], []
    for _ in range(rounds):
        a_times.append(_times_ms(fn_a, reps))
        b_times.append(_times_ms(fn_b, reps))
    late = [t for ts in a_times[rounds // 2 :] for t in ts]
    flat = lambda xs: [t for ts in xs for t in ts]  # noqa: E731
    return statistics.median(flat(a_times)), statistics.median(flat(b_times)), statistics.median(late)


def _times_ms(fn, reps: int) -> list:
    """``reps`` queued timings of fn (see time_ms), after two untimed calls."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


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


def fla_stage4_autotuners() -> list:
    """The Triton autotuners of fla's stage-4 module (``fla.ops.common.chunk_delta_h``),
    found under its kernels' decorators (Heuristics -> Autotuner -> JITFunction)."""
    import fla.ops.common.chunk_delta_h as mod

    found = []
    for obj in list(vars(mod).values()):
        for _ in range(4):
            if obj is None:
                break
            if isinstance(getattr(obj, "cache", None), dict) and hasattr(obj, "configs"):
                found.append(obj)
            obj = getattr(obj, "fn", None)
    return found


def pin_fla_stage4():
    """fla's stage-4 Triton kernels pinned to one config (BV = 32, 4 warps, one stage:
    it fits the shared memory of every dtype fla takes at every K <= 256; two stages ask
    245760 B for float32 inputs at K = 128, over the H200's 232448), for runs that use
    fla's values but not its time (the tests' and the A/B's comparisons): every config
    computes the same recurrence, and tuning twelve of them per head / size key costs
    seconds to minutes. Returns a function restoring fla's configs. Never for a timed fla
    (the benchmarks time fla at its best)."""
    import copy

    tuners = fla_stage4_autotuners()
    saved = [(t, t.configs) for t in tuners]
    for t in tuners:
        pick = [c for c in t.configs if c.kwargs.get("BV") == 32 and c.num_warps == 4]
        if pick:
            one = copy.copy(pick[0])
            one.num_stages = 1
            t.configs = [one]
        else:
            t.configs = t.configs[:1]

    def restore():
        for t, configs in saved:
            t.configs = configs

    return restore


def reset_fla_autotune() -> int:
    """Makes fla tune its stage-4 kernels again for the next shape; returns how many
    Triton autotuners were reset.

    fla's autotune key for this kernel has no B or T (H, HV, K, V, BT, BV, gates, layout),
    and fla keeps tuned configs on disk (``cache_results``): in one process a shape reuses
    the config tuned on an earlier shape of the same heads. fla's time at b1_t65536_h32
    moved between 1.69 ms (tuned on itself) and 2.7-2.8 ms (after prod8192) from one run
    to the next. Each bench row starts with its own tuning instead, so fla is timed at its
    best for every shape."""
    tuners = fla_stage4_autotuners()
    for t in tuners:
        t.cache.clear()
        if hasattr(t, "cache_results"):
            t.cache_results = False
    return len(tuners)


def sample_pairs(a: dict, pairs: list) -> dict:
    """A dense call's inputs restricted to some (batch row, value head) pairs: each pair
    becomes a batch row of its own with one head (q and k of its q/k head, GVA's
    ``hv // (HV // H)``), so that the float64 reference can check a sample of a call too
    large to check whole in reasonable time."""
    import torch

    H, HV = a["q"].shape[2], a["do"].shape[2]
    group = HV // H

    def pick(x, per_value_head=True, head_dim=2):
        if x is None:
            return None
        rows = [x[b].select(head_dim - 1, hv if per_value_head else hv // group) for b, hv in pairs]
        return torch.stack(rows).unsqueeze(head_dim)

    out = dict(a)
    out["q"], out["k"] = pick(a["q"], False), pick(a["k"], False)
    for name in ("w", "do", "dv", "gk"):
        out[name] = pick(a.get(name))
    out["g"] = pick(a.get("g"))
    for name in ("h0", "dht"):
        out[name] = pick(a.get(name), head_dim=1)
    return out


def sample_outputs(outs, pairs: list) -> tuple:
    """(dh, dh0, dv2) of a dense call at the (batch row, value head) pairs of
    ``sample_pairs``, shaped as the sampled call's outputs."""
    import torch

    dh, dh0, dv2 = outs

    def pick(x, d):
        return None if x is None else torch.stack([x[b].select(d - 1, hv) for b, hv in pairs]).unsqueeze(d)

    return pick(dh, 2), pick(dh0, 1), pick(dv2, 2)


def run_shape(row, bw, check_ref=True, seed=0, entry="extended", progress=None, ref_pairs=None):
    """Time and check one shape; entry "extended" (fla's signature) or "b2a" (the seed's).

    ``progress``: called with a line before each slow step (fla's first call compiles and
    tunes its kernel; the float64 reference). ``ref_pairs``: check the float64 reference
    on that many random (batch row, value head) pairs of a dense shape, not on all of
    them (the record's "ref" says "float64 (N of M pairs)")."""
    import torch

    import kda_dhu
    from kda_dhu import reference
    from kda_dhu.reference import rel_err

    name, B, T, H, HV, K, V, gate, varlen = row
    svf = name in STATE_V_FIRST
    a, lengths = row_inputs(row, seed)
    fla_fn = kda_dhu.fla_function()
    reset_fla_autotune()
    if entry == "b2a":
        if svf:
            raise ValueError(f"{name}: kda_dhu_b2a cannot express state_v_first")
        b2a_args = (
            a["q"],
            a["k"],
            a["w"],
            a["gk"],
            a["h0"],
            a["dht"],
            a["do"],
            a["dv"],
            a["scale"],
            a["chunk_size"],
        )
        ok, reason = kda_dhu.plan_b2a(*b2a_args)

        def ours_fn():
            return kda_dhu.kda_dhu_b2a(*b2a_args)
    else:
        ok, reason = kda_dhu.plan_call(**a)

        ours_fn = functools.partial(kda_dhu.chunk_gated_delta_rule_bwd_dhu, **a)

    say = progress or (lambda line: None)
    say(f"kda_dhu: first call ({'kernel-sm90a' if ok else 'fla: ' + reason})")
    ours = ours_fn()
    torch.cuda.synchronize()
    say(
        "fla: first call (Triton compiles and tunes fla's stage-4 kernel for this shape: about 20 s on a fresh H200)"
    )
    theirs = fla_fn(**a)
    torch.cuda.synchronize()
    say("timing both, alternating")
    N = B if lengths is None else len(lengths)
    NT_total = ours[0].shape[1]
    nbytes = floor_bytes(B, T, H, HV, K, V, NT_total, N, gate=gate)

    fla_call = functools.partial(fla_fn, **a)
    ms_ours, ms_fla, ms_ours2 = time_interleaved(ours_fn, fla_call)
    # latency: each call issued to an idle GPU, host time included
    lat_ours = time_ms(ours_fn, reps=20, queue_ahead=False)
    lat_fla = time_ms(fla_call, reps=20, queue_ahead=False)
    floor_ms = nbytes / (bw * 1e9) * 1e3

    names = ("dh", "dh0", "dv2")
    ref_kind = "fla"
    ref = theirs
    fp64_bytes = 4 * nbytes  # the reference holds float64 copies of inputs and outputs
    vs_fla = {k: rel_err(o, f) for k, o, f in zip(names, ours, theirs)}
    total_pairs = B * HV
    if check_ref and ref_pairs is not None and lengths is None and ref_pairs < total_pairs:
        gen = torch.Generator().manual_seed(seed)
        chosen = sorted(torch.randperm(total_pairs, generator=gen)[:ref_pairs].tolist())
        pairs = [(i // HV, i % HV) for i in chosen]
        say(f"float64 reference on a sample of {len(pairs)} of {total_pairs} (batch, head) pairs")
        ref = reference.chunk_gated_delta_rule_bwd_dhu_ref(**sample_pairs(a, pairs))
        ours, theirs = sample_outputs(ours, pairs), sample_outputs(theirs, pairs)
        ref_kind = f"float64 ({len(pairs)} of {total_pairs} pairs)"
    elif check_ref and fp64_bytes < 0.5 * torch.cuda.mem_get_info()[0]:
        say(f"float64 reference on all {total_pairs} (batch, head) pairs")
        ref = reference.chunk_gated_delta_rule_bwd_dhu_ref(**a)
        ref_kind = "float64"
    err = {k: rel_err(o, r) for k, o, r in zip(names, ours, ref)}
    fla_err = (
        {k: rel_err(o, r) for k, o, r in zip(names, theirs, ref)} if ref_kind.startswith("float64") else None
    )
    del ours, theirs, ref, a
    torch.cuda.empty_cache()
    return {
        "shape": name,
        "B": B,
        "T": T,
        "H": H,
        "HV": HV,
        "K": K,
        "V": V,
        "dtype": "bf16",
        "gate": gate,
        "varlen": lengths is not None,
        "state_v_first": svf,
        "path": "kernel-sm90a" if ok else f"fla ({reason})",
        "kda_dhu_ms": ms_ours,
        "kda_dhu_ms_repeat": ms_ours2,
        "fla_ms": ms_fla,
        "kda_dhu_latency_ms": lat_ours,
        "fla_latency_ms": lat_fla,
        "floor_ms": floor_ms,
        "min_bytes": nbytes,
        "speedup_vs_fla": ms_fla / ms_ours,
        "over_floor": ms_ours / floor_ms,
        "fla_over_floor": ms_fla / floor_ms,
        "GBs": nbytes / (ms_ours * 1e-3) / 1e9,
        "entry": entry,
        "ref": ref_kind,
        "rel_err": err,
        "fla_rel_err": fla_err,
        "vs_fla": vs_fla,
    }


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
    GPU, versions, commit, date and copy bandwidth, then one row per shape."""
    head = (
        f"{record['gpu']}, fla {record['fla_version']}, torch {record['torch']}, kda_dhu "
        f"{record['kda_dhu_commit']}, {record['date']}; copy bandwidth "
        f"{record['copy_bw_GBs']:.0f} GB/s\n\n"
    )
    lines = [
        "| shape | B | T | H | HV | K | V | kda-dhu ms | fla ms | vs fla | kda-dhu / floor "
        "| fla / floor | err dh (fla) | path |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        fe = r.get("fla_rel_err") or {}
        lines.append(
            f"| {r['shape']} | {r['B']} | {r['T']} | {r['H']} | {r['HV']} | {r['K']} | {r['V']} "
            f"| {r['kda_dhu_ms']:.3f} | {r['fla_ms']:.3f} | {r['speedup_vs_fla']:.2f}x "
            f"| {r['over_floor']:.2f} | {r['fla_over_floor']:.2f} "
            f"| {r['rel_err']['dh']:.1e} ({fe.get('dh', float('nan')):.1e}) | {_path_cell(r['path'])} |"
        )
    return head + "\n".join(lines) + "\n"


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


def plot(record: dict, path: str, source: str | None = None) -> None:
    """A PNG of a benchmark record at ``path``: time over the bandwidth floor per shape,
    kda-dhu and fla side by side (1.0 is the floor; lower is better), titled with the
    record (``source``, its file name, where given; GPU, kda_dhu commit, date, fla).

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
    rows = record["rows"]
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
        f"{what}: chunk_gated_delta_rule_bwd_dhu on {record['gpu']}\n"
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
        prog="python -m kda_dhu.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--all", action="store_true", help="every shape of the table (SHAPES)")
    ap.add_argument(
        "--shapes", default="", help="comma-separated shape names: " + ", ".join(r[0] for r in SHAPES)
    )
    ap.add_argument("--out", default="", help="folder for <date>-<gpu>.json and latest.json")
    ap.add_argument("--no-ref", action="store_true", help="skip the float64 reference")
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
                print(f"kda_dhu.bench: --plot {args.plot}: no plot: {err}", file=sys.stderr)
                return 1
    if args.readme:
        try:
            changed = update_readme(args.readme, check=args.check)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"kda_dhu.bench: --readme {args.readme}: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
        if args.check and changed:
            print(
                f"kda_dhu.bench: {args.readme}: a bench-table block differs from its record", file=sys.stderr
            )
            return 1
        what = "unchanged" if not changed else ("stale" if args.check else "rewritten")
        print(f"kda_dhu.bench: {args.readme}: bench-table blocks {what}", file=sys.stderr)
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
        print("kda_dhu.bench: no CUDA device; the benchmark needs a GPU.", file=sys.stderr)
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
    results = []
    partial = os.path.join(args.out, "partial.json") if args.out else ""
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    try:
        from tqdm import tqdm

        progress = tqdm(rows, desc="shapes", unit="shape", file=sys.stderr, leave=False)
    except ImportError:
        progress = rows
    for i, row in enumerate(progress):
        # An idle pause before each row: at 5a4bf4a and c99b8b5 b8_t4096_h32 timed
        # 0.644-0.653 ms right after prod8192's float64 reference (seconds of fp64 work on
        # the GPU) and 0.575 ms in a run of its own (fla's time moved less).
        time.sleep(args.cooldown)
        r = run_shape(row, bw, check_ref=not args.no_ref)
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
        print(
            f"[{i + 1}/{len(rows)}] {r['shape']:<26} ours {r['kda_dhu_ms']:.3f} ms  fla {r['fla_ms']:.3f} ms  "
            f"x{r['speedup_vs_fla']:.2f} vs fla  {r['over_floor']:.2f}x floor (fla {r['fla_over_floor']:.2f}x)  "
            f"latency {r['kda_dhu_latency_ms']:.3f} / {r['fla_latency_ms']:.3f} ms  "
            f"err[{r['ref']}] dh {r['rel_err']['dh']:.2e} dv2 {r['rel_err']['dv2']:.2e} "
            f"dh0 {r['rel_err']['dh0']:.2e}  {r['path']}",
            flush=True,
        )
    record = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "fla_version": fla.__version__,
        "torch": torch.__version__,
        "kda_dhu_commit": git_commit(),
        "copy_bw_GBs": bw,
        "rows": results,
    }
    if args.out:
        if os.path.exists(partial):
            os.remove(partial)
        write_record(record, args.out, markdown_table(record))
        try:  # the record is the run's result; its picture is a convenience here
            plot(record, os.path.join(args.out, "latest.png"))
        except ImportError as err:
            print(f"kda_dhu.bench: no latest.png: {err}", file=sys.stderr)
    bad = [
        r["shape"]
        for r in results
        if not all(math.isfinite(v) for v in r["rel_err"].values() if v is not None)
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
