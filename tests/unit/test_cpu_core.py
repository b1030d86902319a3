"""The op on the CPU (the Rust core's ``cpu_bwd_dhu``): values and errors.

* ``mode="float64"`` against the float64 reference (``kda_dhu.reference``,
  ``emulate_rounding=False``): at most 1e-12 relative on every output of every variant,
  from torch (bf16, fp16, fp32) and numpy (float16, float32, float64) inputs.
* ``mode="fla"`` against the reference with fla's two operand roundings emulated
  (``emulate_rounding=True``): what is left is fp32 accumulation order and the rounding
  of the 16-bit outputs (bounds below, per output and dtype).
* Bad input raises what the CUDA path raises for it (tests/unit/test_bad_input.py's table),
  from the same validation code; valid unusual input (views, numpy, subclasses) runs.

Every run fills its outputs with NaN first (``_poison``), so an element the core does
not write fails the comparison; inputs are checked unchanged.
"""

from __future__ import annotations

import math

import helpers
import numpy as np
import pytest
import torch
from helpers import make_inputs
from kda_dhu._cpu import chunk_gated_delta_rule_bwd_dhu_cpu as cpu_dhu
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err

_core = pytest.importorskip("kda_dhu._core")

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
OUTPUTS = helpers.OUTPUTS
TENSORS = ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht", "cu_seqlens", "chunk_indices", "chunk_offsets")


def _torch(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _reference(args: dict, emulate_rounding: bool):
    kw = {key: _torch(val) for key, val in args.items()}
    return chunk_gated_delta_rule_bwd_dhu_ref(**kw, emulate_rounding=emulate_rounding)


def _run(args: dict, mode: str):
    """The CPU core on ``args`` with poisoned outputs; checks that no input changed."""
    before = {
        key: (val.clone() if isinstance(val, torch.Tensor) else val.copy())
        for key, val in args.items()
        if isinstance(val, (torch.Tensor, np.ndarray))
    }
    out = cpu_dhu(**args, mode=mode, _poison=True)
    for key, val in before.items():
        now = args[key]
        same = torch.equal(now, val) if isinstance(now, torch.Tensor) else np.array_equal(now, val)
        assert same, f"input {key} was modified"
    return out


def _variant(name: str, gen: torch.Generator) -> dict:
    """The keyword arguments of one SPEC.md variant (fresh random inputs)."""
    kw = dict(generator=gen)
    if name in ("gk", "g", "none"):
        return make_inputs(2, 130, 2, 2, 64, 64, BF16, None if name == "none" else name, **kw)
    if name == "gva_h1_hv4":
        return make_inputs(1, 100, 1, 4, 64, 64, BF16, "gk", **kw)
    if name == "gva_h2_hv4_g":
        return make_inputs(2, 90, 2, 4, 64, 64, BF16, "g", **kw)
    if name.startswith("tail_"):
        return make_inputs(2, int(name[5:]), 2, 2, 64, 64, BF16, "gk", **kw)
    if name == "varlen_padded":
        return make_inputs(1, 300, 2, 2, 64, 64, BF16, "gk", varlen_lengths=[100, 30, 70], **kw)
    if name.startswith("varlen_"):
        gate = name[len("varlen_") :]
        return make_inputs(
            1,
            None,
            2,
            2,
            64,
            64,
            BF16,
            None if gate == "none" else gate,
            varlen_lengths=[1, 63, 65, 128],
            **kw,
        )
    if name == "no_dht":
        return make_inputs(2, 130, 2, 2, 64, 64, BF16, "gk", dht=False, **kw)
    if name == "no_h0":
        return make_inputs(2, 130, 2, 2, 64, 64, BF16, "g", h0=False, **kw)
    if name == "no_dht_no_h0":
        return make_inputs(2, 130, 2, 2, 64, 64, BF16, None, dht=False, h0=False, **kw)
    if name == "state_v_first":
        return make_inputs(2, 130, 2, 2, 64, 128, BF16, "gk", state_v_first=True, **kw)
    if name == "state_v_first_varlen":
        return make_inputs(
            1, None, 2, 2, 64, 64, BF16, "g", varlen_lengths=[1, 63, 65, 128], state_v_first=True, **kw
        )
    if name == "k128_v128_fp16":
        return make_inputs(1, 200, 2, 2, 128, 128, F16, "gk", **kw)
    if name == "k128_v192_fp32":
        return make_inputs(1, 100, 1, 1, 128, 192, F32, "g", **kw)
    if name == "k256_v64":
        return make_inputs(1, 70, 1, 1, 256, 64, BF16, "gk", **kw)
    if name == "k32_v40":  # any K <= 256 and any V on the CPU
        return make_inputs(2, 100, 2, 2, 32, 40, BF16, "gk", **kw)
    if name.startswith("numpy_"):
        dt = {"numpy_float16": F16, "numpy_float32": F32, "numpy_float64": F64}[name]
        args = make_inputs(2, 100, 2, 2, 64, 64, dt, "gk", **kw)
        if dt == F64:  # float64 throughout (the float64 mode takes it)
            args = {
                k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in args.items()
            }
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    raise ValueError(name)


VARIANTS = [
    "gk",
    "g",
    "none",
    "gva_h1_hv4",
    "gva_h2_hv4_g",
    "tail_1",
    "tail_63",
    "tail_65",
    "tail_200",
    "varlen_gk",
    "varlen_g",
    "varlen_none",
    "varlen_padded",
    "no_dht",
    "no_h0",
    "no_dht_no_h0",
    "state_v_first",
    "state_v_first_varlen",
    "k128_v128_fp16",
    "k128_v192_fp32",
    "k256_v64",
    "k32_v40",
    "numpy_float16",
    "numpy_float32",
    "numpy_float64",
]


def _check_kinds(args: dict, out, mode: str):
    """Outputs of the caller's kind, in the mode's dtypes, dh0 iff h0."""
    dh, dh0, dv2 = out
    assert (dh0 is None) == (args.get("h0") is None)
    numpy_in = isinstance(args["q"], np.ndarray)
    for o in (dh, dh0, dv2):
        if o is not None:
            assert isinstance(o, np.ndarray if numpy_in else torch.Tensor), type(o)
    if mode == "float64":
        want = (F64, F64, F64)
    else:
        want = (_torch(args["q"]).dtype, F32, _torch(args["dv"]).dtype)
    for o, dt in zip(out, want):
        if o is not None:
            assert _torch(o).dtype == dt


@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_mode_matches_the_reference(variant, rng):
    args = _variant(variant, rng)
    out = _run(args, "float64")
    _check_kinds(args, out, "float64")
    ref = _reference(args, emulate_rounding=False)
    for name, o, r in zip(OUTPUTS, out, ref):
        if r is None:
            continue
        o = _torch(o)
        assert o.shape == r.shape, (name, o.shape, r.shape)
        assert float(r.abs().max()) > 0, f"{name}: an all-zero reference proves nothing"
        err = rel_err(o, r)
        assert err <= 1e-12, f"{name}: {err:.3e}"


# fla mode against the reference with fla's operand roundings emulated. dh0 is fp32: what
# is left is fp32 accumulation order (~1e-7), or, where a last-bit change of fp32 b flips
# one 16-bit rounding of R_k(b) or R_w(dv2) on the way, ~1e-4 (bf16; measured up to 1.4e-4
# in src/cpu/tests.rs), against ~1.5e-3 for the roundings themselves. dh and dv2 are
# stored in 16 bits: their error is that output rounding (unit roundoff 2^-9 for bf16,
# measured 1.7e-3; 2^-12 for fp16, measured 2.1e-4).
FLA_BOUNDS = {
    # dtype: (dh, dh0, dv2)
    BF16: (3e-3, 4e-4, 3e-3),
    F16: (4e-4, 6e-5, 4e-4),
    F32: (1e-6, 1e-6, 1e-6),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fla_mode_matches_the_emulated_reference(variant, rng):
    args = _variant(variant, rng)
    if variant == "numpy_float64":
        with pytest.raises(TypeError, match=r"^q: expected dtype bfloat16, float16 or float32, got float64$"):
            cpu_dhu(**args, mode="fla")
        return
    out = _run(args, "fla")
    _check_kinds(args, out, "fla")
    ref = _reference(args, emulate_rounding=True)
    exact = _reference(args, emulate_rounding=False)
    bounds = FLA_BOUNDS[_torch(args["q"]).dtype]
    for name, o, r, x, bound in zip(OUTPUTS, out, ref, exact, bounds):
        if r is None:
            continue
        err = rel_err(_torch(o), r)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.0e}"
        if name == "dh0" and _torch(args["q"]).dtype != F32 and args["q"].shape[1] > 64:
            # the roundings are really modelled: fla mode sits far closer to the
            # emulated reference than to the exact one (they differ by 1e-3 or so)
            assert 4 * err < rel_err(_torch(o), x), (err, rel_err(_torch(o), x))


def test_fla_mode_rounds_dv2_before_w_and_b_before_k(rng):
    """The two operand roundings change dh0 by more than fp32 noise: switching the
    reference's emulation off moves it from <= ~1e-4 to ~1e-3 of fla mode's dh0."""
    args = make_inputs(1, 512, 2, 2, 128, 128, BF16, "gk", generator=rng)
    _, dh0, _ = _run(args, "fla")
    near = rel_err(dh0, _reference(args, True)[1])
    far = rel_err(dh0, _reference(args, False)[1])
    assert near < 4e-4 and far > 4 * near, (near, far)


def test_repeated_runs_are_bitwise_identical(rng):
    args = make_inputs(1, 300, 1, 2, 64, 128, BF16, "gk", generator=rng)
    for mode in ("fla", "float64"):
        a, b = _run(args, mode), _run(args, mode)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_dense_padding_rows_and_long_chunk_tables(rng):
    """A padded packed batch: dv2's padding rows are zeros; fla's chunk_indices longer than
    the sequences' chunks (its graph mode) gives dh rows of zeros past them; chunk_offsets
    with N + 1 entries (checked) or N (not used, as on the CUDA path)."""
    lengths = [100, 30, 70]
    args = make_inputs(1, 320, 2, 2, 64, 64, BF16, "gk", varlen_lengths=lengths, generator=rng)
    chunks = [math.ceil(n / 64) for n in lengths]
    offsets = torch.tensor([0, 2, 3, 5])
    for mode in ("float64", "fla"):
        for co in (None, offsets, offsets[:-1]):
            kw = dict(args, chunk_indices=torch.zeros(sum(chunks) + 2, 2, dtype=torch.long), chunk_offsets=co)
            dh, dh0, dv2 = _run(kw, mode)
            assert dh.shape[1] == sum(chunks) + 2
            assert torch.count_nonzero(dh[:, sum(chunks) :]) == 0
            assert torch.count_nonzero(dv2[:, sum(lengths) :]) == 0
            ref = _reference(args, emulate_rounding=mode == "fla")
            bound = 1e-12 if mode == "float64" else 3e-3
            assert rel_err(dh[:, : sum(chunks)], ref[0]) <= bound
            assert rel_err(dv2, ref[2]) <= bound and rel_err(dh0, ref[1]) <= bound


def test_int32_tables_and_strided_views(rng):
    args = make_inputs(1, None, 2, 4, 64, 64, BF16, "g", varlen_lengths=[5, 64, 66], generator=rng)
    ref = _reference(args, emulate_rounding=False)
    views = dict(args)
    views["cu_seqlens"] = args["cu_seqlens"].to(torch.int32)
    views["chunk_offsets"] = torch.tensor([0, 1, 2, 4], dtype=torch.int32)
    views["q"] = args["q"].transpose(1, 2).contiguous().transpose(1, 2)  # strided
    views["do"] = args["do"].mT.contiguous().mT
    views["dht"] = args["dht"].mT.contiguous().mT
    views["k"] = args["k"].requires_grad_()
    out = _run(views, "float64")
    for name, o, r in zip(OUTPUTS, out, ref):
        assert rel_err(o, r) <= 1e-12, name


# ---- errors: the CUDA path's table, the same messages ----

from test_bad_input import BAD, VALID  # noqa: E402


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_input_raises_what_the_cuda_path_raises(case):
    """fla mode takes fla's dtypes: every case raises exactly as ``_core.validate`` (and
    so the CUDA path) does. The float64 mode takes float64 too: its dtype messages list
    it; every other case is the same."""
    kw = case.make()
    with pytest.raises(case.exc, match=case.match):
        cpu_dhu(**kw, mode="fla")
    if "expected dtype" not in case.match:
        with pytest.raises(case.exc, match=case.match):
            cpu_dhu(**kw, mode="float64")


@pytest.mark.parametrize("make", [m for _, m in VALID], ids=[i for i, _ in VALID])
def test_valid_unusual_input_runs(make):
    """The CUDA path's valid-but-unusual inputs (views, numpy, subclasses, requires grad,
    int32 tables, scale as a tensor, ...) all run on the CPU and match the reference."""
    kw = make()
    if kw.get("chunk_size", 64) != 64:
        with pytest.raises(ValueError, match=r"^chunk_size: the CPU path takes 64, got 32$"):
            cpu_dhu(**kw, mode="float64")
        return
    out = _run(kw, "float64")
    ref_kw = {k: v for k, v in kw.items() if k != "chunk_offsets" or kw.get("cu_seqlens") is not None}
    ref_kw = {
        k: (_torch(v).detach() if isinstance(v, (torch.Tensor, np.ndarray)) else v) for k, v in ref_kw.items()
    }
    if isinstance(ref_kw.get("scale"), torch.Tensor):
        ref_kw["scale"] = float(ref_kw["scale"])
    if ref_kw.get("state_v_first") is not None:
        ref_kw["state_v_first"] = bool(ref_kw["state_v_first"])
    else:
        ref_kw.pop("state_v_first", None)
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**ref_kw, emulate_rounding=False)
    for name, o, r in zip(OUTPUTS, out, ref):
        if r is None:
            assert o is None, name
            continue
        assert rel_err(_torch(o), r) <= 1e-12, name


@pytest.mark.parametrize(
    "cu, co, nt, match",
    [
        ([3, 30, 70, 100], None, None, r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 3$"),
        (
            [0, 70, 30, 100],
            None,
            None,
            r"^cu_seqlens: expected non-negative, non-decreasing offsets, got cu_seqlens\[1\] = 70 > "
            r"cu_seqlens\[2\] = 30$",
        ),
        ([0, 30, 70, 101], None, None, r"^cu_seqlens: expected cu_seqlens\[3\] <= T = 100, got 101$"),
        ([0, 30, 70, 100], [0, 1, 3, 4], None, r"^chunk_offsets: expected the chunk offsets of cu_seqlens"),
        ([0, 30, 70, 100], [1, 2, 3, 4], None, r"^chunk_offsets: expected the chunk offsets of cu_seqlens"),
        (
            [0, 30, 70, 100],
            None,
            2,
            r"^chunk_indices: expected at least as many rows as cu_seqlens has chunks",
        ),
        (
            [0, 30, 70, 100],
            None,
            5,
            r"^chunk_indices: expected at most 4 rows \(chunks of 3 sequences in T=100",
        ),
    ],
)
def test_packed_batch_tables_are_checked(cu, co, nt, match):
    """cu_seqlens, chunk_offsets [N + 1] and chunk_indices values: src/varlen.rs's one
    checker (and validation's bound on chunk_indices' length)."""
    kw = make_inputs(1, None, 1, 1, 16, 16, BF16, "gk", varlen_lengths=[30, 40, 30])
    kw["cu_seqlens"] = torch.tensor(cu)
    if co is not None:
        kw["chunk_offsets"] = torch.tensor(co)
    if nt is not None:
        kw["chunk_indices"] = torch.zeros(nt, 2, dtype=torch.long)
    for mode in ("fla", "float64"):
        with pytest.raises(ValueError, match=match):
            cpu_dhu(**kw, mode=mode)


def test_scalar_arguments_of_the_cpu_path():
    kw = make_inputs(1, 64, 1, 1, 16, 16, BF16, "gk")
    with pytest.raises(ValueError, match=r'^mode: expected \'float64\' or \'fla\', got "fp32"$'):
        cpu_dhu(**kw, mode="fp32")
    with pytest.raises(ValueError, match=r"^chunk_size: the CPU path takes 64, got 128$"):
        cpu_dhu(**dict(kw, chunk_size=128))
    with pytest.raises(
        TypeError, match=r"^chunk_indices: expected a tensor \(an object with __dlpack__\), got int$"
    ):
        cpu_dhu(**dict(kw, cu_seqlens=torch.tensor([0, 64]), h0=None, dht=None, chunk_indices=5))
    with pytest.raises(ValueError, match=r"^chunk_indices: expected shape \[NT, 2\]"):
        cpu_dhu(**dict(kw, cu_seqlens=torch.tensor([0, 64]), h0=None, dht=None, chunk_indices=torch.zeros(1)))
    # without cu_seqlens chunk_indices and chunk_offsets are ignored, as in fla
    dh, _, _ = cpu_dhu(**dict(kw, chunk_indices=5, chunk_offsets="x"))
    assert dh.shape == (1, 1, 1, 16, 16)


def test_numpy_has_no_bfloat16_output():
    """A DLPack producer other than torch gets numpy outputs, which cannot be bfloat16."""

    class Wrapped:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, *a, **k):
            return self.t.__dlpack__(*a, **k)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    kw = make_inputs(1, 64, 1, 1, 16, 16, BF16, "gk")
    with pytest.raises(TypeError, match=r"^dh: a numpy output cannot be bfloat16"):
        cpu_dhu(**dict(kw, q=Wrapped(kw["q"])))
    out = cpu_dhu(**dict(kw, q=Wrapped(kw["q"])), mode="float64")
    assert all(isinstance(o, np.ndarray) and o.dtype == np.float64 for o in out)


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["k", "dv", "gk", "dht", "h0"])
def test_mixed_devices_name_the_argument(arg):
    kw = make_inputs(1, 64, 1, 1, 64, 64, BF16, "gk")
    kw[arg] = kw[arg].cuda()
    for mode in ("fla", "float64"):
        with pytest.raises(ValueError, match=rf"^{arg}: expected a CPU tensor, got a tensor on cuda:0$"):
            cpu_dhu(**kw, mode=mode)
