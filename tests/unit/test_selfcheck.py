"""The sm_100a kernel's containment, on the CPU: synthetic check processes (one that
passes, hangs, dies, raises, reports a wrong value), the verdict cache (atomic, one check
among concurrent processes, a killed lock holder), the switches, and the dispatcher's use
of the guard. The kernel and fla are stand-ins that count their calls."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import textwrap
import time
import types
import warnings

import pytest
import torch
from kda_dhu import _dispatch
from kda_dhu._selfcheck import (
    MODE_ENV,
    REPORT_PREFIX,
    Limits,
    SelfCheck,
    Signature,
    classify,
    judge,
    signature_of,
    supervise,
)
from kda_dhu._selfcheck_cache import CACHE_ENV, VerdictStore, cache_root

SIG = Signature("extended", 2, 128, 2, 2, 64, 64, "bfloat16", gk=True, h0=True, dht=True)
IDENTITY = {"gpu": "Test GPU sm_100", "driver": "1.0", "build": "0.1.0+test"}
FAST = Limits(setup=20.0, kernel=1.5, compare=5.0, lock=60.0, retry=3600.0)


def _identity(device):
    return dict(IDENTITY)


def child(body: str):
    """A synthetic check process: ``python -c`` with ``request`` (the parent's request)
    and ``say(msg)`` (a report line) defined, then ``body``."""
    script = (
        "import json, os, signal, subprocess, sys, time\n"
        "request = json.loads(sys.stdin.readline())\n"
        f"def say(msg): print({REPORT_PREFIX!r} + json.dumps(msg), flush=True)\n"
    ) + textwrap.dedent(body)
    return lambda request: [sys.executable, "-c", script]


GOOD = {
    "dh": {
        "kernel_err": 2.4e-3,
        "fla_err": 2.3e-3,
        "kernel_vs_fla": 2e-3,
        "kernel_nonfinite": 0,
        "fla_nonfinite": 0,
    },
    "dh0": {
        "kernel_err": 1.6e-3,
        "fla_err": 1.6e-3,
        "kernel_vs_fla": 1e-3,
        "kernel_nonfinite": 0,
        "fla_nonfinite": 0,
    },
    "dv2": {
        "kernel_err": 1.7e-3,
        "fla_err": 1.7e-3,
        "kernel_vs_fla": 1e-3,
        "kernel_nonfinite": 0,
        "fla_nonfinite": 0,
    },
}
WRONG = dict(GOOD, dv2=dict(GOOD["dv2"], kernel_err=0.41, kernel_vs_fla=0.4))


def _result_body(outputs) -> str:
    result = {"plan": "kernel-sm100a", "outputs": outputs, "pairs": 4, "inputs_modified": []}
    return f"""
        say({{"phase": "setup"}})
        say({{"phase": "kernel"}})
        say({{"phase": "compare"}})
        say({{"result": {json.dumps(result)}}})
    """


PASSES = child(_result_body(GOOD))
REPORTS_WRONG = child(_result_body(WRONG))
HANGS_IN_KERNEL = child("""
    open(request["pidfile"], "w").write(str(os.getpid())) if "pidfile" in request else None
    say({"phase": "setup"})
    say({"phase": "kernel"})
    time.sleep(600)
""")
HANGS_IN_SETUP = child("""
    say({"phase": "setup"})
    time.sleep(600)
""")


class Counter:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def __call__(self):
        self.calls += 1
        return self.result


def _outs(seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, 4, generator=g) for _ in range(3))


def _check(tmp_path, child_command, limits=FAST, **kw):
    return SelfCheck(
        "sm_100a",
        child_command=child_command,
        cache_dir=str(tmp_path),
        identity=_identity,
        limits=limits,
        **kw,
    )


@pytest.fixture(autouse=True)
def _default_mode(monkeypatch):
    monkeypatch.delenv(MODE_ENV, raising=False)


def _never(*a, **k):
    raise AssertionError("must not run")


# ----------------------------------------------------------------------------- outcomes


def test_passing_check_runs_in_the_background_then_turns_the_kernel_on(tmp_path):
    chk = _check(tmp_path, PASSES)
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chk.run(SIG, kern, fla) is fla.result  # first call: fla's result, kernel untouched
        assert kern.calls == 0
        v = chk.wait(SIG, timeout=60)
        assert v is not None and v.outcome == "pass", v
        assert "kernel-sm100a" in v.detail
        for _ in range(3):
            assert chk.run(SIG, kern, fla) is kern.result
    assert (kern.calls, fla.calls, chk.children_started) == (3, 1, 1)
    record = json.load(open(v.path))
    assert record["outcome"] == "pass" and record["signature"] == SIG.to_json()
    assert record["gpu"] == IDENTITY["gpu"] and record["driver"] == "1.0" and record["build"] == "0.1.0+test"
    assert os.path.dirname(v.path).startswith(str(tmp_path))


def test_wait_mode_blocks_the_first_call_until_the_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv(MODE_ENV, "wait")
    chk = _check(tmp_path, PASSES)
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    assert chk.run(SIG, kern, fla) is kern.result
    assert (kern.calls, fla.calls) == (1, 0)


def test_saved_verdict_serves_a_new_process_without_a_check(tmp_path):
    first = _check(tmp_path, PASSES)
    assert first.wait(SIG, timeout=60).passed
    second = _check(tmp_path, child("raise SystemExit('must not run')"))
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    assert second.wait(SIG, timeout=60).passed
    assert second.run(SIG, kern, fla) is kern.result and second.children_started == 0


def test_hanging_kernel_is_killed_at_the_limit_and_switched_off(tmp_path):
    chk = _check(tmp_path, HANGS_IN_KERNEL)
    pidfile = tmp_path / "pid"
    real_command = chk.child_command

    def command(request):
        request["pidfile"] = str(pidfile)
        return real_command(request)

    chk.child_command = command
    start = time.monotonic()
    v = chk.wait(SIG, timeout=60)
    elapsed = time.monotonic() - start
    assert v.outcome == "timeout" and "did not finish within 1.5 s" in v.detail, v
    assert elapsed < 15, elapsed  # killed at the kernel's limit, not the child's own sleep
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    with pytest.warns(RuntimeWarning, match=r"failed its check .*timeout.*verdict file: .*\.json"):
        assert chk.run(SIG, kern, fla) is fla.result
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per signature
        assert chk.run(SIG, kern, fla) is fla.result
    assert kern.calls == 0
    assert json.load(open(v.path))["outcome"] == "timeout"


def test_the_killed_process_takes_what_it_started_with_it(tmp_path):
    """A hung check process's own children (a compiler, say) are killed with it."""
    pidfile = tmp_path / "grandchild"
    body = f"""
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pidfile)!r}, "w").write(str(p.pid))
        say({{"phase": "kernel"}})
        time.sleep(600)
    """
    v = _check(tmp_path, child(body)).wait(SIG, timeout=60)
    assert v.outcome == "timeout"
    pid = int(pidfile.read_text())
    for _ in range(50):  # reaped by init once killed
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the check process's child {pid} survived")


@pytest.mark.parametrize(
    "body,outcome,words",
    [
        ('say({"phase": "kernel"}); os._exit(3)', "crash", r"exit code 3\).*while running the kernel"),
        ('say({"phase": "kernel"}); os.kill(os.getpid(), signal.SIGSEGV)', "crash", "SIGSEGV"),
        (
            'say({"phase": "compare"}); os.kill(os.getpid(), signal.SIGKILL)',
            "crash",
            "SIGKILL.*after running",
        ),
        ('say({"phase": "setup"}); os._exit(1)', "inconclusive", "exit code 1.*before running the kernel"),
    ],
    ids=["exit-in-kernel", "segv-in-kernel", "killed-in-compare", "exit-in-setup"],
)
def test_a_dying_check_process(tmp_path, body, outcome, words):
    import re

    v = _check(tmp_path, child(body)).wait(SIG, timeout=60)
    assert v.outcome == outcome and re.search(words, v.detail), v


def test_wrong_values_fail_warn_once_and_keep_the_kernel_off(tmp_path):
    chk = _check(tmp_path, REPORTS_WRONG)
    v = chk.wait(SIG, timeout=60)
    assert v.outcome == "fail" and "dv2: error 4.10e-01" in v.detail and "1.70e-03" in v.detail, v
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    with pytest.warns(RuntimeWarning, match=r"failed its check of extended_B2_T128.*fail: dv2"):
        assert chk.run(SIG, kern, fla) is fla.result
    other = Signature("b2a", 2, 128, 2, 2, 64, 64, "bfloat16", gk=True, h0=True, dht=True)
    assert chk.run(other, kern, fla) is fla.result  # another signature: checked on its own
    assert chk.wait(other, timeout=60).outcome == "fail"
    assert kern.calls == 0 and chk.children_started == 2


@pytest.mark.parametrize(
    "error,outcome,words",
    [
        (
            {"phase": "setup", "type": "OutOfMemoryError", "message": "CUDA out of memory"},
            "inconclusive",
            "out of",
        ),
        (
            {"phase": "kernel", "type": "OutOfMemoryError", "message": "CUDA out of memory"},
            "inconclusive",
            "out of",
        ),
        ({"phase": "setup", "type": "RuntimeError", "message": "no CUDA device"}, "inconclusive", "no CUDA"),
        (
            {
                "phase": "kernel",
                "type": "RuntimeError",
                "message": "an illegal memory access was encountered",
            },
            "fail",
            "kernel raised RuntimeError: an illegal memory access",
        ),
        ({"phase": "compare", "type": "ValueError", "message": "dh0: shape"}, "fail", "comparing"),
    ],
)
def test_reported_errors(tmp_path, error, outcome, words):
    body = f'say({{"phase": {json.dumps(error["phase"])}}}); say({{"error": {json.dumps(error)}}})'
    v = _check(tmp_path, child(body)).wait(SIG, timeout=60)
    assert v.outcome == outcome and words in v.detail, v


def test_other_output_and_unreadable_reports(tmp_path):
    noisy = child(
        'print("Triton autotuning..."); print('
        + repr(REPORT_PREFIX)
        + ' + "{not json"); print(42)\n'
        + textwrap.dedent(_result_body(GOOD))
    )
    assert _check(tmp_path / "a", noisy).wait(SIG, timeout=60).passed
    garbage = child('say({"phase": "compare"}); say({"result": {"outputs": {"dh": {"kernel_err": "x"}}}})')
    v = _check(tmp_path / "b", garbage).wait(SIG, timeout=60)
    assert v.outcome == "crash" and "lacks dh" in v.detail


def test_a_check_process_that_cannot_start_is_inconclusive(tmp_path):
    v = _check(tmp_path, lambda r: [str(tmp_path / "no-such-python")]).wait(SIG, timeout=60)
    assert v.outcome == "inconclusive" and "could not start" in v.detail


def test_hang_before_the_kernel_is_inconclusive_and_tried_again_later(tmp_path):
    limits = Limits(setup=1.0, kernel=1.0, compare=1.0, lock=30.0, retry=3600.0)
    chk = _check(tmp_path, HANGS_IN_SETUP, limits)
    v = chk.wait(SIG, timeout=60)
    assert v.outcome == "inconclusive" and "did not reach the kernel within 1 s" in v.detail
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    with pytest.warns(RuntimeWarning, match="could not run.*tried again after 3600 s"):
        assert chk.run(SIG, kern, fla) is fla.result
    # Within the retry time another process reads the saved verdict and does not check.
    again = _check(tmp_path, PASSES, limits)
    assert again.wait(SIG, timeout=60).outcome == "inconclusive" and again.children_started == 0
    # Past it, the signature is checked again (here: passes), in memory and on disk.
    later = Limits(setup=20.0, kernel=1.0, compare=1.0, lock=30.0, retry=0.0)
    chk.limits, chk.child_command = later, PASSES
    assert chk.run(SIG, kern, fla) is fla.result  # asks again, fla meanwhile
    assert chk.wait(SIG, timeout=60).passed and chk.children_started == 2
    assert chk.run(SIG, kern, fla) is kern.result


# ----------------------------------------------------------------------------- judge


def _judge(**changes):
    outputs = {k: dict(v) for k, v in GOOD.items()}
    for key, value in changes.items():
        name, field = key.split("__")
        outputs[name][field] = value
    return judge({"plan": "kernel-sm100a", "outputs": outputs}, SIG)


def test_judge_holds_the_kernel_to_specs_bar():
    assert _judge()[0] == "pass"
    assert _judge(dh__kernel_err=1.25 * 2.3e-3)[0] == "pass"
    assert _judge(dh__kernel_err=1.3 * 2.3e-3)[0] == "fail"
    assert _judge(dh0__kernel_nonfinite=1) == (
        "fail",
        "dh0: 1 non-finite or unwritten elements [kernel-sm100a]",
    )
    assert _judge(dv2__kernel_err=float("nan"))[0] == "fail"
    assert _judge(dv2__kernel_vs_fla=2e-2)[0] == "fail"  # bf16 tolerance 1.5e-2 over every element
    assert _judge(dh__fla_nonfinite=3)[0] == "inconclusive"
    outputs = {k: v for k, v in GOOD.items() if k != "dh0"}
    assert judge({"outputs": outputs}, SIG)[0] == "crash"  # h0 given: dh0 must be measured
    no_h0 = Signature("extended", 2, 128, 2, 2, 64, 64, "bfloat16", gk=True, dht=True)
    assert judge({"outputs": outputs}, no_h0)[0] == "pass"
    modified = judge({"outputs": GOOD, "inputs_modified": ["do"]}, SIG)
    assert modified[0] == "fail" and "modified its inputs (do)" in modified[1]
    assert judge(None, SIG)[0] == "crash"


def test_classify_counts_only_what_happens_once_the_kernel_ran():
    base = {"phase": None, "final": None, "timed_out": False, "returncode": 0, "spawn_error": None}
    assert classify(dict(base, phase="setup", timed_out=True), FAST, SIG)[0] == "inconclusive"
    assert classify(dict(base, timed_out=True), FAST, SIG)[0] == "inconclusive"
    assert classify(dict(base, phase="kernel", timed_out=True), FAST, SIG)[0] == "timeout"
    assert classify(dict(base, phase="compare", timed_out=True), FAST, SIG)[0] == "timeout"
    assert classify(dict(base, phase="kernel", returncode=-11), FAST, SIG) == (
        "crash",
        "the check process died (signal SIGSEGV) while running the kernel",
    )


# ----------------------------------------------------------------------------- the cache


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == str(tmp_path / "home" / ".cache" / "kda_dhu")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "kda_dhu")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # XDG: relative paths are invalid
    assert cache_root() == str(tmp_path / "home" / ".cache" / "kda_dhu")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_root() == str(tmp_path / "mine")


def test_default_cache_dir_is_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    chk = SelfCheck("sm_100a", child_command=PASSES, identity=_identity, limits=FAST)
    v = chk.wait(SIG, timeout=60)
    assert v.passed and v.path.startswith(
        str(tmp_path / "c" / "selfcheck" / "sm_100a" / "Test-GPU-sm_100__driver-1.0")
    )


def test_verdicts_are_kept_per_gpu_driver_and_build(tmp_path):
    assert _check(tmp_path, PASSES).wait(SIG, timeout=60).passed
    for changed in ({"driver": "2.0"}, {"gpu": "Other GPU sm_100"}, {"build": "0.1.0+other"}):
        identity = dict(IDENTITY, **changed)
        chk = SelfCheck(
            "sm_100a",
            child_command=REPORTS_WRONG,
            cache_dir=str(tmp_path),
            identity=lambda d, identity=identity: identity,
            limits=FAST,
        )
        assert chk.wait(SIG, timeout=60).outcome == "fail" and chk.children_started == 1, changed
    assert len(list((tmp_path / "selfcheck" / "sm_100a").iterdir())) == 4


def test_the_verdict_file_is_replaced_atomically(tmp_path, monkeypatch):
    store = VerdictStore(str(tmp_path), "sm_100a", IDENTITY)
    path = store.write(SIG.key(), {"signature": SIG.to_json(), "outcome": "pass", "checked_at": 1.0})
    before = open(path).read()
    import kda_dhu._selfcheck_cache as cache

    def torn_dump(record, f, **kw):
        f.write('{"outcome": "fa')  # a writer killed mid-write
        raise OSError("disk full")

    monkeypatch.setattr(cache.json, "dump", torn_dump)
    with pytest.raises(OSError, match="disk full"):
        store.write(SIG.key(), {"signature": SIG.to_json(), "outcome": "fail", "checked_at": 2.0})
    monkeypatch.undo()
    assert open(path).read() == before  # the old verdict stands, whole
    assert sorted(os.listdir(store.dir)) == [os.path.basename(path)]  # no temporary file left
    assert store.read(SIG.key(), SIG.to_json())["outcome"] == "pass"


def test_unreadable_or_foreign_verdict_files_are_checked_again(tmp_path):
    store = VerdictStore(str(tmp_path), "sm_100a", IDENTITY)
    store.ensure()
    for content in (
        '{"outcome": "pa',
        json.dumps({"format": 1, "outcome": "pass", "checked_at": 1.0, "signature": {}}),
    ):
        with open(store.path(SIG.key()), "w") as f:
            f.write(content)
        chk = _check(tmp_path, REPORTS_WRONG)
        assert chk.wait(SIG, timeout=60).outcome == "fail" and chk.children_started == 1
        os.unlink(store.path(SIG.key()))


def _starter(cache_dir, counter, barrier, limits):
    """One of several processes starting together: counts its check process's runs."""
    body = textwrap.dedent(f"""
        with open({counter!r}, "a") as f:
            f.write("ran\\n")
        time.sleep(1.0)
    """) + textwrap.dedent(_result_body(GOOD))
    chk = SelfCheck(
        "sm_100a", child_command=child(body), cache_dir=cache_dir, identity=_identity, limits=limits
    )
    barrier.wait()
    v = chk.wait(SIG, timeout=120)
    if v is None or not v.passed:
        print(v, file=sys.stderr)
        os._exit(1)
    os._exit(0)


def test_concurrent_processes_run_one_check(tmp_path):
    ctx = multiprocessing.get_context("fork")
    n = 6
    barrier = ctx.Barrier(n)
    counter = str(tmp_path / "runs")
    procs = [ctx.Process(target=_starter, args=(str(tmp_path), counter, barrier, FAST)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * n
    assert open(counter).read() == "ran\n"  # exactly one check among the six


def test_concurrent_threads_run_one_check(tmp_path):
    """Record locks do not exclude a process's threads from each other: the per-process
    lock does (separate guards in one process, one cache)."""
    from helpers import run_in_threads

    counter = str(tmp_path / "runs")
    body = textwrap.dedent(f"""
        with open({counter!r}, "a") as f:
            f.write("ran\\n")
        time.sleep(0.5)
    """) + textwrap.dedent(_result_body(GOOD))
    verdicts = []
    run_in_threads(lambda i: verdicts.append(_check(tmp_path, child(body)).check_now(SIG)), 4)
    assert [v.outcome for v in verdicts] == ["pass"] * 4
    assert open(counter).read() == "ran\n"


def _hold_lock(cache_dir, ready):
    store = VerdictStore(cache_dir, "sm_100a", IDENTITY)
    with store.locked(10):
        ready.set()
        time.sleep(600)


def test_a_killed_lock_holder_does_not_block_the_others(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready))
    holder.start()
    assert ready.wait(30)
    waiting = _check(tmp_path, PASSES, Limits(setup=20.0, kernel=1.0, compare=1.0, lock=0.5))
    v = waiting.wait(SIG, timeout=30)
    assert v.outcome == "inconclusive" and "another process held" in v.detail  # held: waits, then gives up
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    start = time.monotonic()
    v = _check(tmp_path, PASSES).check_now(SIG)
    assert v.passed and time.monotonic() - start < 15


def _forked_wait(chk):
    """Exit status: 10 + the check processes this fork started (the count it inherited
    left out), 1 if its verdict did not pass."""
    inherited = chk.children_started
    v = chk.wait(SIG, timeout=60)
    os._exit(10 + chk.children_started - inherited if v is not None and v.passed else 1)


def test_a_forked_process_asks_again_for_a_check_in_flight(tmp_path):
    """A process forked while its parent's check is in flight (a data loader's worker) has
    no worker thread: it asks for the check itself and gets a verdict. Which of the two
    takes the cache's lock first is a race (the parent's worker thread may not have
    reached it at the fork); either way one check process runs in all, the other reads
    its saved verdict."""
    slow = child("time.sleep(1.0)\n" + textwrap.dedent(_result_body(GOOD)))
    chk = _check(tmp_path, slow)
    assert chk.run(SIG, _never, Counter(_outs(1))) is not None  # in flight, in the background
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_forked_wait, args=(chk,))
    p.start()
    p.join(60)
    assert p.exitcode is not None and p.exitcode >= 10, p.exitcode
    assert chk.wait(SIG, timeout=60).passed
    assert chk.children_started + (p.exitcode - 10) == 1


def test_a_fork_waits_while_a_check_process_is_being_started(tmp_path, monkeypatch):
    """A process forked while Popen starts the check process would hold the pipe through
    which Popen learns that the exec succeeded, and Popen would wait for it to exit (a
    persistent data loader worker: the whole run). Forks wait for Popen instead."""
    import subprocess
    import threading

    import kda_dhu._selfcheck as selfcheck

    real_popen, in_popen, done = subprocess.Popen, threading.Event(), []

    def slow_popen(*a, **k):
        in_popen.set()
        time.sleep(0.5)
        proc = real_popen(*a, **k)
        done.append(time.monotonic())
        return proc

    monkeypatch.setattr(selfcheck.subprocess, "Popen", slow_popen)
    chk = _check(tmp_path, PASSES)
    chk.run(SIG, _never, Counter(_outs(1)))
    assert in_popen.wait(30)
    p = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    p.start()
    forked_at = time.monotonic()
    p.join(30)
    assert done and forked_at >= done[0]
    assert chk.wait(SIG, timeout=60).passed


# ----------------------------------------------------------------------------- switches


@pytest.mark.parametrize("mode,expect_kernel", [("on", True), ("ON ", True), ("off", False)])
def test_switches_need_no_check(tmp_path, monkeypatch, mode, expect_kernel):
    monkeypatch.setenv(MODE_ENV, mode)
    chk = _check(tmp_path, lambda r: _never())
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert chk.run(SIG, kern, fla) is (kern.result if expect_kernel else fla.result)
    assert chk.children_started == 0 and os.listdir(tmp_path) == []


def test_off_wins_over_a_passed_verdict(tmp_path, monkeypatch):
    chk = _check(tmp_path, PASSES)
    assert chk.wait(SIG, timeout=60).passed
    monkeypatch.setenv(MODE_ENV, "off")
    kern, fla = Counter(_outs(0)), Counter(_outs(1))
    assert chk.run(SIG, kern, fla) is fla.result and kern.calls == 0


@pytest.mark.parametrize("unset", ["", "0", "auto", " Check "])
def test_unset_switch_values_mean_check(tmp_path, monkeypatch, unset):
    monkeypatch.setenv(MODE_ENV, unset)
    assert _check(tmp_path, PASSES).mode() == "check"


def test_an_unknown_switch_value_raises_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(MODE_ENV, "trusted")
    with pytest.raises(ValueError, match=r"KDA_DHU_SM100: expected one of check, wait, on, off .*'trusted'"):
        _check(tmp_path, PASSES).run(SIG, _never, _never)


# ----------------------------------------------------------------------------- signatures


def test_signature_of_a_call():
    q = torch.zeros(2, 100, 4, 128, dtype=torch.bfloat16)
    do = torch.zeros(2, 100, 8, 64, dtype=torch.bfloat16)
    gk = torch.zeros(2, 100, 8, 128)
    state = torch.zeros(2, 8, 128, 64)
    sig = signature_of("extended", q, do, gk=gk, dht=state)
    assert sig == Signature("extended", 2, 100, 4, 8, 128, 64, "bfloat16", gk=True, dht=True)
    assert sig.key() == "extended_B2_T100_H4_HV8_K128_V64_bfloat16_gk_dht"
    keys = {
        sig.key(),
        signature_of("b2a", q, do, gk=gk, dht=state).key(),
        signature_of("extended", q, do, g=gk[..., 0], dht=state).key(),
        signature_of("extended", q, do, gk=gk, dht=state, h0=state).key(),
        signature_of("extended", q, do, gk=gk, dht=state, state_v_first=True).key(),
        signature_of("extended", q[:1], do[:1], gk=gk, cu_seqlens=torch.tensor([0, 50, 100])).key(),
        signature_of("extended", q.half(), do, gk=gk, dht=state).key(),
    }
    assert len(keys) == 7
    on_1 = Signature.from_json(sig.to_json(), device=1)
    assert on_1.key() == sig.key() and on_1 != sig  # one verdict on disk, per-device in memory


# ----------------------------------------------------------------------------- the dispatcher


class _FakeCall:
    """A ``_core.Call`` deciding the kernel (``reason``: its label), launched by ``run_kernel``."""

    nt, copies, count_chunks, check_tables, unavailable, switches = 1, [], False, False, None, None
    action = "kernel"

    def __init__(self, reason, run_kernel):
        self.reason, self.verdict, self._run = reason, (True, reason), run_kernel
        self.guarded = reason == "kernel-sm100a"
        self.launch_only = not self.guarded

    def run(self, use_graph=False, poison=False):
        return self._run()


def _inject_plan(monkeypatch, reason, run_kernel, run_fla):
    """The general path with an injected decision (the kernel, ``reason``), kernel and fla.
    (The one-crossing path, _core.run, hands sm_100a decisions back: cargo test
    the_blackwell_kernel_is_guarded.)"""
    call = _FakeCall(reason, run_kernel)
    fake = types.SimpleNamespace(
        run=lambda *a, **k: None,  # as for an input read in Python's device scope
        decide=lambda *a, **k: call,
        KernelUnavailableError=_dispatch._require_core().KernelUnavailableError,
    )
    monkeypatch.setattr(_dispatch, "_core", fake)
    monkeypatch.setattr(_dispatch, "_require_core", lambda: fake)
    monkeypatch.setattr(_dispatch._Call, "fla", lambda self: run_fla())


def test_dispatcher_routes_sm100_plans_through_the_guard(monkeypatch, tmp_path):
    """Injected: plans saying kernel-sm100a, a check process that reports a wrong kernel.
    fla's result comes back from the first call on, the kernel never runs, one warning."""
    monkeypatch.setattr(_dispatch, "SM100_CHECK", _check(tmp_path, REPORTS_WRONG))
    good = _outs(4)
    _inject_plan(monkeypatch, "kernel-sm100a", _never, lambda: good)
    q = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _dispatch.chunk_gated_delta_rule_bwd_dhu(q, q, q, q, q) is good
    sig = signature_of("extended", q, q)
    assert _dispatch.SM100_CHECK.wait(sig, timeout=60).outcome == "fail"
    with pytest.warns(RuntimeWarning, match="sm_100a kernel failed its check of extended_B1_T64"):
        assert _dispatch.chunk_gated_delta_rule_bwd_dhu(q, q, q, q, q) is good
    # The seed's dispatcher has its own signatures, each checked before the kernel runs.
    assert _dispatch.kda_dhu_b2a(q, q, q, None, None, None, q, q, 1.0, 64) is good
    b2a = signature_of("b2a", q, q)
    assert _dispatch.SM100_CHECK.wait(b2a, timeout=60).outcome == "fail"
    assert _dispatch.SM100_CHECK.children_started == 2


def test_dispatcher_runs_the_kernel_once_the_check_passed(monkeypatch, tmp_path):
    monkeypatch.setattr(_dispatch, "SM100_CHECK", _check(tmp_path, PASSES))
    ours, theirs = _outs(5), _outs(6)
    _inject_plan(monkeypatch, "kernel-sm100a", lambda: ours, lambda: theirs)
    q = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    assert _dispatch.chunk_gated_delta_rule_bwd_dhu(q, q, q, q, q) is theirs
    assert _dispatch.SM100_CHECK.wait(signature_of("extended", q, q), timeout=60).passed
    assert _dispatch.chunk_gated_delta_rule_bwd_dhu(q, q, q, q, q) is ours


def test_sm90_plans_are_not_checked(monkeypatch, tmp_path):
    monkeypatch.setattr(_dispatch, "SM100_CHECK", _check(tmp_path, lambda r: _never()))
    ours = _outs(5)
    _inject_plan(monkeypatch, "kernel-sm90a", lambda: ours, _never)
    q = torch.zeros(1, 64, 1, 8, dtype=torch.bfloat16)
    assert _dispatch.chunk_gated_delta_rule_bwd_dhu(q, q, q, q, q) is ours


def test_errors_of_a_passed_signature_propagate(monkeypatch, tmp_path):
    """Once a signature passed, the kernel's errors reach the caller (no silent swap)."""
    monkeypatch.setenv(MODE_ENV, "wait")
    chk = _check(tmp_path, PASSES)

    def broken():
        raise RuntimeError("later failure")

    with pytest.raises(RuntimeError, match="later failure"):
        chk.run(SIG, broken, Counter(_outs(1)))


# ----------------------------------------------------------------------------- the real child


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path of the real check process")
def test_real_check_process_without_a_gpu_is_inconclusive(tmp_path):
    """The real check process, end to end up to its first CUDA need: it reads the request,
    reports setup, and reports the missing device, which is not the kernel's fault."""
    v = SelfCheck("sm_100a", cache_dir=str(tmp_path), identity=_identity, limits=FAST).wait(SIG, timeout=120)
    assert v.outcome == "inconclusive" and "no CUDA device" in v.detail, v
    log = json.load(open(v.path))["log"]
    assert "RuntimeError" in open(log).read()


def test_supervise_reports_phases_and_exit_status(tmp_path):
    body = 'say({"phase": "setup"}); say({"phase": "kernel"}); sys.exit(5)'
    report = supervise(child(body)({}), {"x": 1}, FAST, log_path=str(tmp_path / "log"))
    assert report["phase"] == "kernel" and report["final"] is None and report["returncode"] == 5
    assert not report["timed_out"] and report["spawn_error"] is None
