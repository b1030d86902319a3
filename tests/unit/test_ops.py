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


# ---- the forward scan's op, torch.ops.kda_dhu.chunk_gated_delta_rule_fwd_h


def _fwd_args(rng, **kw):
    a = _args(rng, **kw)
    return dict(
        k=a["k"], w=a["w"], u=a["dv"], g=a["g"], gk=a["gk"], initial_state=a["dht"],
        state_v_first=a["state_v_first"], cu_seqlens=a["cu_seqlens"],
    )  # fmt: skip


@pytest.mark.parametrize("save_new_value, output_final_state", [(True, True), (False, False), (True, False)])
def test_fwd_h_op_cpu_matches_the_eager_function(rng, save_new_value, output_final_state):
    import kda_dhu

    a = _fwd_args(rng)
    kw = dict(save_new_value=save_new_value, output_final_state=output_final_state)
    eager = kda_dhu.chunk_gated_delta_rule_fwd_h(**a, **kw)
    op = ops.chunk_gated_delta_rule_fwd_h_op(**a, **kw)
    assert (op[1] is None) is (not save_new_value) and (op[2] is None) is (not output_final_state)
    for x, y in zip(eager, op):
        assert (x is None and y is None) or torch.equal(x, y)


def test_fwd_h_opcheck(rng):
    a = _fwd_args(rng, T=70, state_v_first=True)
    args = (
        a["k"],
        a["w"],
        a["u"],
        a["g"],
        a["gk"],
        a["initial_state"],
        True,
        True,
        True,
        None,
        None,
        None,
        None,
    )
    torch.library.opcheck(
        torch.ops.kda_dhu.chunk_gated_delta_rule_fwd_h.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("gate", ["gk", "g", None])
def test_fwd_h_compile_fullgraph_matches_eager(rng, gate):
    a = _fwd_args(rng, gate=gate)

    def step(k, w, u, g, gk, initial_state):
        h, v_new, final = ops.chunk_gated_delta_rule_fwd_h_op(
            k, w, u, g=g, gk=gk, initial_state=initial_state, output_final_state=True
        )
        return h.float().sum(1), v_new + 1, final * 2

    inputs = (a["k"], a["w"], a["u"], a["g"], a["gk"], a["initial_state"])
    eager = step(*inputs)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(chunk_size=32), ValueError, "chunk_size: the custom op takes 64"),
        (dict(output_final_state=1), TypeError, "output_final_state: expected a bool, got int"),
        (dict(save_new_value="yes"), TypeError, "save_new_value: expected a bool, got str"),
        (dict(state_v_first=None), TypeError, "state_v_first: expected a bool"),
        (dict(w=[1.0]), TypeError, "^w: "),
    ],
)
def test_fwd_h_op_names_bad_arguments(rng, over, exc, match):
    a = _fwd_args(rng)
    with pytest.raises(exc, match=match):
        ops.chunk_gated_delta_rule_fwd_h_op(**{**a, **over})


@pytest.mark.gpu
def test_fwd_h_op_cuda_matches_eager_under_compile_and_a_cuda_graph(rng, monkeypatch):
    """On the kernel (KDA_DHU_FWD_H=on): the op, its torch.compile and a captured CUDA graph
    replayed on new inputs give the eager function's results bit for bit."""
    import kda_dhu
    from kda_dhu import _core

    monkeypatch.setenv("KDA_DHU_FWD_H", "on")
    s4 = make_inputs(2, 256, 4, 4, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng)
    a = dict(k=s4["k"], w=s4["w"], u=s4["dv"], gk=s4["gk"], initial_state=s4["dht"], output_final_state=True)
    before = _core.launch_count()
    eager = kda_dhu.chunk_gated_delta_rule_fwd_h(**a)
    assert _core.launch_count() - before == 1, "the kernel did not run"
    for x, y in zip(eager, ops.chunk_gated_delta_rule_fwd_h_op(**a)):
        assert torch.equal(x, y)
    compiled = torch.compile(lambda: ops.chunk_gated_delta_rule_fwd_h_op(**a), fullgraph=True)()
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)
    static = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.chunk_gated_delta_rule_fwd_h_op(
            **static, output_final_state=True
        )  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.chunk_gated_delta_rule_fwd_h_op(**static, output_final_state=True)
    fresh = make_inputs(2, 256, 4, 4, 128, 128, torch.bfloat16, "gk", device="cuda", generator=rng)
    b = dict(k=fresh["k"], w=fresh["w"], u=fresh["dv"], gk=fresh["gk"], initial_state=fresh["dht"])
    for n, t in b.items():
        static[n].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    want = kda_dhu.chunk_gated_delta_rule_fwd_h(**b, output_final_state=True)
    for x, y in zip(want, out):
        assert torch.equal(x, y)
