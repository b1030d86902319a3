"""benches/chunk_sweep.py and benches/chain_stamps.py on the CPU: the sweep's least-squares
line, bad arguments refused by name, the probe's words read back, and without a GPU each
says so with exit status 2."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT


def _script(name):
    return os.path.join(REPO_ROOT, "benches", f"{name}.py")


def _module(name="chunk_sweep"):
    spec = importlib.util.spec_from_file_location(name, _script(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args, name="chunk_sweep"):
    return subprocess.run([sys.executable, _script(name), *args], capture_output=True, text=True, timeout=120)


def test_fit_recovers_a_line():
    fit = _module().fit
    xs = [1, 2, 4, 18, 64]
    a, b = fit(xs, [6.5 + 1.25 * x for x in xs])
    assert a == pytest.approx(6.5) and b == pytest.approx(1.25)
    a, b = fit([3, 3], [2.0, 4.0])  # one abscissa: the mean, no slope
    assert (a, b) == (3.0, 0.0)


@pytest.mark.parametrize(
    "args,msg",
    [
        (("--chunks", "1,x"), "is not a comma-separated list of numbers"),
        (("--chunks", "0,4"), "the lengths must be positive"),
        (("--chunks", "-1"), "the lengths must be positive"),
        (("--reps", "0"), "--reps must be >= 1"),
        (("--op", "fwd"), "invalid choice"),
        (("--gate", "gv"), "invalid choice"),
    ],
)
def test_bad_arguments(args, msg):
    proc = _run(*args)
    assert proc.returncode == 2
    assert msg in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_says_so():
    proc = _run("--chunks", "1,2")
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr


def test_chain_stamps_reads_the_probe_words():
    st = _module("chain_stamps")
    words = [0] * st.N_STAMPS + [4]
    for k in range(10):  # a level-1 build: points 0-9 only
        words[k] = 400 * (k + 1)
    nc, sec = st.sections(words)
    assert nc == 4
    assert list(sec)[:2] == ["dv_issue", "stores"] and "pack" not in sec
    assert sec["dv_issue"] == 100 and sec["wd_wait"] == 1000 and sec["total"] == 5500
    words[10], words[15] = 8, -4  # level 2: pack; a sum past 2**31 (a negative int32) reads unsigned
    nc, sec = st.sections(words)
    assert list(sec)[:2] == ["pack", "dv_issue"] and sec["pack"] == 2
    assert sec["hand_back"] == (2**32 - 4) / 4
    with pytest.raises(ValueError):
        st.sections([0] * (st.N_STAMPS + 1))  # a build without the probe: dh's own values


def test_chain_stamps_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = _run("--chunks", "4", name="chain_stamps")
    assert r.returncode == 2 and "no CUDA device" in r.stderr
