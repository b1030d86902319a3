"""GPU: no input layout gives a wrong answer, on any route.

For each input (q, k, w, do, dv, g, gk, h0, dht) and each layout of
``kda_dhu.testing.LAYOUTS`` (dims 1 and 2 permuted: T/H, or HV/K of a state; a slice of a
larger tensor along dim 1, dim 2 and the last dim, whose other elements are NaN; a
misaligned and an aligned storage offset; stride 0 along dim 2), through the direct entry
point, the custom op, fla's public function with kda-dhu registered (the registry route),
``kda_dhu_b2a`` (its envelope, past its 256-CTA floor), and calls the planner sends to fla
(K = 256: direct and through the registry):

- each output is contiguous, finite, and within 1.25x of fla's error on the same values
  laid out contiguously, against the float64 reference;
- the kernel runs where the plan is the kernel, fla's function where it is not (counted
  launches); the registry's verifier accepts a call whose input must be copied (fla's
  function would read it as if contiguous) and says so;
- ``Call.copies`` names exactly the inputs that are not packed (contiguous, and
  16-byte aligned where the kernel reads them through TMA or vector loads; g and h0 need
  no alignment, h0 is never read);
- the caller's tensors (their layout, address and every byte of their storage) are left
  as they were.

Negative strides (a CuPy ``[::-1]`` view: torch cannot make one) are refused by name on
every route (fla's registry: its verifier names the argument, then fla's own function
fails on an array that is not a torch tensor). Skipped without CuPy.

Cases: one test per (input, route), the layouts in a loop (the contiguous call's fla and
reference computed once). ~15 s for the file on an H200 once fla's kernels are compiled.
"""

from __future__ import annotations

import contextlib

import helpers
import kda_dhu
import pytest
import torch
from helpers import make_inputs, register_or_skip, via_registry
from kda_dhu import _core
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
from kda_dhu.testing import LAYOUTS, KernelProbe, backend_mode, relayout

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
NAMES = helpers.FLOAT_INPUTS
OUTPUTS = helpers.OUTPUTS
POS = helpers.POS
# Read through TMA or vector loads: must be 16-byte aligned as well as contiguous.
ALIGNED = ("q", "k", "w", "do", "dv", "gk", "dht")
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Shapes whose every dim a layout touches has size >= 2 (a size-1 dim's stride is no layout).
SHAPES = {
    # the extended rule's kernel: a tail (T % 64 = 2), 8 CTAs
    "kernel": dict(B=2, T=130, H=2, HV=2, K=128, V=128),
    # the seed dispatcher's envelope past its floor: B * HV * V / 64 = 256 CTAs
    "b2a": dict(B=2, T=128, H=32, HV=32, K=128, V=256),
    # the planner sends it to fla (K not in {64, 128})
    "fla": dict(B=2, T=130, H=2, HV=2, K=256, V=128),
}


def _b2a(a):
    return kda_dhu.kda_dhu_b2a(
        a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], 64
    )


# route -> (shape, call, kernel launches)
ROUTES = {
    "direct": ("kernel", lambda a: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a), 1),
    "op": ("kernel", lambda a: kda_dhu.chunk_gated_delta_rule_bwd_dhu_op(**a), 1),
    "registry": ("kernel", via_registry, 1),
    "b2a": ("b2a", _b2a, 1),
    "direct-fla": ("fla", lambda a: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a), 0),
    "registry-fla": ("fla", via_registry, 0),
}
CASES = [(n, r) for n in NAMES for r in ROUTES if not (n == "g" and r == "b2a")]


@pytest.fixture(autouse=True)
def _hopper_and_no_switches(no_switches):
    if _core.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("needs an sm_90 device (H100 / H200): the routes below are the sm_90a kernel's")


def _inputs(rng, shape: str, name: str, dtype=BF16) -> dict:
    s = SHAPES[shape]
    gate = "g" if name == "g" else "gk"
    return make_inputs(
        s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"], dtype, gate, device="cuda", generator=rng
    )


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(INT[x.element_size()])


def _snapshot(args: dict) -> dict:
    """Each caller tensor's layout, address and the bits of its whole storage."""
    out = {}
    for k, x in args.items():
        if isinstance(x, torch.Tensor):
            n = x.untyped_storage().nbytes() // x.element_size()
            storage = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), 0, (n,))
            out[k] = (tuple(x.shape), x.stride(), x.storage_offset(), x.data_ptr(), _bits(storage).clone())
    return out


def _contiguous_baseline(a: dict):
    """fla's outputs and the float64 reference on contiguous copies of the inputs, and
    fla's error per output."""
    packed = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    fla = kda_dhu.fla_function()(**packed)
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**packed, emulate_rounding=False)
    errs = [None if r is None else rel_err(f, r) for f, r in zip(fla, ref)]
    return ref, errs


def _expected_copies(name: str, x: torch.Tensor) -> list:
    packed = x.is_contiguous() and (name not in ALIGNED or x.data_ptr() % 16 == 0)
    return [] if packed else [name]


@pytest.mark.parametrize("name,route", CASES, ids=[f"{n}-{r}" for n, r in CASES])
def test_every_layout_gives_the_contiguous_answer(rng, name, route):
    """Every layout of ``name`` through ``route``: the contiguous call's answer (within
    1.25x of fla's error against the reference), the route's kernel launches, the copies
    the prepared call names, the caller's tensors unchanged. < 1 s each."""
    shape, call, launches = ROUTES[route]
    registry = route.startswith("registry")
    if registry:
        register_or_skip()
    args = _inputs(rng, shape, name)
    base = _contiguous_baseline(args)
    failures, seen = [], 0
    for layout in LAYOUTS:
        x = relayout(args[name], layout)
        if x is None:
            continue
        seen += 1
        a = dict(args, **{name: x})
        ref, errs = _contiguous_baseline(a) if layout == "expanded" else base
        copies = _expected_copies(name, x)
        prepared = _core.decide("extended", *(a.get(k) for k in POS))
        if prepared.copies != copies:
            failures.append(f"{layout}: Call.copies {prepared.copies}, expected {copies}")
        before = _snapshot(a)
        with backend_mode("kda_dhu") if registry else contextlib.nullcontext(), KernelProbe() as probe:
            outs = call(a)
        torch.cuda.synchronize()
        if probe.launches != launches:
            failures.append(f"{layout}: {probe.launches} kernel launches, expected {launches}")
        if registry:
            accepted, reason = probe.verdicts[0] if probe.verdicts else (None, None)
            want = bool(launches) or bool(copies)  # fla's plan: accepted only to copy first
            if accepted != want or (copies and f"after copying {name}" not in (reason or "")):
                failures.append(f"{layout}: the verifier said {probe.verdicts}")
        for out, o, r, e_fla in zip(OUTPUTS, outs, ref, errs):
            if r is None:
                if o is not None:
                    failures.append(f"{layout}: {out} is not None")
                continue
            if not o.is_contiguous():
                failures.append(f"{layout}: {out} is not contiguous (strides {o.stride()})")
            e = rel_err(o, r)
            if not e <= 1.25 * e_fla + 1e-6:
                failures.append(
                    f"{layout}: {out} error {e:.3e} vs fla's {e_fla:.3e} on the contiguous layout"
                )
        after = _snapshot(a)
        for k, b in before.items():
            if after[k][:4] != b[:4] or not torch.equal(after[k][4], b[4]):
                failures.append(f"{layout}: the caller's {k} changed")
    assert seen >= 5, f"{name}: only {seen} layouts applied"
    assert not failures, f"{name} through {route}:\n" + "\n".join(failures)


NEGATIVE_ROUTES = {
    "direct": lambda a: kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a),
    "op": lambda a: kda_dhu.chunk_gated_delta_rule_bwd_dhu_op(**a),
    "b2a": _b2a,
    "registry": via_registry,
}
NEGATIVE_CASES = [(n, r) for n in NAMES for r in NEGATIVE_ROUTES if not (n == "g" and r == "b2a")]


@pytest.mark.parametrize("name,route", NEGATIVE_CASES, ids=[f"{n}-{r}" for n, r in NEGATIVE_CASES])
def test_negative_strides_are_refused_by_name(rng, name, route):
    """``name`` as a CuPy view reversed along dim 1 (fp16 inputs: CuPy has no bfloat16):
    ValueError "<name>: expected non-negative strides" from kda-dhu's entry points; through
    fla's registry the verifier rejects the call with those words and fla's own function
    raises (it takes torch tensors only), no silent answer. Nothing is launched."""
    cupy = pytest.importorskip("cupy")
    if route == "registry":
        register_or_skip()
    args = _inputs(rng, "kernel", name, dtype=torch.float16)
    flipped = cupy.from_dlpack(args[name])[:, ::-1]
    assert any(s < 0 for s in flipped.strides)
    a = dict(args, **{name: flipped})
    want = f"{name}: expected non-negative strides"
    with backend_mode("kda_dhu"), KernelProbe() as probe:
        if route == "registry":
            with pytest.raises(Exception):  # noqa: B017 - fla's own function on a CuPy array
                NEGATIVE_ROUTES[route](a)
            assert probe.verdicts and not probe.verdicts[0][0], probe.verdicts
            assert want in probe.verdicts[0][1], probe.verdicts
        else:
            with pytest.raises(ValueError, match=f"^{want}"):
                NEGATIVE_ROUTES[route](a)
    assert probe.launches == 0
