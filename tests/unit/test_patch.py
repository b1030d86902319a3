"""kda_dhu.patch: rebinding fla's stage 4 in every fla module, and undoing it exactly."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from helpers import run_in_threads

pytest.importorskip("fla.ops.common.chunk_delta_h")

P = importlib.import_module("kda_dhu.patch")  # not `import kda_dhu.patch`: kda_dhu.patch may be the function
D = importlib.import_module("kda_dhu._dispatch")
NAME = "chunk_gated_delta_rule_bwd_dhu"
SOURCE = "fla.ops.common.chunk_delta_h"


def _ours():
    return D.chunk_gated_delta_rule_bwd_dhu


def _snapshot() -> dict[str, object]:
    """Every fla.* module's global named chunk_gated_delta_rule_bwd_dhu."""
    return {
        n: m.__dict__[NAME]
        for n, m in list(sys.modules.items())
        if (n == "fla" or n.startswith("fla.")) and isinstance(m, types.ModuleType) and NAME in m.__dict__
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

    assert P.patch() == len(fla_holders)
    assert P.is_patched()
    during = _snapshot()
    assert during.keys() == before.keys()
    for n in before:
        if n in fla_holders:
            assert during[n] is _ours(), n
        else:  # some other function of the same name: untouched
            assert during[n] is before[n], n
    assert set(P.patched_modules()) == fla_holders

    assert P.unpatch() == len(fla_holders)
    assert not P.is_patched()
    _assert_same(before, _snapshot())
    assert sys.modules[SOURCE].__dict__[NAME] is decorated


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
    assert len(P.patched_modules()) == n

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
