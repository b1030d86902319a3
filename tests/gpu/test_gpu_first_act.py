"""GPU: each first act of a process after ``import kda_dhu``, fla not imported yet,
returns the right answer: the seed dispatcher below its 256-CTA floor (fla's function
runs), a direct call the planner routes to fla (K = 256: no kernel), fla's public call
(the registry: the kernel runs), and ``patch()`` followed by fla's KDA module's call.

Each runs in a fresh interpreter with a time limit (a lock held across fla's import
used to make the first two and ``patch()`` wait forever), and checks its outputs against
the float64 reference and its kernel launches. fla tunes its kernel in the child (no
pin: pinning imports fla, which is what the child must do first), ~10-60 s each.
"""

from __future__ import annotations

import pytest
import torch
from helpers import finish_child, start_child
from kda_dhu import _core

pytestmark = pytest.mark.gpu

LIMIT_S = 180  # under the GPU session's per-test limit (200 s), so that this message is the one seen

_PREAMBLE = """
import sys
import torch
import kda_dhu
from kda_dhu import _core
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
from kda_dhu.testing import make_inputs
assert "fla" not in sys.modules

def inputs(B, T, H, K=128):
    return make_inputs(B, T, H, H, K, 128, device="cuda", generator=torch.Generator().manual_seed(B * T * H))

def check(a, out, launches, want_launches, what):
    torch.cuda.synchronize()
    assert launches == want_launches, f"{what}: {launches} kernel launches, expected {want_launches}"
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**a)
    errs = {n: rel_err(o, r) for n, o, r in zip(("dh", "dh0", "dv2"), out, ref)}
    assert max(errs.values()) < 1e-2, f"{what}: {errs}"
    print("DONE", what, launches, errs)

def counted(fn):
    n0 = _core.launch_count()
    out = fn()
    torch.cuda.synchronize()
    return out, _core.launch_count() - n0

KERNEL = (4, 128, 32)  # 256 CTAs: the kernel on every rule
BELOW = (1, 1024, 4)   # 8 CTAs: under kda_dhu_b2a's 256-CTA floor (fla's there)
FLA = (2, 128, 2, 256)  # K = 256: no kernel, fla's on every route
"""

_ACTS = {
    "kda_dhu_b2a below its floor": """
a = inputs(*BELOW)
out, n = counted(lambda: kda_dhu.kda_dhu_b2a(a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], 64))
check(a, out, n, 0, "kda_dhu_b2a below its floor")
""",
    "a direct call routed to fla": """
a = inputs(*FLA)
out, n = counted(lambda: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a))
check(a, out, n, 0, "chunk_gated_delta_rule_bwd_dhu on fla's route")
""",
    "fla's public call": """
import fla.ops.common.chunk_delta_h as m
a = inputs(*KERNEL)
out, n = counted(lambda: m.chunk_gated_delta_rule_bwd_dhu(**a))
check(a, out, n, 1, "fla's chunk_gated_delta_rule_bwd_dhu (registry)")
""",
    "patch(), then fla's KDA call": """
assert kda_dhu.patch() > 0
import fla.ops.kda.chunk_bwd as kb
for shape, want in ((KERNEL, 1), (BELOW, 1), (FLA, 0)):
    a = inputs(*shape)
    out, n = counted(lambda: kb.chunk_gated_delta_rule_bwd_dhu(**a))
    check(a, out, n, want, f"fla.ops.kda.chunk_bwd's stage 4 after patch(), {shape}")
""",
}


@pytest.fixture(autouse=True)
def _hopper():
    if _core.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("needs an sm_90 device (H100 / H200): the routes below are the sm_90a kernel's")


@pytest.mark.parametrize("act", list(_ACTS))
def test_first_act_on_the_gpu_returns_the_right_answer(act):
    finish_child(start_child(_PREAMBLE + _ACTS[act]), LIMIT_S, act)
