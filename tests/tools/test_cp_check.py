"""CPU: benches/cp_check.py's parts that need no GPU (arguments, the cases' sequence
lengths, the rank split and its inverse, the metrics, the checks, the backend switch and
routing probes, the gather over a two-rank gloo group) and its --dry-run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "benches", "cp_check.py")


def _load():
    spec = importlib.util.spec_from_file_location("cp_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cp_check"] = mod
    spec.loader.exec_module(mod)
    return mod


cp = _load()


def test_args_defaults_and_errors():
    a = cp.parse_args([])
    assert (a.T, a.H, a.HV, a.K, a.V, a.dtype) == (16384, 32, 32, 128, 128, "bf16")
    assert a.cases == list(cp.CASES) and a.variants == list(cp.VARIANTS)
    assert a.gate_normalizers == [1.0, 16.0] and a.require_kernel == "i64"
    a = cp.parse_args(
        [
            "--T",
            "32768",
            "--H",
            "16",
            "--HV",
            "32",
            "--cases",
            "cut",
            "--variants",
            "i64",
            "--tol-kda",
            "5e-3",
            "--out",
            "/tmp/x",
        ]
    )
    assert (a.T, a.H, a.HV, a.cases, a.variants, a.tol_kda, a.out) == (
        32768,
        16,
        32,
        ["cut"],
        ["i64"],
        5e-3,
        "/tmp/x",
    )
    # the GPU test's settings: fla's own int32 context, the one-GPU run on int32 too
    a = cp.parse_args(["--variants", "as_built", "--cu-dtype", "int32", "--require-kernel", "all"])
    assert (a.variants, a.cu_dtype, a.require_kernel) == (["as_built"], "int32", "all")
    assert cp.required_settings(a.require_kernel, a.variants) == {"single", "cp[as_built]"}
    assert cp.parse_args([]).cu_dtype == "int64"
    assert cp.cu_from_lengths([3, 5], torch.int32).tolist() == [0, 3, 8]
    assert cp.cu_from_lengths([3, 5], torch.int32).dtype == torch.int32
    for bad in (
        ["--cases", "nope"],
        ["--variants", "x"],
        ["--H", "3", "--HV", "4"],
        ["--T", "100", "--lengths", "10,20"],
        ["--cu-dtype", "int16"],
    ):
        with pytest.raises(SystemExit):
            cp.parse_args(bad)


@pytest.mark.parametrize("T", [1024, 4096, 16384, 32768, 12288])
@pytest.mark.parametrize("W", [2, 4])
def test_case_lengths(T, W):
    part = T // W
    for case in cp.CASES:
        lens = cp.case_lengths(case, T, W)
        assert sum(lens) == T and min(lens) >= 1, (case, lens)
        bounds = cp.cu_from_lengths(lens)[1:-1].tolist()
        if case == "cut":
            assert len(lens) == 6
            assert not any(b % part == 0 for b in bounds), lens  # a sequence crosses every rank boundary
            assert not any(n % 64 == 0 for n in lens[:-1]), lens
        elif case == "aligned":
            assert all(r * part in bounds for r in range(1, W)), lens
        else:
            assert lens == [T]
    assert cp.case_lengths("cut", T, W, [T - 1, 1]) == [T - 1, 1]


def test_split_and_gather_roundtrip():
    x, do = cp.make_inputs(64, 2, 4, 16, 8, seed=3)
    assert x["q"].dtype == torch.bfloat16 and x["g"].dtype == torch.float32
    assert x["v"].shape == (1, 64, 4, 8) and x["beta"].shape == (1, 64, 4) and do.shape == (1, 64, 4, 8)
    assert (x["g"] <= 0).all()
    for t in (*x.values(), do):
        pieces = [cp.local_slice(t, r, 4) for r in range(4)]
        assert all(p.is_contiguous() and p.shape[1] == 16 for p in pieces)
        assert pieces[0].data_ptr() != t.data_ptr()  # a copy: its own autograd leaf
        assert torch.equal(cp.concat_pieces(pieces), t)
    with pytest.raises(ValueError):
        cp.local_slice(x["q"], 0, 3)
    x2, _ = cp.make_inputs(64, 2, 4, 16, 8, seed=3, gate_normalizer=16.0)
    assert torch.equal(x2["q"], x["q"]) and torch.allclose(x2["g"] * 16, x["g"])


def test_compare():
    ref = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    m = cp.compare(ref.clone(), ref)
    assert m == {"rel_fro": 0.0, "max_rel": 0.0, "max_abs": 0.0, "finite": True}
    out = ref.clone()
    out[1, 1] += 0.4
    m = cp.compare(out, ref)
    assert math.isclose(m["max_abs"], 0.4, rel_tol=1e-6) and math.isclose(m["max_rel"], 0.1, rel_tol=1e-6)
    assert math.isclose(m["rel_fro"], 0.4 / ref.norm().item(), rel_tol=1e-6)
    assert cp.compare(torch.ones(3), torch.zeros(3))["rel_fro"] == pytest.approx(math.sqrt(3))
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert cp.compare(bad, ref)["finite"] is False and cp.compare(bad, ref)["rel_fro"] == math.inf
    assert cp.compare(ref.bfloat16(), ref)["rel_fro"] < 4e-3
    with pytest.raises(ValueError):
        cp.compare(ref, ref[0])
    c = cp.comparison("x", "kda", {"q": ref, "o": ref}, {"q": ref})
    assert set(c["metrics"]) == {"q"} and c["kind"] == "kda"


def _case(rel=1e-3, launches=1, fla_launches=0, calls=1, kind="kda"):
    metrics = {"q": {"rel_fro": rel, "max_rel": rel, "max_abs": rel, "finite": True}}
    return {
        "case": "cut",
        "gate_normalizer": 1.0,
        "lengths": [1],
        "contexts": {},
        "comparisons": [{"name": "c", "kind": kind, "metrics": metrics}],
        "routing": {
            s: {
                "fla": {"kernel_launches": fla_launches, "stage4_calls": calls, "verdicts": []},
                "kda_dhu": {"kernel_launches": launches, "stage4_calls": calls, "verdicts": []},
            }
            for s in ("single", "cp[as_built]", "cp[i64]")
        },
    }


def test_evaluate():
    args = cp.parse_args([])
    ok = {"rank": 0, "cases": [_case()]}
    assert cp.evaluate([ok], args) == ([], [])
    # the as-built (int32) context not taking the kernel is a note, not a failure, by default
    c = _case()
    c["routing"]["cp[as_built]"]["kda_dhu"]["kernel_launches"] = 0
    fails, notes = cp.evaluate([{"rank": 1, "cases": [c]}], args)
    assert fails == [] and len(notes) == 1 and "cp[as_built]" in notes[0]
    fails, _ = cp.evaluate([{"rank": 1, "cases": [c]}], cp.parse_args(["--require-kernel", "all"]))
    assert len(fails) == 1
    assert len(cp.evaluate([{"rank": 0, "cases": [_case(rel=0.05)]}], args)[0]) == 1
    assert cp.evaluate([{"rank": 0, "cases": [_case(rel=0.015, kind="cp")]}], args)[0] == []
    assert cp.evaluate([{"rank": 0, "cases": [_case(rel=0.5, kind="noise")]}], args)[0] == []
    assert len(cp.evaluate([{"rank": 0, "cases": [_case(launches=0)]}], args)[0]) == 2  # single, i64
    assert len(cp.evaluate([{"rank": 0, "cases": [_case(fla_launches=1)]}], args)[0]) == 3
    assert len(cp.evaluate([{"rank": 0, "cases": [_case(calls=0, launches=0)]}], args)[0]) == 6
    nan = _case()
    nan["comparisons"][0]["metrics"]["q"].update(finite=False, rel_fro=math.inf)
    assert len(cp.evaluate([{"rank": 0, "cases": [nan]}], args)[0]) == 1
    assert len(cp.evaluate([{"rank": 0, "error": "Traceback\nRuntimeError: x"}], args)[0]) == 1
    assert "rank 0 cut" in cp.format_table(ok)


def test_report_writes_json(tmp_path, capsys):
    args = cp.parse_args(["--out", str(tmp_path)])
    c = _case()
    c["comparisons"][0]["metrics"]["q"]["rel_fro"] = math.inf
    c["comparisons"][0]["metrics"]["q"]["finite"] = False
    rc = cp.report([{"rank": 0, "cases": [c]}, {"rank": 1, "cases": [_case()]}], args, {}, 1.0)
    assert rc == cp.EXIT_FAIL
    summary = json.loads((tmp_path / "cp_check.json").read_text())
    assert summary["ok"] is False and len(summary["failures"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_fla_split_and_i64_context():
    ctxmod = pytest.importorskip("fla.ops.cp.context")
    cu = cp.cu_from_lengths(cp.case_lengths("cut", 4096, 2))
    ctxs = [ctxmod.get_cp_cu_seqlens(cu, cu_seqlens_cpu=cu, world_size=2, rank=r) for r in range(2)]
    assert [c.cu_seqlens.dtype for c in ctxs] == [torch.int32, torch.int32]
    assert (ctxs[0].is_first_rank, ctxs[0].is_last_rank, ctxs[1].is_first_rank, ctxs[1].is_last_rank) == (
        True,
        False,
        False,
        True,
    )
    c64 = cp.i64_context(ctxs[1])
    assert c64.cu_seqlens.dtype == c64.cu_seqlens_cpu.dtype == torch.int64
    assert c64.cu_seqlens.tolist() == ctxs[1].cu_seqlens.tolist()
    assert (c64.pre_num_ranks, c64.is_first_rank, c64.group) == (1, False, None)
    assert ctxs[1].cu_seqlens.dtype == torch.int32  # the original is left as it is
    assert cp.context_meta(c64)["dtype"] == "int64"


def test_backend_switch_and_routing():
    pytest.importorskip("fla.ops.kda.chunk_bwd")
    from kda_dhu import _dispatch, fla_backend

    if fla_backend.backend_instance() is None:
        pytest.skip("kda_dhu's fla backend is not registered here")
    backend = fla_backend.backend_instance()
    before = os.environ.get(cp.BACKEND_ENV)
    for mode in cp.MODES:
        with cp.backend_mode(mode):
            assert backend.is_enabled() == (mode == "kda_dhu")
    assert os.environ.get(cp.BACKEND_ENV) == before
    import fla.ops.kda.chunk_bwd as bwd

    orig = (bwd.chunk_gated_delta_rule_bwd_dhu, _dispatch.verify)
    with cp.Routing() as probe:
        assert bwd.chunk_gated_delta_rule_bwd_dhu is not orig[0]
        assert _dispatch.verify is not orig[1]
        q = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
        verdict = backend.chunk_gated_delta_rule_bwd_dhu_verifier(q, q, q, q, q)  # a CPU call: no
        assert verdict[0] is False
        assert probe.snapshot()["verdicts"] and probe.snapshot()["kernel_launches"] == 0
    assert (bwd.chunk_gated_delta_rule_bwd_dhu, _dispatch.verify) == orig


def _gloo_rank(rank, world_size, port, result_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        x, _ = cp.make_inputs(32, 2, 2, 8, 8, seed=5)
        full = {
            n: cp._gather(cp.local_slice(t, rank, world_size), world_size, dist.group.WORLD)
            for n, t in x.items()
        }
        ok = all(torch.equal(full[n], x[n]) for n in x)
        objs = [None] * world_size
        dist.all_gather_object(objs, {"rank": rank, "ok": ok})
        with open(os.path.join(result_dir, f"r{rank}.json"), "w") as f:
            json.dump(objs, f)
    finally:
        dist.destroy_process_group()


def test_gather_over_gloo(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_gloo_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for r in range(2):
        objs = json.loads((tmp_path / f"r{r}.json").read_text())
        assert objs == [{"rank": 0, "ok": True}, {"rank": 1, "ok": True}]


def test_dry_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--T", "2048", "--H", "2", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                p
                for p in (
                    os.path.dirname(__import__("kda_dhu").__file__) + "/..",
                    os.environ.get("PYTHONPATH"),
                )
                if p
            ),
        ),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "cp_check: PASS" in proc.stdout
    summary = json.loads((tmp_path / "cp_check.json").read_text())
    assert summary["ok"] and summary["env"]["dry_run"]


def test_no_gpus_exit_status():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("has two GPUs: the spawning mode would run")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--T", "1024"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
    )
    assert proc.returncode == cp.EXIT_ENV, proc.stdout + proc.stderr
