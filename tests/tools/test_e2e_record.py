"""benches/e2e.py without a GPU: the packed lengths, the targets, the routing checks of a
row, the GDN refusal probe's reading of fla's error, and the tables of records."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from helpers import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benches", "e2e.py")
RECORD = os.path.join(REPO_ROOT, "benches", "results", "e2e-latest.json")


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_varlen_lengths_are_drawn_from_the_range_and_fill_T(e2e):
    lo, hi = e2e.VARLEN_RANGE
    lens = e2e.varlen_lengths(32768, lo, hi, seed=0)
    assert sum(lens) == 32768
    assert all(lo <= n <= hi for n in lens), (min(lens), max(lens))
    assert 32768 // hi <= len(lens) <= 32768 // lo
    assert len(set(lens)) > len(lens) // 2  # drawn, not one repeated length
    assert e2e.varlen_lengths(32768, lo, hi, seed=0) == lens  # fixed seed, fixed batch
    assert e2e.varlen_lengths(32768, lo, hi, seed=1) != lens
    # a remainder below lo is spread over the last lengths, none below lo
    for T in (lo, lo + 1, 2 * hi - 1, 5000):
        got = e2e.varlen_lengths(T, lo, hi, seed=3)
        assert sum(got) == T and all(lo <= n <= hi for n in got), (T, got)
    with pytest.raises(ValueError, match="T >= lo"):
        e2e.varlen_lengths(100, lo, hi)


def _row(case, bwd, s4, timed=None, reps=30, per_call=1):
    return {
        "case": case,
        "bwd_speedup": bwd,
        "stage4_speedup": s4,
        "grad_checks": [
            {
                "gate_normalizer": 1.0,
                "rel_err": {"q": 1e-4},
                "kernel_launches": {"fla": 0, "kda_dhu": per_call, "fla_again": 0},
                "stage4_calls": {"fla": per_call, "kda_dhu": per_call, "fla_again": per_call},
                "verdicts": {"kda_dhu": [], "fla": []},
            }
        ],
        "kernel_launches_timed": timed if timed is not None else {"fla": 0, "kda_dhu": reps * per_call},
        "timed_backwards": reps,
    }


def test_targets_follow_the_measurement_that_set_them(e2e):
    dense_then_bwd = 15.55 / 15.33
    rows = [
        _row("kda_varlen_t32768_h32", bwd=1.004, s4=1.30),
        _row("kda_b8_t4096_h32", bwd=dense_then_bwd * 0.996, s4=0.778 / 0.549 * 0.94),
    ]
    t = {(x["case"], x["what"].split()[0]): x for x in e2e.targets(rows)}
    assert t["kda_varlen_t32768_h32", "stage-4"]["ok"] is True
    assert t["kda_varlen_t32768_h32", "backward"]["ok"] is False  # 1.004 < 1.005
    assert t["kda_b8_t4096_h32", "bwd_speedup"]["ok"] is True  # within 0.5% of then
    assert t["kda_b8_t4096_h32", "stage4_speedup"]["ok"] is False  # 6% below then
    assert abs(t["kda_b8_t4096_h32", "bwd_speedup"]["limit"] - dense_then_bwd * 0.995) < 1e-12
    # a stage 4 not timed (--no-stage4) is not measured, not met
    none = e2e.targets([_row("kda_varlen_t32768_h32", bwd=1.01, s4=None)])
    assert [x["ok"] for x in none] == [None, True]


def test_row_routing_checks(e2e):
    ok = _row("kda_b8_t4096_h32", 1.0, 1.0)
    assert e2e.case_failures(ok, tol=2e-2) == []
    bad = _row("kda_b8_t4096_h32", 1.0, 1.0, timed={"fla": 3, "kda_dhu": 29})
    msgs = e2e.case_failures(bad, tol=2e-2)
    assert any("3 kernel launches in the timed backwards with FLA_KDA_DHU=0" in m for m in msgs), msgs
    assert any("29 kernel launches in 30 timed backwards" in m for m in msgs), msgs
    off = _row("kda_b8_t4096_h32", 1.0, 1.0)
    off["grad_checks"][0]["kernel_launches"]["fla"] = 1
    off["grad_checks"][0]["rel_err"]["q"] = float("nan")
    msgs = e2e.case_failures(off, tol=2e-2)
    assert any("ran with FLA_KDA_DHU=0" in m for m in msgs) and any("rel err over" in m for m in msgs)


def test_gdn_refusal_is_fla_own_error(e2e, monkeypatch):
    """fla's chunk_bwd_dqkwg refusing (RuntimeError) is the row note, in fla's words; where
    it runs, GDN runs."""
    chunk_o = pytest.importorskip("fla.ops.common.chunk_o")
    monkeypatch.setattr(e2e, "DEVICE", "cpu")

    def refuse(**kw):
        assert kw["g"] is not None and kw["g"].dtype.is_floating_point
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

    monkeypatch.setattr(chunk_o, "chunk_bwd_dqkwg", refuse)
    assert e2e.gdn_backward_refusal().startswith("RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper")
    monkeypatch.setattr(chunk_o, "chunk_bwd_dqkwg", lambda **kw: None)
    assert e2e.gdn_backward_refusal() is None


def test_tables_of_the_committed_and_a_new_record(e2e, tmp_path, capsys):
    assert e2e.main(["--table", RECORD]) == 0
    assert "| kda_b8_t4096_h32 |" in capsys.readouterr().out
    with open(RECORD) as f:
        record = json.load(f)
    row = {**record["rows"][0], **_row("kda_b8_t4096_h32", 1.02, 1.45)}
    record.update(
        rows=[row],
        skipped=[{"case": "gdn_b8_t4096_h32", "reason": "RuntimeError: refused"}],
        targets=e2e.targets([row]),
    )
    table = e2e.markdown_table(record)
    assert "| gdn_b8_t4096_h32 | not run: RuntimeError: refused |" in table
    assert "30 timed: 30 / 0" in table
    assert table.count("| yes |") == 2
