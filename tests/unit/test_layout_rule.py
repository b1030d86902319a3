"""The layout rule, on the CPU: an input that is not packed (contiguous, 16-byte aligned
where the kernel needs it) is copied, never handed on strided, and never refused; a
negative stride is refused by name; the caller's tensors are left as they are.

For each input (q, k, w, do, dv, g, gk, h0, dht) and each layout of
``kda_dhu.testing.LAYOUTS`` (dims 1 and 2 permuted, a slice along dim 1, dim 2 and the
last dim, a misaligned and an aligned storage offset, stride 0 along dim 2):

- validation accepts it (``_core.validate``);
- ``_dispatch._Call.packed`` (what every CUDA route runs before the kernel or fla's
  function reads a tensor that ``PreparedCall.copies`` names) gives a contiguous,
  16-byte aligned tensor of the same values in new memory, h0 a fresh tensor of its shape
  and dtype (h0 is never read), and leaves the caller's tensor and the other arguments
  alone;
- the public entry point on CPU tensors (the Rust core's CPU path) returns bitwise what
  it returns for the same values laid out contiguously, with contiguous outputs.

Which layouts a CUDA call copies (``PreparedCall.copies``) is pinned by the Rust planner
test ``views_are_planned_as_packed_and_named_for_a_copy`` and, on the GPU, by
tests/gpu/test_gpu_layouts.py. A few seconds in all.
"""

from __future__ import annotations

import helpers
import kda_dhu
import numpy as np
import pytest
import torch
from helpers import make_inputs
from kda_dhu import _core, _dispatch
from kda_dhu.testing import LAYOUTS, relayout

BF16 = torch.bfloat16
NAMES = helpers.FLOAT_INPUTS
# _Call's positional order (fla's signature)
CALL_ORDER = helpers.CALL_ORDER
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _args(rng, name: str) -> dict:
    """A small call whose every dim that a layout touches has size >= 2: B2 T70 (a tail)
    H2 HV2 K64 V64, the scalar gate g when ``name`` is g, else gk; dht and h0 given."""
    return make_inputs(2, 70, 2, 2, 64, 64, BF16, "g" if name == "g" else "gk", generator=rng)


def _call(args: dict) -> _dispatch._Call:
    a = dict(args, chunk_indices=None, chunk_offsets=None, use_graph=False)
    return _dispatch._Call(*(a[n] for n in CALL_ORDER))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(INT[x.element_size()])


def _snapshot(x: torch.Tensor):
    """Everything of the caller's tensor a call could change: its layout, its address and
    the bits of its whole storage (the elements outside a view included)."""
    storage = torch.empty(0, dtype=x.dtype).set_(
        x.untyped_storage(), 0, (x.untyped_storage().nbytes() // x.element_size(),)
    )
    return (tuple(x.shape), x.stride(), x.storage_offset(), x.data_ptr(), _bits(storage).clone())


def _cases():
    return [(n, lay) for n in NAMES for lay in LAYOUTS]


def _layout_or_skip(x: torch.Tensor, layout: str) -> torch.Tensor:
    y = relayout(x, layout)
    if y is None:
        pytest.skip(f"{layout} does not apply to shape {tuple(x.shape)}")
    return y


@pytest.mark.parametrize("name,layout", _cases())
def test_validation_accepts_it_and_packed_copies_it(rng, name, layout):
    """validate accepts the layout; _Call.packed([name]) gives a new contiguous, 16-byte
    aligned tensor with the same values (h0: a fresh tensor of its shape and dtype), the
    other arguments untouched; the caller's tensor keeps its layout, address and bits."""
    args = _args(rng, name)
    x = _layout_or_skip(args[name], layout)
    args[name] = x
    before = _snapshot(x)
    _core.validate(**args)
    call = _call(args)
    packed = call.packed([name])
    y = getattr(packed, name)
    assert y is not x and y.data_ptr() != x.data_ptr(), f"{name}: packed kept the caller's memory"
    assert y.is_contiguous() and y.data_ptr() % 16 == 0, (name, y.stride(), y.data_ptr() % 16)
    assert (tuple(y.shape), y.dtype, y.device) == (tuple(x.shape), x.dtype, x.device)
    if name != "h0":
        assert torch.equal(_bits(y), _bits(x)), f"{name}: the copy's values differ"
    for other in NAMES:
        if other != name:
            assert getattr(packed, other) is getattr(call, other), f"{other} was replaced"
    assert getattr(call, name) is x, "packed changed the caller's call"
    after = _snapshot(x)
    assert after[:4] == before[:4], f"{name}: layout or address changed"
    assert torch.equal(after[4], before[4]), f"{name}: the caller's storage was written"


@pytest.mark.parametrize("name", NAMES)
def test_the_cpu_path_answers_every_layout_as_the_contiguous_one(rng, name):
    """The public entry point on CPU tensors, for each layout of ``name``: bitwise the
    answer for the same values laid out contiguously, outputs contiguous, the caller's
    tensor unchanged. A layout read as if contiguous would read the NaN outside the view
    (or the wrong elements) and fail."""
    args = _args(rng, name)
    seen = 0
    for layout in LAYOUTS:
        x = relayout(args[name], layout)
        if x is None:
            continue
        seen += 1
        before = _snapshot(x)
        expect = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**dict(args, **{name: x.contiguous()}))
        got = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**dict(args, **{name: x}))
        for out, o, e in zip(("dh", "dh0", "dv2"), got, expect):
            assert o.is_contiguous(), f"{name} {layout}: {out} is not contiguous"
            assert torch.isfinite(o).all(), f"{name} {layout}: {out} has non-finite elements"
            assert torch.equal(_bits(o), _bits(e)), (
                f"{name} {layout}: {out} differs from the contiguous call's"
            )
        after = _snapshot(x)
        assert after[:4] == before[:4] and torch.equal(after[4], before[4]), f"{name} {layout}: input changed"
    assert seen >= 5, f"{name}: only {seen} layouts applied"


@pytest.mark.parametrize("name", NAMES)
def test_negative_strides_are_refused_by_name(rng, name):
    """numpy (a DLPack producer that exports negative strides; torch cannot make them)
    arrays with ``name`` reversed along dim 1: validation and the public entry point raise
    ValueError naming the argument."""
    args = make_inputs(2, 70, 2, 2, 64, 64, torch.float32, "g" if name == "g" else "gk", generator=rng)
    arrays = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    arrays[name] = arrays[name][:, ::-1]
    assert any(s < 0 for s in arrays[name].strides)
    want = rf"^{name}: expected non-negative strides"
    with pytest.raises(ValueError, match=want):
        _core.validate(**arrays)
    with pytest.raises(ValueError, match=want):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**arrays)
    assert isinstance(arrays["q"], np.ndarray)
