"""Stage 4 on the inputs one rank sees under fla's context parallelism, on one device.

fla's CP KDA backward (FLACPContext over NCCL) cuts packed sequences at the rank
boundary, gives each rank int32 ``cu_seqlens`` of its own tokens (fla's
``get_cp_cu_seqlens``, contiguous or zigzag layout) and its chunk table, and carries a
non-zero dht into the sequence that continues on the next rank. NCCL will not run two
ranks on one GPU, so this is a stand-in for the two-GPU check (tests/gpu/test_gpu_multi.py,
benches/cp_check.py): each rank's stage-4 call, built by fla's own rules, against the
float64 reference (every output, outputs poisoned), on the CPU path and on the GPU (the
kernel, as fla's CP backward calls it: through fla's registry, with chunk_indices).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs

pytest.importorskip("fla.ops.cp.context")


def _rank_calls(lengths: list[int], world_size: int, layout: str, H: int, K: int, V: int, rng, device: str):
    """Per rank: the keyword arguments of its stage-4 call (fla's int32 local cu_seqlens and
    chunk table, a non-zero dht for every local sequence: the next rank's carry for the cut
    one, the caller's gradient for the others)."""
    from fla.ops.cp.context import get_cp_cu_seqlens
    from fla.ops.utils.index import prepare_chunk_indices

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    calls = []
    for rank in range(world_size):
        ctx = get_cp_cu_seqlens(cu, cu_seqlens_cpu=cu, world_size=world_size, rank=rank, layout=layout)
        local = ctx.cu_seqlens_cpu.to(torch.int32)
        local_lengths = (local[1:] - local[:-1]).tolist()
        a = make_inputs(
            1, None, H, H, K, V, torch.bfloat16, "gk", varlen_lengths=local_lengths, generator=rng
        )
        a["cu_seqlens"] = local
        a["chunk_indices"] = prepare_chunk_indices(local.long(), 64).to(torch.int32)
        a = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        calls.append(a)
    return calls


def _check(ours, ref, tol):
    from kda_dhu.reference import rel_err

    for name, o, r in zip(("dh", "dh0", "dv2"), ours, ref):
        assert (o is None) == (r is None), name
        if r is None:
            continue
        assert o.shape == r.shape, (name, o.shape, r.shape)
        assert torch.isfinite(o.float()).all(), name
        assert rel_err(o, r) <= tol, (name, rel_err(o, r))


CASES = [
    ([300, 500, 224], 2, "contiguous"),  # T 1024: the second sequence crosses the boundary at 512
    ([64, 700, 100, 160], 2, "zigzag"),  # four parts of 256 tokens, rank r holds parts r and 3 - r
    ([1000, 24], 2, "contiguous"),  # one long sequence cut mid-chunk (512 = 8 chunks, 488 + 24)
]


@pytest.mark.parametrize("lengths, world_size, layout", CASES)
def test_rank_inputs_on_the_cpu_path(rng, lengths, world_size, layout):
    import kda_dhu
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref

    for a in _rank_calls(lengths, world_size, layout, 2, 64, 64, rng, "cpu"):
        ours = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
        ref = chunk_gated_delta_rule_bwd_dhu_ref(**{k: v for k, v in a.items() if k != "chunk_indices"},
                                                 emulate_rounding=False)  # fmt: skip
        _check(ours, ref, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, world_size, layout", CASES)
def test_rank_inputs_on_the_kernel_through_fla(rng, lengths, world_size, layout):
    """As fla's CP backward calls stage 4: fla's public function (the registry), int32
    tables, chunk_indices given; the kernel must run (one launch per call), no host read."""
    import kda_dhu
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu as fla_public
    from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err
    from kda_dhu.testing import KernelProbe

    assert kda_dhu.register_backend()
    for a in _rank_calls(lengths, world_size, layout, 4, 128, 128, rng, "cuda"):
        with KernelProbe() as probe:
            ours = fla_public(**a)
            torch.cuda.synchronize()
        assert probe.launches == 1, probe.verdicts
        fla = kda_dhu.fla_function()(**a)
        ref = chunk_gated_delta_rule_bwd_dhu_ref(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                    for k, v in a.items() if k != "chunk_indices"},
                                                 emulate_rounding=False)  # fmt: skip
        for name, o, f, r in zip(("dh", "dh0", "dv2"), ours, fla, ref):
            r = r.to(o.device)
            assert torch.isfinite(o.float()).all(), name
            assert rel_err(o, r) <= 1.25 * rel_err(f, r) + 1e-6, (name, rel_err(o, r), rel_err(f, r))
