"""GPU: KDA_DHU_FORCE means one thing on every route (src/env.rs's table).

Routes: the full-signature entry point, the seed dispatcher ``kda_dhu_b2a``, the custom
op, fla's public call through its backend registry (verifier and implementation), and
fla's KDA module's call after ``patch()``. Shapes: one every rule sends to the kernel
(256 CTAs) and one below a wave (8 CTAs, 16 chunks) that the seed's rule sends to fla (its
256-CTA floor) and the others to the kernel. Kernel launches are counted with
``_core.launch_count()`` (every route) and every output is checked against the float64
reference:

| KDA_DHU_FORCE | kernel-route shape | below-a-wave shape | K = 256 (the kernel cannot) |
|---|---|---|---|
| unset | 1 launch | 0 under kda_dhu_b2a, else 1 | 0 (fla) |
| fla | 0 | 0 | 0 |
| kernel | 1 | 1 | RuntimeError naming the switch |
| bogus | ValueError naming the switch | ValueError | ValueError |

and ``plan_call`` / ``plan_b2a`` say so. ~5 s once fla's kernels are compiled.
"""

from __future__ import annotations

import sys

import kda_dhu
import pytest
import torch
from helpers import make_inputs, register_or_skip
from kda_dhu import _core
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err

pytestmark = pytest.mark.gpu

SHAPES = {
    "kernel-route": (4, 128, 32, 128),  # B, T, H = HV, K
    "below-a-wave": (1, 1024, 4, 128),
    "k256": (2, 128, 2, 256),
}
# launches per (switch, shape); an exception type where every route raises it
EXPECTED = {
    None: {"kernel-route": 1, "below-a-wave": 1, "k256": 0},
    "fla": {"kernel-route": 0, "below-a-wave": 0, "k256": 0},
    "kernel": {"kernel-route": 1, "below-a-wave": 1, "k256": RuntimeError},
    "bogus": {"kernel-route": ValueError, "below-a-wave": ValueError, "k256": ValueError},
}


def _direct(a):
    return kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)


def _b2a(a):
    return kda_dhu.kda_dhu_b2a(
        a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], 64
    )


def _op(a):
    return kda_dhu.chunk_gated_delta_rule_bwd_dhu_op(**a)


def _registry(a):
    import fla.ops.common.chunk_delta_h as m

    assert not kda_dhu.is_patched()
    return m.chunk_gated_delta_rule_bwd_dhu(**a)  # fla's dispatch wrapper: verifier, then implementation


def _patched(a):
    with kda_dhu.patched():
        return sys.modules["fla.ops.kda.chunk_bwd"].chunk_gated_delta_rule_bwd_dhu(**a)


ROUTES = {"direct": _direct, "b2a": _b2a, "op": _op, "registry": _registry, "patched": _patched}


def expected(switch, shape, route):
    """EXPECTED, with the seed's rule's own floor: unset, kda_dhu_b2a sends the
    below-a-wave shape to fla."""
    if switch is None and shape == "below-a-wave" and route in ("b2a", "plan_b2a"):
        return 0
    return EXPECTED[switch][shape]


@pytest.fixture(scope="module")
def cases():
    gen = torch.Generator().manual_seed(23)
    out = {}
    for name, (B, T, H, K) in SHAPES.items():
        a = make_inputs(B, T, H, H, K, 128, device="cuda", generator=gen)
        out[name] = (a, chunk_gated_delta_rule_bwd_dhu_ref(**a))
    return out


@pytest.fixture(autouse=True)
def _setup(no_switches):
    if _core.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("needs an sm_90 device (H100 / H200): the routes below are the sm_90a kernel's")
    register_or_skip()
    import fla.ops.kda.chunk_bwd  # noqa: F401 - the patched route's module


@pytest.mark.parametrize("switch", list(EXPECTED), ids=lambda s: f"FORCE={s}")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("route", list(ROUTES))
def test_the_switch_decides_the_same_on_every_route(cases, monkeypatch, switch, shape, route):
    a, ref = cases[shape]
    if route == "b2a" and shape == "k256":
        pytest.skip("kda_dhu_b2a's K = 256 is the kernel-cannot case of the full signature (covered there)")
    if switch is not None:
        monkeypatch.setenv("KDA_DHU_FORCE", switch)
    want = expected(switch, shape, route)
    torch.cuda.synchronize()
    before = _core.launch_count()
    if isinstance(want, type):
        with pytest.raises(want, match="KDA_DHU_FORCE"):
            ROUTES[route](a)
        torch.cuda.synchronize()
        assert _core.launch_count() == before, f"{route}: a kernel launched before the error"
        return
    out = ROUTES[route](a)
    torch.cuda.synchronize()
    launches = _core.launch_count() - before
    assert launches == want, (
        f"{route}, KDA_DHU_FORCE={switch}, {shape}: {launches} launches, documented {want}"
    )
    for name, o, r in zip(("dh", "dh0", "dv2"), out, ref):
        e = rel_err(o, r)
        assert e < 1e-2, f"{route}, KDA_DHU_FORCE={switch}, {shape}: {name} relative error {e:.2e}"


@pytest.mark.parametrize("switch", list(EXPECTED), ids=lambda s: f"FORCE={s}")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_planners_say_what_runs(cases, monkeypatch, switch, shape):
    a, _ = cases[shape]
    if switch is not None:
        monkeypatch.setenv("KDA_DHU_FORCE", switch)
    verdicts = {"plan_call": kda_dhu.plan_call(**a)}
    if shape != "k256":
        verdicts["plan_b2a"] = kda_dhu.plan_b2a(
            a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], 64
        )
    for who, (ok, reason) in verdicts.items():
        want = expected(switch, shape, who)
        if isinstance(want, type):
            assert ok is False and reason.startswith(f"{want.__name__}: KDA_DHU_FORCE"), (who, reason)
        else:
            assert ok is (want == 1), (who, ok, reason)
            if switch == "fla":
                assert reason == "KDA_DHU_FORCE=fla", (who, reason)
