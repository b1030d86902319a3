"""The sm_100a containment on a real GPU, whatever GPU is present.

The real check process runs one signature's check end to end (inputs on the device, fla,
the float64 reference, the kernel the planner picks: on an H200 the sm_90a kernel stands
in for the sm_100a one); the dispatcher's guard runs with the planner's sm_90a plans
relabelled sm_100a, so that the first call returns fla's result and the kernel runs only
after the check passed; synthetic check processes hang on the GPU or kill their CUDA
context, after which this process's GPU still computes right.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from helpers import make_inputs
from kda_dhu import _dispatch
from kda_dhu._selfcheck import (
    MODE_ENV,
    REPORT_PREFIX,
    Limits,
    SelfCheck,
    Signature,
    child_env,
    classify,
    default_child_command,
    rel_diff,
    signature_of,
    supervise,
)

pytestmark = pytest.mark.gpu

# A fresh process imports torch and fla and autotunes fla's kernel: minutes at most.
LIMITS = Limits(setup=400.0, kernel=60.0, compare=120.0, lock=30.0)


@pytest.fixture(autouse=True)
def _default_mode(monkeypatch):
    monkeypatch.delenv(MODE_ENV, raising=False)


def _sig(entry="extended", **kw):
    fields = dict(B=2, T=256, H=4, HV=4, K=128, V=128, dtype="bfloat16", gk=True, h0=True, dht=True)
    fields.update(kw)
    return Signature(entry, device=torch.cuda.current_device(), **fields)


def _gpu_still_right():
    """This process's CUDA context works and computes right."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=g).cuda()
    got = (a @ a).double().cpu()
    want = a.double().cpu() @ a.double().cpu()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-1)
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    "entry,fields",
    [
        pytest.param("extended", {}, id="dense-gk"),
        pytest.param("extended", dict(B=1, T=700, gk=False, g=True, N=3), id="varlen-g"),
        pytest.param("b2a", {}, id="b2a"),
    ],
)
def test_real_check_passes_the_present_kernel(tmp_path, entry, fields):
    sig = _sig(entry, **fields)
    chk = SelfCheck("gpu-test", cache_dir=str(tmp_path), limits=LIMITS)
    v = chk.check_now(sig)
    assert v.passed, v
    record = json.load(open(v.path))
    result = record["final_report"]["result"]
    major, minor = torch.cuda.get_device_capability()
    assert record["gpu"] == f"{torch.cuda.get_device_name()} sm_{major}{minor}"
    assert "kernel-sm" in result["plan"] and result["inputs_modified"] == []
    assert set(result["outputs"]) == {"dh", "dh0", "dv2"}
    # Saved: a second guard reads it, no second check process.
    again = SelfCheck("gpu-test", cache_dir=str(tmp_path), limits=LIMITS)
    assert again.check_now(sig).passed and again.children_started == 0


def test_real_check_fails_a_wrong_kernel(tmp_path):
    """The real check process with the kernel's dv2 made wrong after it ran."""
    sig = _sig()
    request = {"signature": sig.to_json(), "device": sig.device, "limits": {}, "perturb": "dv2"}
    report = supervise(default_child_command(request), request, LIMITS, env=child_env())
    outcome, detail = classify(report, LIMITS, sig)
    assert outcome == "fail" and "dv2" in detail, (outcome, detail, report.get("log_tail"))


def test_dispatcher_uses_fla_until_the_check_passed(tmp_path, monkeypatch, rng):
    import kda_dhu
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref
    from kda_dhu.testing import KernelProbe

    real_core = _dispatch._core

    class Relabelled:
        """A decision whose sm_90a kernel runs as the sm_100a one would: through the guard."""

        def __init__(self, call):
            self._call = call

        def __getattr__(self, name):
            return getattr(self._call, name)

        @property
        def guarded(self):
            return self._call.action == "kernel"

    class GeneralPathCore:
        """The core, less the one-crossing path (which runs sm_90a decisions unguarded)."""

        def run(self, *a, **k):
            return None

        def decide(self, *a, **k):
            return Relabelled(real_core.decide(*a, **k))

        def __getattr__(self, name):
            return getattr(real_core, name)

    monkeypatch.setattr(_dispatch, "_core", GeneralPathCore())
    monkeypatch.setattr(
        _dispatch, "SM100_CHECK", SelfCheck("sm_100a", cache_dir=str(tmp_path), limits=LIMITS)
    )
    args = make_inputs(2, 256, 4, 4, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng)
    fla = kda_dhu.fla_function()(**args)
    with KernelProbe() as probe:
        first = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
        torch.cuda.synchronize()
        assert probe.launches == 0  # the kernel never ran in this process before the verdict
    for name, o, f in zip(("dh", "dh0", "dv2"), first, fla):
        assert rel_diff(o, f)[0] < 1e-6, name  # fla's result
    sig = signature_of("extended", args["q"], args["do"], gk=args["gk"], h0=args["h0"], dht=args["dht"])
    v = _dispatch.SM100_CHECK.wait(sig, timeout=LIMITS.longest_wait)
    assert v is not None and v.passed, v
    with KernelProbe() as probe:
        second = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
        torch.cuda.synchronize()
        assert probe.launches == 1
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**args, emulate_rounding=False)
    from kda_dhu.reference import rel_err

    for name, o, f, r in zip(("dh", "dh0", "dv2"), second, fla, ref):
        assert rel_err(o, r) <= 1.25 * rel_err(f, r) + 1e-6, name


def _gpu_child(body: str):
    script = (
        "import json, os, sys, torch\n"
        "request = json.loads(sys.stdin.readline())\n"
        f"def say(msg): print({REPORT_PREFIX!r} + json.dumps(msg), flush=True)\n"
        "x = torch.zeros(4, device='cuda'); torch.cuda.synchronize()\n"
        "say({'phase': 'kernel'})\n"
    ) + textwrap.dedent(body)
    return lambda request: [sys.executable, "-c", script]


def test_a_kernel_that_hangs_on_the_gpu_is_killed(tmp_path):
    limits = Limits(setup=120.0, kernel=10.0, compare=10.0, lock=30.0)
    hang = _gpu_child("torch.cuda._sleep(1 << 62); torch.cuda.synchronize()")
    chk = SelfCheck("gpu-test", child_command=hang, cache_dir=str(tmp_path), limits=limits)
    v = chk.check_now(_sig())
    assert v.outcome == "timeout", v
    _gpu_still_right()


def test_a_kernel_that_kills_its_cuda_context_is_contained(tmp_path):
    """An out-of-range gather: a device-side assert, which (like an illegal address)
    leaves the check process's CUDA context unusable. This process's is untouched."""
    body = """
        try:
            y = x[torch.tensor([1 << 40], device="cuda")]
            torch.cuda.synchronize()
            say({"phase": "compare"})
        except Exception as e:
            say({"error": {"phase": "kernel", "type": type(e).__name__, "message": str(e)[:500]}})
    """
    chk = SelfCheck("gpu-test", child_command=_gpu_child(body), cache_dir=str(tmp_path), limits=LIMITS)
    v = chk.check_now(_sig())
    assert v.outcome in ("fail", "crash"), v
    _gpu_still_right()
