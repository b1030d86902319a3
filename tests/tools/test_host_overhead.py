"""benches/host_overhead.py without a GPU: the do-nothing backends in fla's registry and the
modes' switches, the rounds' rotation, the targets' arithmetic, the table, and a dry run
(CPU tensors) writing a record."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from helpers import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benches", "host_overhead.py")


@pytest.fixture(scope="module")
def ho():
    spec = importlib.util.spec_from_file_location("host_overhead", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fla_registry():
    pytest.importorskip("fla.backends")
    from kda_dhu import fla_backend

    if not fla_backend.register_backend():
        pytest.skip("fla's backend dispatch is off here")
    return fla_backend._registry()[1]


def test_each_mode_switches_on_exactly_its_backend(ho, fla_registry, monkeypatch):
    """fla's own is_enabled (the check its dispatch makes per call) sees kda-dhu's backend
    on only for registry / direct, and each do-nothing backend only for its mode; the
    do-nothing backends share kda-dhu's priority and leave the registry on exit."""
    from kda_dhu import fla_backend

    monkeypatch.delenv(ho.BACKEND_ENV, raising=False)
    kda = fla_backend.backend_instance()
    with ho.null_backends() as inst:
        assert set(inst) == {"null_reject", "null_accept"}
        for b in inst.values():
            assert fla_registry._backends[b.backend_type] is b
            assert b.priority == kda.priority
        for mode in ho.MODES:
            ho.set_mode_env(mode, inst)
            assert kda.is_enabled() == (mode in ("registry", "direct")), mode
            for name, b in inst.items():
                assert b.is_enabled() == (name == mode), (mode, name)
        assert inst["null_reject"].verify(fla_backend.NAME) == (False, "no")
        inst["null_accept"].outputs = sentinel = object()
        assert inst["null_accept"].verify(fla_backend.NAME) == (True, None)
        assert inst["null_accept"].get_implementation(fla_backend.NAME)() is sentinel
        env_vars = [b.env_var for b in inst.values()]
        types = [b.backend_type for b in inst.values()]
    for t in types:
        assert t not in fla_registry._backends
    for v in env_vars:
        assert v not in os.environ


def test_fla_returns_the_accepting_backends_outputs(ho, fla_registry, monkeypatch):
    """fla's public stage 4 (its dispatch wrapper) hands an accepted call to the do-nothing
    backend and returns what it returns: the kernel route's baseline is fla's dispatch alone."""
    import fla.ops.common.chunk_delta_h as stage4

    call = ho.route_call("kernel", "cpu")
    with ho.null_backends() as inst:
        ho.set_mode_env("null_accept", inst)
        inst["null_accept"].outputs = sentinel = (object(),)
        assert stage4.chunk_gated_delta_rule_bwd_dhu(**call) is sentinel
        ho.set_mode_env("fla_off", inst)  # restore before the backends leave
    monkeypatch.delenv(ho.BACKEND_ENV, raising=False)


def test_routes_are_fla_keyword_calls(ho):
    """The varlen routes pack VARLEN_LENGTHS into T; with chunk_indices, fla's table (one
    row per chunk); every route passes KDA backward's keywords."""
    pytest.importorskip("fla.ops.utils.index")
    for route, r in ho.ROUTES.items():
        c = ho.route_call(route, "cpu")
        assert set(c) == {"q", "k", "w", "gk", "h0", "dht", "do", "dv", "scale", "cu_seqlens", "chunk_size",
                          "chunk_indices", "chunk_offsets", "state_v_first"}  # fmt: skip
        assert tuple(c["q"].shape) == (r["B"], r["T"], r["H"], r["K"])
        assert (c["cu_seqlens"] is not None) == r["varlen"]
        assert (c["chunk_indices"] is not None) == r["chunk_indices"]
        if r["chunk_indices"]:
            assert c["chunk_indices"].shape[0] == sum(-(-n // 64) for n in ho.VARLEN_LENGTHS)


def test_rounds_rotate_routes_and_modes(ho):
    """Every cell gets one batch per round, its environment set before it, and the order of
    groups and of cells within a group rotates from round to round."""
    order = []
    env_set = []

    def cell(g, n):
        return (lambda: order.append((g, n)), lambda: env_set.append((g, n)))

    cells = {g: {n: cell(g, n) for n in ("a", "b", "c")} for g in ("x", "y")}
    clock = ho.Clock(cuda=False)
    out = ho.measure(cells, clock, rounds=3, calls=2, warmup=1)
    for g in cells:
        for n in cells[g]:
            assert len(out[g][n]["per_round_us"]) == 3
            assert out[g][n]["median_us"] > 0 and out[g][n]["caught_up"] == 0
    timed = order[len(cells) * 3 * (1 + 2) :]  # after each cell's warm-up call + estimate batch
    firsts = [timed[i * 12] for i in range(3)]  # 6 cells x 2 calls per round
    assert firsts == [("x", "a"), ("y", "b"), ("x", "c")]
    assert env_set[-1] == timed[-1]


def _cells(**per_mode):
    return {m: {"per_round_us": v, "median_us": None} for m, v in per_mode.items()}


def test_targets_take_differences_within_rounds(ho):
    cells = {
        # kernel route: registry - null_accept - direct per round: 4, 6, 4 -> median 4
        "kernel": _cells(
            registry=[40, 46, 38], null_accept=[20, 22, 18], direct=[16, 18, 16], fla_off=[90, 90, 90]
        ),
        # fla route: registry - fla_off per round: 6, 5.5, 7 -> median 6 (missed)
        "fla_b8_k256": _cells(registry=[96, 95.5, 97], fla_off=[90, 90, 90], null_reject=[91, 91, 91]),
        "varlen_ci": _cells(registry=[50, 50], direct=[30, 30]),  # no null_accept: no value
    }
    derived, targets = ho.derive(cells)
    assert derived["kernel"]["registry_minus_null_accept_minus_direct_us"] == 4
    assert derived["fla_b8_k256"]["registry_minus_fla_off_us"] == 6
    assert derived["fla_b8_k256"]["registry_minus_null_reject_us"] == 5
    t = {x["route"]: x for x in targets}
    assert t["kernel"]["ok"] is True and t["kernel"]["value_us"] == 4
    assert t["fla_b8_k256"]["ok"] is False and t["fla_b8_k256"]["limit_us"] == 5
    assert t["varlen_ci"]["ok"] is None and t["varlen_ci"]["value_us"] is None


def test_dry_run_writes_the_record(ho, fla_registry, tmp_path, monkeypatch):
    """The whole script on CPU tensors: a record with the raw rounds, the routing checks
    passed, the tables, and the dated copy named by the commit."""
    monkeypatch.setenv("KDA_DHU_COMMIT", "abc1234")
    before = set(fla_registry._backends)
    rc = ho.main(["--dry-run", "--out", str(tmp_path), "--rounds", "2", "--calls", "2", "--warmup", "1"])
    assert rc == 0
    assert set(fla_registry._backends) == before
    names = sorted(os.listdir(tmp_path))
    assert "host-latest.json" in names and "host-latest.md" in names
    assert any(n.startswith("host-") and n.endswith("-cpu-dry-run-abc1234.json") for n in names), names
    with open(tmp_path / "host-latest.json") as f:
        r = json.load(f)
    assert r["dry_run"] is True and r["kda_dhu_commit"] == "abc1234" and r["problems"] == []
    for key in ("date", "gpu", "torch", "fla_version", "settings", "routes", "cells", "targets"):
        assert key in r, key
    assert set(r["cells"]) == set(ho.DRY_RUN_ROUTES)
    for cells in r["cells"].values():
        assert set(cells) == set(ho.DRY_RUN_MODES)
        for c in cells.values():
            assert len(c["per_round_us"]) == 2 and all(t > 0 for t in c["per_round_us"])
            assert c["launches_per_call"] == 0  # the CPU path launches nothing
    assert set(r["steps"]) == set(ho.DRY_RUN_STEPS)
    table = (tmp_path / "host-latest.md").read_text()
    assert table == ho.markdown_table(r)
    assert "DRY RUN" in table and "| kernel |" in table


def test_table_marks_a_missed_target(ho):
    record = {
        "gpu": "G", "torch": "t", "fla_version": "f", "kda_dhu_commit": "c", "date": "d",
        "settings": {"rounds": 3, "calls": 5}, "modes": ["registry", "fla_off"],
        "cells": {"fla_k256": _cells(registry=[1.0], fla_off=[1.0])},
        "derived": {"fla_k256": {"registry_minus_fla_off_us": 7.3}},
        "targets": [{"route": "fla_k256", "name": "fla route: registry - fla_off", "value_us": 7.3,
                     "limit_us": 5.0, "ok": False}],
    }  # fmt: skip
    for c in record["cells"]["fla_k256"].values():
        c["median_us"] = 1.0
    table = ho.markdown_table(record)
    assert "| fla_k256 | 1.0 | 1.0 | - | 7.3 |" in table
    assert "| 7.3 | 5 | **no** |" in table
