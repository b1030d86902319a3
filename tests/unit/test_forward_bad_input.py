"""The forward scan's entry point (``kda_dhu._forward.chunk_gated_delta_rule_fwd_h``) on bad input,
on the CPU: every error names the forward call's argument and the expectation (src/forward.rs
renames stage 4's shared checks), before any implementation runs, and the caller's tensors
are left as they were."""

from __future__ import annotations

import pytest
import torch
from kda_dhu._forward import chunk_gated_delta_rule_fwd_h


def _good(svf: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 2, 128, 2, 4, 128, 64
    state = (B, HV, V, K) if svf else (B, HV, K, V)
    return dict(
        k=torch.randn(B, T, H, K, generator=g).bfloat16(),
        w=torch.randn(B, T, HV, K, generator=g).bfloat16(),
        u=torch.randn(B, T, HV, V, generator=g).bfloat16(),
        gk=-torch.rand(B, T, HV, K, generator=g),
        initial_state=torch.randn(*state, generator=g),
        output_final_state=True,
        state_v_first=svf,
    )


CASES = [
    ("u", lambda a: a.update(u=a["u"][:, :, :3]), ValueError, "u: expected shape [B=2, T=128, HV=4, V=64]"),
    (
        "w dtype",
        lambda a: a.update(w=a["w"].half()),
        TypeError,
        "w: expected dtype bfloat16 like k, got float16",
    ),
    ("k rank", lambda a: a.update(k=a["k"][..., 0]), ValueError, "k: expected a 4-D tensor [B, T, H, K]"),
    (
        "heads",
        lambda a: a.update(k=a["k"][:, :, :1].expand(2, 128, 3, 128)),
        ValueError,
        "w: expected HV (dim 2) to be a positive multiple of H=3 (k's heads)",
    ),
    (
        "initial_state",
        lambda a: a.update(initial_state=a["initial_state"].transpose(-1, -2)),
        ValueError,
        "initial_state: expected shape [N=2, HV=4, K=128, V=64]",
    ),
    ("gk dtype", lambda a: a.update(gk=a["gk"].bfloat16()), TypeError, "gk: expected dtype float32"),
    (
        "flag",
        lambda a: a.update(output_final_state="yes"),
        TypeError,
        "output_final_state: expected a bool, got",
    ),
    ("save", lambda a: a.update(save_new_value=2.5), TypeError, "save_new_value: expected a bool, got"),
    ("chunk_size", lambda a: a.update(chunk_size=64.0), TypeError, "chunk_size: expected an int, got"),
    ("not a tensor", lambda a: a.update(u=[1, 2]), TypeError, "u: expected a tensor"),
]


@pytest.mark.parametrize("name, change, exc, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(name, change, exc, message):
    a = _good()
    change(a)
    before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc) as info:
        chunk_gated_delta_rule_fwd_h(**a)
    assert str(info.value).startswith(message), str(info.value)
    for n, t in before.items():
        assert torch.equal(a[n], t), f"{n} was modified"


def test_state_v_first_s_initial_state_is_v_before_k():
    a = _good(svf=True)
    a["initial_state"] = a["initial_state"].transpose(-1, -2).contiguous()
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \[N=2, HV=4, V=64, K=128\]"):
        chunk_gated_delta_rule_fwd_h(**a)


@pytest.mark.parametrize(
    "save, final, svf", [(True, True, False), (False, False, True), (True, False, False)]
)
def test_host_inputs_run_the_cpu_path_in_fla_s_dtypes(save, final, svf):
    """Inputs in host memory: the float64 recurrence with fla's casts, outputs in fla's
    dtypes and None where fla returns None; against the reference itself rounded."""
    from kda_dhu.reference import chunk_gated_delta_rule_fwd_h_ref, rel_err

    a = _good(svf=svf)
    a.update(output_final_state=final, save_new_value=save)
    h, v_new, fs = chunk_gated_delta_rule_fwd_h(**a)
    ref = chunk_gated_delta_rule_fwd_h_ref(**a, emulate_rounding=True)
    assert h.dtype == torch.bfloat16 and h.shape == ref[0].shape
    assert rel_err(h, ref[0]) < 4e-3
    assert (v_new is None) == (not save) and (fs is None) == (not final)
    if save:
        assert v_new.dtype == torch.bfloat16 and rel_err(v_new, ref[1]) < 4e-3
    if final:
        assert fs.dtype == torch.float32 and rel_err(fs, ref[2]) < 1e-6
