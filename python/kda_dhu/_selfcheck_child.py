"""The self-check's check process: one signature's check, apart from the training job.

Run as ``python -m kda_dhu._selfcheck_child`` by ``kda_dhu._selfcheck.supervise``, which
writes one JSON request line to stdin ({"signature", "device", "limits", optional
"perturb"}) and keeps stdin open: end of file (the parent gone, or done with this
process) ends it, and so does its own deadline (the sum of the phase limits). Reports go
to stdout as ``REPORT_PREFIX + json`` lines: ``{"phase": p}`` as each phase starts, then
``{"result": measurements}`` or ``{"error": {"phase", "type", "message"}}``; anything
else printed goes to stderr (the parent's log).

Phases, in this order so that everything the kernel does not own is done before it runs:

* setup: random inputs of the signature on the device (seeded by the signature's key,
  so a failure can be reproduced), the planner's verdict for the entry, fla's outputs,
  the float64 reference on a sample of (sequence, head) pairs (kept on the host), and a
  checksum of every input;
* kernel: the kernel under the entry's rule (the "capable" rule where that rule sends the
  call to fla), outputs poisoned with NaN, then a device synchronize;
* compare: per output, the errors of the kernel and of fla against the sampled reference,
  the kernel's difference from fla over every element, non-finite counts; the inputs'
  checksums again.

``perturb`` (tests of the check itself): the name of an output that is made wrong after
the kernel ran, so that the report shows a wrong kernel.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import traceback
import zlib

import torch

from ._core import BT  # tokens per chunk of every kernel (cuda/dhu_layout.h)
from ._selfcheck import REPORT_PREFIX, RULES, Signature, rel_diff

NAMES = ("dh", "dh0", "dv2")
PAIRS = 8  # (sequence, head) pairs the reference is computed on, at most
REF_BUDGET = 1 << 25  # float64 elements of dh the sampled reference may hold (256 MiB)


def varlen_lengths(sig: Signature, gen: torch.Generator) -> list[int]:
    """N random sequence lengths that sum to T (all positive where T >= N)."""
    N, T = sig.N, sig.T
    if N is None or N < 1:
        raise ValueError(f"N: expected a positive number of sequences, got {N}")
    if N == 1:
        return [T]
    if T >= N:
        cuts = (torch.randperm(T - 1, generator=gen)[: N - 1] + 1).tolist()
    else:
        cuts = torch.randint(0, T + 1, (N - 1,), generator=gen).tolist()
    bounds = [0] + sorted(cuts) + [T]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def inputs_for(sig: Signature, device, gen: torch.Generator) -> dict:
    """``make_inputs``' keyword arguments for a call of this signature."""
    from .testing import make_inputs

    if sig.g and sig.gk:
        raise ValueError("g and gk together: the kernel does not take them (fla's function runs)")
    gate = "gk" if sig.gk else ("g" if sig.g else None)
    lengths = varlen_lengths(sig, gen) if sig.N is not None else None
    return make_inputs(
        sig.B,
        sig.T,
        sig.H,
        sig.HV,
        sig.K,
        sig.V,
        getattr(torch, sig.dtype),
        gate,
        varlen_lengths=lengths,
        dht=sig.dht,
        h0=sig.h0,
        state_v_first=sig.state_v_first,
        device=device,
        generator=gen,
    )


def sample_pairs(sig: Signature, gen: torch.Generator, budget: int = REF_BUDGET) -> list[tuple[int, int]]:
    """(batch, value head) pairs to compute the reference on: all of them where there are
    at most PAIRS (and the reference fits ``budget``), else the first, the last and
    random others. A varlen call (B == 1) samples heads, each with all its sequences."""
    chunks = -(-sig.T // BT) + (sig.N or 0)  # dh's chunk count, an upper bound with varlen
    count = max(1, min(PAIRS, budget // max(1, chunks * sig.K * sig.V)))
    pairs = [(b, hv) for b in range(sig.B) for hv in range(sig.HV)]
    if len(pairs) <= count:
        return pairs
    keep = [0] + ([len(pairs) - 1] if count > 1 else [])
    for i in (torch.randperm(len(pairs) - 2, generator=gen) + 1).tolist():
        if len(keep) >= count:
            break
        keep.append(i)
    return [pairs[i] for i in sorted(keep)]


def _states(x, sig: Signature, b: int, hv: int):
    """The [N, HV, ...] state tensor's part for (b, hv): sequence b, or every sequence of
    a varlen call."""
    if x is None:
        return None
    return x[:, hv : hv + 1] if sig.N is not None else x[b : b + 1, hv : hv + 1]


def slice_inputs(args: dict, sig: Signature, b: int, hv: int) -> dict:
    """The call restricted to batch b and value head hv (its q/k head hv // (HV / H)):
    B = H = HV = 1, every sequence of a varlen call kept."""
    h = hv // (sig.HV // sig.H)
    out = dict(args)
    for name, head in (("q", h), ("k", h), ("w", hv), ("do", hv), ("dv", hv), ("g", hv), ("gk", hv)):
        x = args.get(name)
        out[name] = None if x is None else x[b : b + 1, :, head : head + 1].contiguous()
    for name in ("h0", "dht"):
        x = _states(args.get(name), sig, b, hv)
        out[name] = None if x is None else x.contiguous()
    return out


def slice_outputs(outs, sig: Signature, b: int, hv: int) -> tuple:
    """(dh, dh0, dv2) restricted as ``slice_inputs`` restricts the call."""
    dh, dh0, dv2 = outs
    return dh[b : b + 1, :, hv : hv + 1], _states(dh0, sig, b, hv), dv2[b : b + 1, :, hv : hv + 1]


def reference_samples(args: dict, sig: Signature, pairs) -> list[tuple]:
    """The float64 reference (exact recurrence) of each pair, on the host."""
    from .reference import chunk_gated_delta_rule_bwd_dhu_ref

    refs = []
    for b, hv in pairs:
        ref = chunk_gated_delta_rule_bwd_dhu_ref(**slice_inputs(args, sig, b, hv), emulate_rounding=False)
        refs.append(tuple(None if r is None else r.cpu() for r in ref))
    return refs


def sampled_error(outs, refs, pairs, sig: Signature, i: int) -> float:
    """‖out − ref‖ / ‖ref‖ of output i over all sampled pairs together; inf where the
    sampled part of the output is not finite."""
    num2 = den2 = 0.0
    for (b, hv), ref in zip(pairs, refs):
        x = slice_outputs(outs, sig, b, hv)[i].detach().to("cpu", torch.float64)
        r = ref[i]
        if not bool(torch.isfinite(x).all()):
            return math.inf
        num2 += float(((x - r) ** 2).sum())
        den2 += float((r**2).sum())
    return math.sqrt(num2) / math.sqrt(den2) if den2 > 0 else math.sqrt(num2)


def measure(ours, theirs, refs, pairs, sig: Signature) -> dict:
    """Per output present: kernel_err and fla_err against the sampled reference,
    kernel_vs_fla over every element, kernel_nonfinite and fla_nonfinite counts. Raises
    ValueError where one side lacks an output the other has, or shapes differ."""
    outputs = {}
    for i, name in enumerate(NAMES):
        o, f = ours[i], theirs[i]
        if o is None and f is None:
            continue
        if o is None or f is None:
            raise ValueError(
                f"{name}: the kernel returned {'None' if o is None else 'a tensor'}, fla the other"
            )
        if tuple(o.shape) != tuple(f.shape):
            raise ValueError(f"{name}: shape {tuple(o.shape)}, fla's {tuple(f.shape)}")
        diff, bad_o, bad_f = rel_diff(o, f)
        outputs[name] = {
            "kernel_err": sampled_error(ours, refs, pairs, sig, i),
            "fla_err": sampled_error(theirs, refs, pairs, sig, i),
            "kernel_vs_fla": diff,
            "kernel_nonfinite": bad_o,
            "fla_nonfinite": bad_f,
        }
    return outputs


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksums(args: dict) -> dict:
    """An integer sum of the bits of every input tensor (any changed element shows,
    except changes that cancel in the sum)."""
    out = {}
    for name, x in args.items():
        if isinstance(x, torch.Tensor):
            bits = x.view(_INT_VIEW[x.element_size()]) if x.is_floating_point() else x
            out[name] = int(bits.sum(dtype=torch.int64))
    return out


class Check:
    """One signature's check, phase by phase (see the module docstring)."""

    def __init__(self, request: dict):
        self.sig = Signature.from_json(request["signature"])
        self.device = request.get("device")
        self.perturb = request.get("perturb")

    def setup(self) -> None:
        from . import _dispatch
        from .testing import plan

        if not torch.cuda.is_available():
            raise RuntimeError("the check process sees no CUDA device")
        device = torch.device("cuda", 0 if self.device is None else int(self.device))
        torch.cuda.set_device(device)
        gen = torch.Generator().manual_seed(zlib.crc32(self.sig.key().encode()))
        a = self.args = inputs_for(self.sig, device, gen)
        rule = RULES[self.sig.entry]
        ok, reason = plan(a, rule)
        self.rule, self.plan = rule, reason
        if not ok:  # the parent planned the kernel; here (a stand-in GPU) the rule may not
            ok, capable = plan(a, "capable")
            if not ok:
                raise RuntimeError(f"the kernel cannot run this signature: {capable}")
            self.rule, self.plan = "capable", f"{capable} (capable rule; the {rule} rule: {reason})"
        self.fla = _dispatch.fla_function()(**a)
        torch.cuda.synchronize()
        self.pairs = sample_pairs(self.sig, gen)
        self.refs = reference_samples(a, self.sig, self.pairs)
        self.sums = checksums(a)

    def kernel(self) -> tuple:
        from .testing import run_kernel

        ours = run_kernel(self.args, poison=True, rule=self.rule)
        torch.cuda.synchronize()
        return ours

    def compare(self, ours) -> dict:
        if self.perturb:
            ours = list(ours)
            i = NAMES.index(self.perturb)
            ours[i] = ours[i].clone()
            ours[i].view(-1)[: max(1, ours[i].numel() // 8)] += 1.0
        outputs = measure(ours, self.fla, self.refs, self.pairs, self.sig)
        after = checksums(self.args)
        return {
            "plan": self.plan,
            "outputs": outputs,
            "pairs": len(self.pairs),
            "inputs_modified": [k for k, v in self.sums.items() if after.get(k) != v],
        }


def main() -> int:
    """Reads the request, runs the phases, reports; 0 when a result was reported."""
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr

    def emit(msg: dict) -> None:
        report.write(REPORT_PREFIX + json.dumps(msg) + "\n")
        report.flush()

    def failed(phase: str, e: BaseException) -> int:
        traceback.print_exc()
        emit({"error": {"phase": phase, "type": type(e).__name__, "message": str(e)[:2000]}})
        return 1

    request = json.loads(sys.stdin.buffer.readline() or b"{}")

    def lifeline():
        try:
            sys.stdin.buffer.read()
        finally:
            os._exit(70)

    threading.Thread(target=lifeline, daemon=True).start()
    limits = request.get("limits") or {}
    total = sum(float(limits.get(p, 600.0)) for p in ("setup", "kernel", "compare")) + 60.0
    watchdog = threading.Timer(total, os._exit, (71,))
    watchdog.daemon = True
    watchdog.start()

    emit({"phase": "setup"})
    try:
        check = Check(request)
        check.setup()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        return failed("setup", e)
    emit({"phase": "kernel"})
    try:
        ours = check.kernel()
    except BaseException as e:  # noqa: BLE001
        return failed("kernel", e)
    emit({"phase": "compare"})
    try:
        result = check.compare(ours)
    except BaseException as e:  # noqa: BLE001
        return failed("compare", e)
    emit({"result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
