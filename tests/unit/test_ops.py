"""The torch custom op: schema, fake implementation and torch.compile(fullgraph=True).

CPU: the op's CPU implementation is the float64 reference cast to the output dtypes, so
these run without a GPU; the GPU test checks the op against the eager dispatcher."""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs
from kda_dhu import ops
from kda_dhu.reference import chunk_gated_delta_rule_bwd_dhu_ref, rel_err


def _args(rng, **kw):
    a = make_inputs(
        kw.pop("B", 2),
        kw.pop("T", 130),
        2,
        2,
        16,
        32,
        torch.bfloat16,
        kw.pop("gate", "gk"),
        generator=rng,
        **kw,
    )
    a.pop("chunk_size")
    return a


def test_op_cpu_matches_reference(rng):
    a = _args(rng)
    dh, dh0, dv2 = ops.chunk_gated_delta_rule_bwd_dhu_op(**a)
    ref = chunk_gated_delta_rule_bwd_dhu_ref(**a)
    assert dh.dtype == torch.bfloat16 and dv2.dtype == torch.bfloat16 and dh0.dtype == torch.float32
    for out, r in zip((dh, dh0, dv2), ref):
        assert rel_err(out, r) < 1e-2


def test_op_returns_none_without_h0(rng):
    a = _args(rng, h0=False)
    assert ops.chunk_gated_delta_rule_bwd_dhu_op(**a)[1] is None


def test_opcheck(rng):
    a = _args(rng, T=70)
    args = (
        a["q"],
        a["k"],
        a["w"],
        a["do"],
        a["dv"],
        a["g"],
        a["gk"],
        a["h0"],
        a["dht"],
        a["scale"],
        False,
        None,
        None,
        None,
    )
    torch.library.opcheck(
        torch.ops.kda_dhu.chunk_gated_delta_rule_bwd_dhu.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


def test_compile_fullgraph_with_scale_an_argument(rng):
    """scale as an argument of the compiled function (dynamo may not specialize it): the
    op's scalar checks must trace (a string test on type(scale).__name__ did not)."""
    a = _args(rng)

    def step(q, k, w, do, dv, gk, h0, dht, scale):
        dh, dh0, dv2 = ops.chunk_gated_delta_rule_bwd_dhu_op(
            q, k, w, do, dv, gk=gk, h0=h0, dht=dht, scale=scale
        )
        return dh, dh0, dv2

    inputs = (a["q"], a["k"], a["w"], a["do"], a["dv"], a["gk"], a["h0"], a["dht"])
    compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
    for scale in (a["scale"], 0.5):  # a second value: dynamo re-traces or generalizes
        eager = step(*inputs, scale)
        compiled = compiled_step(*inputs, scale)
        for x, y in zip(eager, compiled):
            assert torch.equal(x, y)
    # not checked while tracing: the op's implementation refuses it when the graph runs
    with pytest.raises(Exception, match=r"scale: expected a finite float"):
        compiled_step(*inputs, float("inf"))


@pytest.mark.parametrize("gate", ["gk", "g", None])
def test_compile_fullgraph_matches_eager(rng, gate):
    a = _args(rng, gate=gate)

    def step(q, k, w, do, dv, g, gk, h0, dht):
        dh, dh0, dv2 = ops.chunk_gated_delta_rule_bwd_dhu_op(
            q, k, w, do, dv, g=g, gk=gk, h0=h0, dht=dht, scale=a["scale"]
        )
        return dh.float().sum(1), dh0 * 2, dv2 + 1

    inputs = (a["q"], a["k"], a["w"], a["do"], a["dv"], a["g"], a["gk"], a["h0"], a["dht"])
    eager = step(*inputs)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_op_cuda_matches_eager_dispatcher(rng):
    import kda_dhu

    a = make_inputs(2, 256, 4, 4, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng)
    a.pop("chunk_size")
    eager = kda_dhu.chunk_gated_delta_rule_bwd_dhu(**a)
    op = ops.chunk_gated_delta_rule_bwd_dhu_op(**a)
    for x, y in zip(eager, op):
        assert torch.equal(x, y)
    compiled = torch.compile(lambda: ops.chunk_gated_delta_rule_bwd_dhu_op(**a), fullgraph=True)()
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)


# Bad scalars reach the op's wrapper before any conversion: the same TypeError / ValueError,
# naming the argument, as the eager function (found by a review that broke the op's CPU path).
@pytest.mark.parametrize(
    "over, exc, match",
    [
        ({"scale": "0.125"}, TypeError, r"^scale: expected a float or None, got str$"),
        ({"scale": b"0.125"}, TypeError, r"^scale: expected a float or None, got bytes$"),
        ({"scale": [0.125]}, TypeError, r"^scale: expected a float or None, got list$"),
        ({"scale": True}, TypeError, r"^scale: expected a float or None, got bool$"),
        ({"scale": 1 + 1j}, TypeError, r"^scale: expected a float or None, got complex$"),
        ({"scale": 10**400}, ValueError, r"^scale: expected a finite float, got int \(too large"),
        ({"scale": float("nan")}, ValueError, r"^scale: expected a finite float, got nan$"),
        ({"scale": torch.tensor(0.1)}, TypeError, r"^scale: .*the custom op takes a Python or numpy float"),
        ({"chunk_size": 64.0}, TypeError, r"^chunk_size: expected an int, got float$"),
        ({"chunk_size": True}, TypeError, r"^chunk_size: expected an int, got bool$"),
        ({"chunk_size": 32}, ValueError, r"^chunk_size: the custom op takes 64, got 32$"),
        ({"state_v_first": 1}, TypeError, r"^state_v_first: expected a bool, got int$"),
        ({"q": None}, (TypeError, ValueError), r"^q: "),
        ({"gk": "x"}, (TypeError, ValueError), r"^gk: "),
    ],
)
def test_op_names_bad_arguments(rng, over, exc, match):
    a = _args(rng)
    with pytest.raises(exc, match=match):
        ops.chunk_gated_delta_rule_bwd_dhu_op(**{**a, **over})


def test_op_accepts_numpy_scalars(rng):
    np = pytest.importorskip("numpy")
    a = _args(rng)
    ref = ops.chunk_gated_delta_rule_bwd_dhu_op(**a)
    out = ops.chunk_gated_delta_rule_bwd_dhu_op(
        **{**a, "scale": np.float32(a["scale"]), "state_v_first": np.False_, "chunk_size": np.int64(64)}
    )
    for x, y in zip(out, ref):
        assert torch.allclose(x.float(), y.float(), rtol=1e-6, atol=0)


def test_op_cpu_checks_cu_seqlens_values_and_the_callers_chunk_offsets(rng):
    a = make_inputs(1, None, 1, 1, 16, 32, torch.bfloat16, "gk", varlen_lengths=[30, 34], generator=rng)
    a.pop("chunk_size")
    good = ops.chunk_gated_delta_rule_bwd_dhu_op(**a)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected cu_seqlens\[0\] == 0, got 5$"):
        ops.chunk_gated_delta_rule_bwd_dhu_op(**{**a, "cu_seqlens": torch.tensor([5, 30, 64])})
    # both sequences on chunk 0: a wrong table of N + 1 offsets is an error naming it (the
    # CUDA path checks it on the device), fla's own table is taken, a table of N is not used
    with pytest.raises(ValueError, match=r"^chunk_offsets: expected the chunk offsets of cu_seqlens"):
        ops.chunk_gated_delta_rule_bwd_dhu_op(**{**a, "chunk_offsets": torch.tensor([0, 0, 1])})
    for table in ([0, 1, 2], [0, 5]):
        same = ops.chunk_gated_delta_rule_bwd_dhu_op(**{**a, "chunk_offsets": torch.tensor(table)})
        for x, y in zip(same, good):
            assert torch.equal(x, y)
