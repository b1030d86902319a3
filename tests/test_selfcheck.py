"""The sm_100a self-check: first call per signature compared with fla; a mismatch switches
the kernel off for the process, warns once and returns fla's result. CPU only: the
kernel and fla are stand-ins, one of them made wrong on purpose."""

from __future__ import annotations

import warnings

import pytest
import torch
from kda_dhu import _dispatch
from kda_dhu._selfcheck import SelfCheck, compare_outputs


def _outs(seed, dtype=torch.bfloat16, bad=False):
    g = torch.Generator().manual_seed(seed)
    dh = torch.randn(2, 3, 4, 8, 8, generator=g).to(dtype)
    dh0 = torch.randn(2, 4, 8, 8, generator=g)
    dv2 = torch.randn(2, 130, 4, 8, generator=g).to(dtype)
    if bad:
        dv2 = dv2.clone()
        dv2[0, 5] += 1.0  # one wrong row: a wrong kernel
    return dh, dh0, dv2


class Counter:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def __call__(self):
        self.calls += 1
        return self.result


def test_matching_kernel_is_checked_once_per_signature(monkeypatch):
    monkeypatch.delenv("KDA_DHU_SM100_TRUSTED", raising=False)
    chk = SelfCheck("test")
    good = _outs(0)
    kern, fla = Counter(good), Counter(tuple(x.clone() for x in good))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert chk.run("sigA", kern, fla) is good
    assert (kern.calls, fla.calls) == (3, 1)  # fla ran only for the first call
    chk.run("sigB", kern, fla)
    assert fla.calls == 2  # a new signature is checked again
    assert chk.disabled_reason is None


def test_mismatch_warns_once_disables_and_returns_fla(monkeypatch):
    monkeypatch.delenv("KDA_DHU_SM100_TRUSTED", raising=False)
    chk = SelfCheck("test")
    kern, fla = Counter(_outs(1, bad=True)), Counter(_outs(1))
    with pytest.warns(RuntimeWarning, match="disagreed with fla"):
        out = chk.run("sig", kern, fla)
    assert out is fla.result
    assert chk.disabled_reason is not None and "dv2" in chk.disabled_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        out2 = chk.run("other", kern, fla)
    assert out2 is fla.result and kern.calls == 1  # the kernel never runs again


def test_trust_env_skips_the_check(monkeypatch):
    monkeypatch.setenv("KDA_DHU_SM100_TRUSTED", "1")
    chk = SelfCheck("test")
    kern, fla = Counter(_outs(2, bad=True)), Counter(_outs(2))
    assert chk.run("sig", kern, fla) is kern.result
    assert fla.calls == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compare_outputs_tolerances(dtype):
    a = _outs(3, dtype)
    noise = tuple(
        x + (1e-3 * x.float().abs().mean() * torch.randn(x.shape)).to(x.dtype) if x.dtype == dtype else x
        for x in a
    )
    assert compare_outputs(a, a)[0]
    assert compare_outputs(noise, a)[0]
    assert not compare_outputs(_outs(3, dtype, bad=True), a)[0]
    nan = (a[0], a[1], a[2].clone().fill_(float("nan")))
    assert not compare_outputs(nan, a)[0]
    assert not compare_outputs((a[0], None, a[2]), a)[0]


class _FakeCall:
    nt = 1


class _FakeCore:
    @staticmethod
    def run(*a, **k):
        return None  # the one-crossing path hands the call to the general path

    @staticmethod
    def force():
        return None


def _inject_plan(monkeypatch, reason, run_kernel, run_fla):
    """The general path with an injected plan (``reason``), kernel and fla."""
    monkeypatch.setattr(_dispatch, "_core", _FakeCore)
    monkeypatch.setattr(_dispatch, "_require_core", lambda: _FakeCore)
    monkeypatch.setattr(_dispatch, "_on_cpu", lambda q: False)
    monkeypatch.setattr(_dispatch, "_decide", lambda rule, c: (True, reason, _FakeCall, c))
    monkeypatch.setattr(_dispatch, "_launch", lambda *a, **k: run_kernel())
    monkeypatch.setattr(_dispatch._Call, "fla", lambda self: run_fla())


def test_dispatcher_routes_sm100_plans_through_the_check(monkeypatch):
    """Injected: a plan saying kernel-sm100a and a wrong kernel; fla's result comes back."""
    monkeypatch.delenv("KDA_DHU_SM100_TRUSTED", raising=False)
    monkeypatch.setattr(_dispatch, "SM100_CHECK", SelfCheck("sm_100a"))
    good, bad = _outs(4), _outs(4, bad=True)
    # the one-crossing path (_core.run) hands sm_100a plans back to this one (cargo test
    # plan_runs_in_one_crossing_only_on_sm90): injected here, so it is taken out
    _inject_plan(monkeypatch, "kernel-sm100a", lambda: bad, lambda: good)
    q = torch.zeros(1, 64, 1, 8, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="sm_100a kernel disagreed"):
        out = _dispatch.chunk_gated_delta_rule_bwd_dhu(q, q, q, q, q)
    assert out is good
    assert _dispatch.SM100_CHECK.disabled_reason is not None

    # The seed's dispatcher shares the guard: the kernel stays off for it too (not run
    # again, no second warning).
    def no_kernel(*a, **k):
        raise AssertionError("the kernel must stay off after the mismatch")

    monkeypatch.setattr(_dispatch, "_launch", lambda *a, **k: no_kernel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _dispatch.kda_dhu_b2a(q, q, q, None, None, None, q, q, 1.0, 64)
    assert out is good


def test_sm90_plans_are_not_checked(monkeypatch):
    monkeypatch.setattr(_dispatch, "SM100_CHECK", SelfCheck("sm_100a"))
    ours = _outs(5)

    def no_fla():
        raise AssertionError("fla must not run for a verified kernel")

    _inject_plan(monkeypatch, "kernel-sm90a", lambda: ours, no_fla)
    q = torch.zeros(1, 64, 1, 8, dtype=torch.bfloat16)
    assert _dispatch.chunk_gated_delta_rule_bwd_dhu(q, q, q, q, q) is ours


def test_driver_error_on_first_call_warns_disables_and_returns_fla(monkeypatch):
    """A RuntimeError from the kernel's first call of a signature (a driver error: image
    not loading, launch refused) switches the kernel off and returns fla's result."""
    monkeypatch.delenv("KDA_DHU_SM100_TRUSTED", raising=False)
    chk = SelfCheck("test")
    fla = Counter(_outs(2))
    calls = []

    def failing_kernel():
        calls.append(1)
        raise RuntimeError("cuModuleLoadData: CUDA_ERROR_NO_BINARY_FOR_GPU")

    with pytest.warns(RuntimeWarning, match="failed on its first call of sig.*NO_BINARY_FOR_GPU"):
        out = chk.run("sig", failing_kernel, fla)
    assert out is fla.result and fla.calls == 1
    assert "NO_BINARY_FOR_GPU" in chk.disabled_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, the kernel not tried again
        assert chk.run("other", failing_kernel, fla) is fla.result
    assert len(calls) == 1 and fla.calls == 2


def test_errors_that_are_not_the_kernels_propagate(monkeypatch):
    """Out of memory (the caller's), bad input (ValueError) and any error of a checked or
    trusted signature reach the caller; the kernel stays on."""
    monkeypatch.delenv("KDA_DHU_SM100_TRUSTED", raising=False)
    fla = Counter(_outs(3))
    for exc in (torch.cuda.OutOfMemoryError("CUDA out of memory"), ValueError("q: expected ...")):
        chk = SelfCheck("test")

        def kernel(exc=exc):
            raise exc

        with pytest.raises(type(exc)):
            chk.run("sig", kernel, fla)
        assert chk.disabled_reason is None
    chk = SelfCheck("test")
    good = _outs(4)
    state = {"fail": False}

    def flaky():
        if state["fail"]:
            raise RuntimeError("later failure")
        return good

    chk.run("sig", flaky, Counter(tuple(x.clone() for x in good)))
    state["fail"] = True
    with pytest.raises(RuntimeError, match="later failure"):
        chk.run("sig", flaky, fla)  # a checked signature: not swapped for fla silently
    monkeypatch.setenv("KDA_DHU_SM100_TRUSTED", "1")
    with pytest.raises(RuntimeError, match="later failure"):
        chk.run("new", flaky, fla)
    assert chk.disabled_reason is None
