"""A device whose driver or GPU cannot run the kernel image: one warning, then fla.

CPU tests: the core's constants and exception; the once-per-device warning; the entry
points through a stand-in core that answers as the real one does for such a device (a
fallback verdict whose reason starts with UNAVAILABLE_PREFIX, or KernelUnavailableError
at launch), and a launch error that means a bug still raising. The Rust unit tests
(launch::tests, driver::tests) cover how driver answers are classified.

GPU tests (each in a child process: a device's verdict is kept for the process): an image
the H200 cannot load (KDA_DHU_IMAGE_FILE) sends every call to fla with one warning, and
each embedded image (KDA_DHU_IMAGE=cuda12 / cuda13) passes parity cases of
test_gpu_kernel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import kda_dhu
import pytest
import torch
from helpers import TESTS, make_inputs
from kda_dhu import _core, _dispatch, _driver
from kda_dhu._driver import KernelUnavailableWarning

REASON = (
    "kernel unavailable on cuda:0: sm_90 with CUDA driver 12.2: cuModuleLoadData(dhu_sm90 sm_90a, CUDA 13 "
    "image) failed: CUDA_ERROR_UNSUPPORTED_PTX_VERSION; that image needs a driver for CUDA 13.0 or newer (R580+)"
)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """No device warned about yet in this test."""
    monkeypatch.setattr(_driver, "_warned", set())


def _unavailable_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, KernelUnavailableWarning)]


def test_the_core_names_unavailable_devices_with_one_prefix():
    assert _core.UNAVAILABLE_PREFIX == "kernel unavailable on cuda:"
    assert REASON.startswith(_core.UNAVAILABLE_PREFIX)
    assert issubclass(_core.KernelUnavailableError, RuntimeError)
    assert issubclass(KernelUnavailableWarning, RuntimeWarning)
    switches = [name for name, _, _ in _core.switches()]
    assert "KDA_DHU_IMAGE" in switches and "KDA_DHU_IMAGE_FILE" in switches


def test_both_cuda_versions_of_each_kernel_are_embedded():
    images = set(_core.embedded_kernels())
    for stem, arch in (("dhu_sm90", "sm_90a"), ("dhu_sm100", "sm_100a")):
        for image in ("cuda12", "cuda13"):
            assert (stem, arch, image) in images, images
            # build.rs checked this image's ptxas report (no spills): its lines are there
            assert any(ln.startswith(f"{stem} {arch} {image} ") for ln in _core.build_info().splitlines())
    assert "cuda12: NVRTC 12." in _core.build_info()


def test_one_warning_per_device(fresh_warnings):
    other = REASON.replace("cuda:0", "cuda:3", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _driver.note_unavailable(REASON)
        assert _driver.note_unavailable(REASON)
        assert _driver.note_unavailable(_core.KernelUnavailableError(REASON))
        assert _driver.note_unavailable(other)
        assert not _driver.note_unavailable("4 CTAs <= half of 132 SMs with 256 chunks per sequence")
        assert not _driver.note_unavailable("kernel-sm90a")
    got = _unavailable_warnings(caught)
    assert len(got) == 2, got
    assert got[0] == f"kda_dhu: {REASON}. Stage 4 on cuda:0 runs fla's kernel for the rest of this process."
    assert got[1].startswith("kda_dhu: kernel unavailable on cuda:3: ") and "on cuda:3 runs fla's" in got[1]
    assert len(caught) == 2  # nothing else warned
    assert [
        _driver.unavailable_ordinal(r) for r in (REASON, other, "x", "kernel unavailable on cuda:x: y")
    ] == [
        0,
        3,
        None,
        None,
    ]


class _FlaStandIn:
    """fla's function: records each call's keyword arguments, returns a fixed result."""

    def __init__(self):
        self.calls, self.result = [], (torch.zeros(1), None, torch.ones(1))

    def __call__(self, **kw):
        self.calls.append(kw)
        return self.result


class _Call:
    """A ``_core.Call`` (dense, nothing to copy) on a device whose image is unusable
    (``ok`` False: the decision is fla's function, and says why) or found unusable only at
    the launch (``error``: what the launch raises; None: launches nothing)."""

    copies: list = []
    count_chunks = check_tables = guarded = False

    def __init__(self, args, ok, reason, error=None):
        self.error, self.launches = error, 0
        self.nt = (args["q"].shape[1] + 63) // 64
        self.verdict = (ok, reason)
        self.reason = reason
        self.action = "kernel" if ok else "fla"
        self.launch_only = ok
        self.unavailable = None if ok else reason
        self.switches = None

    def run(self, use_graph=False, poison=False):
        self.launches += 1
        if self.error is not None:
            raise self.error


class _Switches:
    force = None
    check_inputs = False

    @staticmethod
    def now():
        return _Switches()


class _Core:
    """The extension as it decides for one device: `call` from decide, its launch."""

    KernelUnavailableError = _core.KernelUnavailableError
    Call, Switches = _Call, _Switches

    def __init__(self, call, forced_error=None):
        self.call, self.forced_error = call, forced_error

    def run(self, *a):  # as for a tensor that is not a plain torch.Tensor: decided in Python's device scope
        return None

    def decide(self, *a, **kw):
        if self.forced_error is not None:
            raise self.forced_error
        return self.call


def _three_entry_points(args):
    """The full-signature entry point twice, the verifier, and the seed's dispatcher."""
    a = args
    outs = [kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a) for _ in range(2)]
    verdict = kda_dhu.plan_call(**a)
    outs.append(
        kda_dhu.kda_dhu_b2a(a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], 0.125, 64)
    )
    return outs, verdict


def _stand_ins(monkeypatch, call, forced_error=None):
    fla = _FlaStandIn()
    monkeypatch.setattr(_dispatch, "_core", _Core(call, forced_error))
    monkeypatch.setattr(_dispatch, "fla_function", lambda: fla)
    monkeypatch.setattr(_dispatch, "_current_stream", lambda q: 0)
    monkeypatch.delenv("KDA_DHU_FORCE", raising=False)
    return fla


def test_an_unavailable_verdict_runs_fla_with_one_warning(monkeypatch, rng, fresh_warnings):
    args = make_inputs(2, 100, 2, 2, 64, 64, generator=rng)
    call = _Call(args, False, REASON)
    fla = _stand_ins(monkeypatch, call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs, verdict = _three_entry_points(args)
    assert _unavailable_warnings(caught) == [
        f"kda_dhu: {REASON}. Stage 4 on cuda:0 runs fla's kernel for the rest of this process."
    ]
    assert verdict == (False, REASON)
    assert all(o is fla.result for o in outs)
    assert len(fla.calls) == 3 and call.launches == 0
    assert fla.calls[0]["q"] is args["q"] and fla.calls[0]["dv"] is args["dv"]
    assert fla.calls[2]["gk"] is args["gk"] and fla.calls[2]["scale"] == 0.125


def test_kernel_force_on_an_unavailable_device_says_why(monkeypatch, rng, fresh_warnings):
    """KDA_DHU_FORCE=kernel on such a device: the decision's RuntimeError (the core's
    `Error::Forced`, cargo test `the_switches_decide_once`) names the unavailability."""
    args = make_inputs(1, 64, 1, 1, 64, 64, generator=rng)
    forced = RuntimeError(f"KDA_DHU_FORCE=kernel, but the kernel cannot run this call: {REASON}")
    _stand_ins(monkeypatch, _Call(args, False, REASON), forced_error=forced)
    with pytest.raises(RuntimeError, match="kernel unavailable on cuda:0"):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)


def test_an_image_found_unusable_at_launch_runs_fla_with_one_warning(monkeypatch, rng, fresh_warnings):
    args = make_inputs(2, 100, 2, 2, 64, 64, generator=rng)
    call = _Call(args, True, "kernel-sm90a", _core.KernelUnavailableError(REASON))
    fla = _stand_ins(monkeypatch, call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs, _ = _three_entry_points(args)
    assert len(_unavailable_warnings(caught)) == 1, [str(w.message) for w in caught]
    assert all(o is fla.result for o in outs)
    assert call.launches == 3 and len(fla.calls) == 3


def test_a_launch_error_that_means_a_bug_still_raises(monkeypatch, rng, fresh_warnings):
    args = make_inputs(2, 100, 2, 2, 64, 64, generator=rng)
    bug = RuntimeError(
        "cuLaunchKernel(kda_dhu_sm90_k64_bf16, ...) on cuda:0 failed: CUDA_ERROR_LAUNCH_FAILED"
    )
    fla = _stand_ins(monkeypatch, _Call(args, True, "kernel-sm90a", bug))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning
        with pytest.raises(RuntimeError, match="CUDA_ERROR_LAUNCH_FAILED"):
            kda_dhu.chunk_gated_delta_rule_bwd_dhu(**args)
    assert fla.calls == []


# ------------------------------------------------------------------------------ GPU


def _child(code: str, env_extra: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KDA_DHU_IMAGE", "KDA_DHU_IMAGE_FILE", "KDA_DHU_FORCE")
    }
    env.update(env_extra)
    # helpers (tests/) and the GPU tests' checks (tests/gpu/test_gpu_kernel.py) importable
    env["PYTHONPATH"] = os.pathsep.join([TESTS, os.path.join(TESTS, "gpu"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


_UNUSABLE = """
    import json, sys, warnings
    import torch, kda_dhu
    from kda_dhu import _core, _dispatch
    from kda_dhu._driver import KernelUnavailableWarning
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
    from helpers import make_inputs, pin_fla_stage4

    pin_fla_stage4()
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    a = make_inputs(2, 200, 2, 4, 128, 64, torch.bfloat16, "gk", device="cuda", generator=g)
    b = make_inputs(4, 256, 4, 4, 128, 128, torch.bfloat16, "gk", device="cuda", generator=g)
    b2a = (b["q"], b["k"], b["w"], b["gk"], b["h0"], b["dht"], b["do"], b["dv"], b["scale"], 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a) for _ in range(3)]
        verdict = kda_dhu.plan_call(**a)
        out_b2a = kda_dhu.kda_dhu_b2a(*b2a)
    fla = _dispatch.fla_function()
    want = fla(**a)
    want_b2a = fla(q=b2a[0], k=b2a[1], w=b2a[2], gk=b2a[3], h0=b2a[4], dht=b2a[5], do=b2a[6], dv=b2a[7],
                   scale=b2a[8], chunk_size=64)
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**a, emulate_rounding=False)
    same = lambda x, y: all((u is None and v is None) or torch.equal(u, v) for u, v in zip(x, y))
    print("REPORT " + json.dumps({
        "warnings": [str(w.message) for w in caught if issubclass(w.category, KernelUnavailableWarning)],
        "other_warnings": [str(w.message) for w in caught if not issubclass(w.category, KernelUnavailableWarning)],
        "verdict": list(verdict),
        "unavailable": _core.kernel_unavailable(0),
        "image": _core.kernel_image(0),
        "equal_to_fla": [same(o, want) for o in outs],
        "b2a_equal_to_fla": same(out_b2a, want_b2a),
        "rel_err": [rel_err(o, r) for o, r in zip(outs[0], ref)],
    }))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("image", ["elf_garbage", "ptx_text"])
def test_an_image_the_gpu_cannot_load_sends_every_call_to_fla_with_one_warning(tmp_path, rng, image):
    """KDA_DHU_IMAGE_FILE: an ELF header over random bytes (CUDA_ERROR_INVALID_IMAGE or
    the like), or text the driver reads as PTX and cannot compile. Every entry point
    returns fla's own result, bitwise, with one KernelUnavailableWarning naming the GPU,
    the driver and what failed; the verdict says so. ~30 s (fla compiles its kernel)."""
    path = tmp_path / f"{image}.cubin"
    if image == "elf_garbage":
        noise = torch.randint(0, 256, (4096,), generator=rng, dtype=torch.uint8).numpy().tobytes()
        path.write_bytes(b"\x7fELF\x02\x01\x01" + noise)
    else:
        path.write_text("this is not a kernel image\n")
    seed = str(int(torch.randint(0, 2**31, (1,), generator=rng)))
    r = _child(_UNUSABLE, {"KDA_DHU_IMAGE_FILE": str(path)}, seed)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")]
    assert r.returncode == 0 and lines, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rep = json.loads(lines[0][len("REPORT ") :])
    assert len(rep["warnings"]) == 1, rep
    msg = rep["warnings"][0]
    assert msg.startswith("kda_dhu: kernel unavailable on cuda:0: sm_") and " with CUDA driver " in msg, msg
    assert f"cuModuleLoadData(KDA_DHU_IMAGE_FILE={path}) failed: CUDA_ERROR_" in msg, msg
    assert rep["verdict"][0] is False and rep["verdict"][1] == rep["unavailable"], rep
    assert rep["unavailable"].startswith("kernel unavailable on cuda:0: ") and rep["image"] is None, rep
    assert rep["equal_to_fla"] == [True, True, True] and rep["b2a_equal_to_fla"], rep
    assert all(e < 2e-2 for e in rep["rel_err"] if e is not None), rep  # fla's values, not garbage


_PARITY = """
    import sys
    import torch
    from kda_dhu import _core
    from helpers import make_inputs, pin_fla_stage4
    from test_gpu_kernel import _check

    pin_fla_stage4()
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    for B, T, H, HV, K, V, dtype, gate in [
        (2, 320, 4, 4, 128, 64, torch.bfloat16, "gk"),
        (2, 200, 2, 2, 64, 128, torch.float16, "g"),
        (2, 65, 2, 4, 128, 128, torch.bfloat16, None),
        (1, 256, 2, 2, 128, 64, torch.bfloat16, "gk"),
    ]:
        _check(make_inputs(B, T, H, HV, K, V, dtype, gate, device="cuda", generator=g))
    print("IMAGE", _core.kernel_image(0))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("image", ["cuda12", "cuda13"])
def test_each_embedded_image_passes_parity(rng, image):
    """KDA_DHU_IMAGE=cuda12 / cuda13 loads that image (the driver loads both from 13.0 on)
    and the kernel from it meets SPEC.md's bar against the float64 reference and fla on
    tails, GVA, both dtypes and all gates (test_gpu_kernel._check). The full suite runs on
    one image per process: `KDA_DHU_IMAGE=cuda12 pytest tests`. ~30 s each."""
    if _core.device_arch(0) != "sm_90":
        pytest.skip("the parity cases include GVA and tails: the sm_90a kernel's envelope")
    seed = str(int(torch.randint(0, 2**31, (1,), generator=rng)))
    r = _child(_PARITY, {"KDA_DHU_IMAGE": image}, seed)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    cuda = image.removeprefix("cuda")
    assert f"IMAGE dhu_sm90 sm_90a, CUDA {cuda} image" in r.stdout, r.stdout[-2000:]
