"""GPU: fla's training steps with kda-dhu's backend add no host synchronization.

fla's ``chunk_kda`` (KDA) and ``chunk_gated_delta_rule`` (GDN), a packed batch, forward
and backward with kda-dhu registered in fla's backend registry (fla's backward passes
stage 4 its chunk_indices, so no call needs cu_seqlens' values on the host):

- stage 4 (fla's call in the op's backward module, through fla's registry) returns while
  a ~0.2 s sleep kernel is still queued ahead of it, under torch's sync debug mode
  "error", and runs kda-dhu's kernel once (the verifier accepts);
- the whole backward makes no more synchronizing torch calls with kda-dhu on than off
  (fla's forward may read cu_seqlens for its own reasons: not measured), and none at all
  where fla's own backward makes none;
- the gradients match the backend-off ones.

GDN is skipped, with fla's own error, where fla 0.6 refuses its backward (Hopper with
Triton >= 3.4 and < 3.7.1).

Cost: fla compiles and tunes KDA's (GDN's) forward and backward kernels on first use. With
a Triton cache from an earlier run of benches/e2e.py (the same head and state sizes) that
is tens of seconds per op; on a fresh machine minutes (benches/e2e.py measured ~250 s for
its shapes): run this file where that fits (its tests carry a 600 s limit where
pytest-timeout is installed), e.g. after the e2e stage, or deselect it from a shard run
with a tight cap.

    python -m pytest tests/gpu/test_gpu_fla_step.py -q -m gpu
"""

from __future__ import annotations

import importlib
import importlib.util

import kda_dhu
import pytest
import torch
from helpers import SLEEP_CYCLES, count_syncs, register_or_skip, sync_debug
from kda_dhu import _core
from kda_dhu.reference import rel_err
from kda_dhu.testing import KernelProbe, backend_mode

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# fla's kernels compile and autotune on first use: a longer limit where pytest-timeout is
# installed (the GPU runs pass --timeout).
_slow = pytest.mark.timeout(600) if importlib.util.find_spec("pytest_timeout") else (lambda f: f)


@pytest.fixture(autouse=True)
def _hopper_and_no_switches(no_switches):
    """kda-dhu's sm_90a kernel behind fla's registry; no environment switch set."""
    if _core.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("needs an sm_90 device (H100 / H200)")
    yield
    kda_dhu.check_errors()


def _fla_step_inputs(op: str, rng):
    """fla's tests' draw (benches/e2e.py): q, k, v ~ N(0, 1) bf16 (use_qk_l2norm_in_kernel),
    log-space gates logsigmoid(N(0, 1)) / 16 fp32, beta = sigmoid(N(0, 1)) bf16, h0 and
    dht ~ N(0, 1) fp32; a packed batch of 5 documents (one of a single token), 32 heads of
    K = V = 128 (benches/e2e.py's packed shape, shorter: its compiled kernels serve both)."""
    import torch.nn.functional as F

    lengths = [300, 1024, 64, 1, 700]
    T, H, K, V = sum(lengths), 32, 128, 128
    N = len(lengths)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=rng).to(device="cuda", dtype=dt)

    g_shape = (1, T, H, K) if op == "kda" else (1, T, H)
    leaves = dict(
        q=randn(1, T, H, K, dt=BF16),
        k=randn(1, T, H, K, dt=BF16),
        v=randn(1, T, H, V, dt=BF16),
        g=F.logsigmoid(randn(*g_shape)) / 16,
        beta=randn(1, T, H).sigmoid().to(BF16),
        initial_state=randn(N, H, K, V),
    )
    for t in leaves.values():
        t.requires_grad_(True)
    grads_out = (randn(1, T, H, V, dt=BF16), randn(N, H, K, V))
    cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return leaves, grads_out, cu_cpu.cuda(), cu_cpu


def _fla_forward(op: str, leaves: dict, cu, cu_cpu):
    """fla's op forward, training-style (autograd recording): (o, final state)."""
    kw = dict(
        scale=None,
        initial_state=leaves["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    args = (leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"])
    if op == "kda":
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    return fn(*args, **kw)


BACKWARD_MODULE = {"kda": "fla.ops.kda.chunk_bwd", "gdn": "fla.ops.gated_delta_rule.chunk"}


@_slow
@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_fla_training_step_stage4_does_not_synchronize(rng, monkeypatch, op):
    """fla's chunk_kda (KDA) / chunk_gated_delta_rule (GDN), varlen, forward and backward
    with kda-dhu's backend on: stage 4 (fla's call in the op's backward module, through
    fla's registry) returns behind a queued sleep under sync debug mode "error", and runs
    kda-dhu's kernel once; the whole backward makes no more synchronizing torch calls
    with kda-dhu on than off (fla's forward may read cu_seqlens for its own reasons: not
    measured), and none at all when fla's own makes none; the gradients match the
    backend-off ones. GDN is skipped, with fla's error, where fla 0.6 refuses its backward
    (Hopper with Triton >= 3.4 and < 3.7.1). Compiles fla's kernels on first use."""
    register_or_skip()
    module = importlib.import_module(BACKWARD_MODULE[op])
    leaves, grads_out, cu, cu_cpu = _fla_step_inputs(op, rng)
    names = list(leaves)

    def forward():
        return _fla_forward(op, leaves, cu, cu_cpu)

    def backward(o, ht):
        return torch.autograd.grad((o, ht), [leaves[n] for n in names], grads_out)

    # warm-up with the backend off and on (compiles and autotunes fla's kernels)
    for mode in ("fla", "kda_dhu"):
        with backend_mode(mode):
            try:
                backward(*forward())
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - fla's refusal is the skip reason
                if op == "gdn" and mode == "fla":
                    import triton

                    pytest.skip(
                        f"fla refuses GDN's backward here: {type(err).__name__}: {err} "
                        f"(Triton {triton.__version__}, {torch.cuda.get_device_name()})"
                    )
                raise

    # stage 4 alone: behind a sleep, under "error"
    original = module.chunk_gated_delta_rule_bwd_dhu
    busy = []

    def stage4(*args, **kwargs):
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(SLEEP_CYCLES)
        with sync_debug("error"):
            out = original(*args, **kwargs)
        busy.append(not stream.query())
        return out

    with backend_mode("kda_dhu"), KernelProbe() as probe, monkeypatch.context() as m:
        m.setenv("KDA_DHU_FWD_H", "off")  # the backward's recompute of h: fla's (one launch counted)
        m.setattr(module, "chunk_gated_delta_rule_bwd_dhu", stage4)
        backward(*forward())
        torch.cuda.synchronize()
    assert busy == [True], f"stage 4 calls that returned before the GPU drained: {busy}"
    assert probe.launches == 1, f"{probe.launches} kernel launches for one stage-4 call"
    assert len(probe.verdicts) == 1 and probe.verdicts[0][0], probe.verdicts

    # the whole backward: synchronizing torch calls with the backend off and on
    counts, grads = {}, {}
    for mode in ("fla", "kda_dhu"):
        with backend_mode(mode):
            o, ht = forward()
            torch.cuda.synchronize()
            grads[mode], counts[mode] = count_syncs(lambda: backward(o, ht))  # noqa: B023
            torch.cuda.synchronize()
    assert counts["kda_dhu"] <= counts["fla"], f"synchronizing calls in the backward: {counts}"
    if counts["fla"] == 0:
        with backend_mode("kda_dhu"):
            o, ht = forward()
            torch.cuda.synchronize()
            with sync_debug("error"):
                backward(o, ht)
            torch.cuda.synchronize()
    for n, on, off in zip(names, grads["kda_dhu"], grads["fla"]):
        e = rel_err(on, off)
        assert e < 1e-2, f"{op} gradient of {n}: kda-dhu on vs off {e:.3e}"
