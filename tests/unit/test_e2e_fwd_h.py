"""benches/e2e.py --fwd-h without a GPU: the mode switch (KDA_DHU_FWD_H on only in the "on"
mode), the forward scan's spy (bound in every module of the op that imported it, per-step
sums), the launch accounting, the step target and the tables with and without the field."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os

import pytest
from helpers import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benches", "e2e.py")
RECORD = os.path.join(REPO_ROOT, "benches", "results", "e2e-latest.json")


@pytest.fixture
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_fwd_h", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mode_switch_sets_fwd_h_only_in_on_mode_under_the_flag(e2e, monkeypatch):
    env = e2e.FWD_H_ENV
    assert env == "KDA_DHU_FWD_H"
    monkeypatch.setenv(env, "on")
    monkeypatch.setenv(e2e.BACKEND_ENV, "1")
    with e2e.restored_switches():
        for flag in (False, True):
            monkeypatch.setattr(e2e, "FWD_H_ON", flag)
            e2e.set_mode("kda_dhu")
            assert e2e.BACKEND_ENV not in os.environ
            assert os.environ.get(env) == ("on" if flag else "off")
            for off in ("fla", "fla_again"):
                e2e.set_mode(off)
                assert os.environ[e2e.BACKEND_ENV] == "0" and os.environ[env] == "off"
    assert os.environ[env] == "on" and os.environ[e2e.BACKEND_ENV] == "1"  # restored


def test_fwd_h_modules_are_the_ops_callers():
    pytest.importorskip("fla.ops.common.chunk_delta_h")
    spec = importlib.util.spec_from_file_location("e2e_mods", SCRIPT)
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    kda = {m.__name__ for m in e2e.fwd_h_modules("kda")}
    assert {"fla.ops.kda.chunk_fwd", "fla.ops.kda.chunk_bwd"} <= kda  # forward, backward's recompute
    assert all(n.startswith("fla.ops.kda.") for n in kda)
    assert "fla.ops.gated_delta_rule.chunk" in {m.__name__ for m in e2e.fwd_h_modules("gdn")}


def test_fwd_h_spy_rebinds_every_caller_and_sums_per_step(e2e, monkeypatch):
    import types

    src = types.ModuleType("src")
    a, b = types.ModuleType("a"), types.ModuleType("b")

    def fwd_h(x):
        return x + 1

    for m in (src, a, b):
        setattr(m, e2e.FWD_H, fwd_h)
    monkeypatch.setattr(e2e.FwdHSpy, "_modules", staticmethod(lambda op: [a, b]))
    with e2e.FwdHSpy("kda") as spy:
        assert getattr(a, e2e.FWD_H) is getattr(b, e2e.FWD_H) is not fwd_h
        assert getattr(a, e2e.FWD_H)(1) == 2 and getattr(b, e2e.FWD_H)(2) == 3
        assert spy.calls == 2
    assert getattr(a, e2e.FWD_H) is fwd_h and getattr(b, e2e.FWD_H) is fwd_h

    class Ev:
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, end):
            return end.t - self.t

    spy.events = [
        (None, 0, Ev(0), Ev(100)),  # warm-up: left out
        ("fla", 1, Ev(0), Ev(1.0)),
        ("fla", 1, Ev(0), Ev(2.0)),
        ("kda_dhu", 2, Ev(0), Ev(0.5)),
        ("kda_dhu", 2, Ev(0), Ev(1.0)),
        ("kda_dhu", 3, Ev(0), Ev(0.5)),
        ("kda_dhu", 3, Ev(0), Ev(2.0)),
        ("fla", 4, Ev(0), Ev(2.0)),
        ("fla", 4, Ev(0), Ev(2.0)),
    ]
    ms, calls = spy.per_step()
    assert ms == {"fla": 3.5, "kda_dhu": 2.0} and calls == {"fla": 2, "kda_dhu": 2}
    spy.begin("fla", timed=False)
    assert spy.mode is None
    spy.begin("kda_dhu", timed=True)
    assert spy.mode == "kda_dhu" and spy.step == 2


def _row(fwd_h, bwd_launches, timed_bwd, timed_fwd, fwd=None, reps=10):
    check = {
        "gate_normalizer": 1.0,
        "rel_err": {"q": 1e-4},
        "fwd_h_calls_fwd": 1,
        "kernel_launches": {"fla": 0, "kda_dhu": bwd_launches, "fla_again": 0},
        "stage4_calls": {"fla": 1, "kda_dhu": 1, "fla_again": 1},
        "fwd_h_calls": {"fla": 1, "kda_dhu": 1, "fla_again": 1},
        "verdicts": {"kda_dhu": [], "fla": []},
    }
    if fwd is not None:
        check["fwd"] = fwd
    return {
        "case": "kda_b8_t4096_h32",
        "fwd_h": fwd_h,
        "grad_checks": [check],
        "kernel_launches_timed": {"fla": 0, "kda_dhu": timed_bwd},
        "timed_backwards": reps,
        "kernel_launches_timed_fwd": {"fla": 0, "kda_dhu": timed_fwd},
        "timed_forwards": reps,
    }


def test_launch_accounting_with_and_without_fwd_h(e2e):
    fwd_ok = {"rel_err": {"o": 1e-3, "final_state": 1e-3}, "kernel_launches": 1, "fwd_h_calls": 1}
    # --fwd-h: stage 4 + the backward's recompute per backward, the forward's scan per forward
    assert e2e.case_failures(_row(True, 2, 20, 10, fwd_ok), tol=2e-2) == []
    msgs = e2e.case_failures(_row(True, 1, 10, 0, {**fwd_ok, "kernel_launches": 0}), tol=2e-2)
    assert any("ran 1 times for 1 stage-4 and 1 forward-scan calls" in m for m in msgs), msgs
    assert any("10 kernel launches in 10 timed backwards" in m for m in msgs), msgs
    assert any("0 kernel launches in 10 timed forwards with both ops on" in m for m in msgs), msgs
    assert any("ran 0 times for 1 forward-scan calls in the forward" in m for m in msgs), msgs
    bad_fwd = {**fwd_ok, "rel_err": {"o": float("nan"), "final_state": 1e-3}}
    msgs = e2e.case_failures(_row(True, 2, 20, 10, bad_fwd), tol=2e-2)
    assert msgs and all("forward output rel err over" in m for m in msgs), msgs
    # without: the forward scan is fla's; any launch in a forward is a failure
    assert e2e.case_failures(_row(False, 1, 10, 0), tol=2e-2) == []
    msgs = e2e.case_failures(_row(False, 2, 20, 10), tol=2e-2)
    assert len(msgs) == 3 and any("timed forwards (KDA_DHU_FWD_H off)" in m for m in msgs), msgs


def test_step_target_only_with_fwd_h(e2e):
    row = {"case": "kda_b8_t4096_h32", "bwd_speedup": 1.03, "stage4_speedup": 1.45, "fwd_bwd_speedup": 1.021}
    assert not any("forward+backward" in t["what"] for t in e2e.targets([row]))
    step = [t for t in e2e.targets([row], fwd_h=True) if "forward+backward" in t["what"]]
    assert len(step) == 1 and step[0]["limit"] == 1.02 and step[0]["ok"] is True
    row["fwd_bwd_speedup"] = 1.019
    assert [t["ok"] for t in e2e.targets([row], fwd_h=True) if "forward+backward" in t["what"]] == [False]


def test_tables_old_and_fwd_h_records(e2e):
    with open(RECORD) as f:
        record = json.load(f)
    old = e2e.markdown_table(record)
    assert "fwd_h" not in old and "| kda_b8_t4096_h32 |" in old
    row = {
        **record["rows"][0],
        "fwd_h": True,
        "fwd_h_ms": {"fla": 1.234, "kda_dhu": 0.617},
        "fwd_h_calls_per_step": {"fla": 2, "kda_dhu": 2},
        "fwd_h_speedup": 2.0,
        "max_fwd_rel_err": 3e-3,
        "kernel_launches_timed_fwd": {"fla": 0, "kda_dhu": 10},
        "timed_forwards": 10,
    }
    record.update(
        fwd_h=True, rows=[row], skipped=[{"case": "gdn_b8_t4096_h32", "reason": "refused"}], targets=[]
    )
    table = e2e.markdown_table(record)
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| case |"))
    assert "fwd_h ms/step fla" in header and "KDA_DHU_FWD_H=on" in table
    n = header.count("|")
    assert all(line.count("|") == n for line in lines if line.startswith("|"))
    data = next(line for line in lines if line.startswith("| kda_b8_t4096_h32 |"))
    assert "| 1.234 | 0.617 | 2.000x | 2 | 3.0e-03 |" in data and "10 timed fwd: 10 / 0" in data


def test_launch_accounting_of_split_calls(e2e):
    """A call the plan splits launches three kernels (first pass, merge, second pass): the
    spies' per-call counts set what a backward and a forward should launch; a call that
    launched two (or none while counted as the kernel's) fails."""
    fwd_split = {
        "rel_err": {"o": 1e-3, "final_state": 1e-3},
        "kernel_launches": 3,
        "fwd_h_calls": 1,
        "call_launches": [3],
    }
    row = _row(True, 6, 60, 30, fwd_split)
    row["grad_checks"][0]["call_launches"] = {"kda_dhu": {"stage4": [3], "fwd_h": [3]}}
    assert e2e.case_failures(row, tol=2e-2) == []
    # the record without per-call counts reads one launch per call
    old = _row(True, 6, 60, 30, {**fwd_split, "call_launches": None})
    del old["grad_checks"][0]["fwd"]["call_launches"]
    msgs = e2e.case_failures(old, tol=2e-2)
    assert any("ran 6 times for 1 stage-4 and 1 forward-scan calls" in m for m in msgs), msgs
    # a call launching two kernels is neither a plain nor a split call
    row["grad_checks"][0]["call_launches"] = {"kda_dhu": {"stage4": [2], "fwd_h": [4]}}
    msgs = e2e.case_failures(row, tol=2e-2)
    assert any("neither 1 nor 3: [2, 4]" in m for m in msgs), msgs
    # the timed totals follow the per-call counts: 5 per backward here, not 6
    row["grad_checks"][0]["call_launches"] = {"kda_dhu": {"stage4": [3], "fwd_h": [1]}}
    row["grad_checks"][0]["kernel_launches"]["kda_dhu"] = 4
    msgs = e2e.case_failures(row, tol=2e-2)
    assert msgs == ["kda_b8_t4096_h32: 60 kernel launches in 10 timed backwards with the backend on "
                    "(1 stage-4 call(s) and 1 forward-scan call(s) each)"], msgs  # fmt: skip
