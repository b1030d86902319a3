"""End to end: fla's chunk_kda forward + backward with kda-dhu's fla backend off and on.

    python benches/e2e.py                      # every case; prints the table
    python benches/e2e.py --out DIR            # also writes DIR/e2e-<date>-<gpu>.json, e2e-latest.{json,md}
    python benches/e2e.py --shapes kda_b8_t4096_h32 --reps 10
    python benches/e2e.py --fwd-h              # "on" runs fla's forward scan on kda-dhu's kernel too
    python benches/e2e.py --table e2e-latest.json   # the table of a recorded run (no GPU)

What one case does (all in one process, on the same inputs):

1. Inputs as fla's own tests and benchmarks draw them (tests/ops/test_kda.py,
   benchmarks/ops/registry.py): q, k, v ~ N(0, 1) bf16 with use_qk_l2norm_in_kernel=True,
   g = logsigmoid(N(0, 1)) / gate_normalizer fp32 (log-space, per key for KDA, per head
   for GDN), beta = sigmoid(N(0, 1)) bf16, initial_state ~ N(0, 1) fp32, all leaves with
   requires_grad; upstream gradients do ~ N(0, 1) bf16 and dht ~ N(0, 1) fp32 (the final
   state is an output, so stage 4 gets a real dht). Varlen cases pack documents whose
   lengths are drawn uniformly from 256-1792 tokens (fixed seed; ``varlen_lengths``) into
   B = 1, T = 32768, as a pretraining step packs them; fla's backward then hands stage 4
   its chunk_indices (cached from the forward).
2. Gradient check: one forward, then backward (torch.autograd.grad, retain_graph) with
   kda-dhu off (FLA_KDA_DHU=0), on (unset), and off again, on the same graph (its forward
   run with kda-dhu off). Every input's gradient (q, k, v, g, beta, initial_state) is
   compared on vs off by relative L2 error; off vs off-again gives fla's own run-to-run
   noise. Fails above --tol (2e-2, bf16). Done for each --check-normalizers value (1:
   fla's gates, the strong decay of its tests; 16: slow decay, so the state gradient
   carries across many chunks).
   Kernel routing is checked at the same time: kda_dhu.testing.KernelProbe counts kda-dhu's
   kernel launches (kda_dhu._core.launch_count(): every route, the one-crossing path
   included) and records the backend verifier's verdicts (kda_dhu._dispatch.verify); on
   must launch the kernel once per stage-4 call (with --fwd-h, once more per forward-scan
   call), off never. The timed backwards and forwards are counted too
   ("kernel_launches_timed", "kernel_launches_timed_fwd").
3. Timing: CUDA events around the forward (with autograd recording, as in training)
   and around the whole backward (autograd.grad on one retained graph), the two modes
   alternating iteration by iteration (order swapped every iteration), no
   synchronization between iterations; medians after warm-up. Stage 4 alone is timed
   by temporarily rebinding chunk_gated_delta_rule_bwd_dhu in the op's backward module
   (fla.ops.kda.chunk_bwd) to a wrapper that records CUDA events around the call (fla's
   dispatch, kda-dhu's planning and any host synchronization included).

--fwd-h: kda-dhu's backend for fla's forward state scan, chunk_gated_delta_rule_fwd_h
(fla.ops.common.chunk_delta_h; KDA's forward calls it, and its backward again to recompute
h), is on in the "on" mode too: KDA_DHU_FWD_H=on while "on" runs, off in "off" (without
--fwd-h it is off in both: "on" is stage 4 alone). The forward is then checked as well:
in each gradient check one more forward (no_grad) with both on, o and the final state
compared with the off forward's by relative L2 error (over --tol fails). The forward scan
is timed like stage 4, through the same wrapper bound to chunk_gated_delta_rule_fwd_h in
every module of the op's fla package that imported it (KDA: fla.ops.kda.chunk_fwd and
chunk_bwd), over whole steps (forward + backward, --stage4-reps per mode, alternating):
"fwd_h_ms" is the median per step of the sum of its calls, "fwd_h_calls_per_step" their
number. The record says "fwd_h": true.

--graph-probe adds one more check: chunk_kda's CUDA-graph varlen mode (use_graph=True,
cu_seqlens padded with zero-length tail sequences, run eagerly as fla's warm-up step is),
backward off and on; fla then passes stage 4 fixed-size chunk tables (chunk_indices with
nt_max rows). A failure with kda-dhu on where fla runs counts as a failed check.

GDN (fla.ops.gated_delta_rule.chunk_gated_delta_rule) runs only where fla runs its
backward: fla 0.6.0 refuses gated chunk_bwd_dqkwg on Hopper with Triton >= 3.4 and
< 3.7.1 (RuntimeError, its issue 640). ``gdn_backward_refusal`` asks that function itself
on tiny tensors (it refuses before compiling anything), else runs a small GDN forward and
backward; a refused GDN case is recorded as a row note ("skipped") with fla's words.

Targets (the record's "targets", from the measurement that set them, main at 68fc16f):
the varlen KDA case's stage 4 at least 1.25x and its backward at least 1.005x faster with
kda-dhu on; the dense case not worse than then (backward 15.55 -> 15.33 ms, 1.014x, less
0.5%; stage 4 0.778 -> 0.549 ms, 1.417x, less 5%: ratios, since absolute times move from
machine to machine; the run-to-run spread of stage 4's ratio was 3%); one long sequence
(kda_b1_t65536_h32, 64 CTAs): stage 4 at least 1.4x, the backward at least 1.015x. With
--fwd-h also: the dense case's forward + backward (fwd ms + bwd ms) at least 1.02x. The
last line printed is "targets: M of N met".

Each case's row is also written to DIR/e2e-partial.json as it finishes (removed when the
run completes), so a run cut short leaves what it measured.

Exit status: 0 all checks passed and every target met; 1 a gradient (or, --fwd-h, forward
output) error over --tol, a non-finite one, the kernel not running with the backend on (or
running with it off), a case that raised, or a target missed; 2 no usable GPU / kda-dhu
extension.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import json
import logging
import os
import statistics
import sys
import time
import traceback

# benches/ on the path: bench.py's record tools (git_commit, write_record), also where
# this file is loaded by path (the tests).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The backend switch (FLA_KDA_DHU) and the kernel-launch / verdict probe, shared with
# benches/cp_check.py; the forward scan's switch (KDA_DHU_FWD_H, read at every call).
from kda_dhu.fla_backend import FWD_H_SWITCH as FWD_H_ENV
from kda_dhu.testing import BACKEND_ENV, KernelProbe, restored_backend, set_backend

STAGE4 = "chunk_gated_delta_rule_bwd_dhu"
FWD_H = "chunk_gated_delta_rule_fwd_h"  # fla's forward state scan (--fwd-h)
MODES = ("fla", "kda_dhu")  # FLA_KDA_DHU=0, unset (and KDA_DHU_FWD_H=on with --fwd-h)
DEVICE = "cuda"
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")

# name -> op, shape; varlen = (shortest, longest) document length (None: dense)
VARLEN_RANGE = (256, 1792)
CASES = {
    "kda_b8_t4096_h32": dict(op="kda", B=8, T=4096, H=32, HV=32, K=128, V=128, varlen=None),
    "kda_varlen_t32768_h32": dict(op="kda", B=1, T=32768, H=32, HV=32, K=128, V=128, varlen=VARLEN_RANGE),
    # one long sequence: 64 CTAs, half a wave on an H200
    "kda_b1_t65536_h32": dict(op="kda", B=1, T=65536, H=32, HV=32, K=128, V=128, varlen=None),
    # 16 heads: 32 CTAs, stage 4 split in three segments (src/split.rs)
    "kda_b1_t65536_h16": dict(op="kda", B=1, T=65536, H=16, HV=16, K=128, V=128, varlen=None),
    "gdn_b8_t4096_h32": dict(op="gdn", B=8, T=4096, H=32, HV=32, K=128, V=128, varlen=None),
    "gdn_varlen_t32768_h32": dict(op="gdn", B=1, T=32768, H=32, HV=32, K=128, V=128, varlen=VARLEN_RANGE),
}

# The measurement the targets come from (fla 0.6.0, torch 2.11, H200, main at 68fc16f),
# medians in ms, fla / kda-dhu.
BEFORE = {
    "kda_b8_t4096_h32": {
        "bwd_ms": {"fla": 15.55, "kda_dhu": 15.33},
        "stage4_ms": {"fla": 0.778, "kda_dhu": 0.549},
    },
    "kda_varlen_t32768_h32": {
        "bwd_ms": {"fla": 16.12, "kda_dhu": 16.21},
        "stage4_ms": {"fla": 0.739, "kda_dhu": 0.864},
    },
}
VARLEN_TARGETS = {"stage4_speedup": 1.25, "bwd_speedup": 1.005}
# One long sequence (issue "Below one wave"): stage 4 against fla's best, the backward.
LONG_TARGETS = {"stage4_speedup": 1.4, "bwd_speedup": 1.015}
# "Not worse than before" for the dense case: the ratio then, less this fraction.
DENSE_SLACK = {"bwd_speedup": 0.005, "stage4_speedup": 0.05}

# With --fwd-h: the dense case's forward + backward, both ops on (the step).
FWD_H_TARGETS = {"fwd_bwd_speedup": 1.02}

# the module whose global STAGE4 the op's backward calls
BACKWARD_MODULE = {"kda": "fla.ops.kda.chunk_bwd", "gdn": "fla.ops.gated_delta_rule.chunk"}
# the op's fla package: its modules that imported FWD_H call it (forward, backward's recompute)
OP_PACKAGE = {"kda": "fla.ops.kda", "gdn": "fla.ops.gated_delta_rule"}
FWD_H_SOURCE = "fla.ops.common.chunk_delta_h"


# ----------------------------------------------------------------------------- inputs


def varlen_lengths(T: int, lo: int = VARLEN_RANGE[0], hi: int = VARLEN_RANGE[1], seed: int = 0) -> list:
    """Document lengths drawn uniformly from [lo, hi] (Python's random, ``seed``) until they
    reach T, then the excess taken off the last ones (none below lo): every length in
    [lo, hi], summing to T, the same for a seed on every machine."""
    import random

    if not 1 <= lo <= hi or T < lo:
        raise ValueError(f"varlen_lengths: need 1 <= lo <= hi and T >= lo (T={T}, lo={lo}, hi={hi})")
    rng = random.Random(seed)
    lens = []
    while sum(lens) < T:
        lens.append(rng.randint(lo, hi))
    excess = sum(lens) - T
    for i in reversed(range(len(lens))):
        cut = min(excess, lens[i] - lo)
        lens[i] -= cut
        excess -= cut
    if excess:  # pragma: no cover - T >= lo makes this impossible
        raise AssertionError("varlen_lengths: could not fit the lengths to T")
    return lens


def make_inputs(case: dict, seed: int = 0, gate_normalizer: float = 1.0, device=None):
    """(leaves, grad_outputs, cu_seqlens, cu_seqlens_cpu, lengths) for one case.

    The same seed gives the same tensors whatever the gate normalizer (only g changes).
    """
    import torch
    import torch.nn.functional as F

    B, T, H, HV, K, V = (case[k] for k in ("B", "T", "H", "HV", "K", "V"))
    device = DEVICE if device is None else device
    dtype = torch.bfloat16
    lengths = varlen_lengths(T, *case["varlen"], seed=seed) if case["varlen"] else None
    N = B if lengths is None else len(lengths)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    q = randn(B, T, H, K, dt=dtype)
    k = randn(B, T, H, K, dt=dtype)
    v = randn(B, T, HV, V, dt=dtype)
    g_shape = (B, T, HV, K) if case["op"] == "kda" else (B, T, HV)
    g = F.logsigmoid(randn(*g_shape)) / gate_normalizer
    beta = randn(B, T, HV).sigmoid().to(dtype)
    h0 = randn(N, HV, K, V)
    leaves = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    for t in leaves.values():
        t.requires_grad_(True)
    grads_out = (randn(B, T, HV, V, dt=dtype), randn(N, HV, K, V))  # do, dht
    cu = cu_cpu = None
    if lengths is not None:
        offs = [0]
        for n in lengths:
            offs.append(offs[-1] + n)
        cu_cpu = torch.tensor(offs, dtype=torch.int64)
        cu = cu_cpu.to(device)
    return leaves, grads_out, cu, cu_cpu, lengths


def forward(op: str, x: dict, cu, cu_cpu, **extra):
    """(o, final_state) of fla's chunked op, training-style (autograd recording)."""
    kw = dict(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        scale=None,
        initial_state=x["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
        **extra,
    )
    if op == "kda":
        from fla.ops.kda import chunk_kda

        return chunk_kda(**kw)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(**kw)


# ----------------------------------------------------------------------------- modes and probes

FWD_H_ON = False  # --fwd-h (set by main)


def set_mode(mode: str) -> None:
    """kda-dhu's fla backend on for mode "kda_dhu" (FLA_KDA_DHU unset), off for any other
    (FLA_KDA_DHU=0); its forward scan on (KDA_DHU_FWD_H=on) only in "kda_dhu" under --fwd-h,
    off (KDA_DHU_FWD_H=off) otherwise."""
    set_backend(mode)
    if FWD_H_ON and mode == "kda_dhu":
        os.environ[FWD_H_ENV] = "on"
    else:
        os.environ[FWD_H_ENV] = "off"


@contextlib.contextmanager
def restored_switches():
    """FLA_KDA_DHU and KDA_DHU_FWD_H back to their values on entry when the block exits."""
    before = os.environ.get(FWD_H_ENV)
    with restored_backend():
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(FWD_H_ENV, None)
            else:
                os.environ[FWD_H_ENV] = before


def fwd_h_modules(op: str) -> list:
    """The modules of the op's fla package (imported) that bound fla's FWD_H by name."""
    fn = getattr(importlib.import_module(FWD_H_SOURCE), FWD_H)
    pkg = OP_PACKAGE[op]
    importlib.import_module(pkg)
    return [
        m
        for name, m in sorted(sys.modules.items())
        if (name == pkg or name.startswith(pkg + ".")) and m is not None and m.__dict__.get(FWD_H) is fn
    ]


class Stage4Spy:
    """Temporarily rebinds STAGE4 in the op's backward module to a wrapper that counts
    calls and, while ``timing``, records CUDA events around each (tagged with ``mode`` and
    ``step``, which ``begin`` sets before each timed call of ``alternate``). The wrapper
    runs on the caller's thread (autograd's backward thread in the backward), on its
    current stream."""

    name = STAGE4

    def __init__(self, op: str):
        self.modules = self._modules(op)
        self.calls = 0
        self.launches = []  # kda-dhu's kernel launches of each call
        self.timing = False
        self.mode = None
        self.step = 0
        self.events = []

    @staticmethod
    def _modules(op: str) -> list:
        return [importlib.import_module(BACKWARD_MODULE[op])]

    def reset(self):
        self.calls = 0
        self.launches = []
        self.events = []

    def begin(self, mode, timed):
        """alternate's on_mode: the next call's mode (None in warm-up: left out), a new step."""
        self.mode = mode if timed else None
        self.step += 1

    def __enter__(self):
        import torch

        inner = self.modules[0].__dict__[self.name] if self.modules else None
        self._inner = inner

        def wrapper(*args, **kwargs):
            self.calls += 1
            n0 = KernelProbe._count()
            if self.timing:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            out = inner(*args, **kwargs)
            if self.timing:
                end.record()
                self.events.append((self.mode, self.step, start, end))
            self.launches.append(KernelProbe._count() - n0)
            return out

        wrapper.__wrapped__ = inner
        self._wrapper = wrapper
        for module in self.modules:
            setattr(module, self.name, wrapper)
        return self

    def __exit__(self, *exc):
        for module in self.modules:
            if module.__dict__.get(self.name) is self._wrapper:
                setattr(module, self.name, self._inner)
        return False

    def medians(self) -> dict:
        out = {}
        for mode in MODES:
            t = [s.elapsed_time(e) for m, _, s, e in self.events if m == mode]
            out[mode] = statistics.median(t) if t else None
        return out

    def per_step(self) -> tuple:
        """({mode: median over steps of the summed ms of a step's calls}, {mode: calls per
        step, a float if the steps differ}), None for a mode without events."""
        ms, calls = {}, {}
        for mode in MODES:
            steps = {}
            for m, step, s, e in self.events:
                if m == mode:
                    steps.setdefault(step, []).append(s.elapsed_time(e))
            ms[mode] = statistics.median(sum(t) for t in steps.values()) if steps else None
            n = [len(t) for t in steps.values()]
            calls[mode] = (n[0] if len(set(n)) == 1 else sum(n) / len(n)) if n else None
        return ms, calls


class FwdHSpy(Stage4Spy):
    """Stage4Spy for FWD_H, bound in every module of the op's fla package that imported it
    (KDA: fla.ops.kda.chunk_fwd, the forward, and chunk_bwd, the backward's recompute)."""

    name = FWD_H

    @staticmethod
    def _modules(op: str) -> list:
        return fwd_h_modules(op)


class LogCapture(logging.Handler):
    """fla's backend dispatch logs each choice once at INFO ('[FLA Backend] ...')."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        if STAGE4 in msg:
            self.lines.append(msg)


# ----------------------------------------------------------------------------- measurement


def alternate(fn, warmup: int, reps: int, on_mode=None, count=None) -> dict:
    """Median CUDA-event ms of fn() per mode, modes alternating (order swapped every
    iteration); events are read after one synchronization at the end. on_mode(mode,
    timed) is called before each call. ``count``: a counter read around each timed call
    (kernel launches: counted on the host when issued), summed per mode as "count"."""
    import torch

    events = {m: [] for m in MODES}
    counted = {m: 0 for m in MODES}
    for i in range(warmup + reps):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            set_mode(mode)
            if on_mode is not None:
                on_mode(mode, i >= warmup)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            before = count() if count is not None else 0
            start.record()
            fn()
            end.record()
            if i >= warmup:
                events[mode].append((start, end))
                if count is not None:
                    counted[mode] += count() - before
    torch.cuda.synchronize()
    out = {}
    for mode, pairs in events.items():
        t = [s.elapsed_time(e) for s, e in pairs]
        out[mode] = {"median": statistics.median(t), "min": min(t), "max": max(t)}
        if count is not None:
            out[mode]["count"] = counted[mode]
    return out


def rel_err(out, ref) -> float:
    from kda_dhu.reference import rel_err as _rel_err  # one definition, the package's

    return _rel_err(out, ref)


def grad_check(case, args, probe: KernelProbe, spy: Stage4Spy, normalizer: float, fspy: FwdHSpy) -> dict:
    """Backward off / on / off on one forward graph (forward off); errors and routing. With
    --fwd-h also a forward with both ops on (no_grad), its outputs against the graph's."""
    import torch

    x, grads_out, cu, cu_cpu, _ = make_inputs(case, seed=args.seed, gate_normalizer=normalizer)
    leaves = [x[n] for n in GRAD_NAMES]
    set_mode("fla")
    fspy.reset()
    o, ht = forward(case["op"], x, cu, cu_cpu)
    out = {"gate_normalizer": normalizer, "fwd_h_calls_fwd": fspy.calls}
    if FWD_H_ON:
        set_mode("kda_dhu")
        probe.reset()
        fspy.reset()
        with torch.no_grad():
            o_on, ht_on = forward(case["op"], x, cu, cu_cpu)
        torch.cuda.synchronize()
        out["fwd"] = {
            "rel_err": {"o": rel_err(o_on, o), "final_state": rel_err(ht_on, ht)},
            "kernel_launches": probe.launches,
            "fwd_h_calls": fspy.calls,
            "call_launches": list(fspy.launches),
        }
        del o_on, ht_on
    grads, launches, stage4_calls, fwd_h_calls, verdicts, per_call = {}, {}, {}, {}, {}, {}
    for tag, mode in (("fla", "fla"), ("kda_dhu", "kda_dhu"), ("fla_again", "fla")):
        set_mode(mode)
        probe.reset()
        spy.reset()
        fspy.reset()
        grads[tag] = torch.autograd.grad((o, ht), leaves, grads_out, retain_graph=True)
        torch.cuda.synchronize()
        launches[tag], stage4_calls[tag], fwd_h_calls[tag] = probe.launches, spy.calls, fspy.calls
        per_call[tag] = {"stage4": list(spy.launches), "fwd_h": list(fspy.launches)}
        verdicts[tag] = sorted({f"{'kernel' if ok else 'fla'}: {why}" for ok, why in probe.verdicts})
    err = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, grads["kda_dhu"], grads["fla"])}
    noise = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, grads["fla_again"], grads["fla"])}
    del grads, o, ht, x, leaves, grads_out
    return {
        **out,
        "rel_err": err,
        "fla_repeat_rel_err": noise,
        "kernel_launches": launches,
        "stage4_calls": stage4_calls,
        "fwd_h_calls": fwd_h_calls,
        "call_launches": per_call,
        "verdicts": verdicts,
    }


def run_case(name: str, case: dict, args, probe: KernelProbe) -> dict:
    import torch

    t0 = time.time()
    op = case["op"]
    x, grads_out, cu, cu_cpu, lengths = make_inputs(
        case, seed=args.seed, gate_normalizer=args.check_normalizers[0]
    )
    leaves = [x[n] for n in GRAD_NAMES]
    fwd = functools.partial(forward, op, x, cu, cu_cpu)

    # first calls: Triton autotuning, kda-dhu's module load
    for mode in MODES:
        set_mode(mode)
        o, ht = fwd()
        torch.autograd.grad((o, ht), leaves, grads_out)
        del o, ht
    torch.cuda.synchronize()
    t_warm = time.time() - t0

    row = {
        "case": name,
        "op": op,
        **{k: case[k] for k in ("B", "T", "H", "HV", "K", "V")},
        "dtype": "bf16",
        "varlen": lengths is not None,
        "N": case["B"] if lengths is None else len(lengths),
    }
    if lengths is not None:
        s = sorted(lengths)
        row["seq_lens"] = {
            "n": len(s),
            "min": s[0],
            "median": s[len(s) // 2],
            "max": s[-1],
            "mean": sum(s) / len(s),
            "lengths": lengths,
        }

    with Stage4Spy(op) as spy, FwdHSpy(op) as fspy:
        checks = [grad_check(case, args, probe, spy, n, fspy) for n in args.check_normalizers]
        torch.cuda.empty_cache()

        fwd_ms = alternate(lambda: fwd(), args.warmup, args.reps, count=lambda: probe.launches)
        o, ht = fwd()
        bwd = functools.partial(torch.autograd.grad, (o, ht), leaves, grads_out, retain_graph=True)
        bwd_ms = alternate(bwd, args.warmup, args.reps, count=lambda: probe.launches)
        stage4 = None
        if not args.no_stage4:
            spy.reset()
            spy.timing = True
            alternate(bwd, args.warmup, args.stage4_reps, on_mode=spy.begin)  # warm-up events left out
            spy.timing = False
            stage4 = spy.medians()
        del o, ht
        fwd_h = step_ms = None
        if FWD_H_ON:  # the forward scan's calls of whole steps (forward + backward)

            def step(leaves=leaves, grads_out=grads_out):
                o, ht = fwd()
                torch.autograd.grad((o, ht), leaves, grads_out)

            fspy.reset()
            fspy.timing = True
            step_ms = alternate(step, args.warmup, args.stage4_reps, on_mode=fspy.begin)
            fspy.timing = False
            fwd_h = fspy.per_step()
            del step
    del x, leaves, grads_out
    torch.cuda.empty_cache()

    f = {m: fwd_ms[m]["median"] for m in MODES}
    b = {m: bwd_ms[m]["median"] for m in MODES}
    row.update(
        {
            "fwd_ms": f,
            "bwd_ms": b,
            "bwd_speedup": b["fla"] / b["kda_dhu"],
            "fwd_bwd_ms": {m: f[m] + b[m] for m in MODES},
            "fwd_bwd_speedup": (f["fla"] + b["fla"]) / (f["kda_dhu"] + b["kda_dhu"]),
            "fwd_ms_spread": fwd_ms,
            "bwd_ms_spread": bwd_ms,
            "stage4_ms": stage4,
            "stage4_share_of_bwd": (
                {m: stage4[m] / b[m] for m in MODES if stage4[m] is not None} if stage4 else None
            ),
            "stage4_speedup": (
                stage4["fla"] / stage4["kda_dhu"] if stage4 and stage4["fla"] and stage4["kda_dhu"] else None
            ),
            "kernel_launches_timed": {m: bwd_ms[m]["count"] for m in MODES},
            "timed_backwards": args.reps,
            "kernel_launches_timed_fwd": {m: fwd_ms[m]["count"] for m in MODES},
            "timed_forwards": args.reps,
            "fwd_h": FWD_H_ON,
            "fwd_h_ms": fwd_h[0] if fwd_h else None,
            "fwd_h_calls_per_step": fwd_h[1] if fwd_h else None,
            "fwd_h_speedup": (
                fwd_h[0]["fla"] / fwd_h[0]["kda_dhu"]
                if fwd_h and fwd_h[0]["fla"] and fwd_h[0]["kda_dhu"]
                else None
            ),
            "step_ms": {m: step_ms[m]["median"] for m in MODES} if step_ms else None,
            "grad_checks": checks,
            "max_grad_rel_err": max(v for c in checks for v in c["rel_err"].values()),
            "max_fla_repeat_rel_err": max(v for c in checks for v in c["fla_repeat_rel_err"].values()),
            "max_fwd_rel_err": max(
                (v for c in checks for v in c.get("fwd", {}).get("rel_err", {}).values()), default=None
            ),
            "reps": args.reps,
            "warmup": args.warmup,
            "first_calls_s": t_warm,
            "case_s": time.time() - t0,
        }
    )
    return row


# Kernel launches of one call that kda-dhu's kernel runs: one, or three when the plan splits
# the sequence (first pass, merge, second pass: src/split.rs).
CALL_LAUNCHES = (1, 3)


def _launch_sum(per_call, calls: int) -> tuple:
    """(the launches a list of per-call counts sums to, the counts that are not a kernel
    call's); None (a record without per-call counts): one launch for each of ``calls``."""
    per_call = [1] * calls if per_call is None else per_call
    return sum(per_call), [n for n in per_call if n not in CALL_LAUNCHES]


def _expected_launches(c: dict, fwd_h: bool) -> tuple:
    """(kda-dhu launches one backward of grad check ``c`` should make with the backend on,
    the launches of each call that are not a kernel call's) from the spies' per-call counts
    (``call_launches``), or one per call where a record has none."""
    per = c.get("call_launches", {}).get("kda_dhu")
    fh = c.get("fwd_h_calls", {}).get("kda_dhu", 0) if fwd_h else 0
    if per is None:
        return _launch_sum(None, c["stage4_calls"]["kda_dhu"] + fh)
    return _launch_sum(per["stage4"] + (per["fwd_h"] if fwd_h else []), 0)


def case_failures(row: dict, tol: float) -> list:
    out = []
    fwd_h = bool(row.get("fwd_h"))  # --fwd-h: the forward scan's calls launch the kernel too
    for c in row["grad_checks"]:
        where = f"{row['case']} (gate normalizer {c['gate_normalizer']:g})"
        bad = {n: e for n, e in c["rel_err"].items() if not (e < tol)}  # NaN / inf fail too
        if bad:
            out.append(
                f"{where}: gradient rel err over {tol:g}: "
                + ", ".join(f"{n} {e:.2e}" for n, e in bad.items())
            )
        la, calls = c["kernel_launches"], c["stage4_calls"]
        fh = c.get("fwd_h_calls", {}).get("kda_dhu", 0) if fwd_h else 0  # the backward's recompute
        if la["fla"] or la["fla_again"]:
            out.append(f"{where}: kda-dhu's kernel ran with {BACKEND_ENV}=0 ({la['fla']} launches)")
        if calls["kda_dhu"] == 0:
            out.append(f"{where}: stage 4 was never called by the backward (spy saw no call)")
        else:
            want, odd = _expected_launches(c, fwd_h)
            if la["kda_dhu"] != want or odd:
                out.append(
                    f"{where}: kda-dhu's kernel ran {la['kda_dhu']} times for {calls['kda_dhu']} "
                    + (f"stage-4 and {fh} forward-scan calls" if fwd_h else "stage-4 calls")
                    + f" with the backend on (expected {want}"
                    + (f"; calls launching neither 1 nor 3: {odd}" if odd else "")
                    + f"); verdicts: {c['verdicts']['kda_dhu']}"
                )
        fwd = c.get("fwd")  # --fwd-h: a forward with both ops on
        if fwd is not None:
            bad = {n: e for n, e in fwd["rel_err"].items() if not (e < tol)}
            if bad:
                out.append(
                    f"{where}: forward output rel err over {tol:g} ({FWD_H_ENV}=on): "
                    + ", ".join(f"{n} {e:.2e}" for n, e in bad.items())
                )
            if fwd["fwd_h_calls"] == 0:
                out.append(f"{where}: the forward scan was never called by the forward (spy saw no call)")
            elif (fwd["kernel_launches"], []) != _launch_sum(fwd.get("call_launches"), fwd["fwd_h_calls"]):
                out.append(
                    f"{where}: kda-dhu's kernel ran {fwd['kernel_launches']} times for {fwd['fwd_h_calls']} "
                    f"forward-scan calls in the forward with {FWD_H_ENV}=on"
                )
    c0 = row["grad_checks"][0] if row["grad_checks"] else {}
    timed = row.get("kernel_launches_timed")
    if timed is not None:
        per_bwd = c0["stage4_calls"]["kda_dhu"] if c0 else 1
        fh = c0.get("fwd_h_calls", {}).get("kda_dhu", 0) if fwd_h else 0
        want = _expected_launches(c0, fwd_h)[0] if c0 else per_bwd
        if timed["fla"]:
            out.append(
                f"{row['case']}: {timed['fla']} kernel launches in the timed backwards with {BACKEND_ENV}=0"
            )
        if timed["kda_dhu"] != want * row["timed_backwards"]:
            out.append(
                f"{row['case']}: {timed['kda_dhu']} kernel launches in {row['timed_backwards']} timed backwards "
                f"with the backend on ({per_bwd} stage-4 call(s)"
                + (f" and {fh} forward-scan call(s)" if fwd_h else "")
                + " each)"
            )
    timed = row.get("kernel_launches_timed_fwd")
    if timed is not None:
        per_fwd = c0.get("fwd_h_calls_fwd", 0) if fwd_h else 0
        if fwd_h and "call_launches" in c0.get("fwd", {}):
            per_fwd = _launch_sum(c0["fwd"]["call_launches"], 0)[0]
        if timed["fla"]:
            out.append(
                f"{row['case']}: {timed['fla']} kernel launches in the timed forwards with {BACKEND_ENV}=0"
            )
        if timed["kda_dhu"] != per_fwd * row["timed_forwards"]:
            out.append(
                f"{row['case']}: {timed['kda_dhu']} kernel launches in {row['timed_forwards']} timed forwards "
                + (
                    f"with both ops on ({per_fwd} forward-scan call(s) each)"
                    if fwd_h
                    else f"({FWD_H_ENV} off)"
                )
            )
    return out


def targets(rows: list, fwd_h: bool = False) -> list:
    """The record's targets (see the module's docstring) for the rows measured: each
    {"case", "what", "value", "limit", "ok"}; a value that could not be measured is None
    (ok None). ``fwd_h``: the record's --fwd-h (adds the step target)."""
    out = []
    by_case = {r["case"]: r for r in rows}

    def add(case, what, value, limit):
        out.append(
            {"case": case, "what": what, "value": value, "limit": limit,
             "ok": None if value is None else bool(value >= limit)}
        )  # fmt: skip

    if "kda_varlen_t32768_h32" in by_case:
        r = by_case["kda_varlen_t32768_h32"]
        add(r["case"], "stage-4 speedup (fla ms / kda-dhu ms) >= 1.25", r.get("stage4_speedup"),
            VARLEN_TARGETS["stage4_speedup"])  # fmt: skip
        add(r["case"], "backward speedup >= 1.005", r.get("bwd_speedup"), VARLEN_TARGETS["bwd_speedup"])
    if "kda_b1_t65536_h32" in by_case:
        r = by_case["kda_b1_t65536_h32"]
        add(r["case"], "stage-4 speedup >= 1.4", r.get("stage4_speedup"), LONG_TARGETS["stage4_speedup"])
        add(r["case"], "backward speedup >= 1.015", r.get("bwd_speedup"), LONG_TARGETS["bwd_speedup"])
    if "kda_b8_t4096_h32" in by_case:
        r = by_case["kda_b8_t4096_h32"]
        before = BEFORE[r["case"]]
        for key, ms in (("bwd_speedup", "bwd_ms"), ("stage4_speedup", "stage4_ms")):
            then = before[ms]["fla"] / before[ms]["kda_dhu"]
            limit = then * (1 - DENSE_SLACK[key])
            add(r["case"], f"{key} not worse than before ({then:.3f}x, less {DENSE_SLACK[key]:.1%})", r.get(key),
                limit)  # fmt: skip
        if fwd_h:
            add(r["case"], "forward+backward speedup, stage 4 and forward scan on, >= 1.02",
                r.get("fwd_bwd_speedup"), FWD_H_TARGETS["fwd_bwd_speedup"])  # fmt: skip
    return out


# ----------------------------------------------------------------------------- GDN probe, report


def _dqkwg_refusal():
    """fla's gated chunk_bwd_dqkwg (GDN's backward calls it after stage 4) on tiny tensors:
    None if it runs, its RuntimeError's words if it refuses (fla 0.6 refuses on Hopper with
    Triton >= 3.4, < 3.7.1 before compiling anything); raises anything else (another fla's
    signature: the caller then runs the whole op)."""
    import torch
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg

    B, T, H, K, V = 1, 64, 1, 64, 64
    dev = DEVICE
    bf = dict(device=dev, dtype=torch.bfloat16)
    q, k, do = (torch.randn(B, T, H, K, **bf) for _ in range(3))
    v = torch.randn(B, T, H, V, **bf)
    h = torch.randn(B, 1, H, K, V, **bf)
    dh = torch.randn(B, 1, H, K, V, **bf)
    g = torch.zeros(B, T, H, device=dev, dtype=torch.float32)
    try:
        chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, g=g, scale=K**-0.5)
        if q.is_cuda:
            torch.cuda.synchronize()
    except RuntimeError as err:
        return f"RuntimeError: {err}"
    return None


def gdn_backward_refusal():
    """None if fla runs GDN's backward here, else the reason (fla's own error): fla's
    refusing function asked first (``_dqkwg_refusal``), else a small forward + backward."""
    import torch

    try:
        reason = _dqkwg_refusal()
    except Exception:  # noqa: BLE001 - not this fla's signature: run the op below
        pass
    else:
        if reason is not None:
            try:
                import triton

                reason += f" (Triton {triton.__version__}, {torch.cuda.get_device_name()})"
            except Exception:  # noqa: BLE001
                pass
        return reason
    case = dict(op="gdn", B=1, T=128, H=2, HV=2, K=128, V=128, varlen=None)
    x, grads_out, _, _, _ = make_inputs(case, seed=0)
    set_mode("fla")
    try:
        o, ht = forward("gdn", x, None, None)
        torch.autograd.grad((o, ht), [x[n] for n in GRAD_NAMES], grads_out)
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - the reason is what we report
        msg = f"{type(err).__name__}: {err}"
        try:
            import triton

            msg += f" (Triton {triton.__version__}, {torch.cuda.get_device_name()})"
        except Exception:  # noqa: BLE001
            pass
        return msg
    return None


def graph_mode_probe(args, probe: KernelProbe) -> dict:
    """fla's CUDA-graph varlen mode, run eagerly (as its warm-up step is): chunk_kda with
    use_graph=True, cu_seqlens padded with two zero-length tail sequences up to
    max_num_seqs. fla then hands stage 4 fixed-shape chunk tables (chunk_indices has
    nt_max rows, sentinels past the real chunks). Backward off and on; errors recorded."""
    import torch

    case = dict(op="kda", B=1, T=4096, H=4, HV=4, K=128, V=128, varlen=(150, 450))
    x, (do, _), cu, cu_cpu, lengths = make_inputs(case, seed=args.seed)
    pad = 2
    n_max = len(lengths) + pad
    cu_cpu = torch.cat([cu_cpu, cu_cpu[-1:].repeat(pad)])
    cu = cu_cpu.to(cu.device)
    gen = torch.Generator(device=cu.device).manual_seed(args.seed + 1)
    x["initial_state"] = torch.randn(
        n_max, case["HV"], case["K"], case["V"], generator=gen, device=cu.device
    ).requires_grad_(True)
    dht = torch.randn(n_max, case["HV"], case["K"], case["V"], generator=gen, device=cu.device)
    leaves = [x[n] for n in GRAD_NAMES]
    out = {"case": f"kda_graph_varlen_t{case['T']}_h{case['H']}_n{len(lengths)}+{pad}", "max_num_seqs": n_max}
    grads = {}
    for mode in MODES:
        set_mode(mode)
        probe.reset()
        try:
            o, ht = forward("kda", x, cu, None, use_graph=True, max_num_seqs=n_max)
            # cloned: in graph mode fla may hand out static buffers it reuses
            grads[mode] = [t.clone() for t in torch.autograd.grad((o, ht), leaves, (do, dht))]
            del o, ht
            torch.cuda.synchronize()
            out[mode] = {"ok": True, "kernel_launches": probe.launches}
        except Exception as err:  # noqa: BLE001 - the finding is the error
            out[mode] = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "kernel_launches": probe.launches,
            }
    if len(grads) == 2:
        out["rel_err"] = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, grads["kda_dhu"], grads["fla"])}
    return out


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def markdown_table(record: dict) -> str:
    """The table of a record (also what --table prints)."""
    fwd_h = bool(record.get("fwd_h"))  # --fwd-h (records before it have no such field)
    head = (
        f"{record['gpu']}, fla {record['fla_version']}, torch {record['torch']}, triton "
        f"{record.get('triton')}, kda_dhu {record['kda_dhu_commit']}, {record['date']}; "
        f"medians of {record['settings']['reps']} alternating reps; fla = {BACKEND_ENV}=0"
        + (f"; kda-dhu = stage 4 and forward scan on ({FWD_H_ENV}=on, --fwd-h)" if fwd_h else "")
        + "\n\n"
    )
    cols = (
        "| case | fwd ms fla | fwd ms kda-dhu | bwd ms fla | bwd ms kda-dhu | bwd speedup "
        "| fwd+bwd speedup | stage4 ms fla | stage4 ms kda-dhu | stage4 speedup | stage4 share (fla) "
        + (
            "| fwd_h ms/step fla | fwd_h ms/step kda-dhu | fwd_h speedup | fwd_h calls/step | max fwd out err "
            if fwd_h
            else ""
        )
        + "| max grad err (fla repeat) | kernel launches on / off |"
    )
    ncols = cols.count("|") - 1
    lines = [cols, "|" + "---|" * ncols]
    for r in record["rows"]:
        s4 = r.get("stage4_ms") or {}
        share = (r.get("stage4_share_of_bwd") or {}).get("fla")
        launches = " ; ".join(
            f"{c['kernel_launches']['kda_dhu']} / {c['kernel_launches']['fla']}" for c in r["grad_checks"]
        )
        timed = r.get("kernel_launches_timed")
        if timed:
            launches += f" ; {r['timed_backwards']} timed: {timed['kda_dhu']} / {timed['fla']}"
        timed = r.get("kernel_launches_timed_fwd")
        if timed and fwd_h:
            launches += f" ; {r['timed_forwards']} timed fwd: {timed['kda_dhu']} / {timed['fla']}"
        s4x = s4["fla"] / s4["kda_dhu"] if s4.get("fla") and s4.get("kda_dhu") else None
        fh = ""
        if fwd_h:
            fms, fcalls = r.get("fwd_h_ms") or {}, r.get("fwd_h_calls_per_step") or {}
            fh = (
                f"| {_fmt(fms.get('fla'))} | {_fmt(fms.get('kda_dhu'))} | {_fmt(r.get('fwd_h_speedup'))}x "
                f"| {_fmt(fcalls.get('kda_dhu'), 'g')} | {_fmt(r.get('max_fwd_rel_err'), '.1e')} "
            )
        lines.append(
            f"| {r['case']} | {r['fwd_ms']['fla']:.3f} | {r['fwd_ms']['kda_dhu']:.3f} "
            f"| {r['bwd_ms']['fla']:.3f} | {r['bwd_ms']['kda_dhu']:.3f} | {r['bwd_speedup']:.3f}x "
            f"| {r['fwd_bwd_speedup']:.3f}x | {_fmt(s4.get('fla'))} | {_fmt(s4.get('kda_dhu'))} "
            f"| {_fmt(s4x)}x | {_fmt(share, '.1%')} {fh}| {r['max_grad_rel_err']:.1e} ({r['max_fla_repeat_rel_err']:.1e}) "
            f"| {launches} |"
        )
    for s in record.get("skipped", []):
        lines.append(f"| {s['case']} | not run: {s['reason']} |" + " |" * (ncols - 2))
    out = head + "\n".join(lines) + "\n"
    if record.get("targets"):
        out += "\n| target | case | value | limit | met |\n|---|---|---|---|---|\n"
        for t in record["targets"]:
            met = "-" if t["ok"] is None else ("yes" if t["ok"] else "**no**")
            out += f"| {t['what']} | {t['case']} | {_fmt(t['value'])} | {t['limit']:.3f} | {met} |\n"
    return out


def print_checks(row: dict) -> None:
    for c in row["grad_checks"]:
        print(
            f"    grads, gate normalizer {c['gate_normalizer']:g}: kda-dhu vs fla  "
            + "  ".join(f"{n} {e:.2e}" for n, e in c["rel_err"].items())
        )
        print(
            f"    {'':31}fla vs fla again  "
            + "  ".join(f"{n} {e:.2e}" for n, e in c["fla_repeat_rel_err"].items())
        )
        print(
            f"    {'':31}kernel launches on {c['kernel_launches']['kda_dhu']} / off "
            f"{c['kernel_launches']['fla']} for {c['stage4_calls']['kda_dhu']} stage-4 call(s); "
            f"verdicts on: {c['verdicts']['kda_dhu'] or 'none'}; off: {c['verdicts']['fla'] or 'none'}"
            + (f"; forward-scan calls {c['fwd_h_calls']['kda_dhu']}" if row.get("fwd_h") else "")
        )
        if c.get("fwd"):
            f = c["fwd"]
            print(
                f"    {'':31}forward, both on vs off  "
                + "  ".join(f"{n} {e:.2e}" for n, e in f["rel_err"].items())
                + f"  kernel launches {f['kernel_launches']} for {f['fwd_h_calls']} forward-scan call(s)"
            )


# ----------------------------------------------------------------------------- main


def build_record(meta: dict, args, log_lines: list, rows: list, skipped: list, graph, failures: list,
                 t_start: float) -> dict:  # fmt: skip
    """The run's record: meta (GPU, versions, commit), settings, rows, targets."""
    return {
        "date": datetime.date.today().isoformat(),
        **meta,
        "what": (
            "fla chunk_kda (and GDN where fla runs its backward) forward and backward, "
            f"use_qk_l2norm_in_kernel=True, bf16, output_final_state=True; kda-dhu's fla backend "
            f"off ({BACKEND_ENV}=0, 'fla') vs on (unset, 'kda_dhu'), same process, alternating; "
            "medians of CUDA events; bwd = torch.autograd.grad on a retained graph; stage4 = "
            "chunk_gated_delta_rule_bwd_dhu timed with CUDA events inside the backward; kernel "
            "launches counted by kda_dhu._core.launch_count()"
            + (
                f"; fwd_h: {FWD_H_ENV}=on in 'kda_dhu' (off in 'fla'), chunk_gated_delta_rule_fwd_h's "
                "calls timed with CUDA events over whole steps (forward + backward), summed per step"
                if args.fwd_h
                else f"; {FWD_H_ENV}=off (fla's own forward scan in both modes)"
            )
        ),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "fwd_h": args.fwd_h,
        "settings": {
            "reps": args.reps,
            "warmup": args.warmup,
            "stage4_reps": args.stage4_reps,
            "check_normalizers": args.check_normalizers,
            "tol": args.tol,
            "seed": args.seed,
            "varlen_range": list(VARLEN_RANGE),
            "fwd_h": args.fwd_h,
        },
        "fla_backend_log": log_lines,
        "rows": rows,
        "skipped": skipped,
        "graph_probe": graph,
        "before": BEFORE,
        "targets": targets(rows, fwd_h=args.fwd_h),
        "failures": failures,
        "total_s": time.time() - t_start,
    }


def _floats(text: str) -> list:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or not all(v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out",
        default="",
        help="folder for e2e-<date>-<gpu>.json, e2e-latest.json and e2e-latest.md (default: write nothing)",
    )
    ap.add_argument(
        "--shapes", default="", help="comma-separated case names (default: all): " + ", ".join(CASES)
    )
    ap.add_argument("--reps", type=int, default=30, help="timed iterations per mode (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per mode first (default 3)")
    ap.add_argument(
        "--stage4-reps",
        type=int,
        default=15,
        help="iterations per mode for stage 4 alone (and, --fwd-h, for the forward scan's steps)",
    )
    ap.add_argument("--no-stage4", action="store_true", help="skip timing stage 4 alone")
    ap.add_argument(
        "--check-normalizers",
        type=_floats,
        default=[1.0, 16.0],
        metavar="LIST",
        help="gate normalizers of the gradient checks (g = logsigmoid(randn) / n); "
        "the first is also the timed input (default 1,16)",
    )
    ap.add_argument(
        "--tol", type=float, default=2e-2, help="max relative gradient error, bf16 (default 2e-2)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gdn", action="store_true", help="skip the GDN cases (and the probe)")
    ap.add_argument(
        "--fwd-h",
        action="store_true",
        help=f"the 'on' mode runs fla's forward scan (chunk_gated_delta_rule_fwd_h) on kda-dhu too "
        f"({FWD_H_ENV}=on; off in 'off'); times its calls per step and checks the forward",
    )
    ap.add_argument(
        "--graph-probe",
        action="store_true",
        help="also run chunk_kda's CUDA-graph varlen mode (use_graph=True, padded "
        "cu_seqlens) eagerly, off and on, and record what happens",
    )
    ap.add_argument(
        "--table",
        default="",
        metavar="JSON",
        help="print the markdown table of a recorded run and exit (no GPU needed)",
    )
    args = ap.parse_args(argv)

    if args.table:
        try:
            with open(args.table) as f:
                print(markdown_table(json.load(f)), end="")
        except (OSError, ValueError, KeyError, TypeError) as err:
            ap.error(f"--table {args.table}: not an e2e record ({type(err).__name__}: {err})")
        return 0
    names = list(CASES)
    if args.shapes:
        names = [n.strip() for n in args.shapes.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            ap.error(f"unknown case(s) {unknown}; one of: {', '.join(CASES)}")
    if args.reps < 1 or args.warmup < 0 or args.stage4_reps < 1:
        ap.error("--reps and --stage4-reps must be >= 1, --warmup >= 0")
    global FWD_H_ON
    FWD_H_ON = args.fwd_h

    import torch

    if not torch.cuda.is_available():
        print("e2e: no CUDA device; this benchmark needs a GPU.", file=sys.stderr)
        return 2
    import fla
    import kda_dhu
    from bench import git_commit, write_record
    from kda_dhu import fla_backend

    usable, why = kda_dhu.cuda_status()
    if not usable:
        print(f"e2e: kda-dhu cannot run its kernel here: {why} ({kda_dhu.__file__})", file=sys.stderr)
        return 2
    if not fla_backend.is_registered() and not fla_backend.register_backend():
        print(
            "e2e: kda-dhu is not registered as an fla backend and cannot be "
            "(FLA_DISABLE_BACKEND_DISPATCH=1, or fla without fla.backends)",
            file=sys.stderr,
        )
        return 2
    if kda_dhu.is_patched():
        print("e2e: kda_dhu.patch() is active; FLA_KDA_DHU would not switch kda-dhu off", file=sys.stderr)
        return 2
    force = os.environ.get("KDA_DHU_FORCE", "")
    if force:
        print(
            f"e2e: warning: KDA_DHU_FORCE={force!r} is set; the 'on' mode is not the default path",
            file=sys.stderr,
        )
    if os.environ.get(FWD_H_ENV) and not args.fwd_h:
        print(
            f"e2e: warning: {FWD_H_ENV}={os.environ[FWD_H_ENV]!r} is set; ignored (off in both modes) "
            "without --fwd-h",
            file=sys.stderr,
        )
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    gpu = torch.cuda.get_device_name()
    commit = git_commit()
    print(
        f"{gpu}  torch {torch.__version__}  triton {triton_version}  fla {fla.__version__}  "
        f"kda_dhu {kda_dhu.__version__} ({commit}, {kda_dhu.__file__})",
        flush=True,
    )

    fla_log = logging.getLogger("fla.backends")
    capture = LogCapture()
    old_level = fla_log.level
    fla_log.addHandler(capture)
    if fla_log.getEffectiveLevel() > logging.INFO:
        fla_log.setLevel(logging.INFO)

    meta = {
        "gpu": gpu,
        "fla_version": fla.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "kda_dhu_version": kda_dhu.__version__,
        "kda_dhu_commit": commit,
    }
    partial = os.path.join(args.out, "e2e-partial.json") if args.out else ""
    t_start = time.time()
    rows, skipped, failures = [], [], []
    with restored_switches(), KernelProbe() as probe:
        if any(CASES[n]["op"] == "gdn" for n in names):
            reason = "--no-gdn" if args.no_gdn else gdn_backward_refusal()
            if reason:
                print(
                    "GDN skipped: "
                    + (
                        reason
                        if args.no_gdn
                        else f"fla refuses chunk_gated_delta_rule's backward here: {reason}"
                    ),
                    flush=True,
                )
                for n in [n for n in names if CASES[n]["op"] == "gdn"]:
                    skipped.append({"case": n, "reason": reason})
                names = [n for n in names if CASES[n]["op"] != "gdn"]
        for i, name in enumerate(names):
            case = CASES[name]
            try:
                row = run_case(name, case, args, probe)
            except Exception as err:  # noqa: BLE001 - report, go on with the next case
                traceback.print_exc()
                failures.append(f"{name}: raised {type(err).__name__}: {err}")
                torch.cuda.empty_cache()
                continue
            rows.append(row)
            fails = case_failures(row, args.tol)
            failures += fails
            s4 = row["stage4_ms"] or {}
            print(
                f"[{i + 1}/{len(names)}] {name:<28} fwd {row['fwd_ms']['fla']:.3f} / "
                f"{row['fwd_ms']['kda_dhu']:.3f} ms  bwd {row['bwd_ms']['fla']:.3f} / "
                f"{row['bwd_ms']['kda_dhu']:.3f} ms  x{row['bwd_speedup']:.3f} bwd  "
                f"stage4 {_fmt(s4.get('fla'))} / {_fmt(s4.get('kda_dhu'))} ms  "
                + (
                    f"fwd_h {_fmt(row['fwd_h_ms']['fla'])} / {_fmt(row['fwd_h_ms']['kda_dhu'])} ms per step "
                    f"({_fmt(row['fwd_h_calls_per_step']['kda_dhu'], 'g')} calls)  "
                    if row.get("fwd_h_ms")
                    else ""
                )
                + f"max grad err {row['max_grad_rel_err']:.2e} (fla repeat "
                f"{row['max_fla_repeat_rel_err']:.2e})  [fla / kda-dhu; {row['case_s']:.0f} s, "
                f"first calls {row['first_calls_s']:.0f} s]  {'FAIL' if fails else 'ok'}",
                flush=True,
            )
            if row.get("seq_lens"):
                sl = row["seq_lens"]
                print(
                    f"    {sl['n']} sequences, lengths min {sl['min']} median {sl['median']} "
                    f"max {sl['max']} mean {sl['mean']:.0f}"
                )
            print_checks(row)
            if partial:  # the rows so far, should the run be cut short (never e2e-latest.json)
                os.makedirs(args.out, exist_ok=True)
                with open(partial, "w") as f:
                    json.dump(
                        {**build_record(meta, args, capture.lines, rows, skipped, None, failures, t_start),
                         "complete": False},
                        f,
                        indent=1,
                    )  # fmt: skip
        graph = None
        if args.graph_probe:
            try:
                graph = graph_mode_probe(args, probe)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                graph = {"error": f"{type(err).__name__}: {err}"}
            print(f"graph-mode probe: {json.dumps(graph)}", flush=True)
            if graph.get("fla", {}).get("ok") and not graph.get("kda_dhu", {}).get("ok"):
                failures.append(
                    f"graph-mode probe: fla's backward runs, with kda-dhu on it raises: "
                    f"{graph['kda_dhu'].get('error')}"
                )
            elif graph.get("rel_err") and not all(e < args.tol for e in graph["rel_err"].values()):
                failures.append(f"graph-mode probe: gradient rel err over {args.tol:g}: {graph['rel_err']}")
    fla_log.removeHandler(capture)
    fla_log.setLevel(old_level)

    record = build_record(meta, args, capture.lines, rows, skipped, graph, failures, t_start)
    print()
    if rows or skipped:
        print(markdown_table(record), end="")
    for line in capture.lines:
        print(f"fla log: {line}")
    if args.out:
        write_record(record, args.out, markdown_table(record), prefix="e2e-", with_commit=True)
        if os.path.exists(partial):
            os.remove(partial)
        print(f"wrote {args.out}/e2e-latest.json")
    print(f"total {record['total_s']:.0f} s")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
    met = [t for t in record["targets"] if t["ok"]]
    for t in record["targets"]:
        if not t["ok"]:
            print(f"target {'MISSED' if t['ok'] is False else 'not measured'}: {t['case']}: {t['what']}: "
                  f"{_fmt(t['value'])} (limit {t['limit']:.3f})")  # fmt: skip
    print(f"targets: {len(met)} of {len(record['targets'])} met")
    return 1 if failures or len(met) < len(record["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
