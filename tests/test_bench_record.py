"""The benchmark's record tools on the committed H200 record (CPU): the README's table is
generated from it, and the plot draws it."""

from __future__ import annotations

import json
import os

import pytest
from kda_dhu import bench

RECORD = os.path.join(os.path.dirname(__file__), "..", "benches", "results", "latest.json")


def _record():
    with open(RECORD) as f:
        return json.load(f)


def test_record_has_the_schema():
    r = _record()
    for key in ("date", "gpu", "fla_version", "torch", "kda_dhu_commit", "copy_bw_GBs", "rows"):
        assert key in r, key
    for row in r["rows"]:
        assert row["kda_dhu_ms"] > 0 and row["fla_ms"] > 0 and row["floor_ms"] > 0
        assert abs(row["over_floor"] - row["kda_dhu_ms"] / row["floor_ms"]) < 1e-9
        assert set(row["rel_err"]) == {"dh", "dh0", "dv2"}


def test_readme_table_is_generated_from_the_record():
    table = bench.markdown_table(_record())
    with open(os.path.join(os.path.dirname(RECORD), "..", "..", "README.md")) as f:
        readme = f.read()
    assert table.strip() in readme


def test_floor_bytes_matches_the_anchor():
    # prod8192, fla 0.6.0 anchor: 8.690597888 GB
    assert bench.floor_bytes(16, 8192, 32, 32, 128, 128, 16 * 128 // 16, 16) == 8690597888


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.png"
    assert bench.plot(_record(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reset_fla_autotune_clears_the_stage4_tuners():
    """The bench forgets fla's tuned stage-4 configs before each row (and stops fla's disk
    cache of them): a config left in an autotuner's cache is gone afterwards."""
    pytest.importorskip("fla")
    tuners = bench.fla_stage4_autotuners()
    if not tuners:
        pytest.skip("this fla's stage-4 kernels have no Triton autotuner")
    for t in tuners:
        t.cache[("planted",)] = object()
    assert bench.reset_fla_autotune() == len(tuners)
    for t in tuners:
        assert ("planted",) not in t.cache
        assert getattr(t, "cache_results", False) is False
