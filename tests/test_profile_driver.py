"""benches/profile_driver.py (the Nsight Compute driver of scripts/profile.sh) on the CPU:
its shape list is the bench table's, bad arguments are refused by name, and without a
GPU it says so with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benches", "profile_driver.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_list_is_the_bench_table():
    from kda_dhu import bench

    proc = _run("--list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [r[0] for r in bench.SHAPES]


@pytest.mark.parametrize("args,msg", [(("--shapes", "nope"), "unknown shape(s) ['nope']"),
                                      (("--warmup", "-1"), "--warmup must be >= 0"),
                                      (("--nwg", "3"), "invalid choice")])
def test_bad_arguments(args, msg):
    proc = _run(*args)
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_no_gpu_exit_status():
    proc = _run("--shapes", "b4_t8192_h16")
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
