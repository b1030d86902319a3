"""Host time per stage-4 call: kda-dhu called directly, through fla's backend registry, fla
alone, and do-nothing backends registered as kda-dhu's is (microseconds, wall clock).

    python benches/host_overhead.py --out DIR      # GPU: DIR/host-latest.{json,md} + a dated copy
    python benches/host_overhead.py --dry-run      # CPU: the machinery on CPU tensors, no GPU
    python benches/host_overhead.py --table host-latest.json   # a record's table

Routes (the calls: bf16, gk gate, h0 and dht, fla's keyword call as KDA's backward makes it):
  kernel        B1 T64 H1 K128 V64: the planner runs the kernel
  fla_b8_k256   B8 T1096 H4 K256 V128: the planner sends it to fla (K not in {64, 128}; until
                c7c8d09 this route was fla_halfwave, K128, which the kernel now takes)
  fla_k256      B1 T64 H1 K256 V64: the planner sends it to fla (K not in {64, 128})
  varlen_ci     B1 T512 H2 K128 V64, 4 packed sequences (VARLEN_LENGTHS), chunk_indices as
                fla's backward passes them (fla's prepare_chunk_indices)
  varlen        the same without chunk_indices (kda-dhu counts NT through fla's cached table)

Modes (the columns):
  direct        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**call)
  registry      fla's public fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_dhu(**call),
                kda-dhu's backend on (FLA_KDA_DHU unset)
  fla_off       the same with FLA_KDA_DHU=0: fla's public path without kda-dhu
  null_reject   FLA_KDA_DHU=0 and a do-nothing backend, registered as kda-dhu's is (a
                BaseBackend subclass, same priority), whose verifier returns (False, "no"):
                the registry's cost of one rejecting backend (the fla-route baseline)
  null_accept   FLA_KDA_DHU=0 and a do-nothing backend that accepts and returns outputs
                allocated once: fla's own dispatch cost (the kernel-route baseline)
  fla_raw       fla's undecorated function (kda_dhu.fla_function()): no dispatch wrapper

Steps (the kernel route's call taken apart; GPU only): _core.validate, _core.decide,
_core.run (one crossing: read, validate, decide, allocate, launch), Call.run,
Call.launch (outputs given), _core.launch (stateless), _dispatch.verify (the fla
backend's verdict), _core.force, torch.empty x 3 (the outputs' allocation alone).

Measurement: every (route, mode) cell and every step is a batch of --calls calls, timed
with the host's wall clock (time.perf_counter) with Python's garbage collector paused;
each batch is queued behind a sleep kernel (torch.cuda._sleep) longer than the batch's
host time, so the GPU's work never enters the clock and nothing waits for it, unless a
call synchronizes: the record counts the batches in which the sleep had ended before the
batch did ("caught_up"; nonzero means a synchronization in the call, or a host stall).
--rounds rounds; in each, every cell once, the order of routes and of modes rotated from
round to round, so that a drift of the machine falls on every column. Each cell's figure
is the median over rounds of its per-round mean; the raw per-round numbers are recorded.
Before the rounds, each cell is called --warmup times and checked: kernel launches per call
(kda_dhu._core.launch_count()) as the route and mode imply, and null_accept returning its
outputs. fla's stage-4 autotuner is cut to its first --fla-configs configs (default 2):
fla's host path is the same for any number above one (a dict lookup by key), its GPU time
is not measured here, and compiling all 12 configs for four keys would take minutes.

Targets (the record's "targets"): through fla's registry, kda-dhu adds at most 5 us to
fla's own dispatch cost on the kernel route: median over rounds of (registry - null_accept
- direct) <= 5 us, for kernel, varlen_ci and varlen; a call the planner sends to fla costs at
most 5 us more than fla's public path with kda-dhu off: median of (registry - fla_off)
<= 5 us, for fla_b8_k256 and fla_k256. Differences are taken within each round.

--dry-run: CPU tensors (kda-dhu's CPU path for "direct"), modes direct and null_accept,
routes kernel and varlen_ci, the CPU steps, few calls; the same record and table (marked
"dry_run"). Exit status: 0; 1 a routing check failed or a target was missed; 2 no GPU
without --dry-run, or kda-dhu / fla unusable.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings

# benches/ on the path: bench.py's record tools (git_commit, write_record), also where
# this file is loaded by path (the tests).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_dhu.fla_backend import ENV_VAR as BACKEND_ENV  # FLA_KDA_DHU, read by fla on every call

ROUTES = {
    "kernel": dict(B=1, T=64, H=1, K=128, V=64, varlen=False, chunk_indices=False, planner="kernel"),
    "fla_b8_k256": dict(B=8, T=1096, H=4, K=256, V=128, varlen=False, chunk_indices=False, planner="fla"),
    "fla_k256": dict(B=1, T=64, H=1, K=256, V=64, varlen=False, chunk_indices=False, planner="fla"),
    "varlen_ci": dict(B=1, T=512, H=2, K=128, V=64, varlen=True, chunk_indices=True, planner="kernel"),
    "varlen": dict(B=1, T=512, H=2, K=128, V=64, varlen=True, chunk_indices=False, planner="kernel"),
}
# The packed batch of the varlen routes: tails, a sequence shorter than one chunk.
VARLEN_LENGTHS = [100, 37, 250, 125]
MODES = ("direct", "registry", "fla_off", "null_reject", "null_accept", "fla_raw")
STEPS = (
    "validate",
    "decide",
    "run (one crossing)",
    "Call.run",
    "Call.launch",
    "launch (stateless)",
    "verify",
    "force",
    "torch.empty x3",
    "fla route: validate",
    "fla route: decide",
    "fla route: verify",
    "fla route: direct",
    "fla route: fla_raw",
)
DRY_RUN_ROUTES = ("kernel", "varlen_ci")
DRY_RUN_MODES = ("direct", "null_accept")
DRY_RUN_STEPS = ("validate", "force", "torch.empty x3")
LIMIT_US = 5.0  # the targets' bound


# ----------------------------------------------------------------------------- do-nothing backends


def null_backend_classes(base: type, priority: int) -> dict:
    """Two do-nothing fla backends for the operation 'common', shaped as kda-dhu's: a
    BaseBackend subclass defining stage 4's verifier and implementation, same priority,
    switched by an environment variable read on every call (fla's is_enabled reads
    FLA_<TYPE> and then env_var, as for kda-dhu's), off by default.

    "null_reject": the verifier returns (False, "no"). "null_accept": the verifier returns
    (True, None) and the implementation returns ``outputs`` (set by the caller)."""

    class NullReject(base):
        backend_type = "kda_dhu_null_reject"
        package_name = None
        env_var = "KDA_DHU_BENCH_NULL_REJECT"
        default_enable = False

        def chunk_gated_delta_rule_bwd_dhu_verifier(self, *args, **kwargs):
            return False, "no"

        def chunk_gated_delta_rule_bwd_dhu(self, *args, **kwargs):
            raise AssertionError("null_reject's implementation is never called")

    class NullAccept(base):
        backend_type = "kda_dhu_null_accept"
        package_name = None
        env_var = "KDA_DHU_BENCH_NULL_ACCEPT"
        default_enable = False
        outputs = None

        def chunk_gated_delta_rule_bwd_dhu_verifier(self, *args, **kwargs):
            return True, None

        def chunk_gated_delta_rule_bwd_dhu(self, *args, **kwargs):
            return self.outputs

    for cls in (NullReject, NullAccept):
        cls.priority = priority
    return {"null_reject": NullReject, "null_accept": NullAccept}


@contextlib.contextmanager
def null_backends():
    """Registers the two do-nothing backends in fla's 'common' registry for the block (as
    kda_dhu.fla_backend registers kda-dhu's), yields {mode: the registered instance}, and
    removes them on exit."""
    from fla import backends
    from kda_dhu import fla_backend

    _, registry = fla_backend._registry()
    classes = null_backend_classes(backends.BaseBackend, fla_backend.PRIORITY)
    instances = {}
    try:
        for mode, cls in classes.items():
            backends.register(fla_backend.OPERATION)(cls)
            instances[mode] = registry._backends[cls.backend_type]
        yield instances
    finally:
        for cls in classes.values():
            registry._backends.pop(cls.backend_type, None)
            os.environ.pop(cls.env_var, None)


def set_mode_env(mode: str, instances: dict) -> None:
    """The environment of a mode: kda-dhu's backend on for "registry" and "direct" (direct
    never passes through fla), off otherwise; a do-nothing backend on for its own mode."""
    if mode in ("registry", "direct"):
        os.environ.pop(BACKEND_ENV, None)
    else:
        os.environ[BACKEND_ENV] = "0"
    for name, inst in instances.items():
        if name == mode:
            os.environ[inst.env_var] = "1"
        else:
            os.environ.pop(inst.env_var, None)


# ----------------------------------------------------------------------------- calls


def route_call(route: str, device: str) -> dict:
    """fla's keyword arguments of stage 4 for a route, as KDA's backward passes them."""
    import torch
    from kda_dhu.testing import make_inputs

    r = ROUTES[route]
    a = make_inputs(
        r["B"],
        None if r["varlen"] else r["T"],
        r["H"],
        r["H"],
        r["K"],
        r["V"],
        torch.bfloat16,
        "gk",
        varlen_lengths=VARLEN_LENGTHS if r["varlen"] else None,
        device=device,
        generator=torch.Generator().manual_seed(0),
    )
    if r["varlen"] and a["q"].shape[1] != r["T"]:
        raise AssertionError(f"VARLEN_LENGTHS sum to {a['q'].shape[1]}, route {route} says T={r['T']}")
    chunk_indices = None
    if r["chunk_indices"]:
        from fla.ops.utils.index import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(a["cu_seqlens"], 64)
    return dict(
        q=a["q"],
        k=a["k"],
        w=a["w"],
        gk=a["gk"],
        h0=a["h0"],
        dht=a["dht"],
        do=a["do"],
        dv=a["dv"],
        scale=a["scale"],
        cu_seqlens=a["cu_seqlens"],
        chunk_size=64,
        chunk_indices=chunk_indices,
        chunk_offsets=None,
        state_v_first=False,
    )


def mode_fn(mode: str, call: dict):
    """A zero-argument function making one call of the route in this mode."""
    import functools

    import fla.ops.common.chunk_delta_h as fla_stage4
    import kda_dhu

    if mode == "direct":
        return functools.partial(kda_dhu.chunk_gated_delta_rule_bwd_dhu, **call)
    if mode == "fla_raw":
        return functools.partial(kda_dhu.fla_function(), **call)
    return functools.partial(fla_stage4.chunk_gated_delta_rule_bwd_dhu, **call)


def step_fns(call: dict, device: str) -> dict:
    """The kernel route's steps (STEPS) as zero-argument functions."""
    import kda_dhu
    import torch
    from kda_dhu import _core, _dispatch

    fns = {
        "validate": lambda: _core.validate(**call),
        "force": _core.force,
    }
    if device == "cpu":
        dh_shape = (1, 1, 1, ROUTES["kernel"]["K"], ROUTES["kernel"]["V"])
        dh0, dv = call["dht"], call["dv"]
        fns["torch.empty x3"] = lambda: (
            torch.empty(dh_shape, dtype=dv.dtype),
            torch.empty_like(dh0),
            torch.empty_like(dv),
        )
        return fns
    decided = _core.decide("extended", **call)
    if decided.action != "kernel":
        raise RuntimeError(f"the planner sends the kernel route to fla: {decided.reason}")
    dh_shape, dh0_shape, dv2_shape = decided.out_shapes()
    dh = torch.empty(dh_shape, dtype=call["q"].dtype, device=device)
    dh0 = torch.empty(dh0_shape, dtype=torch.float32, device=device)
    dv2 = torch.empty(dv2_shape, dtype=call["dv"].dtype, device=device)
    stream = torch.cuda.current_stream().cuda_stream
    c = call
    f = route_call("fla_b8_k256", device)
    fns.update(
        {
            "decide": lambda: _core.decide("extended", **c),
            "run (one crossing)": lambda: _core.run("extended", **c),
            "Call.run": decided.run,
            "Call.launch": lambda: decided.launch(dh, dh0, dv2, stream),
            "launch (stateless)": lambda: _core.launch(**c, dh=dh, dh0=dh0, dv2=dv2, stream=stream),
            "verify": lambda: _dispatch.verify(**c),
            # where a call the planner sends to fla spends its host time (fla_b8_k256)
            "fla route: validate": lambda: _core.validate(**f),
            "fla route: decide": lambda: _core.decide("extended", **f),
            "fla route: verify": lambda: _dispatch.verify(**f),
            "fla route: direct": lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**f),
            "fla route: fla_raw": lambda: kda_dhu.fla_function()(**f),
            "torch.empty x3": lambda: (
                torch.empty(dh_shape, dtype=c["q"].dtype, device=device),
                torch.empty(dh0_shape, dtype=torch.float32, device=device),
                torch.empty(dv2_shape, dtype=c["dv"].dtype, device=device),
            ),
        }
    )
    return fns


def expected_launches(route: str, mode: str) -> int | None:
    """Kernel launches per call that the route and mode imply (None: not checked)."""
    if mode in ("direct", "registry"):
        return 1 if ROUTES[route]["planner"] == "kernel" else 0
    return 0


STEP_LAUNCHES = {
    "run (one crossing)": 1,
    "Call.run": 1,
    "Call.launch": 1,
    "launch (stateless)": 1,
}


# ----------------------------------------------------------------------------- clock


class Clock:
    """Host microseconds per call of a batch of calls; on a GPU, each batch queued behind a
    sleep kernel longer than the batch (see the module's docstring)."""

    def __init__(self, cuda: bool, sleep_factor: float = 3.0, min_sleep_us: float = 3000.0):
        self.cuda = cuda
        self.sleep_factor = sleep_factor
        self.min_sleep_us = min_sleep_us
        self.cycles_per_us = self._calibrate() if cuda else None

    @staticmethod
    def _calibrate() -> float:
        """GPU clock cycles of torch.cuda._sleep per microsecond: the fastest of a few
        trials (the highest clock), so a sleep sized with it lasts at least as long."""
        import torch

        best = 0.0
        cycles = 20_000_000
        for _ in range(4):
            torch.cuda._sleep(1_000_000)
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            best = max(best, cycles / (a.elapsed_time(b) * 1e3))
        return best

    def batch(self, fn, calls: int, est_us: float) -> tuple:
        """(host us per call, whether the sleep had ended before the batch did)."""
        import torch

        sleep_done = None
        gc.disable()
        try:
            if self.cuda:
                us = max(self.sleep_factor * est_us * calls, self.min_sleep_us)
                torch.cuda._sleep(int(us * self.cycles_per_us))
                sleep_done = torch.cuda.Event()
                sleep_done.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            dt = time.perf_counter() - t0
            caught_up = bool(sleep_done.query()) if sleep_done is not None else False
        finally:
            gc.enable()
        if self.cuda:
            torch.cuda.synchronize()
        return dt / calls * 1e6, caught_up

    def sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()


# ----------------------------------------------------------------------------- measurement


def rotated(seq, r: int) -> list:
    seq = list(seq)
    k = r % len(seq) if seq else 0
    return seq[k:] + seq[:k]


def measure(cells: dict, clock: Clock, rounds: int, calls: int, warmup: int, on_cell=None) -> dict:
    """Per-round host us of every cell. ``cells``: {group: {name: (fn, env)}} where env()
    sets the cell's environment. Returns {group: {name: {"per_round_us": [...],
    "caught_up": n, "warmup_us": us}}}."""
    out = {g: {n: {"per_round_us": [], "caught_up": 0} for n in names} for g, names in cells.items()}
    est = {}
    for g, names in cells.items():
        for n, (fn, env) in names.items():
            env()
            for _ in range(warmup):
                fn()
            clock.sync()
            us, _ = clock.batch(fn, calls, 0.0)  # behind the shortest sleep: sizes the later ones
            est[g, n] = us
            out[g][n]["warmup_us"] = us
            if on_cell is not None:
                on_cell(g, n)
    for r in range(rounds):
        for g in rotated(cells, r):
            for n in rotated(cells[g], r):
                fn, env = cells[g][n]
                env()
                us, caught = clock.batch(fn, calls, max(est[g, n], 1.0))
                est[g, n] = max(est[g, n], us)
                out[g][n]["per_round_us"].append(us)
                out[g][n]["caught_up"] += int(caught)
    for g in out.values():
        for cell in g.values():
            t = cell["per_round_us"]
            cell["median_us"] = statistics.median(t) if t else None
            cell["min_us"] = min(t) if t else None
    return out


def paired(a: list, b: list, c: list | None = None) -> float | None:
    """Median over rounds of a - b (- c): differences within each round."""
    if not a or not b or (c is not None and not c):
        return None
    d = [x - y - (z if c is not None else 0.0) for x, y, z in zip(a, b, c if c is not None else a)]
    return statistics.median(d)


def derive(cells: dict) -> tuple:
    """(derived figures per route, targets) from the measured cells."""
    derived, targets = {}, []
    for route, modes in cells.items():
        if route not in ROUTES:
            continue
        t = {m: c["per_round_us"] for m, c in modes.items()}
        d = {}
        if "registry" in t and "null_accept" in t and "direct" in t:
            d["registry_minus_null_accept_minus_direct_us"] = paired(
                t["registry"], t["null_accept"], t["direct"]
            )
        if "registry" in t and "null_accept" in t:
            d["registry_minus_null_accept_us"] = paired(t["registry"], t["null_accept"])
        if "registry" in t and "fla_off" in t:
            d["registry_minus_fla_off_us"] = paired(t["registry"], t["fla_off"])
        if "registry" in t and "null_reject" in t:
            d["registry_minus_null_reject_us"] = paired(t["registry"], t["null_reject"])
        if "fla_off" in t and "fla_raw" in t:
            d["fla_wrapper_us"] = paired(t["fla_off"], t["fla_raw"])
        derived[route] = d
        if ROUTES[route]["planner"] == "kernel":
            name, key = (
                "kernel route: registry - null_accept - direct",
                "registry_minus_null_accept_minus_direct_us",
            )
            what = (
                "through fla's registry, kda-dhu adds at most 5 us to fla's own dispatch cost (the accepting "
                "do-nothing backend) over its direct call"
            )
        else:
            name, key = "fla route: registry - fla_off", "registry_minus_fla_off_us"
            what = "a call the planner sends to fla costs at most 5 us more than fla's public path with kda-dhu off"
        value = d.get(key)
        targets.append(
            {
                "route": route,
                "name": name,
                "what": what,
                "value_us": value,
                "limit_us": LIMIT_US,
                "ok": None if value is None else bool(value <= LIMIT_US),
            }
        )
    return derived, targets


# ----------------------------------------------------------------------------- record


def _f(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def markdown_table(record: dict) -> str:
    """The table of a host-overhead record (also what --table prints)."""
    s = record["settings"]
    head = (
        f"{record['gpu']}, torch {record['torch']}, fla {record['fla_version']}, kda_dhu "
        f"{record['kda_dhu_commit']}, {record['date']}; host us per call, median over {s['rounds']} rounds "
        f"of {s['calls']} calls{' (DRY RUN, CPU tensors)' if record.get('dry_run') else ''}\n\n"
    )
    modes = record["modes"]
    lines = [
        "| route | " + " | ".join(modes) + " | registry - null_accept - direct | registry - fla_off |",
        "|---|" + "---|" * (len(modes) + 2),
    ]
    for route, cells in record["cells"].items():
        d = record["derived"].get(route, {})
        lines.append(
            f"| {route} | "
            + " | ".join(_f(cells[m]["median_us"]) if m in cells else "-" for m in modes)
            + f" | {_f(d.get('registry_minus_null_accept_minus_direct_us'))}"
            f" | {_f(d.get('registry_minus_fla_off_us'))} |"
        )
    out = head + "\n".join(lines) + "\n"
    if record.get("steps"):
        out += "\n| kernel route step | host us |\n|---|---|\n"
        for n, c in record["steps"].items():
            out += f"| {n} | {_f(c['median_us'], '.2f')} |\n"
    if record.get("targets"):
        out += "\n| target | value us | limit us | ok |\n|---|---|---|---|\n"
        for t in record["targets"]:
            ok = "-" if t["ok"] is None else ("yes" if t["ok"] else "**no**")
            out += f"| {t['route']}: {t['name']} | {_f(t['value_us'])} | {t['limit_us']:g} | {ok} |\n"
    if record.get("problems"):
        out += "\nProblems: " + "; ".join(record["problems"]) + "\n"
    return out


def versions() -> dict:
    import kda_dhu
    import torch

    out = {"torch": torch.__version__, "kda_dhu_version": kda_dhu.__version__}
    try:
        import fla

        out["fla_version"] = fla.__version__
    except Exception:  # noqa: BLE001
        out["fla_version"] = None
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        out["triton"] = None
    out["python"] = platform.python_version()
    return out


def cut_fla_autotune(n: int) -> int:
    """fla's stage-4 autotuners keep their first n configs (0: all); returns how many
    autotuners were cut."""
    if n <= 0:
        return 0
    from kda_dhu import _measure as bench

    tuners = bench.fla_stage4_autotuners()
    for t in tuners:
        t.configs = list(t.configs)[:n]
    return len(tuners)


def run(args) -> tuple:
    """Measures and returns (record, exit status)."""
    import kda_dhu
    import torch
    from bench import git_commit
    from kda_dhu import _core, fla_backend

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    routes = [r for r in (DRY_RUN_ROUTES if dry else ROUTES) if not args.routes or r in args.routes]
    modes = [m for m in (DRY_RUN_MODES if dry else MODES) if not args.modes or m in args.modes]
    steps = [] if args.no_steps else list(DRY_RUN_STEPS if dry else STEPS)

    if not fla_backend.register_backend():
        raise SystemExit(
            "host_overhead: kda-dhu cannot register in fla's registry (FLA_DISABLE_BACKEND_DISPATCH=1?)"
        )
    if kda_dhu.is_patched():
        raise SystemExit("host_overhead: kda_dhu.patch() is active; fla's public path would be kda-dhu's")
    cut = 0 if dry else cut_fla_autotune(args.fla_configs)
    problems = []
    with null_backends() as instances:
        calls = {r: route_call(r, device) for r in routes}
        planner = {}
        for r in routes:
            if dry:
                planner[r] = None
                continue
            ok, reason = kda_dhu.plan_call(**calls[r])
            planner[r] = [ok, reason]
            if ok != (ROUTES[r]["planner"] == "kernel"):
                problems.append(f"{r}: the planner says {'kernel' if ok else 'fla'} ({reason})")
        # the accepting backend's outputs: the route's own, computed once (fla's, or the
        # CPU path's in a dry run)
        outputs = {}
        if "null_accept" in modes:
            set_mode_env("direct", instances)
            compute = kda_dhu.chunk_gated_delta_rule_bwd_dhu if dry else kda_dhu.fla_function()
            outputs = {r: compute(**calls[r]) for r in routes}

        def env_of(mode, route=None):
            def env():
                set_mode_env(mode, instances)
                if mode == "null_accept":
                    instances["null_accept"].outputs = outputs[route]

            return env

        cells = {r: {m: (mode_fn(m, calls[r]), env_of(m, r)) for m in modes} for r in routes}
        if steps:
            fns = step_fns(calls["kernel"] if "kernel" in calls else route_call("kernel", device), device)
            cells["steps"] = {s: (fns[s], env_of("registry")) for s in steps}

        launches = {}

        def check(group, name):
            """One more call of the cell: kernel launches, and null_accept's outputs."""
            fn, env = cells[group][name]
            env()
            before = _core.launch_count()
            out = fn()
            n = _core.launch_count() - before
            if group == "steps":
                want = None if dry else STEP_LAUNCHES.get(name, 0)
            else:
                want = None if dry else expected_launches(group, name)
                if name == "null_accept" and out is not outputs[group]:
                    problems.append(
                        f"{group} null_accept: fla did not return the do-nothing backend's outputs"
                    )
            launches[group, name] = n
            if want is not None and n != want:
                problems.append(f"{group} {name}: {n} kernel launches per call, expected {want}")

        clock = Clock(cuda=not dry)
        t0 = time.time()
        measured = measure(cells, clock, args.rounds, args.calls, args.warmup, on_cell=check)
        elapsed = time.time() - t0
        set_mode_env("registry", instances)
    for (g, n), k in launches.items():
        measured[g][n]["launches_per_call"] = k
        if measured[g][n]["caught_up"]:
            problems.append(
                f"{g} {n}: in {measured[g][n]['caught_up']} of {args.rounds} batches the queued sleep "
                "ended before the batch (a synchronization in the call, or a host stall)"
            )
    steps_rec = measured.pop("steps", None)
    derived, targets = derive(measured)
    v = versions()
    record = {
        "kind": "host-overhead",
        "date": datetime.date.today().isoformat(),
        "gpu": "cpu-dry-run" if dry else torch.cuda.get_device_name(),
        **v,
        "kda_dhu_commit": git_commit(),
        "dry_run": dry,
        "cpu_count": os.cpu_count(),
        "what": (
            "host wall-clock microseconds per stage-4 call (median over rounds of per-round means; each batch "
            "queued behind a sleep kernel on the GPU), see benches/host_overhead.py's docstring"
        ),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "settings": {
            "rounds": args.rounds,
            "calls": args.calls,
            "warmup": args.warmup,
            "fla_configs": args.fla_configs,
            "fla_autotuners_cut": cut,
            "sleep_factor": clock.sleep_factor,
            "sleep_cycles_per_us": clock.cycles_per_us,
            "varlen_lengths": VARLEN_LENGTHS,
        },
        "routes": {r: {**ROUTES[r], "planner_verdict": planner[r]} for r in routes},
        "modes": modes,
        "cells": measured,
        "steps": steps_rec,
        "derived": derived,
        "targets": targets,
        "problems": problems,
        "tma_cache": None if dry else _core.tma_cache_info(),
        "dlpack_intake": _core.dlpack_intake(),
        "elapsed_s": elapsed,
    }
    missed = [t for t in targets if t["ok"] is False]
    return record, (1 if problems or missed else 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="folder for host-latest.{json,md} and the dated copy")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 10; dry run 2)")
    ap.add_argument("--calls", type=int, default=None, help="calls per batch (default 200; dry run 5)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed calls per cell first (default 20; dry run 2)"
    )
    ap.add_argument(
        "--fla-configs", type=int, default=2, help="fla's stage-4 autotune configs kept (default 2; 0 all)"
    )
    ap.add_argument("--routes", default="", help="comma-separated subset of: " + ", ".join(ROUTES))
    ap.add_argument("--modes", default="", help="comma-separated subset of: " + ", ".join(MODES))
    ap.add_argument("--no-steps", action="store_true", help="skip the kernel route's steps")
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU tensors, no GPU: the machinery and the record"
    )
    ap.add_argument("--table", default="", metavar="JSON", help="print a record's table and exit")
    args = ap.parse_args(argv)
    if args.table:
        try:
            with open(args.table) as f:
                print(markdown_table(json.load(f)), end="")
        except (OSError, ValueError, KeyError, TypeError) as err:
            ap.error(f"--table {args.table}: not a host-overhead record ({type(err).__name__}: {err})")
        return 0
    defaults = (2, 5, 2) if args.dry_run else (10, 200, 20)
    for name, d in zip(("rounds", "calls", "warmup"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, d)
    if args.rounds < 1 or args.calls < 1 or args.warmup < 0:
        ap.error("--rounds and --calls must be >= 1, --warmup >= 0")
    args.routes = [r for r in args.routes.split(",") if r]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [r for r in args.routes if r not in ROUTES] + [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown route(s) / mode(s) {bad}")
    warnings.filterwarnings("ignore")
    os.environ.pop("KDA_DHU_FORCE", None)
    os.environ.pop("KDA_DHU_CHECK_INPUTS", None)

    import torch

    if not args.dry_run:
        if not torch.cuda.is_available():
            print("host_overhead: no CUDA device (--dry-run runs the machinery on the CPU)", file=sys.stderr)
            return 2
        import kda_dhu

        usable, why = kda_dhu.cuda_status()
        if not usable:
            print(f"host_overhead: kda-dhu cannot launch here: {why}", file=sys.stderr)
            return 2
    record, status = run(args)
    table = markdown_table(record)
    print(table, end="")
    if args.out:
        from bench import write_record

        write_record(record, args.out, table, prefix="host-", with_commit=True)
        print(f"wrote {args.out}/host-latest.json")
    for p in record["problems"]:
        print(f"problem: {p}")
    met = [t for t in record["targets"] if t["ok"]]
    print(f"targets: {len(met)} of {len(record['targets'])} met; {len(record['problems'])} problem(s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
