"""benches/profile_driver.py (the Nsight Compute driver of scripts/device/profile.sh) on the CPU:
its shape list is the bench table's, bad arguments are refused by name, and without a
GPU it says so with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "benches", "profile_driver.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_list_is_the_bench_table():
    from kda_dhu import _measure as bench

    proc = _run("--list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [r[0] for r in bench.SHAPES]


@pytest.mark.parametrize(
    "args,msg",
    [
        (("--shapes", "nope"), "unknown shape(s) ['nope']"),
        (("--warmup", "-1"), "--warmup must be >= 0"),
        (("--nwg", "3"), "invalid choice"),
        (("--op", "fwd"), "invalid choice"),
    ],
)
def test_bad_arguments(args, msg):
    proc = _run(*args)
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_no_gpu_exit_status():
    for op in ("dhu", "fwd_h"):
        proc = _run("--op", op, "--shapes", "b4_t8192_h16")
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr


@pytest.mark.gpu
def test_forward_scan_launches_are_the_kernels():
    """--op fwd_h: every call of the forward scan launched kda-dhu's kernel (the driver exits 1
    if fla ran one), one line per shape."""
    proc = _run("--op", "fwd_h", "--shapes", "b8_t1096_h4_tail", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    assert "b8_t1096_h4_tail: forward scan, 1 + 1 launches" in proc.stdout


def test_row_inputs_carry_the_rows_layout_and_lengths(monkeypatch):
    """bench.row_inputs: the one place a table row becomes a call (bench, variants, the
    profile driver): state_v_first states for the rows named in STATE_V_FIRST, packed
    lengths for "avg1k" rows."""
    from kda_dhu import _measure as bench

    monkeypatch.setattr(bench, "STATE_V_FIRST", {"tiny_svf"})
    a, lengths = bench.row_inputs(("tiny_svf", 2, 128, 2, 2, 64, 128, "gk", None), device="cpu")
    assert lengths is None and a["state_v_first"] is True
    assert a["h0"].shape == a["dht"].shape == (2, 2, 128, 64)
    a, lengths = bench.row_inputs(("tiny_varlen", 1, 640, 2, 2, 64, 64, "g", "avg1k"), device="cpu")
    assert "state_v_first" not in a and sum(lengths) == 640 and len(lengths) == 64
    assert a["cu_seqlens"].tolist()[-1] == 640 and a["h0"].shape == (64, 2, 64, 64)


def test_run_kernel_forwards_every_argument_to_validation():
    """kda_dhu.testing.run_kernel on CPU tensors gets as far as the device check: with
    K != V, a state_v_first call validates only if state_v_first reached the validator."""
    from kda_dhu.testing import make_inputs, run_kernel

    for svf in (False, True):
        a = make_inputs(
            1,
            100,
            2,
            2,
            64,
            128,
            torch.bfloat16,
            "gk",
            state_v_first=svf,
            generator=torch.Generator().manual_seed(0),
        )
        with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor"):
            run_kernel(a, poison=True)
