"""kda_dhu.patch: rebinding fla's stage 4 in every fla module, and undoing it exactly."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from helpers import run_in_threads

pytest.importorskip("fla.ops.common.chunk_delta_h")

P = importlib.import_module("kda_dhu.patch")  # not `import kda_dhu.patch`: kda_dhu.patch may be the function
D = importlib.import_module("kda_dhu._dispatch")
NAME = "chunk_gated_delta_rule_bwd_dhu"
FWD_H = "chunk_gated_delta_rule_fwd_h"
SOURCE = "fla.ops.common.chunk_delta_h"


def _ours():
    return D.chunk_gated_delta_rule_bwd_dhu


def _ours_fwd_h():
    return importlib.import_module("kda_dhu._forward").chunk_gated_delta_rule_fwd_h


def _snapshot(name: str = NAME) -> dict[str, object]:
    """Every fla.* module's global named ``name``."""
    return {
        n: m.__dict__[name]
        for n, m in list(sys.modules.items())
        if (n == "fla" or n.startswith("fla.")) and isinstance(m, types.ModuleType) and name in m.__dict__
    }


def _assert_same(before: dict, after: dict):
    assert before.keys() == after.keys()
    for n in before:
        assert after[n] is before[n], n


@pytest.fixture(autouse=True)
def clean():
    """Every test starts and ends unpatched, with fla's users already imported."""
    P.unpatch()
    P.patch()
    P.unpatch()
    assert not P.is_patched()
    yield
    P.unpatch()


def test_patch_rebinds_every_fla_user_and_unpatch_restores_identity():
    original = D.fla_function()
    decorated = sys.modules[SOURCE].__dict__[NAME]
    before = _snapshot()
    fla_holders = {n for n, obj in before.items() if obj is decorated or obj is original}
    for expected in (
        SOURCE,
        "fla.ops.kda.chunk_bwd",
        "fla.ops.gated_delta_rule.chunk",
        "fla.ops.delta_rule.chunk",
    ):
        assert expected in fla_holders, expected
    fwd_decorated = sys.modules[SOURCE].__dict__[FWD_H]
    fwd_before = _snapshot(FWD_H)
    fwd_holders = {n for n, obj in fwd_before.items() if obj is fwd_decorated}
    for expected in (
        SOURCE,
        "fla.ops.kda.chunk_fwd",
        "fla.ops.kda.chunk_bwd",
        "fla.ops.gated_delta_rule.chunk",
    ):
        assert expected in fwd_holders, expected

    assert P.patch() == len(fla_holders) + len(fwd_holders)
    assert P.is_patched()
    during = _snapshot()
    assert during.keys() == before.keys()
    for n in before:
        if n in fla_holders:
            assert during[n] is _ours(), n
        else:  # some other function of the same name: untouched
            assert during[n] is before[n], n
    assert set(P.patched_modules()) == fla_holders
    assert set(P.patched_modules(FWD_H)) == fwd_holders
    for n, obj in _snapshot(FWD_H).items():
        assert obj is (_ours_fwd_h() if n in fwd_holders else fwd_before[n]), n

    assert P.unpatch() == len(fla_holders) + len(fwd_holders)
    assert not P.is_patched()
    _assert_same(before, _snapshot())
    _assert_same(fwd_before, _snapshot(FWD_H))
    assert sys.modules[SOURCE].__dict__[NAME] is decorated
    assert sys.modules[SOURCE].__dict__[FWD_H] is fwd_decorated


def test_imports_after_patch_get_the_replacement():
    with P.patched():
        ns: dict = {}
        exec(f"from {SOURCE} import {NAME} as f", ns)
        assert ns["f"] is _ours()
    ns = {}
    exec(f"from {SOURCE} import {NAME} as f", ns)
    assert ns["f"] is not _ours()


def test_patch_finds_any_fla_module_holding_fla_function():
    """Modules not in the known list: one holding the decorated function, one the
    undecorated original, one an unrelated function of the same name."""
    decorated = sys.modules[SOURCE].__dict__[NAME]
    original = D.fla_function()

    def unrelated(*a, **k):
        return None

    fakes = {}
    for suffix, obj in (("decorated", decorated), ("original", original), ("unrelated", unrelated)):
        mod = types.ModuleType(f"fla._kda_dhu_test_{suffix}")
        setattr(mod, NAME, obj)
        fakes[suffix] = mod
        sys.modules[mod.__name__] = mod
    try:
        before = _snapshot()
        P.patch()
        assert getattr(fakes["decorated"], NAME) is _ours()
        assert getattr(fakes["original"], NAME) is _ours()
        assert getattr(fakes["unrelated"], NAME) is unrelated
        P.unpatch()
        assert getattr(fakes["decorated"], NAME) is decorated
        assert getattr(fakes["original"], NAME) is original
        _assert_same(before, _snapshot())
    finally:
        for mod in fakes.values():
            sys.modules.pop(mod.__name__, None)


def test_context_manager_restores_on_exception():
    before = _snapshot()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with P.patched():
            assert P.is_patched()
            assert sys.modules[SOURCE].__dict__[NAME] is _ours()
            raise Boom()
    assert not P.is_patched()
    _assert_same(before, _snapshot())


def test_patch_is_idempotent_and_unpatch_without_patch_is_noop():
    before = _snapshot()
    assert P.unpatch() == 0
    _assert_same(before, _snapshot())

    n = P.patch()
    assert n > 0
    once = _snapshot()
    assert P.patch() == 0  # nothing left to rebind
    _assert_same(once, _snapshot())
    assert len(P.patched_modules()) + len(P.patched_modules(FWD_H)) == n

    assert P.unpatch() == n  # one unpatch undoes both patches
    _assert_same(before, _snapshot())
    assert P.unpatch() == 0
    _assert_same(before, _snapshot())


def test_nested_context_keeps_the_outer_patch():
    before = _snapshot()
    with P.patched():
        with P.patched():
            pass
        assert P.is_patched()
        assert sys.modules[SOURCE].__dict__[NAME] is _ours()
    assert not P.is_patched()
    _assert_same(before, _snapshot())

    P.patch()
    with P.patched():
        pass
    assert P.is_patched()  # the explicit patch() outlives the context
    P.unpatch()
    _assert_same(before, _snapshot())


def test_unpatch_leaves_a_foreign_rebinding_alone():
    before = _snapshot()
    mod = sys.modules["fla.ops.kda.chunk_bwd"]

    def foreign(*a, **k):
        return None

    P.patch()
    setattr(mod, NAME, foreign)
    try:
        P.unpatch()
        assert getattr(mod, NAME) is foreign
        after = _snapshot()
        for n in before:
            if n != mod.__name__:
                assert after[n] is before[n], n
    finally:
        setattr(mod, NAME, before[mod.__name__])
    _assert_same(before, _snapshot())


def test_concurrent_patch_unpatch_ends_consistent():
    before = _snapshot()

    def worker(i: int):
        for _ in range(20):
            if i % 2:
                P.patch()
            else:
                P.unpatch()

    run_in_threads(worker, 8)
    P.unpatch()
    _assert_same(before, _snapshot())


def test_original_function_is_fla_object_while_patched(monkeypatch):
    import inspect

    decorated = sys.modules[SOURCE].__dict__[NAME]
    assert P.original_function() is decorated
    with P.patched():
        assert P.original_function() is decorated
        # the dispatcher's fallback, looked up for the first time while patched,
        # must still be fla's undecorated function, never the replacement
        if hasattr(D, "_fla_fn"):
            monkeypatch.setattr(D, "_fla_fn", None)
        fn = D.fla_function()
        assert fn is inspect.unwrap(decorated)
        assert fn is not _ours()
    assert P.original_function() is decorated


def test_the_forward_scan_is_patched_only_where_fla_s_parameters_are_ours(monkeypatch):
    """fla's fwd_h with other parameters (another fla version): stage 4 alone is rebound."""
    from kda_dhu import _fla

    fwd_before = _snapshot(FWD_H)

    def other_fwd_h(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, chunk_size=64):
        return None

    monkeypatch.setattr(_fla, "fla_fwd_h_function", lambda: other_fwd_h)
    n = P.patch()
    assert n == len(P.patched_modules()) > 0 and P.patched_modules(FWD_H) == []
    _assert_same(fwd_before, _snapshot(FWD_H))
    P.unpatch()


def test_the_patched_forward_scan_runs_on_cpu_and_hands_fla_its_own(monkeypatch, rng):
    """Through fla's patched name (fla.ops.kda.chunk_fwd): CPU inputs run the CPU path
    (the float64 reference with fla's casts); the fallback is fla's function as it was
    before the patch, never the patched name (no recursion)."""
    from helpers import make_inputs
    from kda_dhu import _fla
    from kda_dhu.reference import chunk_gated_delta_rule_fwd_h_ref

    fwd_decorated = sys.modules[SOURCE].__dict__[FWD_H]
    s4 = make_inputs(1, 100, 2, 2, 64, 64, generator=rng)
    a = dict(k=s4["k"], w=s4["w"], u=s4["dv"], gk=s4["gk"], initial_state=s4["dht"], output_final_state=True)
    with P.patched():
        fwd = sys.modules["fla.ops.kda.chunk_fwd"].__dict__[FWD_H]
        assert fwd is _ours_fwd_h()
        h, v_new, final = fwd(**a)
        assert _fla.fla_fwd_h_function() is importlib.import_module("inspect").unwrap(fwd_decorated)
    ref = chunk_gated_delta_rule_fwd_h_ref(**a, emulate_rounding=True)
    for o, r, dtype in zip((h, v_new, final), ref, (a["k"].dtype, a["u"].dtype, torch.float32)):
        assert o.dtype == dtype and torch.equal(o, r.to(dtype)), "the CPU path is the reference"
