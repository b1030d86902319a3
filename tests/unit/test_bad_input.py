"""Bad input, case by case, on the CPU: every check of the host core.

Each raising case goes through ``kda_dhu._core.validate`` (everything but the device)
and, where the public API matters, through ``kda_dhu.chunk_gated_delta_rule_bwd_dhu``,
``kda_dhu.kda_dhu_b2a`` (same exception, same message: the device check comes last)
and ``kda_dhu.plan_call`` (returns ``(False, "<Exception>: <message>")``, never raises).
Messages follow src/error.rs: ``"<argument>: expected ..."``. No failing call modifies
its inputs.

Valid-but-unusual input (non-contiguous, offset or expanded views, numpy arrays, tensors
that require grad, ...) must pass ``validate``: fla copies such tensors, so for the
planner they are fallbacks, not errors. The planner's fallback reasons for them need a
CUDA device (on the CPU ``plan`` stops at "expected a CUDA tensor"); they are tested
with the same layouts in src/validate.rs (``views_validate_and_plan_names_the_layout``).

DLPack producers that torch cannot imitate (negative strides, broken capsules) are
made with numpy and ctypes; the capsule cases run in a subprocess so that a crash
shows as a failed test instead of ending the session.

cu_seqlens' values are checked in Python on the GPU path only
(``_core.check_tables``, the checker the kernel runs on the device); those checks are called directly at the end.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import kda_dhu
import numpy as np
import pytest
import torch
from kda_dhu import _dispatch

_core = pytest.importorskip("kda_dhu._core")

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
B_, T_, H_, HV_, K_, V_ = 2, 100, 2, 4, 64, 128  # K != V: a transposed state shows


def call(B=B_, T=T_, H=H_, HV=HV_, K=K_, V=V_, dtype=BF16, gate="gk", N=None, seed=0) -> dict:
    """A valid fla call on CPU tensors (random, never zeros); fresh tensors every call."""
    return {key: val.clone() for key, val in _call(B, T, H, HV, K, V, dtype, gate, N, seed).items()}


@functools.cache
def _call(B, T, H, HV, K, V, dtype, gate, N, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    N = B if N is None else N

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    kw = dict(
        q=r(B, T, H, K),
        k=r(B, T, H, K),
        w=r(B, T, HV, K),
        do=r(B, T, HV, V),
        dv=r(B, T, HV, V),
        h0=r(N, HV, K, V, dt=F32),
        dht=r(N, HV, K, V, dt=F32),
    )
    if gate == "gk":
        kw["gk"] = -r(B, T, HV, K, dt=F32).abs()
    elif gate == "g":
        kw["g"] = -r(B, T, HV, dt=F32).abs()
    return kw


def varlen_call(**over) -> dict:
    """B == 1, three packed sequences of 30, 40, 30 tokens."""
    kw = call(B=1, N=3)
    kw["cu_seqlens"] = torch.tensor([0, 30, 70, 100])
    kw.update(over)
    return kw


def with_(**over) -> Callable[[], dict]:
    return lambda: {**call(), **over}


def tensor_of(shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


class NotCapsule:
    """Has __dlpack__, but it returns an int."""

    def __dlpack__(self, *args, **kwargs):
        return 5


class Exploding:
    """Has __dlpack__, and it raises."""

    def __dlpack__(self, *args, **kwargs):
        raise RuntimeError("boom")


class Sub(torch.Tensor):
    pass


def _q_with(*shape, dtype=BF16):
    return tensor_of(shape, dtype)


@dataclass
class Bad:
    id: str
    make: Callable[[], dict]
    exc: type
    match: str
    # fla_api: also through chunk_gated_delta_rule_bwd_dhu / plan_call; b2a: also through
    # kda_dhu_b2a (only for calls it can express: no g, cu_seqlens or state_v_first).
    fla_api: bool = True
    b2a: bool = True


BAD: list[Bad] = [
    # ---- dtypes, per tensor ----
    Bad(
        "q int32",
        with_(q=_q_with(B_, T_, H_, K_, dtype=torch.int32)),
        TypeError,
        r"^q: expected dtype bfloat16, float16 or float32, got int32$",
    ),
    Bad(
        "q int64",
        with_(q=_q_with(B_, T_, H_, K_, dtype=torch.int64)),
        TypeError,
        r"^q: expected dtype bfloat16, float16 or float32, got int64$",
    ),
    Bad(
        "q bool",
        with_(q=_q_with(B_, T_, H_, K_, dtype=torch.bool)),
        TypeError,
        r"^q: expected dtype bfloat16, float16 or float32, got bool$",
    ),
    Bad(
        "q float8_e4m3fn",
        with_(q=_q_with(B_, T_, H_, K_, dtype=torch.float8_e4m3fn)),
        TypeError,
        r"^q: expected dtype bfloat16, float16 or float32, got float8_e4m3fn$",
    ),
    Bad(
        "q complex64",
        with_(q=_q_with(B_, T_, H_, K_, dtype=torch.complex64)),
        TypeError,
        r"^q: expected dtype bfloat16, float16 or float32, got complex64$",
    ),
    Bad(
        "do fp64",
        with_(do=tensor_of((B_, T_, HV_, V_), torch.float64)),
        TypeError,
        r"^do: expected dtype bfloat16, float16 or float32, got float64$",
    ),
    Bad(
        "g bf16",
        lambda: {**call(gate="g"), "g": tensor_of((B_, T_, HV_), BF16)},
        TypeError,
        r"^g: expected dtype float32, got bfloat16$",
        b2a=False,
    ),
    Bad(
        "gk fp16",
        with_(gk=tensor_of((B_, T_, HV_, K_), F16)),
        TypeError,
        r"^gk: expected dtype float32, got float16$",
    ),
    Bad(
        "dht bf16",
        with_(dht=tensor_of((B_, HV_, K_, V_), BF16)),
        TypeError,
        r"^dht: expected dtype float32, got bfloat16$",
    ),
    Bad(
        "h0 int32",
        with_(h0=tensor_of((B_, HV_, K_, V_), torch.int32)),
        TypeError,
        r"^h0: expected a floating-point dtype, got int32$",
    ),
    Bad(
        "cu_seqlens float",
        lambda: varlen_call(cu_seqlens=torch.tensor([0.0, 30, 70, 100])),
        TypeError,
        r"^cu_seqlens: expected dtype int64 or int32, got float32$",
        b2a=False,
    ),
    Bad(
        "chunk_offsets float",
        lambda: varlen_call(chunk_offsets=torch.tensor([0.0, 1, 2, 4])),
        TypeError,
        r"^chunk_offsets: expected dtype int64 or int32, got float32$",
        b2a=False,
    ),
    # ---- mixed dtypes ----
    Bad(
        "k fp16 with q bf16",
        with_(k=tensor_of((B_, T_, H_, K_), F16)),
        TypeError,
        r"^k: expected dtype bfloat16 like q and w, got float16$",
    ),
    Bad(
        "w fp32 with q bf16",
        with_(w=tensor_of((B_, T_, HV_, K_), F32)),
        TypeError,
        r"^w: expected dtype bfloat16 like q and k, got float32$",
    ),
    Bad(
        "q fp32 with k and w bf16",
        with_(q=tensor_of((B_, T_, H_, K_), F32)),
        TypeError,
        r"^q: expected dtype bfloat16 like k and w, got float32$",
    ),
    Bad(
        "q a numpy float32 array with k and w bf16",
        with_(q=tensor_of((B_, T_, H_, K_), F32).numpy()),
        TypeError,
        r"^q: expected dtype bfloat16 like k and w, got float32$",
    ),
    Bad(
        "dv fp16 with do bf16",
        with_(dv=tensor_of((B_, T_, HV_, V_), F16)),
        TypeError,
        r"^dv: expected dtype bfloat16 like do, got float16$",
    ),
    Bad(
        "do fp16 with dv and q bf16",
        with_(do=tensor_of((B_, T_, HV_, V_), F16)),
        TypeError,
        r"^do: expected dtype bfloat16 like dv, got float16$",
    ),
    # ---- not tensors ----
    Bad(
        "q list",
        lambda: {**call(), "q": call()["q"].tolist()},
        TypeError,
        r"^q: expected a tensor \(an object with __dlpack__\), got list$",
    ),
    Bad(
        "q None", with_(q=None), TypeError, r"^q: expected a tensor \(an object with __dlpack__\), got None$"
    ),
    Bad(
        "k None", with_(k=None), TypeError, r"^k: expected a tensor \(an object with __dlpack__\), got None$"
    ),
    Bad(
        "w None", with_(w=None), TypeError, r"^w: expected a tensor \(an object with __dlpack__\), got None$"
    ),
    Bad(
        "do None",
        with_(do=None),
        TypeError,
        r"^do: expected a tensor \(an object with __dlpack__\), got None$",
    ),
    Bad(
        "dv None",
        with_(dv=None),
        TypeError,
        r"^dv: expected a tensor \(an object with __dlpack__\), got None$",
    ),
    Bad(
        "gk str", with_(gk="gk"), TypeError, r"^gk: expected a tensor \(an object with __dlpack__\), got str$"
    ),
    Bad(
        "dht list",
        with_(dht=[[0.0]]),
        TypeError,
        r"^dht: expected a tensor \(an object with __dlpack__\), got list$",
    ),
    Bad(
        "h0 float",
        with_(h0=1.0),
        TypeError,
        r"^h0: expected a tensor \(an object with __dlpack__\), got float$",
    ),
    Bad(
        "cu_seqlens list",
        lambda: varlen_call(cu_seqlens=[0, 30, 70, 100]),
        TypeError,
        r"^cu_seqlens: expected a tensor \(an object with __dlpack__\), got list$",
        b2a=False,
    ),
    Bad(
        "k numpy scalar",
        with_(k=np.float32(1.0)),
        TypeError,
        r"^k: expected a tensor \(an object with __dlpack__\), got numpy.float32$",
    ),
    Bad(
        "w whose __dlpack__ returns an int",
        with_(w=NotCapsule()),
        TypeError,
        r"^w: expected a tensor \(an object with __dlpack__\), got .*NotCapsule whose __dlpack__\(\) "
        r"returned int, not a DLPack capsule$",
    ),
    Bad(
        "w whose __dlpack__ raises",
        with_(w=Exploding()),
        ValueError,
        r"^w: __dlpack__\(\) failed: RuntimeError: boom$",
    ),
    Bad(
        "gk numpy read-only (broadcast_to)",
        with_(gk=np.broadcast_to(np.zeros((1, 1, HV_, K_), np.float32), (B_, T_, HV_, K_))),
        ValueError,
        r"^gk: __dlpack__\(\) failed: BufferError: .*readonly",
    ),
    Bad(
        "q on the meta device",
        with_(q=torch.empty(B_, T_, H_, K_, dtype=BF16, device="meta")),
        ValueError,
        r"^q: torch's DLPack export failed: .*meta",
    ),
    Bad(
        "do sparse",
        with_(do=tensor_of((B_, T_, HV_, V_), F32).to_sparse()),
        ValueError,
        r"^do: torch's DLPack export failed: \S",
    ),
    # torch's lazy negation is lost in DLPack: the data would be read with the wrong sign.
    Bad(
        "q with the negative bit (q._neg_view())",
        lambda: {**call(), "q": call()["q"]._neg_view()},
        ValueError,
        r"^q: expected a tensor without torch's lazy negation bit \(is_neg\(\) is True; DLPack cannot "
        r"carry it\), pass x.resolve_neg\(\)$",
    ),
    Bad(
        "gk with the negative bit, via a subclass",
        lambda: {**call(), "gk": call()["gk"]._neg_view().as_subclass(Sub)},
        ValueError,
        r"^gk: expected a tensor without torch's lazy negation bit",
    ),
    # ---- ranks ----
    Bad(
        "q 3-D",
        with_(q=tensor_of((B_, T_, K_))),
        ValueError,
        r"^q: expected a 4-D tensor \[B, T, H, K\], got shape \[2, 100, 64\]$",
    ),
    Bad(
        "q 5-D",
        with_(q=tensor_of((1, B_, T_, H_, K_))),
        ValueError,
        r"^q: expected a 4-D tensor \[B, T, H, K\], got shape \[1, 2, 100, 2, 64\]$",
    ),
    Bad(
        "q 0-D",
        with_(q=torch.tensor(1.0, dtype=BF16)),
        ValueError,
        r"^q: expected a 4-D tensor \[B, T, H, K\], got shape \[\]$",
    ),
    Bad(
        "k 3-D",
        with_(k=tensor_of((T_, H_, K_))),
        ValueError,
        r"^k: expected shape \[B=2, T=100, H=2, K=64\] like q, got \[100, 2, 64\]$",
    ),
    Bad(
        "w 3-D",
        with_(w=tensor_of((T_, HV_, K_))),
        ValueError,
        r"^w: expected a 4-D tensor \[B, T, HV, K\], got shape \[100, 4, 64\]$",
    ),
    Bad(
        "do 3-D",
        with_(do=tensor_of((T_, HV_, V_))),
        ValueError,
        r"^do: expected a 4-D tensor \[B, T, HV, V\], got shape \[100, 4, 128\]$",
    ),
    Bad(
        "dv 5-D",
        with_(dv=tensor_of((1, B_, T_, HV_, V_))),
        ValueError,
        r"^dv: expected shape \[B=2, T=100, HV=4, V=128\] like do, got \[1, 2, 100, 4, 128\]$",
    ),
    Bad(
        "g 4-D",
        lambda: {**call(gate="g"), "g": tensor_of((B_, T_, HV_, 1), F32)},
        ValueError,
        r"^g: expected shape \[B=2, T=100, HV=4\], got \[2, 100, 4, 1\]$",
        b2a=False,
    ),
    Bad(
        "gk 3-D",
        with_(gk=tensor_of((B_, T_, HV_), F32)),
        ValueError,
        r"^gk: expected shape \[B=2, T=100, HV=4, K=64\], got \[2, 100, 4\]$",
    ),
    Bad(
        "dht 3-D",
        with_(dht=tensor_of((HV_, K_, V_), F32)),
        ValueError,
        r"^dht: expected shape \[N=2, HV=4, K=64, V=128\], got \[4, 64, 128\]$",
    ),
    Bad(
        "h0 5-D",
        with_(h0=tensor_of((1, B_, HV_, K_, V_), F32)),
        ValueError,
        r"^h0: expected shape \[N=2, HV=4, K=64, V=128\], got \[1, 2, 4, 64, 128\]$",
    ),
    # ---- shape mismatches ----
    Bad(
        "k with another B",
        with_(k=tensor_of((1, T_, H_, K_))),
        ValueError,
        r"^k: expected shape \[B=2, T=100, H=2, K=64\] like q, got \[1, 100, 2, 64\]$",
    ),
    Bad(
        "k with another T",
        with_(k=tensor_of((B_, 99, H_, K_))),
        ValueError,
        r"^k: expected shape \[B=2, T=100, H=2, K=64\] like q, got \[2, 99, 2, 64\]$",
    ),
    Bad(
        "k with another H",
        with_(k=tensor_of((B_, T_, HV_, K_))),
        ValueError,
        r"^k: expected shape \[B=2, T=100, H=2, K=64\] like q, got \[2, 100, 4, 64\]$",
    ),
    Bad(
        "w with another B",
        with_(w=tensor_of((1, T_, HV_, K_))),
        ValueError,
        r"^w: expected shape \[B=2, T=100, HV=4, K=64\], got \[1, 100, 4, 64\]$",
    ),
    Bad(
        "w with another T",
        with_(w=tensor_of((B_, 64, HV_, K_))),
        ValueError,
        r"^w: expected shape \[B=2, T=100, HV=4, K=64\], got \[2, 64, 4, 64\]$",
    ),
    Bad(
        "K of w != K of q",
        with_(w=tensor_of((B_, T_, HV_, 128))),
        ValueError,
        r"^w: expected shape \[B=2, T=100, HV=4, K=64\], got \[2, 100, 4, 128\]$",
    ),
    Bad(
        "H does not divide HV",
        lambda: call(H=3, HV=4),
        ValueError,
        r"^w: expected HV \(dim 2\) to be a positive multiple of H=3 \(q's heads\), got HV=4$",
    ),
    Bad(
        "H > HV",
        lambda: call(H=4, HV=2),
        ValueError,
        r"^w: expected HV \(dim 2\) to be a positive multiple of H=4 \(q's heads\), got HV=2$",
    ),
    Bad(
        "HV of do != HV of w",
        with_(do=tensor_of((B_, T_, 2 * HV_, V_))),
        ValueError,
        r"^do: expected shape \[B=2, T=100, HV=4, V=128\], got \[2, 100, 8, 128\]$",
    ),
    Bad(
        "do with another T",
        with_(do=tensor_of((B_, 101, HV_, V_))),
        ValueError,
        r"^do: expected shape \[B=2, T=100, HV=4, V=128\], got \[2, 101, 4, 128\]$",
    ),
    Bad(
        "V of dv != V of do",
        with_(dv=tensor_of((B_, T_, HV_, 64))),
        ValueError,
        r"^dv: expected shape \[B=2, T=100, HV=4, V=128\] like do, got \[2, 100, 4, 64\]$",
    ),
    Bad(
        "dht with another N",
        with_(dht=tensor_of((3, HV_, K_, V_), F32)),
        ValueError,
        r"^dht: expected shape \[N=2, HV=4, K=64, V=128\], got \[3, 4, 64, 128\]$",
    ),
    Bad(
        "dht [N, HV, V, K] without state_v_first",
        with_(dht=tensor_of((B_, HV_, V_, K_), F32)),
        ValueError,
        r"^dht: expected shape \[N=2, HV=4, K=64, V=128\], got \[2, 4, 128, 64\]$",
    ),
    Bad(
        "h0 [N, HV, K, V] with state_v_first",
        lambda: {**call(), "state_v_first": True},
        ValueError,
        r"^h0: expected shape \[N=2, HV=4, V=128, K=64\] \(state_v_first=True\), got \[2, 4, 64, 128\]$",
        b2a=False,
    ),
    Bad(
        "dht [N, HV, K, V] with state_v_first",
        lambda: {**call(), "state_v_first": True, "h0": tensor_of((B_, HV_, V_, K_), F32)},
        ValueError,
        r"^dht: expected shape \[N=2, HV=4, V=128, K=64\] \(state_v_first=True\), got \[2, 4, 64, 128\]$",
        b2a=False,
    ),
    Bad(
        "g [B, T]",
        lambda: {**call(gate="g"), "g": tensor_of((B_, T_), F32)},
        ValueError,
        r"^g: expected shape \[B=2, T=100, HV=4\], got \[2, 100\]$",
        b2a=False,
    ),
    Bad(
        "g [B, T, H] with H != HV",
        lambda: {**call(gate="g"), "g": tensor_of((B_, T_, H_), F32)},
        ValueError,
        r"^g: expected shape \[B=2, T=100, HV=4\], got \[2, 100, 2\]$",
        b2a=False,
    ),
    Bad(
        "gk [B, T, H, K] with H != HV",
        with_(gk=tensor_of((B_, T_, H_, K_), F32)),
        ValueError,
        r"^gk: expected shape \[B=2, T=100, HV=4, K=64\], got \[2, 100, 2, 64\]$",
    ),
    Bad(
        "gk with another K",
        with_(gk=tensor_of((B_, T_, HV_, 32), F32)),
        ValueError,
        r"^gk: expected shape \[B=2, T=100, HV=4, K=64\], got \[2, 100, 4, 32\]$",
    ),
    Bad(
        "K > 256",
        lambda: call(K=512, V=64),
        ValueError,
        r"^q: expected 1 <= K <= 256 \(shape \[B, T, H, K\]\), got K=512 in \[2, 100, 2, 512\]$",
    ),
    Bad(
        "K == 0",
        lambda: call(K=0),
        ValueError,
        r"^q: expected 1 <= K <= 256 \(shape \[B, T, H, K\]\), got K=0 in \[2, 100, 2, 0\]$",
    ),
    Bad(
        "T == 0",
        lambda: call(T=0),
        ValueError,
        r"^q: expected T >= 1 \(shape \[B, T, H, K\]\), got \[2, 0, 2, 64\]$",
    ),
    Bad(
        "B == 0",
        lambda: call(B=0),
        ValueError,
        r"^q: expected B >= 1 \(shape \[B, T, H, K\]\), got \[0, 100, 2, 64\]$",
    ),
    Bad(
        "H == 0",
        lambda: call(H=0, HV=0),
        ValueError,
        r"^q: expected H >= 1 \(shape \[B, T, H, K\]\), got \[2, 100, 0, 64\]$",
    ),
    Bad(
        "HV == 0",
        lambda: call(H=1, HV=0),
        ValueError,
        r"^w: expected HV \(dim 2\) to be a positive multiple of H=1 \(q's heads\), got HV=0$",
    ),
    Bad("V == 0", lambda: call(V=0), ValueError, r"^do: expected V >= 1, got shape \[2, 100, 4, 0\]$"),
    # ---- varlen ----
    Bad(
        "cu_seqlens with B != 1",
        lambda: {**call(), "cu_seqlens": torch.tensor([0, 30, 100])},
        ValueError,
        r"^q: expected B == 1 with cu_seqlens \(sequences packed along T\), got B=2$",
        b2a=False,
    ),
    Bad(
        "cu_seqlens of length 1",
        lambda: varlen_call(cu_seqlens=torch.tensor([0])),
        ValueError,
        r"^cu_seqlens: expected a 1-D tensor \[N\+1\] with N >= 1, got shape \[1\]$",
        b2a=False,
    ),
    Bad(
        "cu_seqlens of length 0",
        lambda: varlen_call(cu_seqlens=torch.zeros(0, dtype=torch.int64)),
        ValueError,
        r"^cu_seqlens: expected a 1-D tensor \[N\+1\] with N >= 1, got shape \[0\]$",
        b2a=False,
    ),
    Bad(
        "cu_seqlens 2-D",
        lambda: varlen_call(cu_seqlens=torch.tensor([[0, 30, 70, 100]])),
        ValueError,
        r"^cu_seqlens: expected a 1-D tensor \[N\+1\] with N >= 1, got shape \[1, 4\]$",
        b2a=False,
    ),
    Bad(
        "cu_seqlens 0-D",
        lambda: varlen_call(cu_seqlens=torch.tensor(100)),
        ValueError,
        r"^cu_seqlens: expected a 1-D tensor \[N\+1\] with N >= 1, got shape \[\]$",
        b2a=False,
    ),
    Bad(
        "varlen h0 with N = B",
        lambda: varlen_call(h0=tensor_of((1, HV_, K_, V_), F32)),
        ValueError,
        r"^h0: expected shape \[N=3, HV=4, K=64, V=128\], got \[1, 4, 64, 128\]$",
        b2a=False,
    ),
    Bad(
        "chunk_offsets of the wrong length",
        lambda: varlen_call(chunk_offsets=torch.tensor([0, 1])),
        ValueError,
        r"^chunk_offsets: expected shape \[N=3\] or \[N\+1=4\], got \[2\]$",
        b2a=False,
    ),
    Bad(
        "chunk_offsets a list",
        lambda: varlen_call(chunk_offsets=[0, 1, 2]),
        TypeError,
        r"^chunk_offsets: expected a tensor \(an object with __dlpack__\), got list$",
        b2a=False,
    ),
    # ---- scalars ----
    Bad("chunk_size 0", with_(chunk_size=0), ValueError, r"^chunk_size: expected a positive int, got 0$"),
    Bad(
        "chunk_size -64", with_(chunk_size=-64), ValueError, r"^chunk_size: expected a positive int, got -64$"
    ),
    Bad(
        "chunk_size 2**70",
        with_(chunk_size=2**70),
        ValueError,
        r"^chunk_size: expected a positive int that fits in int64, got 1180591620717411303424$",
    ),
    Bad("chunk_size 64.0", with_(chunk_size=64.0), TypeError, r"^chunk_size: expected an int, got float$"),
    Bad("chunk_size None", with_(chunk_size=None), TypeError, r"^chunk_size: expected an int, got NoneType$"),
    Bad("chunk_size '64'", with_(chunk_size="64"), TypeError, r"^chunk_size: expected an int, got str$"),
    Bad("scale nan", with_(scale=float("nan")), ValueError, r"^scale: expected a finite float, got nan$"),
    Bad("scale inf", with_(scale=math.inf), ValueError, r"^scale: expected a finite float, got inf$"),
    Bad("scale -inf", with_(scale=-math.inf), ValueError, r"^scale: expected a finite float, got -inf$"),
    Bad(
        "scale 1e300 (inf as float32)",
        with_(scale=1e300),
        ValueError,
        r"^scale: expected a finite float \(within float32's range, as the kernel applies it\), got 1e300$",
    ),
    Bad(
        "scale 10**400",
        with_(scale=10**400),
        ValueError,
        r"^scale: expected a finite float, got int \(too large for float64\)$",
    ),
    Bad("scale a string", with_(scale="0.125"), TypeError, r"^scale: expected a float or None, got str$"),
    Bad("scale bytes", with_(scale=b"0.125"), TypeError, r"^scale: expected a float or None, got bytes$"),
    Bad("scale a list", with_(scale=[0.125]), TypeError, r"^scale: expected a float or None, got list$"),
    Bad(
        "scale a 2-element tensor",
        with_(scale=torch.ones(2)),
        TypeError,
        r"^scale: expected a float or None, got torch.Tensor$",
    ),
    Bad(
        "state_v_first 'yes'",
        with_(state_v_first="yes"),
        TypeError,
        r"^state_v_first: expected a bool, got str$",
        b2a=False,
    ),
    Bad(
        "state_v_first 1",
        with_(state_v_first=1),
        TypeError,
        r"^state_v_first: expected a bool, got int$",
        b2a=False,
    ),
    # ---- strides: the one layout that is an error (numpy exports negative strides) ----
    Bad(
        "gk with negative strides (numpy [::-1])",
        lambda: {**call(), "gk": np.ascontiguousarray(call()["gk"].numpy()[::-1])[::-1]},
        ValueError,
        r"^gk: expected non-negative strides, got strides \[-25600, 256, 64, 1\]$",
    ),
    Bad(
        "cu_seqlens with negative strides",
        lambda: varlen_call(cu_seqlens=np.array([100, 70, 30, 0])[::-1]),
        ValueError,
        r"^cu_seqlens: expected non-negative strides, got strides \[-1\]$",
        b2a=False,
    ),
]

_TENSOR_KEYS = ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht", "cu_seqlens", "chunk_offsets")


def _b2a(kw: dict):
    return kda_dhu.kda_dhu_b2a(
        kw["q"],
        kw["k"],
        kw["w"],
        kw.get("gk"),
        kw.get("h0"),
        kw.get("dht"),
        kw["do"],
        kw["dv"],
        kw.get("scale"),
        kw.get("chunk_size", 64),
    )


def _snapshot(kw: dict) -> dict:
    """Deep copies of every tensor-like argument, with the metadata a call could change."""
    snap = {}
    for key, val in kw.items():
        if isinstance(val, torch.Tensor):
            if val.is_meta or val.is_sparse:
                snap[key] = (val.shape, val.dtype, val.device, val.requires_grad)
            else:
                snap[key] = (
                    val.detach().clone(),
                    val.stride(),
                    val.storage_offset(),
                    val.requires_grad,
                    val.is_neg(),
                )
        elif isinstance(val, np.ndarray):
            snap[key] = (val.copy(), val.strides, val.flags.writeable)
    return snap


def _assert_unchanged(kw: dict, snap: dict):
    for key, before in snap.items():
        val = kw[key]
        if isinstance(val, torch.Tensor):
            if val.is_meta or val.is_sparse:
                assert (val.shape, val.dtype, val.device, val.requires_grad) == before, key
                continue
            data, stride, offset, rg, neg = before
            assert (val.stride(), val.storage_offset(), val.requires_grad, val.is_neg()) == (
                stride,
                offset,
                rg,
                neg,
            ), key
            assert val.dtype == data.dtype and val.shape == data.shape, key
            assert torch.equal(val.detach(), data), f"{key} was modified"
        else:
            data, strides, writeable = before
            assert val.strides == strides and val.flags.writeable == writeable, key
            np.testing.assert_array_equal(val, data, err_msg=f"{key} was modified")


@pytest.fixture(autouse=True)
def _no_force(monkeypatch):
    monkeypatch.delenv(_dispatch.FORCE_ENV, raising=False)


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_validate_raises_naming_the_argument(case: Bad):
    kw = case.make()
    snap = _snapshot(kw)
    with pytest.raises(case.exc, match=case.match):
        _core.validate(**kw)
    _assert_unchanged(kw, snap)


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_prepare_and_plan_raise_the_same(case: Bad):
    """The planner (and the prepared call of the kernel path) validate first: the same error."""
    kw = case.make()
    snap = _snapshot(kw)
    for fn in (_core.decide,):
        with pytest.raises(case.exc, match=case.match):
            fn("extended", **kw)
    _assert_unchanged(kw, snap)


@pytest.mark.parametrize("case", [c for c in BAD if c.fla_api], ids=[c.id for c in BAD if c.fla_api])
def test_public_api_raises_the_same(case: Bad, request):
    """On CPU tensors the input checks come before the device check: the same error."""
    kw = case.make()
    snap = _snapshot(kw)
    with pytest.raises(case.exc, match=case.match):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)
    _assert_unchanged(kw, snap)
    if case.b2a:
        with pytest.raises(case.exc, match=case.match):
            _b2a(kw)
        _assert_unchanged(kw, snap)


@pytest.mark.parametrize("case", [c for c in BAD if c.fla_api], ids=[c.id for c in BAD if c.fla_api])
def test_plan_call_reports_without_raising(case: Bad, request):
    kw = case.make()
    snap = _snapshot(kw)
    ok, reason = kda_dhu.plan_call(**kw)
    assert ok is False
    prefix = case.exc.__name__ + ": "
    assert reason.startswith(prefix), reason
    assert re.search(case.match, reason[len(prefix) :]), reason
    _assert_unchanged(kw, snap)


# ---- valid input that is unusual: validate passes; on the CPU the public API runs the
# CPU implementation and plan_call says so; the kernel planner stops at its device check ----


def _transposed(shape, dtype=BF16):
    """shape [B, T, H, X] as a non-contiguous transpose of a [B, H, T, X] tensor."""
    B, T, H, X = shape
    return torch.randn(B, H, T, X).to(dtype).transpose(1, 2)


def _every_other(shape, dtype=BF16):
    """x[..., ::2] of a tensor twice as wide in the last dim."""
    return torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]


def _offset(shape, dtype=BF16):
    """flat[1:].view(shape): contiguous, data pointer one element past an aligned one."""
    n = math.prod(shape)
    return torch.randn(n + 1).to(dtype)[1:].view(shape)


def _numpy_call() -> dict:
    kw = call(dtype=F32)
    return {key: val.numpy() for key, val in kw.items()}


VALID: list[tuple[str, Callable[[], dict]]] = [
    ("plain", call),
    ("q transposed view", lambda: {**call(), "q": _transposed((B_, T_, H_, K_))}),
    ("k [..., ::2]", lambda: {**call(), "k": _every_other((B_, T_, H_, K_))}),
    ("dv [..., ::2]", lambda: {**call(), "dv": _every_other((B_, T_, HV_, V_))}),
    ("w offset by 2 bytes", lambda: {**call(), "w": _offset((B_, T_, HV_, K_))}),
    ("gk offset by 4 bytes", lambda: {**call(), "gk": _offset((B_, T_, HV_, K_), F32)}),
    ("dht offset by 4 bytes", lambda: {**call(), "dht": _offset((B_, HV_, K_, V_), F32)}),
    ("dht.mT.contiguous().mT", lambda: {**call(), "dht": call()["dht"].mT.contiguous().mT}),
    (
        "do expanded along T (stride 0)",
        lambda: {**call(), "do": tensor_of((B_, 1, HV_, V_)).expand(B_, T_, HV_, V_)},
    ),
    ("every tensor a numpy float32 array", _numpy_call),
    ("q requires grad", lambda: {**call(), "q": call()["q"].requires_grad_()}),
    ("w an nn.Parameter", lambda: {**call(), "w": torch.nn.Parameter(call()["w"])}),
    (
        "k a Tensor subclass that requires grad",
        lambda: {**call(), "k": call()["k"].requires_grad_().as_subclass(Sub)},
    ),
    ("h0 float64 (only its presence matters)", lambda: {**call(), "h0": call()["h0"].double()}),
    ("h0 bfloat16", lambda: {**call(), "h0": call()["h0"].bfloat16()}),
    (
        "do, dv float32 with q bfloat16 (fla takes it)",
        lambda: {**call(), "do": call()["do"].float(), "dv": call()["dv"].float()},
    ),
    ("K == 256", lambda: call(K=256, V=64)),
    ("K == 1, V == 1, T == 1", lambda: call(T=1, K=1, V=1)),
    ("GVA: H=1, HV=4", lambda: call(H=1)),
    ("g gate", lambda: call(gate="g")),
    ("no gate, no h0, no dht", lambda: {k: v for k, v in call(gate=None).items() if k not in ("h0", "dht")}),
    (
        "state_v_first with [N, HV, V, K] states",
        lambda: {**call(), "state_v_first": True, "h0": call()["h0"].mT, "dht": call()["dht"].mT},
    ),
    ("state_v_first numpy bool", lambda: {**call(), "state_v_first": np.False_}),
    ("state_v_first None", lambda: {**call(), "state_v_first": None}),
    ("varlen", varlen_call),
    (
        "varlen int32 cu_seqlens and chunk_offsets [N]",
        lambda: varlen_call(
            cu_seqlens=torch.tensor([0, 30, 70, 100], dtype=torch.int32),
            chunk_offsets=torch.tensor([0, 1, 2], dtype=torch.int32),
        ),
    ),
    (
        "varlen strided cu_seqlens",
        lambda: varlen_call(cu_seqlens=torch.tensor([0, 9, 30, 9, 70, 9, 100, 9])[::2]),
    ),
    (
        "chunk_offsets without cu_seqlens is ignored, as fla does",
        lambda: {**call(), "chunk_offsets": "ignored"},
    ),
    ("scale an int", lambda: {**call(), "scale": 1}),
    ("scale a numpy float", lambda: {**call(), "scale": np.float32(0.125)}),
    ("scale a 0-d tensor", lambda: {**call(), "scale": torch.tensor(0.125)}),
    ("scale negative, zero", lambda: {**call(), "scale": -0.0}),
    ("chunk_size 32 (fla takes other chunk sizes)", lambda: {**call(), "chunk_size": 32}),
    ("chunk_size a numpy int", lambda: {**call(), "chunk_size": np.int64(64)}),
]


@pytest.mark.parametrize("make", [m for _, m in VALID], ids=[i for i, _ in VALID])
def test_valid_input_passes_validate(make):
    kw = make()
    snap = _snapshot(kw)
    assert _core.validate(**kw) is None
    _assert_unchanged(kw, snap)


@pytest.mark.parametrize("make", [m for _, m in VALID], ids=[i for i, _ in VALID])
def test_valid_cpu_input_runs_on_the_cpu_and_stops_at_the_kernels_device_check(make):
    """Valid input in host memory runs on the CPU (the Rust core's CPU path; chunk_size
    other than 64 is the one thing it refuses, by name), and plan_call says so; the
    kernel's planner stops at its device check; the caller's tensors are never modified."""
    kw = make()
    snap = _snapshot(kw)
    if kw.get("chunk_size", 64) not in (64, None) and not isinstance(kw.get("chunk_size"), bool):
        with pytest.raises(ValueError, match=r"^chunk_size: the CPU path takes 64"):
            kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)
        ok, reason = kda_dhu.plan_call(**kw)
        assert ok is False and reason.startswith("ValueError: chunk_size: the CPU path takes 64"), reason
    else:
        dh, dh0, dv2 = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)
        assert tuple(dv2.shape) == tuple(kw["dv"].shape)
        assert (dh0 is None) == (kw.get("h0") is None)
        assert np.isfinite(np.asarray(dv2.float() if isinstance(dv2, torch.Tensor) else dv2)).all()
        ok, reason = kda_dhu.plan_call(**kw)
        assert ok is False and reason.startswith("cpu: "), reason
    if kw.get("chunk_size", 64) not in (64, None) and not isinstance(kw.get("chunk_size"), bool):
        with pytest.raises(ValueError, match=r"^chunk_size: the CPU path takes 64"):
            _core.decide("capable", **kw)
    else:  # the one decision of a call in host memory: kda-dhu's CPU implementation
        assert _core.decide("capable", **kw).action == "cpu"
    _assert_unchanged(kw, snap)


def test_plan_rule_names_the_choices():
    for fn in (_core.decide,):
        with pytest.raises(
            ValueError, match=r"^rule: expected 'b2a', 'extended' or 'capable', got \"fast\"$"
        ):
            fn("fast", **call())


# A dtype the other tensors of a call do not share, by the argument's own: one fla takes
# for the 16-bit tensors (float32), a 16-bit one for the float32 tensors, a float one
# for the tables; h0 takes any float dtype, so an integer one.
_ODD = {BF16: F32, F32: BF16, torch.int64: F32}


@pytest.mark.parametrize(
    "base, name",
    [("dense gk", n) for n in ("q", "k", "w", "do", "dv", "gk", "h0", "dht")]
    + [("packed g", n) for n in ("g", "cu_seqlens", "chunk_indices", "chunk_offsets")],
)
def test_the_odd_dtype_out_is_named(base, name):
    """Every tensor argument given a dtype the others of its call do not have: the error
    names that argument, on every entry point (validate, the call, plan_call)."""
    if base == "dense gk":
        kw = call()
    else:
        kw = varlen_call(g=-tensor_of((1, T_, HV_), F32).abs(), gk=None)
        kw["chunk_indices"] = torch.tensor([[0, 0], [1, 0], [2, 0]])  # 30, 40, 30 tokens: a chunk each
        kw["chunk_offsets"] = torch.tensor([0, 1, 2, 3])
    x = kw[name]
    kw[name] = x.to(torch.int32 if name == "h0" else _ODD[x.dtype])
    pattern = rf"^{name}: expected "
    with pytest.raises(TypeError, match=pattern):
        _core.validate(**kw)
    with pytest.raises(TypeError, match=pattern):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)
    ok, reason = kda_dhu.plan_call(**kw)
    assert ok is False and re.match(rf"TypeError: {name}: expected ", reason), reason


def test_plan_call_and_plan_b2a_say_what_runs_for_host_inputs():
    """CPU tensors: the verdict names kda-dhu's CPU implementation (what the call runs),
    and bad input is a verdict, not an exception, from both planners."""
    kw = call()
    for ok, reason in (
        kda_dhu.plan_call(**kw),
        kda_dhu.plan_b2a(
            kw["q"], kw["k"], kw["w"], kw["gk"], kw["h0"], kw["dht"], kw["do"], kw["dv"], 0.125, 64
        ),
    ):
        assert ok is False and reason.startswith("cpu: ") and "CPU implementation" in reason, reason
    bad = {**kw, "dv": kw["dv"][..., :3]}
    ok, reason = kda_dhu.plan_call(**bad)
    assert ok is False and reason.startswith("ValueError: dv: expected shape"), reason
    ok, reason = kda_dhu.plan_b2a(
        bad["q"], bad["k"], bad["w"], bad["gk"], bad["h0"], bad["dht"], bad["do"], bad["dv"], 0.125, 64
    )
    assert ok is False and reason.startswith("ValueError: dv: expected shape"), reason
    ok, reason = kda_dhu.plan_call(**{**kw, "chunk_size": 32})
    assert ok is False and reason == "ValueError: chunk_size: the CPU path takes 64, got 32", reason


def test_force_env_is_read_at_every_call(monkeypatch):
    """KDA_DHU_FORCE is read (by the core's one reader of every switch) at each use: set,
    changed, unset."""
    monkeypatch.delenv(_dispatch.FORCE_ENV, raising=False)
    assert _core.force() is None
    monkeypatch.setenv(_dispatch.FORCE_ENV, " Kernel ")
    assert _core.force() == "kernel"
    os.environ[_dispatch.FORCE_ENV] = "fla"
    assert _core.force() == "fla"
    for unset in ("", "0", "auto"):
        monkeypatch.setenv(_dispatch.FORCE_ENV, unset)
        assert _core.force() is None
    monkeypatch.delenv(_dispatch.FORCE_ENV)
    assert _core.force() is None
    names = [name for name, _, _ in _core.switches()]
    assert _dispatch.FORCE_ENV in names and "KDA_DHU_CHECK_INPUTS" in names


def test_descriptor_cache_starts_empty_with_its_bound():
    """The cache's counters and bound as a CPU process sees them (nothing fills it without
    a GPU; tests/gpu/test_gpu_host.py fills and clears it on one)."""
    _core.tma_cache_clear()
    info = _core.tma_cache_info()
    assert info == {"hits": 0, "misses": 0, "evictions": 0, "size": 0, "capacity": _core.TMA_CACHE_CAPACITY}
    assert _core.TMA_CACHE_CAPACITY == 64


def test_force_env_with_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(_dispatch.FORCE_ENV, "bogus")
    with pytest.raises(
        ValueError, match=r"^KDA_DHU_FORCE: expected 'kernel', 'fla' or unset, got \"bogus\"$"
    ):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**call())
    with pytest.raises(ValueError, match=r"^KDA_DHU_FORCE: "):
        _core.force()


def test_force_fla_still_validates(monkeypatch):
    """KDA_DHU_FORCE=fla skips the planner, not the input checks."""
    monkeypatch.setenv(_dispatch.FORCE_ENV, "fla")
    kw = {**call(), "dht": tensor_of((B_, HV_, K_, V_), BF16)}
    with pytest.raises(TypeError, match=r"^dht: expected dtype float32, got bfloat16$"):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)


def test_a_consumed_capsule_is_refused():
    """An object that hands out the same capsule twice: the second read is an error."""
    kw = call()
    cap = kw["q"].__dlpack__()

    class Same:
        def __dlpack__(self, *args, **kwargs):
            return cap

    kw["q"] = Same()
    _core.validate(**kw)
    with pytest.raises(ValueError, match=r"^q: __dlpack__\(\) returned a capsule that was already consumed$"):
        _core.validate(**kw)


# ---- broken DLPack producers (ctypes), in a subprocess: a crash fails one test ----

_PRODUCER = r'''
import ctypes, json, sys, warnings
warnings.filterwarnings("ignore")
import torch
import kda_dhu._core as core

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]
class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]
class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]
class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]
class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]
class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]

new_capsule = ctypes.pythonapi.PyCapsule_New
new_capsule.restype = ctypes.py_object
new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

class Producer:
    """Describes memory it does not own (never read: validation reads metadata only)."""
    def __init__(self, shape, strides=None, code=2, bits=32, device=(1, 0), ndim=None,
                 null_shape=False, name=b"dltensor", version=None):
        n = len(shape)
        self.shape = (ctypes.c_int64 * max(n, 1))(*shape)
        self.strides = (ctypes.c_int64 * max(n, 1))(*strides) if strides else None
        self.name = ctypes.create_string_buffer(name)
        self.mt = DLManagedTensorVersioned() if version else DLManagedTensor()
        if version:
            self.mt.version = DLPackVersion(*version)
        t = self.mt.dl_tensor
        t.data = 0x100000
        t.device = DLDevice(*device)
        t.ndim = n if ndim is None else ndim
        t.dtype = DLDataType(code, bits, 1)
        if not null_shape:
            t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            t.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
    def __dlpack__(self, *args, **kwargs):
        return new_capsule(ctypes.addressof(self.mt), ctypes.addressof(self.name), None)

B, T, H, HV, K, V = 2, 100, 2, 4, 64, 128
def base():
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s).to(dt)
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), w=r(B, T, HV, K), do=r(B, T, HV, V), dv=r(B, T, HV, V),
                gk=r(B, T, HV, K, dt=torch.float32), dht=r(B, HV, K, V, dt=torch.float32))

F32 = dict(code=2, bits=32)
cases = {
    "gk by ctypes (sanity)": dict(gk=Producer([B, T, HV, K], **F32)),
    "gk negative strides": dict(gk=Producer([B, T, HV, K], strides=[-T * HV * K, HV * K, K, 1], **F32)),
    "gk negative extent": dict(gk=Producer([B, -T, HV, K], **F32)),
    "w negative HV": dict(w=Producer([B, T, -4, K], code=4, bits=16)),
    "q ndim -1": dict(q=Producer([B, T, H, K], code=4, bits=16, ndim=-1)),
    "q ndim 1000000": dict(q=Producer([B, T, H, K], code=4, bits=16, ndim=1000000)),
    "q NULL shape": dict(q=Producer([B, T, H, K], code=4, bits=16, null_shape=True)),
    "q 0-D, NULL shape": dict(q=Producer([], code=4, bits=16, null_shape=True)),
    "q capsule named 'foo'": dict(q=Producer([B, T, H, K], code=4, bits=16, name=b"foo")),
    "q capsule named 'used_dltensor'": dict(q=Producer([B, T, H, K], code=4, bits=16, name=b"used_dltensor")),
    "q DLPack 2.0 (versioned)": dict(q=Producer([B, T, H, K], code=4, bits=16, name=b"dltensor_versioned",
                                                version=(2, 0))),
    "q DLPack 1.1 (versioned)": dict(q=Producer([B, T, H, K], code=4, bits=16, name=b"dltensor_versioned",
                                                version=(1, 1))),
    "q float8_e5m2": dict(q=Producer([B, T, H, K], code=12, bits=8)),
    "q opaque handle": dict(q=Producer([B, T, H, K], code=3, bits=64)),
    "dht byte size past int64": dict(dht=Producer([2**40, 2**40, K, V], **F32)),
    "dht on ROCm (plan)": dict(dht=Producer([B, HV, K, V], device=(10, 0), **F32)),
}
out = {}
for name, over in cases.items():
    fn = core.decide if name.endswith("(plan)") else core.validate
    args = ("extended",) if fn is core.decide else ()
    kw = {**base(), **over}
    if fn is core.decide:  # every tensor on "cuda:0" except the one under test
        kw = {k: (v if k in over else Producer(list(v.shape), code=(4 if v.dtype == torch.bfloat16 else 2),
                                                 bits=(16 if v.dtype == torch.bfloat16 else 32), device=(2, 0)))
              for k, v in kw.items()}
    try:
        fn(*args, **kw)
        out[name] = ["ok", ""]
    except BaseException as e:
        out[name] = [type(e).__name__, str(e)]
print(json.dumps(out))
'''

PRODUCER_EXPECT = {
    "gk by ctypes (sanity)": ("ok", r"^$"),
    "gk negative strides": (
        "ValueError",
        r"^gk: expected non-negative strides, got strides \[-25600, 256, 64, 1\]$",
    ),
    "gk negative extent": (
        "ValueError",
        r"^gk: expected non-negative extents whose size in bytes fits in int64, got shape "
        r"\[2, -100, 4, 64\]$",
    ),
    "w negative HV": ("ValueError", r"^w: expected non-negative extents whose size in bytes fits in int64"),
    "q ndim -1": ("ValueError", r"^q: expected 0 <= ndim <= 64 from DLPack, got ndim = -1$"),
    "q ndim 1000000": ("ValueError", r"^q: expected 0 <= ndim <= 64 from DLPack, got ndim = 1000000$"),
    "q NULL shape": ("ValueError", r"^q: DLPack shape pointer is NULL for a 4-D tensor$"),
    "q 0-D, NULL shape": ("ValueError", r"^q: expected a 4-D tensor \[B, T, H, K\], got shape \[\]$"),
    "q capsule named 'foo'": (
        "ValueError",
        r"^q: __dlpack__\(\) returned a capsule named \"foo\", expected \"dltensor\"$",
    ),
    "q capsule named 'used_dltensor'": (
        "ValueError",
        r"^q: __dlpack__\(\) returned a capsule that was already consumed$",
    ),
    "q DLPack 2.0 (versioned)": (
        "ValueError",
        r"^q: __dlpack__\(\) returned a DLPack 2.0 tensor, expected DLPack 1.x or the "
        r"legacy capsule$",
    ),
    "q DLPack 1.1 (versioned)": ("ok", r"^$"),
    "q float8_e5m2": ("TypeError", r"^q: expected dtype bfloat16, float16 or float32, got float8_e5m2$"),
    "q opaque handle": ("TypeError", r"^q: expected dtype bfloat16, float16 or float32, got opaque handle$"),
    "dht byte size past int64": (
        "ValueError",
        r"^dht: expected non-negative extents whose size in bytes fits in int64, got shape "
        r"\[1099511627776, 1099511627776, 64, 128\]$",
    ),
    "dht on ROCm (plan)": ("ValueError", r"^dht: expected a CUDA tensor, got a tensor on rocm:0$"),
}


@pytest.fixture(scope="module")
def producer_results():
    env = {**os.environ, "KDA_DHU_NO_AUTOREGISTER": "1", "RUST_BACKTRACE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PRODUCER)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, f"the interpreter died (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    assert "panicked" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(PRODUCER_EXPECT))
def test_broken_dlpack_producers(producer_results, name):
    exc, pattern = PRODUCER_EXPECT[name]
    got_exc, got_msg = producer_results[name]
    assert got_exc == exc, (got_exc, got_msg)
    assert re.search(pattern, got_msg), got_msg


# ---- cu_seqlens' values: the one checker (src/varlen.rs), as the host check runs it ----


@pytest.mark.parametrize(
    "cu, T, match",
    [
        ([1, 50, 200], 200, r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 1$"),
        ([5, 5], 200, r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 5$"),
        (
            [0, 120, 50, 200],
            200,
            r"^cu_seqlens: expected non-negative, non-decreasing offsets, got cu_seqlens\[1\] = 120 > cu_seqlens\[2\] = 50$",
        ),
        (
            [0, -5, 10],
            200,
            r"^cu_seqlens: expected non-negative, non-decreasing offsets, got cu_seqlens\[0\] = 0 > cu_seqlens\[1\] = -5$",
        ),
        ([0, 50, 300], 200, r"^cu_seqlens: expected cu_seqlens\[2\] <= T = 200, got 300$"),
        ([0, 201], 200, r"^cu_seqlens: expected cu_seqlens\[1\] <= T = 200, got 201$"),
    ],
)
def test_check_tables_rejects_bad_offsets(cu, T, match):
    with pytest.raises(ValueError, match=match):
        _core.check_tables(cu, T)


@pytest.mark.parametrize(
    "cu, T, offsets",
    [
        ([0, 30, 70, 100], 100, [0, 1, 2, 3]),
        ([0, 50, 150], 200, [0, 1, 3]),  # padded packed batch: cu[-1] < T
        ([0, 64, 64, 130], 200, [0, 1, 1, 3]),  # an empty sequence
        ([0, 0], 200, [0, 0]),  # every sequence empty: no chunks
        ([0, 65, 129], 129, [0, 2, 3]),
    ],
)
def test_check_tables_gives_the_chunk_offsets(cu, T, offsets):
    assert _core.check_tables(cu, T) == offsets
    assert _core.check_tables(cu, T, offsets, offsets[-1]) == offsets


def test_check_inputs_raises_bad_values_at_once_on_the_host(monkeypatch):
    """KDA_DHU_CHECK_INPUTS=1: a packed batch's values are read and checked on the host
    before anything runs (on a CPU machine this stops at the device check otherwise)."""
    kw = varlen_call()
    kw["cu_seqlens"] = torch.tensor([0, 30, 10, 100], dtype=torch.int64)
    c = _dispatch._Call(kw["q"], kw["k"], kw["w"], kw["do"], kw["dv"], kw.get("g"), kw.get("gk"), kw.get("h0"),
                        kw.get("dht"), 0.1, False, kw["cu_seqlens"], 64, None, None, False)  # fmt: skip
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected non-negative, non-decreasing offsets"):
        _dispatch._host_check(c, None)


def test_nt_comes_from_chunk_indices_without_reading_values():
    """A packed batch with chunk_indices: NT is its length, known on the host with no read
    of cu_seqlens (whatever its values), and the output shapes follow from it."""
    kw = varlen_call()
    ci = torch.zeros(4, 2, dtype=torch.int32)  # at most ceil(100 / 64) + 3 - 1 = 4 rows
    _core.validate(**kw, chunk_indices=ci)
    with pytest.raises(ValueError, match=r"^chunk_indices: expected shape \[NT, 2\]"):
        _core.validate(**kw, chunk_indices=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"^chunk_indices: expected dtype int64 or int32"):
        _core.validate(**kw, chunk_indices=torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"^chunk_indices: expected at most"):
        _core.validate(**kw, chunk_indices=torch.zeros(10**6, 2, dtype=torch.int32))


# ---------------------------------------------------- found by breaking the checks


def test_zero_tensor_without_memory_is_refused_by_name():
    """torch's ZeroTensor exports a null data pointer: a kernel would read address 0."""
    make = getattr(torch, "_efficientzerotensor", None)
    if make is None:
        pytest.skip("this torch has no _efficientzerotensor")
    kw = call()
    kw["gk"] = make(kw["gk"].shape, dtype=F32)
    with pytest.raises(ValueError, match=r"^gk: expected a tensor backed by memory, got a null data pointer"):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**kw)
    ok, reason = kda_dhu.plan_call(**kw)
    assert not ok and reason.startswith("ValueError: gk: expected a tensor backed by memory")


@pytest.mark.parametrize(
    "scale, kind",
    [
        (np.complex128(1 + 1j), "complex128"),
        (np.complex64(1), "complex64"),
        (torch.tensor([0.5 + 0j]), "Tensor"),
        (True, "bool"),
        (np.bool_(True), "bool"),
    ],
)
def test_complex_and_bool_scales_are_refused(scale, kind):
    with pytest.raises(TypeError, match=r"^scale: expected a float or None, got "):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**{**call(), "scale": scale})


@pytest.mark.parametrize(
    "scale",
    [0.125, 1, np.float32(0.125), np.float64(0.125), np.int64(1), torch.tensor(0.125), torch.tensor([0.125])],
)
def test_real_scales_pass_validation(scale):
    dh, dh0, dv2 = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**{**call(), "scale": scale})  # on the CPU
    assert torch.isfinite(dv2.float()).all()


def test_int32_cu_seqlens_views_are_judged_as_they_are():
    """int32 cu_seqlens is read as int32 (never widened); a view is judged as it is and the
    validator names it (no 64 GB copy of an expanded tensor, no silent acceptance of a
    negated view)."""
    kw = varlen_call()
    huge = torch.zeros(1, dtype=torch.int32).expand(2**33)
    with pytest.raises(ValueError, match=r"^h0: expected shape \[N=8589934591,"):  # judged, not copied
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**{**kw, "cu_seqlens": huge})
    neg = torch.tensor([0, 30, 70, 100], dtype=torch.int32)._neg_view()
    with pytest.raises((TypeError, ValueError), match=r"^cu_seqlens: "):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**{**kw, "cu_seqlens": neg})


def test_bool_chunk_size_is_refused_as_the_custom_op_refuses_it():
    with pytest.raises(TypeError, match=r"^chunk_size: expected an int, got bool$"):
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**{**call(), "chunk_size": True})
    ok, reason = kda_dhu.plan_call(**{**call(), "chunk_size": True})
    assert not ok and reason == "TypeError: chunk_size: expected an int, got bool"


# ------------------------------------------------------- the one-crossing path (_core.run)


def test_run_hands_back_non_plain_tensors_before_reading_them():
    """_core.run (the eager entry points' path without cu_seqlens) reads plain torch
    tensors only: any other object, a subclass included, goes back to the general path
    (None) before its __dlpack__ is called (the general path calls it under the inputs'
    device). Plain CPU tensors are read, and refused at the device check."""
    from kda_dhu import _core

    calls = []

    class Recording(torch.Tensor):
        def __dlpack__(self, *args, **kwargs):
            calls.append("dlpack")
            return super().__dlpack__(*args, **kwargs)

    a = call()
    pos = [a.get(n) for n in ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht")]
    for i in range(len(pos)):
        if pos[i] is None:
            continue
        odd = list(pos)
        odd[i] = odd[i].as_subclass(Recording)
        assert _core.run("extended", *odd, a.get("scale")) is None, i
    assert calls == []
    # plain CPU tensors are read, and handed back decided: the CPU path
    assert _core.run("extended", *pos, a.get("scale")).action == "cpu"


@pytest.mark.parametrize("value", [None, "", "0", " Auto ", "fla", "kernel", "bogus"])
def test_one_crossing_reads_force_once(monkeypatch, value):
    """_core.run reads KDA_DHU_FORCE once, first, as every route does: an invalid value
    raises naming the switch before anything is read; any other value (the unset ones,
    "fla", "kernel") goes on to read and validate the call (a 3-D q is named), the switch
    then part of the one decision (cargo test the_switches_decide_once)."""
    if value is None:
        monkeypatch.delenv(_dispatch.FORCE_ENV, raising=False)
    else:
        monkeypatch.setenv(_dispatch.FORCE_ENV, value)
    a = call()
    pos = [a.get(n) for n in ("q", "k", "w", "do", "dv", "g", "gk", "h0", "dht")]
    pos[0] = pos[0][0]  # 3-D
    match = (
        r"^KDA_DHU_FORCE: expected 'kernel', 'fla' or unset"
        if value == "bogus"
        else r"^q: expected a 4-D tensor"
    )
    with pytest.raises(ValueError, match=match):
        _core.run("extended", *pos, a.get("scale"))


def test_dlpack_intake_is_the_exchange_api_where_torch_has_one():
    """torch >= 2.10 offers DLPack's C exchange API: tensors are read through it (no
    capsules); KDA_DHU_NO_EXCHANGE_API=1 selects the capsule path, which reads the same."""
    from kda_dhu import _core

    _core.validate(**call())  # torch imported and read at least once
    has_api = hasattr(torch._C, "_dlpack_exchange_api") or hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    assert _core.dlpack_intake() == ("exchange" if has_api else "capsule")
    assert _intake_in_a_new_process(KDA_DHU_NO_EXCHANGE_API="1") == "capsule"


def _intake_in_a_new_process(prelude: str = "pass", **env) -> str:
    """``_core.dlpack_intake()`` in a fresh interpreter (torch's exporter is looked up once
    per process) after ``prelude`` ran with torch imported, under these extra variables;
    KDA_DHU_NO_EXCHANGE_API only where given."""
    code = (
        "import torch\n"
        f"{prelude}\n"
        "import kda_dhu; from kda_dhu import _core\n"
        "_core.validate(*[torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)] * 5)\n"
        "print(_core.dlpack_intake())"
    )
    full = {k: v for k, v in os.environ.items() if k != "KDA_DHU_NO_EXCHANGE_API"}
    full.update(KDA_DHU_NO_AUTOREGISTER="1", **env)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(
    not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
    reason="this torch has no class-level DLPack exchange API",
)
@pytest.mark.parametrize("own", ["missing", "not_a_capsule", "raises"])
def test_dlpack_intake_falls_back_to_the_class_attribute(own):
    """Where torch._C._dlpack_exchange_api is missing, returns something else or raises,
    the exchange API still comes from torch.Tensor.__dlpack_c_exchange_api__."""
    patch = {
        "missing": "del torch._C._dlpack_exchange_api"
        if hasattr(torch._C, "_dlpack_exchange_api")
        else "pass",
        "not_a_capsule": "torch._C._dlpack_exchange_api = lambda: 42",
        "raises": "torch._C._dlpack_exchange_api = lambda: 1 / 0",
    }[own]
    assert _intake_in_a_new_process(patch) == "exchange"
