"""benches/build_ab.py on the CPU: its arguments (the builds as LABEL=PATH, each named when
wrong) and its plan; the timing itself needs a GPU and two wheels (benches/NOTES.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "benches", "build_ab.py")
sys.path.insert(0, os.path.join(REPO_ROOT, "benches"))

import build_ab  # noqa: E402


def _wheel(folder, name="kda_dhu-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl"):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    open(path, "wb").close()
    return path


def test_wheels_as_files_or_folders(tmp_path):
    a = _wheel(tmp_path / "old")
    b = _wheel(tmp_path / "new")
    assert build_ab.parse_wheels([f"old={a}", f"new={tmp_path / 'new'}"]) == [("old", a), ("new", b)]


@pytest.mark.parametrize(
    "items, match",
    [
        (["old"], "is not LABEL=PATH"),
        (["1x=a.whl", "b=b.whl"], "is not LABEL=PATH"),
        (["old=missing.whl", "new=missing.whl"], "neither a .whl file nor a folder"),
        (["empty={empty}", "new={new}"], "holds 0 kda_dhu wheels"),
        (["old={new}", "old={new}"], "label 'old' given twice"),
        (["old={new}"], "at least two"),
    ],
)
def test_bad_wheels_are_named(tmp_path, items, match):
    new = os.path.dirname(_wheel(tmp_path / "new"))
    os.makedirs(tmp_path / "empty")
    items = [i.format(new=new, empty=tmp_path / "empty") for i in items]
    with pytest.raises(ValueError, match=match):
        build_ab.parse_wheels(items)


def _script(*args):
    """build_ab.py in a process of its own (no GPU: --plan or an argument error)."""
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_plan_runs_without_a_gpu(tmp_path):
    a = _wheel(tmp_path / "old")
    b = _wheel(tmp_path / "new")
    proc = _script("--wheels", f"old={a}", f"new={b}", "--plan", "--site", str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"old: {a} -> {tmp_path / 'site' / 'old'}" in proc.stdout
    assert "3 round(s) of old, new; dhu" in proc.stdout


def test_a_mistyped_shape_is_named(tmp_path):
    a = _wheel(tmp_path / "old")
    proc = _script("--wheels", f"old={a}", f"new={a}", "--shapes", "b1_t65536", "--plan")
    assert proc.returncode == 2
    assert "unknown shape(s) ['b1_t65536']" in proc.stderr


def test_medians_and_ratios_from_the_processes(tmp_path, monkeypatch, capsys):
    """The parent's arithmetic on stand-in processes: each build's median over its rounds,
    its ratio to the first build, in the table and in build_ab.json."""
    import json
    import types

    times = {"old": iter([1.0, 3.0, 2.0]), "new": iter([2.2, 2.0, 9.0])}

    def run(cmd, **kw):
        if "--child" not in cmd:
            return types.SimpleNamespace(returncode=0)
        label = cmd[cmd.index("--child") + 1]
        rec = {"label": label, "kda_dhu": "x", "gpu": "G", "torch": "t", "b1_t65536_h32": next(times[label])}
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(rec) + "\n", stderr="")

    monkeypatch.setattr(build_ab.subprocess, "run", run)
    a = _wheel(tmp_path / "old")
    b = _wheel(tmp_path / "new")
    argv = ["--wheels", f"old={a}", f"new={b}", "--shapes", "b1_t65536_h32", "--out", str(tmp_path / "out")]
    assert build_ab.main(argv) == 0
    assert "| b1_t65536_h32 | 2.0000 | 2.2000 | 1.100 |" in capsys.readouterr().out
    record = json.load(open(tmp_path / "out" / "build_ab.json"))
    assert record["median_ms"] == {"old": {"b1_t65536_h32": 2.0}, "new": {"b1_t65536_h32": 2.2}}
    assert record["failed_processes"] == 0


def test_plan_names_the_forward_scan(tmp_path):
    a = _wheel(tmp_path / "old")
    proc = _script("--wheels", f"old={a}", f"new={a}", "--op", "fwd_h", "--plan")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 round(s) of old, new; fwd_h" in proc.stdout
    bad = _script("--wheels", f"old={a}", f"new={a}", "--op", "fwd", "--plan")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
