"""The benchmark's record tools on the committed H200 records (CPU): the speed tables of
README.md and docs/performance.md are generated from them, and the plot draws them (or
fails, saying why)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import BENCHES, REPO_ROOT, lab_module
from kda_dhu import _measure

bench = lab_module("bench")  # benches/bench.py: the records, tables, plots

RECORD = os.path.join(REPO_ROOT, "benches", "results", "latest.json")


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


README = os.path.join(os.path.dirname(RECORD), "..", "..", "README.md")


def test_readme_tables_are_the_records_tables():
    """Every generated block of README.md is what the generator makes from the committed
    record it names, and the main one names latest.json."""
    with open(README) as f:
        text = f.read()
    assert "<!-- bench-table: benches/results/latest.json -->" in text
    assert bench.markdown_table(_record()) in text
    assert bench.update_readme(README, check=True) is False, (
        "README's speed tables differ from their records: python benches/bench.py --readme README.md"
    )


DOCS_PERFORMANCE = os.path.join(os.path.dirname(README), "docs", "performance.md")


def test_docs_performance_tables_are_the_records_tables():
    """docs/performance.md's generated blocks (the current record and the forced one) are
    what the generator makes from the records they name (paths relative to docs/)."""
    if not os.path.exists(DOCS_PERFORMANCE):
        pytest.skip("no docs/ beside tests/ (the cluster wheel's CPU tests copy README.md only)")
    with open(DOCS_PERFORMANCE) as f:
        text = f.read()
    assert "<!-- bench-table: ../benches/results/latest.json -->" in text
    assert "<!-- bench-table: ../benches/results/2026-11-30-NVIDIA_H200-forced-c99b8b5.json -->" in text
    assert bench.update_readme(DOCS_PERFORMANCE, check=True) is False, (
        "docs/performance.md's tables differ from their records: "
        "python benches/bench.py --readme docs/performance.md"
    )


def test_a_hand_edited_block_is_found_and_made_anew():
    with open(README) as f:
        text = f.read()
    ratio = re.search(r"\| (\d+\.\d\d)x \|", text)  # a vs-fla cell of the generated table
    edited = text.replace(ratio.group(0), f"| {float(ratio.group(1)) + 0.01:.2f}x |", 1)
    assert edited != text
    root = os.path.dirname(os.path.abspath(README))
    assert bench.render_readme(edited, root) == text
    with pytest.raises(ValueError, match="no '<!-- bench-table"):
        bench.render_readme("no block here", root)


def test_the_path_column_gives_the_planners_condition_without_a_quoted_figure():
    assert bench._path_cell("kernel-sm90a") == "kernel-sm90a"
    path = "fla (GVA (H=16 < HV=32) below one wave (64 CTAs < 132 SMs): measured 0.96x fla's speed (gva))"
    assert bench._path_cell(path) == "fla: GVA (H=16 < HV=32) below one wave (64 CTAs < 132 SMs)"


def test_floor_bytes_matches_the_anchor():
    # prod8192, fla 0.6.0 anchor: 8.690597888 GB
    assert _measure.floor_bytes(16, 8192, 32, 32, 128, 128, 16 * 128 // 16, 16) == 8690597888


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_plot_draws_the_record_or_names_the_extra(tmp_path):
    """With matplotlib (the ``bench`` extra; CI installs it) the plot is a PNG; without, it
    raises ImportError naming the extra and writes nothing."""
    path = tmp_path / "r.png"
    if _has_matplotlib():
        bench.plot(_record(), str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        with pytest.raises(ImportError, match=r"kda-dhu\[bench\]"):
            bench.plot(_record(), str(path))
        assert not path.exists()


def test_plot_names_its_record_says_lower_is_better_and_marks_the_rows_that_ran_fla(tmp_path, monkeypatch):
    """The figure's title names the record (file, commit, date), its axis says lower is
    better, and each row whose path is fla has a hatched kda-dhu bar and "(ran fla)"
    under its name; the other rows neither."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    drawn = []
    savefig = Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    record = _record()
    # one row routed to fla (the current record has none), as a record of a planner's fla
    # clause would hold it
    record["rows"][1] = dict(record["rows"][1], path="fla (an example clause: measured 0.9x fla's speed)")
    bench.plot(record, str(tmp_path / "r.png"), source="latest.json")
    (ax,) = drawn[0].axes
    title = ax.get_title()
    for part in ("latest.json", record["kda_dhu_commit"], record["date"], record["gpu"]):
        assert part in title, (part, title)
    assert "lower is better" in ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    ours = ax.containers[0]  # the kda-dhu bars, drawn first
    ran_fla = [r["path"].startswith("fla") for r in record["rows"]]
    assert any(ran_fla) and not all(ran_fla)
    for row, label, bar, fla in zip(record["rows"], labels, ours, ran_fla):
        assert label.startswith(row["shape"])
        assert ("(ran fla)" in label) == fla, label
        assert bool(bar.get_hatch()) == fla, row["shape"]


def _plot_cli(tmp_path, hide_matplotlib: bool) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        + ("sys.modules['matplotlib'] = None\n" if hide_matplotlib else "")
        + f"sys.path.insert(0, {BENCHES!r})\n"
        + "from bench import main\n"
        + f"sys.exit(main(['--table', {RECORD!r}, '--plot', {str(tmp_path / 'r.png')!r}]))\n"
    )
    import kda_dhu

    root = os.path.dirname(os.path.dirname(os.path.abspath(kda_dhu.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_plot_without_matplotlib_exits_1_and_says_why(tmp_path):
    proc = _plot_cli(tmp_path, hide_matplotlib=True)
    assert proc.returncode == 1, proc.stderr
    assert "no plot" in proc.stderr and "kda-dhu[bench]" in proc.stderr, proc.stderr
    assert proc.stdout.startswith(_record()["gpu"])  # the table itself still printed
    assert not (tmp_path / "r.png").exists()


def test_plot_cli_exit_code_follows_matplotlib(tmp_path):
    proc = _plot_cli(tmp_path, hide_matplotlib=False)
    if _has_matplotlib():
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert proc.returncode == 1 and "kda-dhu[bench]" in proc.stderr, proc.stderr


def test_reset_fla_autotune_clears_the_stage4_tuners():
    """The bench forgets fla's tuned stage-4 configs before each row (and stops fla's disk
    cache of them): a config left in an autotuner's cache is gone afterwards."""
    pytest.importorskip("fla")
    tuners = _measure.fla_stage4_autotuners()
    if not tuners:
        pytest.skip("this fla's stage-4 kernels have no Triton autotuner")
    for t in tuners:
        t.cache[("planted",)] = object()
    assert _measure.reset_fla_autotune() == len(tuners)
    for t in tuners:
        assert ("planted",) not in t.cache
        assert getattr(t, "cache_results", False) is False


@pytest.mark.parametrize("gate, state_v_first", [("gk", False), ("g", True), (None, False)])
def test_a_sample_of_pairs_is_the_whole_call_at_those_pairs(gate, state_v_first):
    """The main job's reference sample: the float64 reference of the sampled call equals
    the whole call's reference at those (batch, value head) pairs (GVA: each pair reads
    its own q/k head), and the sampled outputs are the whole outputs there."""
    import torch
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref
    from kda_dhu.testing import make_inputs

    a = make_inputs(
        3,
        130,
        2,
        4,
        16,
        32,
        gate=gate,
        state_v_first=state_v_first,
        generator=torch.Generator().manual_seed(5),
    )
    pairs = [(0, 3), (1, 0), (2, 1), (2, 2)]
    whole = chunk_gated_delta_rule_bwd_dhu_ref(**a)
    sampled = chunk_gated_delta_rule_bwd_dhu_ref(**_measure.sample_pairs(a, pairs))
    for name, s, w in zip(("dh", "dh0", "dv2"), sampled, _measure.sample_outputs(whole, pairs)):
        assert s.shape == w.shape, (name, s.shape, w.shape)
        assert torch.equal(s, w), name
