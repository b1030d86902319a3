"""Calls fla's function computes are calls kda-dhu takes (CPU: validation, no GPU).

kda-dhu answers every call of fla's stage-4 signature, on its kernel or through fla's
function; its validation must not refuse a call fla computes. Known gaps are pinned here
as the named refusal they are today.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs
from kda_dhu import _core


def _fla_chunk_indices(cu: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fla's prepare_chunk_indices, written out: (sequence, chunk) rows of chunk_size-token chunks."""
    rows = []
    bounds = cu.tolist()
    for n, (s, e) in enumerate(zip(bounds, bounds[1:])):
        rows += [(n, c) for c in range(-(-(e - s) // chunk_size))]
    return torch.tensor(rows, dtype=cu.dtype).reshape(len(rows), 2)


def test_a_packed_batch_of_32_token_chunks_validates(rng):
    """GDN's chunk_size 32 with fla's chunk_indices for 32-token chunks: fla computes it
    (the planner would send it to fla: chunk_size != 64)."""
    a = make_inputs(1, None, 2, 2, 128, 64, torch.bfloat16, "g", varlen_lengths=[100, 130, 70], chunk_size=32,
                    generator=rng)  # fmt: skip
    ci = _fla_chunk_indices(a["cu_seqlens"], 32)
    assert ci.shape[0] == 12
    _core.validate(**a, chunk_indices=ci)


def test_t_zero_is_refused_by_name(rng):
    """T = 0: fla's function computes it (no chunks: dh0 = dht, dv2 empty); kda-dhu's
    validation refuses it, naming q (tests/gpu/test_gpu_fallback.py accepts either)."""
    a = make_inputs(2, 0, 2, 2, 128, 64, torch.bfloat16, "gk", generator=rng)
    with pytest.raises(ValueError, match=r"^q: expected T >= 1"):
        _core.validate(**a)
