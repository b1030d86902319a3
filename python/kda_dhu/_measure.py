"""The measurement of one shape: kda-dhu against fla in the same run (the main job,
``python -m kda_dhu``, and the lab's benchmark, benches/bench.py, both use it).

SHAPES is the project's shape table. Times are medians of CUDA-event timings after
warm-up, kda-dhu and fla alternating in one process. The bandwidth floor is the fewest
bytes (each input read once, each output written once: ``floor_bytes``) over the
device-to-device copy bandwidth measured in the same run (bytes read + written). Errors
are against the float64 reference computed on the GPU where it fits, else against fla
(the result's "ref" field says which).
"""

from __future__ import annotations

import functools
import statistics

from ._core import BT  # tokens per chunk of every kernel (cuda/dhu_layout.h)

# torch is imported inside the functions that use it: ``python benches/bench.py --help``,
# a mistyped shape name and ``--table`` answer without it.

# name, B, T, H, HV, K, V, gate, varlen (list of lengths or None)
SHAPES = [
    ("prod8192", 16, 8192, 32, 32, 128, 128, "gk", None),
    ("b8_t4096_h32", 8, 4096, 32, 32, 128, 128, "gk", None),
    ("b4_t8192_h16", 4, 8192, 16, 16, 128, 128, "gk", None),
    ("b1_t65536_h32", 1, 65536, 32, 32, 128, 128, "gk", None),
    # one long sequence with 16 heads: 32 CTAs of one warpgroup, a quarter of a wave
    ("b1_t65536_h16", 1, 65536, 16, 16, 128, 128, "gk", None),
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


# --- the forward scan (fla's chunk_gated_delta_rule_fwd_h) on the same shapes -----------------


def fwd_floor_bytes(B, T, H, HV, K, V, NT_total, N, elem=2, gate="gk") -> int:
    """The forward scan's fewest bytes (an initial and a final state): k, w, u and the gate
    read (gk: the last row of each chunk; g: every token), h and v_new written, the fp32
    initial state read and final state written (benches/fwd_h_probe.py's count)."""
    b = (B * T * H * K + B * T * HV * K) * elem  # k, w
    b += 2 * B * T * HV * V * elem  # u, v_new
    if gate == "gk":
        b += B * NT_total * HV * K * 4  # gk's last rows
    elif gate == "g":
        b += B * T * HV * 4
    b += B * NT_total * HV * K * V * elem  # h
    b += 2 * N * HV * K * V * 4  # initial_state, final_state
    return b


def fwd_h_args(a: dict) -> dict:
    """fla's ``chunk_gated_delta_rule_fwd_h`` keyword arguments from a stage-4 row's inputs
    (``row_inputs``): k, w, u = dv, its gate (g or gk), initial_state = dht,
    output_final_state=True, state_v_first as the row's; a packed batch also gets
    cu_seqlens_cpu and fla's chunk tables (chunk_indices, chunk_offsets: fla's
    ``prepare_chunk_indices`` / ``prepare_chunk_offsets``, as fla's KDA forward passes
    them; ``kda_dhu.testing.chunk_tables`` without fla)."""
    kw = dict(
        k=a["k"],
        w=a["w"],
        u=a["dv"],
        g=a.get("g"),
        gk=a.get("gk"),
        initial_state=a["dht"],
        output_final_state=True,
        chunk_size=a.get("chunk_size", BT),
        save_new_value=True,
        state_v_first=bool(a.get("state_v_first", False)),
    )
    cu = a.get("cu_seqlens")
    if cu is not None:
        try:
            from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

            indices = prepare_chunk_indices(cu, kw["chunk_size"])
            offsets = prepare_chunk_offsets(cu, kw["chunk_size"])
        except ImportError:
            from .testing import chunk_tables

            indices, offsets = chunk_tables(cu, T=a["k"].shape[1])
        kw.update(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), chunk_indices=indices, chunk_offsets=offsets)
    return kw


def fwd_h_row_args(row, seed=0, device="cuda") -> tuple:
    """(keyword arguments, lengths) of the forward scan on a SHAPES row: the row's stage-4
    inputs (``row_inputs``: the same seed, gate, packed lengths and state layout) through
    ``fwd_h_args``, with k's rows scaled to unit norm and w's to norm 0.25 (as
    ``kda_dhu.testing.make_inputs`` draws them, which benches/fwd_h_probe.py used): the
    forward state then stays O(1), where stage 4's k and w (rows of norm about 1, drawn
    independently) let the ungated rows' state grow about 1e6-fold over 4096 tokens."""
    import torch.nn.functional as F

    a, lengths = row_inputs(row, seed, device=device)
    a["k"] = F.normalize(a["k"].float(), dim=-1).to(a["k"].dtype)
    a["w"] = (0.25 * F.normalize(a["w"].float(), dim=-1)).to(a["w"].dtype)
    return fwd_h_args(a), lengths


def run_fwd_h_shape(row, bw, seed=0, progress=None) -> dict:
    """Time and check the forward scan on one shape of SHAPES: kda-dhu's
    ``kda_dhu._forward.chunk_gated_delta_rule_fwd_h`` against fla's function (undecorated,
    ``_forward.fla_fwd_h_function``) on the row's inputs (``fwd_h_row_args``), in the
    same process, fla tuning its kernels for the row first (``reset_fla_autotune``: fla's
    forward kernel is in the same module), then both timed alternating
    (``time_interleaved``), as ``run_shape`` times stage 4.

    ``launches``: kda-dhu's kernel launches (``_core.launch_count()``) of our first call
    (1: the kernel ran it; 0: fla's function did), ``launches_per_call`` over every timed
    call of ours. Errors are against fla's outputs (``rel_err``: h, v_new, final_state); on
    a padded packed batch v_new's rows past cu_seqlens[-1] (fla leaves them unwritten) are
    zeroed on both sides first. The row has stage 4's timing keys and "op": "fwd_h"."""
    import torch

    from . import _core
    from ._forward import chunk_gated_delta_rule_fwd_h, fla_fwd_h_function
    from .reference import rel_err

    name, B, T, H, HV, K, V, gate, varlen = row
    kw, lengths = fwd_h_row_args(row, seed)
    fla_fn = fla_fwd_h_function()
    reset_fla_autotune()
    say = progress or (lambda line: None)

    calls = [0]

    def ours_fn():
        calls[0] += 1
        return chunk_gated_delta_rule_fwd_h(**kw)

    fla_call = functools.partial(fla_fn, **kw)

    say("kda_dhu: first call (forward scan)")
    before = _core.launch_count()
    ours = chunk_gated_delta_rule_fwd_h(**kw)
    torch.cuda.synchronize()
    launches = _core.launch_count() - before
    say("fla: first call (Triton compiles and tunes fla's forward-scan kernel for this shape)")
    theirs = fla_call()
    torch.cuda.synchronize()

    end = int(kw["cu_seqlens_cpu"][-1]) if kw.get("cu_seqlens_cpu") is not None else T
    if end < T:  # a padded packed batch: fla leaves v_new's rows past the last sequence unwritten
        for out in (ours, theirs):
            if out[1] is not None:
                out[1][:, end:] = 0
    names = ("h", "v_new", "final_state")
    err = {n: rel_err(o, f) for n, o, f in zip(names, ours, theirs)}
    N = B if lengths is None else len(lengths)
    NT_total = ours[0].shape[1]
    nbytes = fwd_floor_bytes(B, T, H, HV, K, V, NT_total, N, gate=gate)
    del ours, theirs
    torch.cuda.empty_cache()

    say("timing both, alternating")
    calls[0] = 0
    before = _core.launch_count()
    ms_ours, ms_fla, ms_ours2 = time_interleaved(ours_fn, fla_call)
    lat_ours = time_ms(ours_fn, reps=20, queue_ahead=False)
    lat_fla = time_ms(fla_call, reps=20, queue_ahead=False)
    per_call = (_core.launch_count() - before) / max(calls[0], 1)
    floor_ms = nbytes / (bw * 1e9) * 1e3
    if launches == 1:
        path = "kernel-sm90a"
    elif launches == 0:
        path = "fla (no kda-dhu launch)"
    else:
        path = f"kernel ({launches} launches)"
    return {
        "op": "fwd_h",
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
        "state_v_first": name in STATE_V_FIRST,
        "path": path,
        "launches": launches,
        "launches_per_call": per_call,
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
        "ref": "fla",
        "rel_err": err,
    }
