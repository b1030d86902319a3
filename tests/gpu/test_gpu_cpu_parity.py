"""The CPU path's ``fla`` mode against the CUDA kernel, on the GPU tests' shapes (GPU machine).

Both compute SPEC.md's recurrence with fla's rounding points (b rounded to q's dtype
before k @ b, dv2 rounded before w^T dv2, scale after the fp32 q^T do dot) and fp32
accumulation, so on the same inputs their outputs differ by summation order only: the
fp32 sums run in another order (wgmma's, matrixmultiply's), and where that moves an fp32
value across a 16-bit rounding boundary, one element of R_k(b) or R_w(dv2) changes by one
ulp and the change is carried on through the scan. Measured on the CPU against a float64
simulation of the kernel's arithmetic (same roundings, summation exact), the CPU side
alone is <= 1e-4 relative on every output (bf16), so two such implementations are
<= ~2e-4 apart; the bounds below allow 2.5x that.

One difference is not summation order: with the scalar gate g the kernel weights do
rather than q (q^T diag(e) do = q^T (diag(e) do)) and rounds do[t] * exp2(g[t]) to
q's dtype in shared memory, where fla (and the CPU fla mode) keep q[t] * exp2(g[t]) in
fp32. That adds about one 16-bit rounding to the q^T do term: measured 4e-4 .. 6.5e-4
(bf16) against the simulation, so the g bounds are 4x that; fp16 carries 3 more bits.

Each case draws fresh inputs on the CPU; the kernel's outputs are poisoned with NaN before
it runs and the CPU's before the core runs, so an unwritten element fails.
"""

from __future__ import annotations

import helpers
import pytest
import torch
from helpers import make_inputs

pytestmark = pytest.mark.gpu

BF16, F16 = torch.bfloat16, torch.float16

# (dtype, scalar gate) -> relative bound on each of dh, dh0, dv2
BOUNDS = {
    (BF16, False): 5e-4,
    (F16, False): 2e-4,
    (BF16, True): 2.5e-3,
    (F16, True): 4e-4,
}

LENGTHS = helpers.VARLEN_LENGTHS

# name -> make_inputs arguments (B, T, H, HV, K, V, dtype, gate, extra keywords): the
# shapes of tests/gpu/test_gpu_kernel.py.
CASES = {
    "envelope_bf16_k128_v128_t320": (2, 320, 4, 4, 128, 128, BF16, "gk", {}),
    "envelope_bf16_k64_v64_t64": (2, 64, 4, 4, 64, 64, BF16, "gk", {}),
    "envelope_fp16_k128_v64_t320": (2, 320, 4, 4, 128, 64, F16, "gk", {}),
    "envelope_fp16_k64_v128_t64": (2, 64, 4, 4, 64, 128, F16, "gk", {}),
    "tail_t63_gk": (2, 63, 2, 2, 128, 128, BF16, "gk", {}),
    "tail_t65_none": (2, 65, 2, 2, 128, 128, BF16, None, {}),
    "tail_t200_g": (2, 200, 2, 2, 128, 128, BF16, "g", {}),
    "tail_t200_none": (2, 200, 2, 2, 128, 128, BF16, None, {}),
    "tail_t200_g_fp16": (2, 200, 2, 2, 128, 128, F16, "g", {}),
    "varlen_gk": (1, None, 2, 2, 128, 64, BF16, "gk", dict(varlen_lengths=LENGTHS)),
    "varlen_g": (1, None, 2, 2, 128, 64, BF16, "g", dict(varlen_lengths=LENGTHS)),
    "varlen_none": (1, None, 2, 2, 128, 64, BF16, None, dict(varlen_lengths=LENGTHS)),
    "varlen_padded": (1, 300, 2, 2, 64, 64, BF16, "gk", dict(varlen_lengths=[100, 30, 70])),
    # fla's chunk tables in int32 (chunk_offsets of N + 1 entries: read by both)
    "varlen_tables_int32": (
        1,
        300,
        2,
        2,
        128,
        64,
        BF16,
        "g",
        dict(varlen_lengths=[100, 0, 30, 70], tables=torch.int32),
    ),
    "gva_h1_hv4": (1, 192, 1, 4, 128, 64, BF16, "gk", {}),
    "gva_h16_hv32": (1, 192, 16, 32, 128, 64, BF16, "gk", {}),
    "no_dht": (2, 128, 2, 2, 64, 64, BF16, "gk", dict(dht=False)),
    "no_h0": (2, 128, 2, 2, 64, 64, BF16, "gk", dict(h0=False)),
    "no_states": (2, 128, 2, 2, 128, 128, BF16, "gk", dict(dht=False, h0=False)),
    "state_v_first_k128_v128": (2, 320, 4, 4, 128, 128, BF16, "gk", dict(state_v_first=True)),
    "state_v_first_k64_v256_g": (1, 192, 2, 2, 64, 256, BF16, "g", dict(state_v_first=True)),
    "state_v_first_varlen": (
        1,
        None,
        2,
        2,
        128,
        128,
        BF16,
        "gk",
        dict(varlen_lengths=LENGTHS, state_v_first=True),
    ),
    "b2a_like_t512": (2, 512, 4, 4, 128, 128, BF16, "gk", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fla_mode_matches_the_kernel(rng, case):
    from kda_dhu._cpu import chunk_gated_delta_rule_bwd_dhu_cpu
    from kda_dhu.reference import rel_err
    from kda_dhu.testing import chunk_tables, run_kernel

    B, T, H, HV, K, V, dtype, gate, extra = CASES[case]
    extra = dict(extra)
    tables = extra.pop("tables", None)
    args = make_inputs(B, T, H, HV, K, V, dtype, gate, generator=rng, **extra)
    if tables is not None:
        cu = args["cu_seqlens"].to(tables)
        ci, co = chunk_tables(cu, T)
        args.update(cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co)
    ours = chunk_gated_delta_rule_bwd_dhu_cpu(**args, mode="fla", _poison=True)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    kernel = run_kernel(on_gpu, poison=True)
    torch.cuda.synchronize()
    bound = BOUNDS[(dtype, gate == "g")]
    for name, o, k in zip(("dh", "dh0", "dv2"), ours, kernel):
        if k is None:
            assert o is None, name
            continue
        k = k.cpu()
        assert o.shape == k.shape and o.dtype == k.dtype, (name, o.shape, k.shape, o.dtype, k.dtype)
        assert torch.isfinite(k).all() and torch.isfinite(o).all(), f"{name}: non-finite (unwritten?)"
        assert float(k.float().abs().max()) > 0, name
        err = rel_err(o, k)
        assert err <= bound, f"{name}: CPU fla mode vs kernel {err:.2e} > {bound:.0e}"
