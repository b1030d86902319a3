"""fla's context-parallel KDA backward (FLACPContext over NCCL) with kda-dhu's backend off
and on, against the one-GPU run.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 benches/cp_check.py
    torchrun --standalone --nproc_per_node=2 benches/cp_check.py --T 32768 --H 32
    python3 benches/cp_check.py [--nproc 2] [...]     # spawns the ranks itself (torch.multiprocessing)
    python3 benches/cp_check.py --dry-run             # CPU only: inputs, split, compare, checks

How fla 0.6 runs KDA with context parallelism (fla/ops/cp, fla/ops/kda/chunk.py):

* The packed batch (B = 1, T tokens, global ``cu_seqlens``) is cut into ``world_size``
  contiguous pieces of T / world_size tokens (T must divide); rank r holds tokens
  [r T / W, (r + 1) T / W) of q, k, v, g, beta (and of the output gradient).
* ``build_cp_context(cu_seqlens, group=...)`` (fla.ops.cp) returns the rank's
  ``FLACPContext``: its local ``cu_seqlens`` (int32, the global boundaries clipped to the
  piece), whether its first / last local sequence continues from / into other ranks
  (``is_first_rank`` / ``is_last_rank``, ``pre_num_ranks`` / ``post_num_ranks``) and the
  process group.
* ``chunk_kda(q_local, ..., cp_context=ctx)`` (``cu_seqlens`` is taken from the context;
  ``initial_state`` and ``output_final_state`` are refused under CP). Forward: each rank
  summarises its first sequence's state map, the maps are all-gathered and merged into
  the initial state of its first local sequence. Backward: each rank summarises its first
  sequence's backward map (chunk_cp_bwd_dh), the maps are all-gathered and merged into
  the ``dht`` of its last local sequence, then fla's ordinary varlen backward runs
  locally; stage 4 (``chunk_gated_delta_rule_bwd_dhu``, the function kda-dhu replaces) is
  called with the local cu_seqlens, that dht and h0 = None.
* Gradients come back per rank for its own tokens; this script all-gathers them along T.

What one case does (every rank, same inputs, broadcast from rank 0):

1. One GPU, no CP: chunk_kda forward on all T tokens, backward with kda-dhu's fla
   backend off (``FLA_KDA_DHU=0``), on (unset), off again, on one retained graph. The
   ``fla`` gradients are the reference. (Every rank does this on its own GPU, at the same
   time, and compares its own gathered CP gradients with it.)
2. CP over all ranks, for each --variants entry:
     ``as_built``: the FLACPContext exactly as fla builds it (int32 cu_seqlens);
     ``i64``:      the same context with its cu_seqlens cast to int64 (fla's kernels read
                   either; kda-dhu's kernel reads only int64, so this is the variant in
                   which kda-dhu's kernel actually runs under CP).
   One forward, then backward off / on / off again; the local gradients are all-gathered.
3. Compared, every input's gradient (q, k, v, g, beta; CP has no h0) and the output o:
     kind ``kda``:   kda-dhu on vs off, same setting     (tolerance --tol-kda / --tol-kda-max)
     kind ``cp``:    CP (off or on) vs one-GPU fla       (tolerance --tol-cp / --tol-cp-max)
     kind ``noise``: fla run twice (reported, not checked)
   Metrics: rel_fro = ||out - ref||_F / ||ref||_F, max_rel = max|out - ref| / max|ref|.
4. Routing: kda_dhu._core.launch_count() counts kernel launches (every route), a wrapper
   around kda_dhu._dispatch.verify records the backend verifier's verdicts, one around
   fla.ops.kda.chunk_bwd's stage-4 global counts stage-4 calls. Stage 4 must be called in
   every backward; with the backend off the kernel must never run; with it on it must run
   once per stage-4 call in the settings --require-kernel names.

Nothing here sets NCCL variables (NCCL_NVLS_ENABLE and the like are left as the machine
has them; they are reported). Output: a table on rank 0's stdout; with --out DIR (default
$OUT when set) DIR/cp_check.json.

Exit status: 0 every check passed; 1 a tolerance exceeded, a non-finite gradient, wrong
routing, or an error on any rank; 2 not enough GPUs / no kda-dhu extension / no fla.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import socket
import sys
import time
import traceback

import torch
from kda_dhu.testing import BACKEND_ENV, KernelProbe, backend_mode  # noqa: F401  (backend_mode: the script's API)

STAGE4 = "chunk_gated_delta_rule_bwd_dhu"
BACKWARD_MODULE = "fla.ops.kda.chunk_bwd"  # the module whose STAGE4 global KDA's backward calls
GRAD_NAMES = ("q", "k", "v", "g", "beta")
COLUMNS = ("o",) + GRAD_NAMES
MODES = ("fla", "kda_dhu", "fla_again")  # backend off, on, off again
VARIANTS = ("as_built", "i64")
CASES = ("cut", "single", "aligned")
# NCCL settings reported, never set
NCCL_REPORT = (
    "NCCL_NVLS_ENABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_DISABLE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_CUMEM_ENABLE",
    "NCCL_DEBUG",
)

EXIT_OK, EXIT_FAIL, EXIT_ENV = 0, 1, 2


# ----------------------------------------------------------------------------- arguments


def _csv(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x.strip()]

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--T", type=int, default=16384, help="total packed tokens (B = 1); divisible by the world size"
    )
    p.add_argument("--H", type=int, default=32, help="q/k heads")
    p.add_argument("--HV", type=int, default=None, help="v heads (default H; HV > H is GVA)")
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument(
        "--cases",
        type=_csv(str),
        default=list(CASES),
        help=f"comma list of {CASES}: cut = uneven sequences whose boundaries miss "
        "every rank boundary; single = one sequence over all ranks; aligned = a "
        "sequence boundary exactly at each rank boundary",
    )
    p.add_argument(
        "--lengths",
        type=_csv(int),
        default=None,
        help="explicit sequence lengths for the 'cut' case (must sum to T)",
    )
    p.add_argument(
        "--gate-normalizers",
        type=_csv(float),
        default=[1.0, 16.0],
        help="g = logsigmoid(N(0,1)) / n: 1 = fla's tests' strong decay, 16 = slow "
        "decay (the state gradient carries across the rank boundary)",
    )
    p.add_argument("--variants", type=_csv(str), default=list(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument(
        "--require-kernel",
        choices=("i64", "all", "none"),
        default="i64",
        help="settings in which kda-dhu's kernel must run with the backend on: "
        "i64 = one-GPU and CP[i64] (default); all = also CP[as_built]; none",
    )
    p.add_argument(
        "--cu-dtype",
        choices=("int64", "int32"),
        default="int64",
        help="dtype of the one-GPU run's cu_seqlens (int32 = as fla's CP context builds "
        "them: with --variants as_built, Triton compiles fla's varlen kernels "
        "once, not twice)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol-kda", type=float, default=1e-2, help="rel_fro bound, backend on vs off")
    p.add_argument("--tol-kda-max", type=float, default=5e-2, help="max_rel bound, backend on vs off")
    p.add_argument("--tol-cp", type=float, default=2e-2, help="rel_fro bound, CP vs one GPU")
    p.add_argument("--tol-cp-max", type=float, default=1e-1, help="max_rel bound, CP vs one GPU")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--nccl-timeout", type=float, default=480.0, help="process-group timeout, s")
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or None,
        help="directory for cp_check.json (default $OUT when set)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU only: build inputs, split and re-gather them (fla's split metadata "
        "computed for every rank without a process group), exercise the metrics, "
        "the checks and the table; no GPU, no NCCL",
    )
    args = p.parse_args(argv)
    for c in args.cases:
        if c not in CASES:
            p.error(f"--cases: unknown case {c!r} (choose from {CASES})")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r} (choose from {VARIANTS})")
    if args.HV is None:
        args.HV = args.H
    if args.HV % args.H:
        p.error(f"--HV ({args.HV}) must be a multiple of --H ({args.H})")
    if args.T <= 0 or args.nproc < 1:
        p.error("--T and --nproc must be positive")
    if args.lengths is not None and (sum(args.lengths) != args.T or min(args.lengths) < 1):
        p.error(f"--lengths must be positive and sum to --T ({args.T}), got sum {sum(args.lengths)}")
    return args


# ----------------------------------------------------------------------------- inputs


def case_lengths(case: str, T: int, world_size: int, explicit=None) -> list:
    """Sequence lengths (summing to T) of a case.

    cut:     six uneven sequences (weights 3:7:1:9:5:6, none a multiple of 64 long) whose
             boundaries avoid every rank boundary (a multiple of T / world_size), so one
             sequence straddles each rank boundary;
    single:  one sequence of T tokens (spans every rank);
    aligned: one sequence per rank piece, split unevenly in two inside the piece, so a
             boundary falls exactly on every rank boundary (no state crosses ranks).
    """
    part = T // world_size
    if case == "single":
        return [T]
    if case == "aligned":
        out = []
        for _ in range(world_size):
            a = max(1, min(part - 1, part // 3 + 5)) if part > 1 else part
            out.extend([a, part - a] if part - a > 0 else [a])
        return out
    if case != "cut":
        raise ValueError(f"unknown case {case!r}")
    if explicit is not None:
        return list(explicit)
    weights = (3, 7, 1, 9, 5, 6)
    n = len(weights)
    if T < 4 * n:
        return [T]
    lens = [max(1, T * w // sum(weights)) for w in weights]
    lens[-1] = T - sum(lens[:-1])
    # odd lengths (never a multiple of 64) where that keeps them positive
    for i in range(n - 1):
        if lens[i] % 2 == 0 and lens[i] > 1:
            lens[i] -= 1
            lens[-1] += 1
    # move every interior boundary off the rank boundaries
    for _ in range(4 * n):
        bounds, acc = [], 0
        for x in lens[:-1]:
            acc += x
            bounds.append(acc)
        hit = next((i for i, b in enumerate(bounds) if b % part == 0), None)
        if hit is None:
            break
        shift = 37 if lens[hit + 1] > 37 else -1
        lens[hit] += shift
        lens[hit + 1] -= shift
    assert sum(lens) == T and min(lens) >= 1, lens
    return lens


def cu_from_lengths(lengths, dtype=torch.int64) -> torch.Tensor:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + int(n))
    return torch.tensor(offs, dtype=dtype)


def make_inputs(T, H, HV, K, V, seed=0, gate_normalizer=1.0, device="cpu", dtype=torch.bfloat16):
    """Global (unsliced) leaves and the output gradient, detached: q, k, v ~ N(0, 1) in
    dtype (fla's kernel l2-normalises q, k: use_qk_l2norm_in_kernel=True),
    g = logsigmoid(N(0, 1)) / gate_normalizer fp32 per key, beta = sigmoid(N(0, 1)) in
    dtype, do ~ N(0, 1) in dtype. The same seed gives the same tensors whatever the
    gate normalizer (only g changes)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    x = {
        "q": randn(1, T, H, K, dt=dtype),
        "k": randn(1, T, H, K, dt=dtype),
        "v": randn(1, T, HV, V, dt=dtype),
    }
    x["g"] = torch.nn.functional.logsigmoid(randn(1, T, HV, K)) / gate_normalizer
    x["beta"] = randn(1, T, HV).sigmoid().to(dtype)
    do = randn(1, T, HV, V, dt=dtype)
    return x, do


def local_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous piece along T (dim 1), as fla's contiguous CP layout cuts it."""
    T = t.shape[1]
    if T % world_size:
        raise ValueError(f"T = {T} is not divisible by world_size = {world_size}")
    part = T // world_size
    return t[:, rank * part : (rank + 1) * part].contiguous().clone()


def concat_pieces(pieces) -> torch.Tensor:
    """The inverse of local_slice over all ranks (what the all-gather assembles)."""
    return torch.cat(list(pieces), dim=1)


def i64_context(ctx):
    """A copy of an FLACPContext with int64 cu_seqlens (device and host); the rest as is."""
    return dataclasses.replace(
        ctx,
        cu_seqlens=ctx.cu_seqlens.to(torch.int64) if ctx.cu_seqlens is not None else None,
        cu_seqlens_cpu=ctx.cu_seqlens_cpu.to(torch.int64) if ctx.cu_seqlens_cpu is not None else None,
    )


def context_meta(ctx) -> dict:
    return {
        "cu_seqlens_local": ctx.cu_seqlens_cpu.tolist()
        if ctx.cu_seqlens_cpu is not None
        else ctx.cu_seqlens.tolist(),
        "dtype": str(ctx.cu_seqlens.dtype).replace("torch.", ""),
        "is_first_rank": ctx.is_first_rank,
        "is_last_rank": ctx.is_last_rank,
        "pre_num_ranks": ctx.pre_num_ranks,
        "post_num_ranks": ctx.post_num_ranks,
        "layout": ctx.layout,
    }


# ----------------------------------------------------------------------------- metrics


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """rel_fro = ||out - ref||_F / ||ref||_F and max_rel = max|out - ref| / max|ref| in float64
    (each the absolute figure when ref is all zero); inf when out is not finite."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"compare: shape mismatch {tuple(out.shape)} vs {tuple(ref.shape)}")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if not bool(torch.isfinite(o).all()) or not bool(torch.isfinite(r).all()):
        return {"rel_fro": math.inf, "max_rel": math.inf, "max_abs": math.inf, "finite": False}
    d = o - r
    num, den = torch.linalg.vector_norm(d).item(), torch.linalg.vector_norm(r).item()
    mad, mar = d.abs().max().item() if d.numel() else 0.0, r.abs().max().item() if r.numel() else 0.0
    return {
        "rel_fro": num / den if den > 0 else num,
        "max_rel": mad / mar if mar > 0 else mad,
        "max_abs": mad,
        "finite": True,
    }


def comparison(name: str, kind: str, outs: dict, refs: dict) -> dict:
    """{'name', 'kind', 'metrics': {tensor: compare(...)}} over the names both dicts hold."""
    return {
        "name": name,
        "kind": kind,
        "metrics": {n: compare(outs[n], refs[n]) for n in COLUMNS if n in outs and n in refs},
    }


# ----------------------------------------------------------------------------- checks


def required_settings(require: str, variants) -> set:
    if require == "none":
        return set()
    req = {"single"}
    if "i64" in variants:
        req.add("cp[i64]")
    if require == "all" and "as_built" in variants:
        req.add("cp[as_built]")
    return req


def evaluate(rank_results: list, args) -> tuple:
    """(failures, notes) over every rank's results."""
    failures, notes = [], []
    tols = {"kda": (args.tol_kda, args.tol_kda_max), "cp": (args.tol_cp, args.tol_cp_max)}
    required = required_settings(args.require_kernel, args.variants)
    for res in rank_results:
        rank = res["rank"]
        if res.get("error"):
            failures.append(f"rank {rank}: {res['error'].strip().splitlines()[-1]}")
            continue
        for case in res["cases"]:
            where = f"rank {rank} {case['case']} (gate normalizer {case['gate_normalizer']:g})"
            for c in case["comparisons"]:
                for n, m in c["metrics"].items():
                    if not m["finite"]:
                        failures.append(f"{where}: {c['name']}: {n} not finite")
                        continue
                    if c["kind"] not in tols:
                        continue
                    tf, tm = tols[c["kind"]]
                    if not (m["rel_fro"] <= tf and m["max_rel"] <= tm):
                        failures.append(
                            f"{where}: {c['name']}: {n} rel_fro {m['rel_fro']:.2e} "
                            f"(tol {tf:g}), max_rel {m['max_rel']:.2e} (tol {tm:g})"
                        )
            for setting, modes in case["routing"].items():
                for mode, r in modes.items():
                    if r["stage4_calls"] == 0:
                        failures.append(
                            f"{where}: {setting} {mode}: stage 4 never called by the "
                            "backward (another chunk_kda backend took the call?)"
                        )
                    if mode != "kda_dhu" and r["kernel_launches"]:
                        failures.append(
                            f"{where}: {setting} {mode}: kda-dhu's kernel ran "
                            f"{r['kernel_launches']} times with {BACKEND_ENV}=0"
                        )
                on = modes.get("kda_dhu")
                if on is None:
                    continue
                if on["kernel_launches"] != on["stage4_calls"]:
                    msg = (
                        f"{where}: {setting}: kda-dhu's kernel ran {on['kernel_launches']} times "
                        f"for {on['stage4_calls']} stage-4 calls with the backend on; "
                        f"verdicts: {on['verdicts']}"
                    )
                    (failures if setting in required else notes).append(msg)
    return failures, notes


# ----------------------------------------------------------------------------- report


def _cell(m):
    return "-" if m is None else f"{m['rel_fro']:.1e}/{m['max_rel']:.1e}"


def format_case(case: dict, rank: int, metrics: bool = True) -> str:
    """One case of one rank: its contexts, a row per comparison (cells rel_fro/max_rel),
    the routing."""
    lines = [
        f"rank {rank} {case['case']}: lengths {case['lengths']}, gate normalizer "
        f"{case['gate_normalizer']:g}" + ("  (cells: rel_fro/max_rel)" if metrics else "")
    ]
    for setting, meta in case.get("contexts", {}).items():
        lines.append(f"  {setting}: {meta}")
    if metrics:
        w = max([len(c["name"]) for c in case["comparisons"]] + [10])
        lines.append(f"  {'comparison':<{w}}  {'kind':<5}  " + "  ".join(f"{n:<15}" for n in COLUMNS))
        for c in case["comparisons"]:
            lines.append(
                f"  {c['name']:<{w}}  {c['kind']:<5}  "
                + "  ".join(f"{_cell(c['metrics'].get(n)):<15}" for n in COLUMNS)
            )
    for setting, modes in case["routing"].items():
        parts = [
            f"{mode}: {r['kernel_launches']} launches / {r['stage4_calls']} stage-4 calls"
            + (f" {r['verdicts']}" if r["verdicts"] else "")
            for mode, r in modes.items()
        ]
        lines.append(f"  routing {setting}: " + "; ".join(parts))
    return "\n".join(lines)


def format_table(res: dict, metrics: bool = True) -> str:
    """One rank's results, every case (metrics=False: contexts and routing only)."""
    return "\n".join(format_case(c, res["rank"], metrics) for c in res["cases"])


def worst(rank_results: list) -> dict:
    """Largest rel_fro / max_rel per (kind, tensor) over every rank and case."""
    out = {}
    for res in rank_results:
        for case in res.get("cases", []):
            for c in case["comparisons"]:
                for n, m in c["metrics"].items():
                    key = f"{c['kind']}:{n}"
                    prev = out.get(key, {"rel_fro": 0.0, "max_rel": 0.0})
                    out[key] = {
                        "rel_fro": max(prev["rel_fro"], m["rel_fro"]),
                        "max_rel": max(prev["max_rel"], m["max_rel"]),
                    }
    return out


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_summary(out_dir, summary: dict) -> str | None:
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "cp_check.json")
    with open(path, "w") as f:
        json.dump(_jsonable(summary), f, indent=1)
    return path


def report(rank_results: list, args, env: dict, seconds: float) -> int:
    """Print the tables, write the JSON; the exit status (same on every rank)."""
    failures, notes = evaluate(rank_results, args)
    for res in rank_results:  # rank 0's metrics were printed case by case as they came
        if res.get("error"):
            print(f"rank {res['rank']} raised:\n{res['error']}")
        elif res["rank"] != 0:
            print(format_table(res, metrics=False))
    print("worst per kind:tensor (rel_fro / max_rel), all ranks:")
    for key, m in sorted(worst(rank_results).items()):
        print(f"  {key:<12} {m['rel_fro']:.2e} / {m['max_rel']:.2e}")
    for n in notes:
        print(f"NOTE: {n}")
    for f in failures:
        print(f"FAIL: {f}")
    ok = not failures
    summary = {
        "ok": ok,
        "failures": failures,
        "notes": notes,
        "args": vars(args),
        "env": env,
        "worst": worst(rank_results),
        "seconds": seconds,
        "ranks": rank_results,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path = write_summary(args.out, summary)
    if path:
        print(f"summary: {path}")
    print(f"cp_check: {'PASS' if ok else 'FAIL'} ({len(failures)} failures, {seconds:.0f} s)")
    return EXIT_OK if ok else EXIT_FAIL


# ----------------------------------------------------------------------------- probes


class Routing(KernelProbe):
    """kda_dhu.testing.KernelProbe (kernel launches, the backend verifier's verdicts) that
    also counts the stage-4 calls made by KDA's backward (fla.ops.kda.chunk_bwd's global)."""

    def __init__(self):
        import importlib

        self.bwd = importlib.import_module(BACKWARD_MODULE)
        super().__init__()

    def reset(self):
        super().reset()
        self.calls = 0

    def snapshot(self) -> dict:
        return {
            "kernel_launches": self.launches,
            "stage4_calls": self.calls,
            "verdicts": sorted({f"{'kernel' if ok else 'fla'}: {why}" for ok, why in self.verdicts}),
        }

    def _wrappers(self) -> list:
        def stage4(original):
            def wrapper(*a, **kw):
                self.calls += 1
                return original(*a, **kw)

            return wrapper

        return super()._wrappers() + [(self.bwd, STAGE4, stage4)]


# ----------------------------------------------------------------------------- the GPU run


def _forward(x: dict, cu=None, cu_cpu=None, ctx=None):
    from fla.ops.kda import chunk_kda

    o, _ = chunk_kda(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        scale=None,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
        cp_context=ctx,
    )
    return o


def _backward_modes(o, leaves: dict, do, probe: Routing):
    """Backward off / on / off again on one retained graph: ({mode: {name: grad}}, routing)."""
    grads, routing = {}, {}
    names = list(leaves)
    for mode in MODES:
        with backend_mode(mode):
            probe.reset()
            g = torch.autograd.grad(o, [leaves[n] for n in names], do, retain_graph=True)
            torch.cuda.synchronize()
        grads[mode] = dict(zip(names, g))
        routing[mode] = probe.snapshot()
    return grads, routing


def _gather(t: torch.Tensor, world_size: int, group) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t, group=group)
    return concat_pieces(parts)


def run_case(case: str, normalizer: float, args, rank: int, world_size: int, device, probe: Routing) -> dict:
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context

    group = dist.group.WORLD
    t0 = time.time()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    lengths = case_lengths(case, args.T, world_size, args.lengths)
    cu_cpu = cu_from_lengths(lengths, getattr(torch, args.cu_dtype))
    cu = cu_cpu.to(device)
    x, do = make_inputs(
        args.T,
        args.H,
        args.HV,
        args.K,
        args.V,
        seed=args.seed,
        gate_normalizer=normalizer,
        device=device,
        dtype=dtype,
    )
    for t in (*x.values(), do):  # one set of inputs everywhere, whatever each GPU draws
        dist.broadcast(t, src=0, group=group)
    out = {
        "case": case,
        "gate_normalizer": normalizer,
        "lengths": lengths,
        "comparisons": [],
        "routing": {},
        "contexts": {},
    }

    # 1. one GPU, all T tokens, no CP
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o = _forward(leaves, cu, cu_cpu)
    grads, out["routing"]["single"] = _backward_modes(o, leaves, do, probe)
    ref = dict(grads["fla"], o=o.detach())
    single_kda = dict(grads["kda_dhu"], o=ref["o"])
    out["comparisons"].append(comparison("single: kda_dhu vs fla", "kda", grads["kda_dhu"], grads["fla"]))
    out["comparisons"].append(
        comparison("single: fla again vs fla", "noise", grads["fla_again"], grads["fla"])
    )
    del o, leaves, grads
    torch.cuda.empty_cache()

    # 2. CP, each variant of the context
    base_ctx = build_cp_context(cu, group=group, cu_seqlens_cpu=cu_cpu)
    for variant in args.variants:
        ctx = base_ctx if variant == "as_built" else i64_context(base_ctx)
        setting = f"cp[{variant}]"
        out["contexts"][setting] = context_meta(ctx)
        leaves = {n: local_slice(t, rank, world_size).requires_grad_(True) for n, t in x.items()}
        do_local = local_slice(do, rank, world_size)
        dist.barrier(group=group)
        o = _forward(leaves, ctx.cu_seqlens, ctx.cu_seqlens_cpu, ctx)
        grads, out["routing"][setting] = _backward_modes(o, leaves, do_local, probe)
        full = {m: {n: _gather(t, world_size, group) for n, t in g.items()} for m, g in grads.items()}
        full["fla"]["o"] = full["kda_dhu"]["o"] = _gather(o.detach(), world_size, group)
        del o, leaves, grads
        out["comparisons"] += [
            comparison(
                f"{setting}: kda_dhu vs fla",
                "kda",
                {n: t for n, t in full["kda_dhu"].items() if n != "o"},
                full["fla"],
            ),
            comparison(f"{setting} fla vs single fla", "cp", full["fla"], ref),
            comparison(
                f"{setting} kda_dhu vs single fla",
                "cp",
                {n: t for n, t in full["kda_dhu"].items() if n != "o"},
                ref,
            ),
            comparison(
                f"{setting} kda_dhu vs single kda_dhu",
                "noise",
                {n: t for n, t in full["kda_dhu"].items() if n != "o"},
                single_kda,
            ),
            comparison(f"{setting}: fla again vs fla", "noise", full["fla_again"], full["fla"]),
        ]
        del full
        torch.cuda.empty_cache()
    del ref, single_kda, x, do
    torch.cuda.empty_cache()
    out["seconds"] = time.time() - t0
    return out


def environment(world_size: int) -> dict:
    env = {
        "torch": torch.__version__,
        "world_size": world_size,
        "nccl_env": {k: os.environ.get(k) for k in NCCL_REPORT if k in os.environ},
        "kda_dhu_commit": os.environ.get("KDA_DHU_COMMIT"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    try:
        import fla

        env["fla"] = getattr(fla, "__version__", None)
    except Exception as err:  # noqa: BLE001
        env["fla"] = f"not importable: {err}"
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        env["nccl"] = None
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def _init_process_group(rank: int, world_size: int, local_rank: int, timeout_s: float):
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    kw = dict(backend="nccl", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        dist.init_process_group(**kw, device_id=torch.device("cuda", local_rank))
    except TypeError:  # torch without device_id
        dist.init_process_group(**kw)


def worker(rank: int, world_size: int, local_rank: int, args) -> int:
    """One rank: every case, then the results of all ranks on every rank; the exit status."""
    import torch.distributed as dist

    t0 = time.time()
    _init_process_group(rank, world_size, local_rank, args.nccl_timeout)
    device = torch.device("cuda", local_rank)
    res = {"rank": rank, "device": torch.cuda.get_device_name(device), "cases": []}
    try:
        import kda_dhu
        from kda_dhu import fla_backend

        ok, msg = kda_dhu.cuda_status()
        if not ok:
            raise RuntimeError(f"kda_dhu cannot run its kernel here: {msg}")
        if not fla_backend.is_registered() and not fla_backend.register_backend():
            raise RuntimeError(
                "kda_dhu's fla backend could not be registered "
                "(FLA_DISABLE_BACKEND_DISPATCH=1, or fla without a backend registry)"
            )
        res["backend_registered"] = fla_backend.is_registered()
        if rank == 0:
            print(
                f"[cp_check] {world_size} ranks, T={args.T} H={args.H} HV={args.HV} K={args.K} "
                f"V={args.V} {args.dtype}; cases {args.cases} x gate normalizers "
                f"{args.gate_normalizers}; variants {args.variants}",
                flush=True,
            )
        with Routing() as probe:
            for case in args.cases:
                for normalizer in args.gate_normalizers:
                    r = run_case(case, normalizer, args, rank, world_size, device, probe)
                    res["cases"].append(r)
                    if rank == 0:
                        print(format_case(r, rank), flush=True)
                        print(
                            f"[cp_check] {case}, gate normalizer {normalizer:g}: "
                            f"{r['seconds']:.1f} s (since start {time.time() - t0:.0f} s)",
                            flush=True,
                        )
                        write_summary(args.out, {"partial": True, "args": vars(args), "ranks": [res]})
    except Exception:  # noqa: BLE001 - reported, and the status says it
        # The other ranks may be waiting in a collective this rank will never join:
        # leave at once, so that torchrun (or the spawning parent) ends them too.
        res["error"] = traceback.format_exc()
        print(f"[cp_check] rank {rank} raised:\n{res['error']}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"cp_check_rank{rank}_error.txt"), "w") as f:
                    f.write(res["error"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAIL)
    res["seconds"] = time.time() - t0
    rc = EXIT_FAIL
    try:
        everything = [None] * world_size
        dist.all_gather_object(everything, res)
        if rank == 0:
            rc = report(everything, args, environment(world_size), time.time() - t0)
        else:
            failures, _ = evaluate(everything, args)
            rc = EXIT_FAIL if failures else EXIT_OK
        dist.barrier()
    except Exception:  # noqa: BLE001 - a rank died mid-collective: fail
        traceback.print_exc()
        rc = EXIT_FAIL
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return rc


def _spawned(index: int, world_size: int, args, port: int):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(index),
        LOCAL_RANK=str(index),
        WORLD_SIZE=str(world_size),
    )
    rc = worker(index, world_size, index, args)
    if rc:
        sys.exit(rc)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- dry run


def dry_run(args) -> int:
    """CPU: everything but the GPU run, at the given shape (use a small --T)."""
    W = args.nproc
    t0 = time.time()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    results = []
    for case in args.cases:
        lengths = case_lengths(case, args.T, W, args.lengths)
        cu_cpu = cu_from_lengths(lengths)
        assert cu_cpu[-1].item() == args.T
        part = args.T // W
        interior = cu_cpu[1:-1].tolist()
        if case == "cut" and args.lengths is None:
            assert not any(b % part == 0 for b in interior), (case, lengths)
        if case == "aligned":
            assert all(r * part in interior for r in range(1, W)), (case, lengths)
        x, do = make_inputs(args.T, args.H, args.HV, args.K, args.V, seed=args.seed, dtype=dtype)
        x2, _ = make_inputs(
            args.T, args.H, args.HV, args.K, args.V, seed=args.seed, gate_normalizer=16.0, dtype=dtype
        )
        assert torch.equal(x["q"], x2["q"]) and not torch.equal(x["g"], x2["g"])
        for n, t in (*x.items(), ("do", do)):
            pieces = [local_slice(t, r, W) for r in range(W)]
            assert all(p.shape[1] == part and p.is_contiguous() for p in pieces), n
            assert torch.equal(concat_pieces(pieces), t), n
        res = {"rank": 0, "cases": [], "device": "cpu (dry run)"}
        entry = {
            "case": case,
            "gate_normalizer": 1.0,
            "lengths": lengths,
            "comparisons": [],
            "routing": {},
            "contexts": {},
        }
        try:  # fla's own split, computed per rank without a process group
            from fla.ops.cp.context import get_cp_cu_seqlens

            for r in range(W):
                ctx = get_cp_cu_seqlens(cu_cpu, cu_seqlens_cpu=cu_cpu, world_size=W, rank=r)
                c64 = i64_context(ctx)
                assert c64.cu_seqlens.dtype == torch.int64 and ctx.cu_seqlens.dtype == torch.int32
                assert c64.is_first_rank == ctx.is_first_rank and c64.post_num_ranks == ctx.post_num_ranks
                assert int(ctx.cu_seqlens_cpu[-1]) == part
                entry["contexts"][f"cp rank {r}"] = context_meta(ctx)
        except ImportError as err:
            entry["contexts"]["fla"] = f"not importable: {err}"
        # metrics against a perturbed copy, as the GPU run forms them
        ref = dict(x, o=do)
        gen = torch.Generator().manual_seed(1)
        noisy = {
            n: (t.float() * (1 + 1e-3 * torch.randn(t.shape, generator=gen))).to(t.dtype)
            for n, t in ref.items()
        }
        entry["comparisons"].append(comparison("dry: perturbed 1e-3 vs original", "kda", noisy, ref))
        entry["comparisons"].append(comparison("dry: original vs original", "noise", ref, ref))
        for c in entry["comparisons"][1:]:
            assert all(m["rel_fro"] == 0 and m["max_rel"] == 0 for m in c["metrics"].values())
        for m in entry["comparisons"][0]["metrics"].values():
            assert 0 < m["rel_fro"] < args.tol_kda, m
        entry["routing"] = {
            "single": {
                "fla": {"kernel_launches": 0, "stage4_calls": 1, "verdicts": []},
                "kda_dhu": {"kernel_launches": 1, "stage4_calls": 1, "verdicts": ["kernel: kernel-sm90a"]},
            }
        }
        res["cases"].append(entry)
        results.append(res)
    merged = {"rank": 0, "device": "cpu (dry run)", "cases": [c for r in results for c in r["cases"]]}
    # the backend switch and the routing probes (kda_dhu and fla importable here)
    try:
        from kda_dhu import fla_backend

        backend = fla_backend.backend_instance()
        assert backend is not None, "kda_dhu's fla backend is not registered"
        before = os.environ.get(BACKEND_ENV)
        for mode in MODES:
            with backend_mode(mode):
                assert backend.is_enabled() == (mode == "kda_dhu"), mode
        assert os.environ.get(BACKEND_ENV) == before
        with Routing() as probe:
            bound = {name: (module, original, ours) for module, name, original, ours in probe._bound}
            assert set(bound) == {"verify", STAGE4}, sorted(bound)
            for name, (module, _original, ours) in bound.items():
                assert module.__dict__[name] is ours, name
        for name, (module, original, _ours) in bound.items():
            assert module.__dict__[name] is original, name
        print("dry run: kda_dhu's backend registered; FLA_KDA_DHU switch and routing probes work")
    except ImportError as err:
        print(f"dry run: backend switch not checked ({err})")
    failures, _ = evaluate([merged], args)
    assert not failures, failures
    # the checks catch what they must
    bad = json.loads(json.dumps(merged))
    bad["cases"][0]["comparisons"][0]["metrics"]["q"]["rel_fro"] = 10 * args.tol_kda
    bad["cases"][0]["routing"]["single"]["kda_dhu"]["kernel_launches"] = 0
    bad["cases"][0]["routing"]["single"]["fla"]["kernel_launches"] = 1
    failures, _ = evaluate([bad], args)
    assert len(failures) == 3, failures
    print(format_table(merged))
    return report([merged], args, {"dry_run": True, "torch": torch.__version__}, time.time() - t0)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun / torch.distributed.run
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if args.T % world_size:
            print(f"--T ({args.T}) must be divisible by the world size ({world_size})", file=sys.stderr)
            return EXIT_ENV
        return worker(rank, world_size, local_rank, args)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < args.nproc:
        print(f"cp_check: needs {args.nproc} GPUs, found {n}", file=sys.stderr)
        return EXIT_ENV
    if args.T % args.nproc:
        print(f"--T ({args.T}) must be divisible by --nproc ({args.nproc})", file=sys.stderr)
        return EXIT_ENV
    import torch.multiprocessing as mp

    try:
        mp.start_processes(
            _spawned,
            args=(args.nproc, args, _free_port()),
            nprocs=args.nproc,
            join=True,
            start_method="spawn",
        )
    except mp.ProcessExitedException as err:
        print(f"cp_check: {err}", file=sys.stderr)
        return err.exit_code if err.exit_code and err.exit_code > 0 else EXIT_FAIL
    except mp.ProcessRaisedException as err:
        print(f"cp_check: {err}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
