"""Two GPUs: fla's context-parallel KDA backward (FLACPContext over NCCL, two ranks) with
kda-dhu's backend off and on, against the one-GPU run (benches/cp_check.py, launched
through torch.distributed.run at a small shape). Skipped with fewer than two GPUs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "benches", "cp_check.py")
# fla's Triton kernels (KDA forward and backward, varlen) compile and autotune on first use
# in both ranks: about 4-5 minutes on a fresh H200 machine. KDA_DHU_CP_TIMEOUT overrides.
TIMEOUT_S = int(os.environ.get("KDA_DHU_CP_TIMEOUT", "540"))

marks = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA GPUs (context parallelism over NCCL)",
    ),
]
if importlib.util.find_spec("pytest_timeout") is not None:
    marks.append(pytest.mark.timeout(TIMEOUT_S + 60))
pytestmark = marks


def _env() -> dict:
    """The child ranks import the kda_dhu this test process imports (an installed wheel,
    or the source tree conftest put on sys.path)."""
    import kda_dhu

    env = os.environ.copy()
    where = os.path.dirname(os.path.dirname(os.path.abspath(kda_dhu.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (where, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def test_cp_two_ranks_matches_one_gpu(tmp_path):
    pytest.importorskip("fla.ops.cp", reason="fla without context parallelism (fla.ops.cp)")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        SCRIPT,
        "--T",
        "4096",
        "--H",
        "4",
        "--K",
        "128",
        "--V",
        "128",
        "--cases",
        "cut,single",
        "--gate-normalizers",
        "1,16",
        # the context exactly as fla builds it (int32 cu_seqlens), and the one-GPU run
        # with int32 cu_seqlens too (one set of Triton compiles); the kernel must run
        "--variants",
        "as_built",
        "--cu-dtype",
        "int32",
        "--require-kernel",
        "all",
        "--out",
        str(tmp_path),
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"")[-6000:] if isinstance(err.stdout, bytes) else (err.stdout or "")[-6000:]
        pytest.fail(f"cp_check did not finish in {TIMEOUT_S} s:\n{out}")
    log = (proc.stdout + "\n" + proc.stderr)[-12000:]
    assert proc.returncode == 0, f"cp_check exited {proc.returncode}:\n{log}"
    summary = json.loads((tmp_path / "cp_check.json").read_text())
    assert summary["ok"], summary["failures"]
    assert len(summary["ranks"]) == 2
    # kda-dhu's kernel ran under CP (fla's own int32-cu_seqlens context), not only on one GPU
    for res in summary["ranks"]:
        for case in res["cases"]:
            on = case["routing"]["cp[as_built]"]["kda_dhu"]
            assert on["kernel_launches"] == on["stage4_calls"] >= 1, (res["rank"], case["case"], on)
