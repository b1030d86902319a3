"""scripts/device/gpu_session.sh without a GPU: the script runs against stand-ins for python3,
nvidia-smi and compute-sanitizer (a PATH of shell stubs that answer as the real commands'
last lines do), so that its order, budget, failure handling and packing are checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPTS = ("gpu_session.sh", "sanitize.sh", "suite_counts.py")

# python3's stand-in: dispatches on the arguments as the session script passes them.
PYTHON_STUB = r"""#!/usr/bin/env bash
echo "python3 $*" >> "$STUB_LOG"
outdir() { while [ $# -gt 0 ]; do [ "$1" = --out ] && { echo "$2"; return; }; shift; done; }
case "$*" in
  "-m pip install"*) exit 0;;
  "-c import kda_dhu._core") exit 0;;
  "-") cat > /dev/null; echo "torch 2.11.0 (CUDA 13.0), fla 0.6.0, kda_dhu 0.1.0"; echo "device: FAKE GPU (9, 0)"
       exit "${STUB_SMOKE_RC:-0}";;
  *sanitize_driver.py*) echo "sanitize_driver: 2 cases OK in 0.1 s"; exit 0;;
  *--collect-only*) printf 'tests/test_a.py::test_%d[a b]\n' 1 2 3 4 5; echo "5 tests collected"; exit 0;;
  "-m pytest"*)
    n=0; fail=0
    for a in "$@"; do case "$a" in *::*) n=$((n + 1)); [ "$a" = "tests/test_a.py::test_3[a b]" ] && fail=1;; esac; done
    if [ $fail = 1 ]; then echo "FAILED tests/test_a.py::test_3[a b] - boom"; echo "1 failed, $((n - 1)) passed in 0.1s"; exit 1; fi
    echo "$n passed, 1 skipped in 0.1s"; exit 0;;
  benches/host_overhead.py*)
    d=$(outdir "$@"); mkdir -p "$d"; echo '{"kind": "host"}' > "$d/host-latest.json"
    echo "targets: 5 of 5 met; 0 problem(s)"; exit 0;;
  benches/e2e.py*)
    d=$(outdir "$@"); mkdir -p "$d"; echo '{"complete": false}' > "$d/e2e-partial.json"
    echo "[1/2] kda_b8_t4096_h32 ..."; echo "FAILED:"; echo "targets: 1 of 4 met"; exit 1;;
  benches/bench.py*)
    d=$(outdir "$@"); mkdir -p "$d"; echo '{"rows": []}' > "$d/latest.json"; echo "[1/1] prod8192 ..."; exit 0;;
  benches/variants.py*) sleep 30; exit 0;;
  "-m kda_dhu --doctor"*) echo "kernel image of cuda:0: dhu_sm90 sm_90a, CUDA ${KDA_DHU_IMAGE#cuda} image (stub)"; exit 0;;
  "-m kda_dhu"*) echo "[  1.0 s] done (cache $TRITON_CACHE_DIR)"; exit 0;;
  scripts/device/suite_counts.py*) exec "$REAL_PYTHON" "$@";;
esac
echo "python3 stub: unexpected arguments: $*" >&2
exit 99
"""

SANITIZER_STUB = r"""#!/usr/bin/env bash
[ "$1" = --version ] && { echo "Version 2025.1 (stub)"; exit 0; }
while [ $# -gt 0 ] && [ "$1" != python3 ]; do shift; done
"$@"
echo "========= ERROR SUMMARY: 0 errors"
"""


@pytest.fixture
def session(tmp_path):
    if shutil.which("xz") is None or shutil.which("timeout") is None:
        pytest.skip("needs xz and timeout")
    repo = tmp_path / "repo"
    (repo / "scripts" / "device").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy(os.path.join(ROOT, "scripts", "device", name), repo / "scripts" / "device" / name)
    (repo / ".carry").mkdir()
    (repo / ".carry" / "kda_dhu-0.1.0-cp39-abi3-linux_x86_64.whl").write_bytes(b"stub")
    (repo / ".carry" / "COMMIT").write_text("abc1234\n")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("python3", PYTHON_STUB), ("compute-sanitizer", SANITIZER_STUB)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    (stubs / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'FAKE GPU'\n")
    (stubs / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "OUT": str(out),
        "SESSION_DIR": str(tmp_path / "res"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "STUB_LOG": str(tmp_path / "calls.log"),
        "REAL_PYTHON": sys.executable,
    }

    def run(*stages, **extra):
        p = subprocess.run(
            ["bash", str(repo / "scripts" / "device" / "gpu_session.sh"), *stages],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        calls = (tmp_path / "calls.log").read_text().splitlines() if (tmp_path / "calls.log").exists() else []
        return p, out, calls

    return run


def _summary(out) -> dict:
    lines = (out / "summary.txt").read_text().splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("stage ")][0]
    return {line.split()[0]: line for line in lines[head + 1 :]}


def test_every_stage_runs_in_order_and_survives_the_others(session):
    (p, out, calls) = session("ab", "e2e", "host", "bench", "sanitize", "tests", AB_CAP="3")
    assert p.returncode == 1, p.stdout + p.stderr
    rows = _summary(out)
    assert list(rows) == ["smoke", "tests", "sanitize", "host", "e2e", "bench", "ab"]
    assert " ok " in rows["smoke"] and "sanitize_driver: 2 cases OK" in rows["smoke"]
    assert "FAILED (rc 1)" in rows["tests"] and "5 tests, 8 shards" in rows["tests"]
    assert "4 passed" in rows["tests"] and "1 failed" in rows["tests"]
    assert " ok " in rows["sanitize"] and "memcheck clean" in rows["sanitize"]
    assert " ok " in rows["host"] and "targets: 5 of 5 met" in rows["host"]
    assert (
        "FAILED (rc 1)" in rows["e2e"]
        and "targets: 1 of 4 met" in rows["e2e"]
        and "checks FAILED" in rows["e2e"]
    )
    assert " ok " in rows["bench"] and "1 row(s)" in rows["bench"]
    assert "TIMEOUT" in rows["ab"]
    assert "tests/test_a.py::test_3[a b]" in (out / "summary.txt").read_text()
    # the timed stages one after another, after the tests
    order = [
        c.split()[1] for c in calls if c.split()[1] in ("benches/host_overhead.py", "benches/e2e.py", "-m")
    ]
    assert order.index("benches/host_overhead.py") < order.index("benches/e2e.py")
    # files back: at most 8; records as their own files, a cut-short run's partial record
    names = sorted(os.listdir(out))
    assert len(names) <= 8, names
    assert {"summary.txt", "logs.tar.xz", "host-latest.json", "e2e-partial.json", "bench-latest.json"} <= set(
        names
    )
    assert json.loads((out / "host-latest.json").read_text()) == {"kind": "host"}
    with tarfile.open(out / "logs.tar.xz") as t:
        members = t.getnames()
    assert sum("pytest_" in m for m in members) == 5  # five tests over eight shards: five non-empty shards
    assert any(m.endswith("sanitize_memcheck.log") for m in members)
    assert p.stdout.rstrip().splitlines()[-1].startswith("ab ")  # the summary is printed last


def test_main_job_and_both_images_of_the_suite_are_recorded(session, tmp_path):
    """main runs the job twice on one fresh Triton cache (fresh, then warm); tests and
    image12 run the whole suite, image12 with KDA_DHU_IMAGE=cuda12 on every shard; their
    counts land in gpu-suite-latest.json, one run per image."""
    (p, out, calls) = session("image12", "tests", "main")
    rows = _summary(out)
    assert list(rows) == ["smoke", "tests", "image12", "main"]
    assert " ok " in rows["main"] and "fresh " in rows["main"] and "warm " in rows["main"], rows["main"]
    jobs = [
        c for c in calls if c.startswith("python3 -m kda_dhu") and "--doctor" not in c and ".bench" not in c
    ]
    assert len(jobs) == 2, calls
    assert "CUDA 12 image" in p.stdout
    record = json.loads((out / "gpu-suite-latest.json").read_text())
    assert record["commit"] == "abc1234" and record["gpu"] == "FAKE GPU"
    assert [r["stage"] for r in record["runs"]] == ["tests", "image12"]
    for run in record["runs"]:
        assert (run["collected"], run["passed"], run["failed"], run["skipped"]) == (5, 4, 1, 4), run
        assert run["failed_tests"] == ["FAILED tests/test_a.py::test_3[a b] - boom"], run
    assert record["runs"][1]["env"] == ["KDA_DHU_IMAGE=cuda12"]


def test_a_failed_smoke_step_stops_the_session(session):
    (p, out, calls) = session("tests", "host", STUB_SMOKE_RC="1")
    assert p.returncode == 3
    rows = _summary(out)
    assert "FAILED" in rows["smoke"]
    assert "not run" in rows["tests"] and "not run" in rows["host"]
    assert not any("pytest" in c or "host_overhead" in c for c in calls)
    assert (out / "logs.tar.xz").exists()


def test_stages_that_do_not_fit_the_budget_are_skipped(session, tmp_path):
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "k.autotune.json").write_text("{}")
    (p, out, calls) = session("tests", "sanitize", "host", "e2e", SESSION_BUDGET="100")
    rows = _summary(out)
    assert "skipped" in rows["tests"] and "needs 120 s" in rows["tests"]
    assert " ok " in rows["sanitize"] and " ok " in rows["host"]
    assert "skipped" in rows["e2e"]
    assert p.returncode == 1
    assert (out / "triton_cache.tar.xz").exists()  # the Triton cache, for the next session


def test_plan_and_bad_stage(session):
    p, _, calls = session("--plan", "e2e", "tests")
    assert p.returncode == 0 and calls == []
    assert [line.split(":")[0].strip() for line in p.stdout.splitlines()[1:]] == ["smoke", "tests", "e2e"]
    p, _, _ = session("nope")
    assert p.returncode == 2 and "unknown stage 'nope'" in p.stderr
