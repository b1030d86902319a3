"""scripts/device/fla_peer_tests.sh without a GPU: a stand-in for fla's test folder (one
failing case among passing ones), sharded as on the device; the summary has every test's
verdict, the launch plugin's counts, each shard's exit status; the logs are packed; a
missing folder is refused by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile

from helpers import REPO_ROOT

SCRIPTS = ("fla_peer_tests.sh", "kda_launch_count.py")

PEER_TESTS = """
import pytest

@pytest.mark.parametrize("i", range(5))
def test_a(i):
    assert i != 3

def test_b():
    pass
"""


def _repo(tmp_path, with_tests=True):
    """A repository-shaped folder: the two scripts, and fla's stand-in tests under .carry/."""
    root = tmp_path / "repo"
    (root / "scripts" / "device").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy(os.path.join(REPO_ROOT, "scripts", "device", name), root / "scripts" / "device" / name)
    # the repository's pytest configuration: pytest's rootdir is the repository, not fla's folder
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    if with_tests:
        ops = root / ".carry" / "fla_tests" / "ops"
        ops.mkdir(parents=True)
        (ops / "test_x.py").write_text(PEER_TESTS)
    return root


def _run(root, out, *args, **env):
    # python3 is this interpreter (its kda_dhu for the launch plugin); no wheel in .carry/
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    full = dict(os.environ, PATH=path, OUT=str(out), **env)
    full.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(root / "scripts" / "device" / "fla_peer_tests.sh"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=full,
    )


def test_shards_verdicts_launches_and_logs(tmp_path):
    root, out = _repo(tmp_path), tmp_path / "out"
    proc = _run(root, out, "ops/test_x.py", PEER_SHARDS="3", PEER_BUDGET="200")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "peer-summary.txt").read_text()
    verdicts = [line.rsplit(" ", 1) for line in summary.splitlines() if line.startswith("ops/")]
    assert sorted(verdicts) == sorted(
        [[f"ops/test_x.py::test_a[{i}]", "FAILED" if i == 3 else "PASSED"] for i in range(5)]
        + [["ops/test_x.py::test_b", "PASSED"]]
    )
    assert summary.count("kda_dhu launches: total 0") == 3  # the plugin ran in each shard
    assert summary.count("exit status") == 3 and "exit status 1" in summary
    with tarfile.open(out / "peer-logs.tar.xz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"ids.txt", "pytest_0.log", "pytest_1.log", "pytest_2.log"} <= names
    assert "1 FAILED" in proc.stdout and "5 PASSED" in proc.stdout


def test_fla_alone_and_an_id_file(tmp_path):
    """PEER_REGISTER=0: kda-dhu's plugin is not loaded (no launch lines); PEER_IDS: exactly
    the listed tests."""
    root, out = _repo(tmp_path), tmp_path / "out"
    ids = tmp_path / "ids.txt"
    ids.write_text("ops/test_x.py::test_b\nops/test_x.py::test_a[0]\n")
    proc = _run(root, out, PEER_SHARDS="2", PEER_REGISTER="0", PEER_IDS=str(ids))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "peer-summary.txt").read_text()
    assert "launches" not in summary
    assert sorted(line for line in summary.splitlines() if line.startswith("ops/")) == [
        "ops/test_x.py::test_a[0] PASSED",
        "ops/test_x.py::test_b PASSED",
    ]


def test_no_tests_folder_is_named(tmp_path):
    root = _repo(tmp_path, with_tests=False)
    proc = _run(root, tmp_path / "out", "ops/test_x.py")
    assert proc.returncode == 2 and ".carry/fla_tests/ops" in proc.stdout
