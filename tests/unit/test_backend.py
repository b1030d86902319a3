"""kda_dhu.fla_backend: kda_dhu in fla's backend registry (fla >= 0.6)."""

from __future__ import annotations

import functools
import importlib
import logging
import re
import sys

import pytest

fb = pytest.importorskip("fla.backends")
if not hasattr(fb, "register"):
    pytest.skip("fla without a backend registry (< 0.6)", allow_module_level=True)

from helpers import make_inputs  # noqa: E402

B = importlib.import_module("kda_dhu.fla_backend")
D = importlib.import_module("kda_dhu._dispatch")
NAME = "chunk_gated_delta_rule_bwd_dhu"
SOURCE = "fla.ops.common.chunk_delta_h"


def _registry():
    importlib.import_module(SOURCE)
    return fb._operation_registries["common"]


def _spy(name, result, calls):
    """A stand-in for D.<name> recording its arguments by fla's parameter names (the
    backend passes fla's 16 arguments in order)."""

    @functools.wraps(getattr(D, name))
    def spy(*args, **kwargs):
        kw = dict(zip(B._FLA_PARAMS, args))
        kw.update(kwargs)
        calls.append(kw)
        return result

    return spy


def _fla_entry():
    """fla's decorated stage 4 (the dispatch wrapper), even if a patch is active."""
    entry = sys.modules[SOURCE].__dict__[NAME]
    assert entry is not D.chunk_gated_delta_rule_bwd_dhu, "test needs fla unpatched"
    return entry


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.delenv("FLA_KDA_DHU", raising=False)
    was_registered = B.backend_instance() is not None  # import kda_dhu registers it
    B.unregister_backend()
    assert B.register_backend() is True
    yield B.backend_instance()
    B.unregister_backend()
    monkeypatch.undo()  # the test's patches of fla first (one takes fla's backends away)
    if was_registered:  # as the import left it, for the test files after this one
        assert B.register_backend() is True


@pytest.fixture
def other_backend():
    """A plain fla backend after ours (priority 2) that takes every stage-4 call."""
    calls = []

    class Catcher(fb.BaseBackend):
        backend_type = "kda_dhu_test_catcher"
        priority = 2

        def chunk_gated_delta_rule_bwd_dhu(self, *args, **kwargs):
            calls.append((args, kwargs))
            return "caught"

    fb.register("common")(Catcher)
    yield calls
    _registry()._backends.pop("kda_dhu_test_catcher", None)


def test_registered_in_common_registry(registered):
    reg = _registry()
    backend = reg._backends["kda_dhu"]
    assert backend is registered
    assert isinstance(backend, fb.BaseBackend)
    assert backend.backend_type == "kda_dhu"
    assert backend.env_var == "FLA_KDA_DHU"
    assert backend.priority < 5
    assert backend.is_available() and backend.is_enabled()
    order = [b.backend_type for b in reg._get_sorted_backends()]
    fla_default = [b.backend_type for b in reg._backends.values() if b.priority >= 5]
    assert all(order.index("kda_dhu") < order.index(t) for t in fla_default)
    assert B.is_registered()


def test_register_is_idempotent(registered):
    assert B.register_backend() is True
    assert B.register_backend() is True
    assert _registry()._backends["kda_dhu"] is registered
    assert sum(b.backend_type == "kda_dhu" for b in _registry()._backends.values()) == 1


def test_unregister_removes_it():
    assert B.unregister_backend() is True
    assert "kda_dhu" not in _registry()._backends
    assert not B.is_registered()
    assert B.unregister_backend() is False


def test_env_var_switch(registered, monkeypatch):
    monkeypatch.setenv("FLA_KDA_DHU", "0")
    assert registered.is_enabled() is False
    monkeypatch.setenv("FLA_KDA_DHU", "1")
    assert registered.is_enabled() is True
    monkeypatch.delenv("FLA_KDA_DHU")
    assert registered.is_enabled() is True


def test_verifier_rejects_cpu_call_without_raising(registered, rng):
    inp = make_inputs(1, 64, 1, 1, 16, 16, gate="gk", generator=rng)
    want = D.plan_call(**inp)
    assert want[0] is False  # whatever the planner says on CPU, it is a rejection
    for args, kwargs in (
        ((), inp),
        (
            (inp["q"], inp["k"], inp["w"], inp["do"], inp["dv"]),
            {k: v for k, v in inp.items() if k not in ("q", "k", "w", "do", "dv")},
        ),
    ):
        accepted, reason = registered.verify(NAME, *args, **kwargs)
        assert accepted is False
        assert isinstance(reason, str) and reason
        assert (accepted, reason) == (bool(want[0]), want[1])
        # the verifier itself, not only fla's exception-catching verify()
        assert registered.chunk_gated_delta_rule_bwd_dhu_verifier(*args, **kwargs) == (False, reason)


def test_verifier_turns_bad_arguments_into_a_rejection(registered, rng):
    inp = make_inputs(1, 64, 1, 1, 16, 16, gate="gk", generator=rng)
    accepted, reason = registered.chunk_gated_delta_rule_bwd_dhu_verifier(inp["q"])
    assert accepted is False and re.search(r"missing .*'k'", reason), reason
    accepted, reason = registered.chunk_gated_delta_rule_bwd_dhu_verifier(**inp, not_an_argument=1)
    assert accepted is False and reason


def test_fla_dispatch_routes_accepted_calls_to_kda_dhu(monkeypatch, rng):
    """Through fla's own wrapper: positional and keyword arguments reach our planner by
    name (defaults applied) and our dispatcher's result comes back."""
    inp = make_inputs(1, 64, 1, 1, 16, 16, gate="gk", generator=rng)
    planned, ran = [], []
    monkeypatch.setattr(D, "verify", _spy("verify", (True, None, None), planned))
    monkeypatch.setattr(D, NAME, _spy(NAME, "ours", ran))
    out = _fla_entry()(
        inp["q"],
        inp["k"],
        inp["w"],
        inp["do"],
        inp["dv"],
        gk=inp["gk"],
        dht=inp["dht"],
        h0=inp["h0"],
        scale=inp["scale"],
    )
    assert out == "ours"
    assert len(planned) == 1 and len(ran) == 1
    for kw in (planned[0], ran[0]):
        assert kw["q"] is inp["q"] and kw["dv"] is inp["dv"] and kw["gk"] is inp["gk"]
        assert kw["g"] is None and kw["chunk_size"] == 64 and kw["state_v_first"] is False
        assert kw["scale"] == inp["scale"]


def test_fla_dispatch_passes_rejected_calls_on(monkeypatch, other_backend, caplog, rng):
    inp = make_inputs(1, 64, 1, 1, 16, 16, gate="g", generator=rng)
    monkeypatch.setattr(D, "verify", _spy("verify", (False, "kda_dhu test rejection", None), []))
    with caplog.at_level(logging.INFO, logger="fla.backends"):
        assert _fla_entry()(**inp) == "caught"
    assert len(other_backend) == 1
    assert any("kda_dhu test rejection" in r.getMessage() for r in caplog.records)


def test_disabled_backend_is_not_consulted(monkeypatch, other_backend, rng):
    inp = make_inputs(1, 64, 1, 1, 16, 16, gate=None, generator=rng)
    planned = []
    monkeypatch.setattr(D, "verify", _spy("verify", (True, None, None), planned))
    monkeypatch.setenv("FLA_KDA_DHU", "0")
    assert _fla_entry()(**inp) == "caught"
    assert planned == []


def test_register_returns_false_without_fla_backends(monkeypatch):
    B.unregister_backend()
    monkeypatch.setitem(sys.modules, "fla.backends", None)  # import fla.backends -> ImportError
    assert B.register_backend() is False


def test_the_forward_scan_is_fla_s_own_while_switched_off(registered, monkeypatch, rng):
    """KDA_DHU_FWD_H: off, the verifier rejects fwd_h calls (fla runs its own), as does
    KDA_DHU_FORCE=fla; on (or FORCE=kernel), it accepts CUDA inputs only (CPU inputs here:
    rejected with the reason); a bad value is named."""
    from kda_dhu import _core

    inp = make_inputs(1, 64, 1, 1, 64, 64, generator=rng)
    a = dict(k=inp["k"], w=inp["w"], u=inp["dv"], gk=inp["gk"])
    monkeypatch.setenv("KDA_DHU_FWD_H", "off")
    ok, reason = registered.chunk_gated_delta_rule_fwd_h_verifier(**a)
    assert (ok, reason) == (False, "KDA_DHU_FWD_H is off (fla's own forward scan)")
    monkeypatch.setenv("KDA_DHU_FORCE", "kernel")
    assert registered.chunk_gated_delta_rule_fwd_h_verifier(**a) == (False, "k is not a CUDA tensor")
    monkeypatch.setenv("KDA_DHU_FWD_H", "on")
    monkeypatch.setenv("KDA_DHU_FORCE", "fla")
    assert registered.chunk_gated_delta_rule_fwd_h_verifier(**a) == (
        False,
        "KDA_DHU_FORCE=fla (fla's own forward scan)",
    )
    monkeypatch.delenv("KDA_DHU_FORCE")
    monkeypatch.setenv("KDA_DHU_FWD_H", "sometimes")
    ok, reason = registered.chunk_gated_delta_rule_fwd_h_verifier(**a)
    assert not ok and "KDA_DHU_FWD_H: expected 'on', 'off' or unset" in reason
    with pytest.raises(ValueError, match="KDA_DHU_FWD_H"):
        _core.fwd_h_on()
    monkeypatch.delenv("KDA_DHU_FWD_H")
    assert registered.chunk_gated_delta_rule_fwd_h_verifier(**a)[0] is False  # CPU inputs either way
    monkeypatch.setenv("KDA_DHU_FWD_H", "on")
    ok, reason = registered.chunk_gated_delta_rule_fwd_h_verifier(**a)
    assert (ok, reason) == (False, "k is not a CUDA tensor")
    ok, reason = registered.chunk_gated_delta_rule_fwd_h_verifier(a["k"], a["w"], a["u"])
    assert (ok, reason) == (False, "k is not a CUDA tensor")
