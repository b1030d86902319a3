"""What a newcomer meets first (CPU): ``import kda_dhu`` is light and still registers the
fla backend before fla's first stage-4 call, whichever package comes first; the lazy
names resolve once; ``--help``, a mistyped shape and ``--doctor`` answer without
waiting on torch or fla where they need neither. Each import order runs in a fresh
interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import kda_dhu
import pytest
from helpers import REPO_ROOT, ROUTE_SWITCHES
from kda_dhu import _measure, doctor

# The folder kda_dhu is imported from, for the fresh interpreters.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kda_dhu.__file__)))
HAS_FLA = importlib.util.find_spec("fla") is not None


def _run(args: list, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python <args>`` in a fresh interpreter that imports this kda_dhu, with none of
    the switches that change a call's route (helpers.ROUTE_SWITCHES) set unless ``env`` sets them."""
    full = {k: v for k, v in os.environ.items() if k not in ROUTE_SWITCHES}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=full, cwd=_ROOT
    )


def _imported(importtime_stderr: str) -> set:
    """Top-level package names of every module ``python -X importtime`` reports."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name and name != "imported package":
                names.add(name.split(".")[0])
    return names


# --- import kda_dhu ------------------------------------------------------------------


def test_import_kda_dhu_imports_neither_torch_nor_fla():
    proc = _run(["-X", "importtime", "-c", "import kda_dhu"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    mods = _imported(proc.stderr)
    assert "kda_dhu" in mods  # the parse found the import itself
    assert not mods & {"torch", "fla", "triton", "numpy"}, sorted(mods)
    assert "Triton is not supported" not in proc.stderr


_REGISTRY_PROBE = """
import logging, sys
order = sys.argv[1]
if order == "kda_dhu first":
    import kda_dhu
    assert "fla" not in sys.modules and "torch" not in sys.modules
    import fla.ops.common.chunk_delta_h as mod
else:
    import fla.ops.common.chunk_delta_h as mod
    import kda_dhu
# fla's own registry, read directly: nothing of kda_dhu has been called since the imports
import fla.backends
held = fla.backends._get_operation_registry("common")._backends.get("kda_dhu")
print("HELD", type(held).__name__ if held is not None else None)
# the module runs with its own loader (Triton reads its kernels' source through it)
print("LOADER", type(mod.__loader__).__name__, type(mod.__spec__.loader).__name__)
import inspect
assert "def chunk_gated_delta_rule_bwd_dhu" in inspect.getsource(mod)

# fla's first stage-4 call consults kda_dhu's verifier (CPU tensors: it declines, and
# fla's own kernel then fails on the CPU, which is not what this checks)
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
log = logging.getLogger("fla.backends")
log.addHandler(Keep())
log.setLevel(logging.INFO)
import torch
B, T, H, K, V = 1, 64, 1, 64, 64
x = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)
try:
    mod.chunk_gated_delta_rule_bwd_dhu(
        q=x(B, T, H, K), k=x(B, T, H, K), w=x(B, T, H, K), do=x(B, T, H, V), dv=x(B, T, H, V),
        gk=torch.zeros(B, T, H, K), h0=None, dht=torch.zeros(B, H, K, V), scale=K**-0.5,
    )
except Exception:
    pass
print("CONSULTED", any("kda_dhu rejected" in m for m in said))
"""


@pytest.mark.skipif(not HAS_FLA, reason="fla is not installed")
@pytest.mark.parametrize("order", ["kda_dhu first", "fla first"])
def test_backend_is_registered_before_the_first_stage4_call(order):
    proc = _run(["-c", textwrap.dedent(_REGISTRY_PROBE), order])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "HELD KdaDhuBackend" in out, out + proc.stderr[-2000:]
    loader = next(ln for ln in out.splitlines() if ln.startswith("LOADER"))
    assert "_RegisteringLoader" not in loader, loader
    assert "CONSULTED True" in out, out + proc.stderr[-2000:]


# --- lazy names ------------------------------------------------------------------------


def test_reference_and_testing_work_after_import_kda_dhu():
    code = """
    import sys
    import kda_dhu
    assert "torch" not in sys.modules
    ref = kda_dhu.reference.chunk_gated_delta_rule_bwd_dhu_ref
    make = kda_dhu.testing.make_inputs
    assert "torch" in sys.modules
    from kda_dhu import reference, testing
    assert reference.chunk_gated_delta_rule_bwd_dhu_ref is ref and testing.make_inputs is make
    print("OK")
    """
    proc = _run(["-c", textwrap.dedent(code)], env={"KDA_DHU_NO_AUTOREGISTER": "1"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_lazy_names_resolve_once_into_the_module_namespace():
    from kda_dhu import _dispatch, fla_backend, ops

    assert kda_dhu.chunk_gated_delta_rule_bwd_dhu is _dispatch.chunk_gated_delta_rule_bwd_dhu
    assert kda_dhu.plan_call is _dispatch.plan_call
    assert kda_dhu.register_backend is fla_backend.register_backend
    assert kda_dhu.chunk_gated_delta_rule_bwd_dhu_op is ops.chunk_gated_delta_rule_bwd_dhu_op
    # resolved: a plain attribute from now on (the hot path never reaches __getattr__)
    assert vars(kda_dhu)["chunk_gated_delta_rule_bwd_dhu"] is _dispatch.chunk_gated_delta_rule_bwd_dhu
    for name in kda_dhu.__all__:
        assert getattr(kda_dhu, name) is not None, name
    assert set(kda_dhu.__all__) <= set(dir(kda_dhu))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        kda_dhu.no_such_name  # noqa: B018


def test_patch_stays_the_function_after_its_module_is_imported():
    import kda_dhu.patch  # noqa: F401 - the submodule, imported by name

    patch_module = sys.modules["kda_dhu.patch"]
    assert callable(kda_dhu.patch) and kda_dhu.patch is patch_module.patch


# --- the command line ------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, usage",
    [
        (["-m", "kda_dhu", "--help"], "usage: python -m kda_dhu "),
        ([os.path.join(REPO_ROOT, "benches", "bench.py"), "--help"], "usage: python benches/bench.py "),
    ],
)
def test_help_imports_neither_torch_nor_fla(args, usage):
    proc = _run(["-X", "importtime", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(usage), proc.stdout[:200]
    mods = _imported(proc.stderr)
    assert "kda_dhu" in mods
    assert not mods & {"torch", "fla"}, sorted(mods)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["-m", "kda_dhu", "--shape", "prod_8192"], "invalid choice: 'prod_8192'"),
        (
            [os.path.join(REPO_ROOT, "benches", "bench.py"), "--shapes", "prod8192,b8_t4096"],
            "unknown shape(s) ['b8_t4096']",
        ),
    ],
)
def test_a_mistyped_shape_fails_before_torch_with_the_shape_list(args, expected):
    proc = _run(["-X", "importtime", *args])
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert expected in proc.stderr, proc.stderr[-3000:]
    for name, *_ in _measure.SHAPES:
        assert name in proc.stderr, name
    assert not _imported(proc.stderr) & {"torch", "fla"}


def _doctor(env=None, verbose: bool = False) -> str:
    proc = _run(["-m", "kda_dhu", "--doctor", *(["--verbose"] if verbose else [])], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "could not check" not in proc.stdout, proc.stdout
    return proc.stdout


@pytest.fixture(scope="module")
def doctor_out() -> str:
    """``python -m kda_dhu --doctor``'s output with no switch set (one run for the tests)."""
    return _doctor()


@pytest.fixture(scope="module")
def doctor_verbose_out() -> str:
    """``python -m kda_dhu --doctor --verbose``'s output with no switch set."""
    return _doctor(verbose=True)


def test_doctor_prints_every_section(doctor_out):
    import torch

    out = doctor_out
    for title in (
        "== versions",
        "== compiled extension",
        "== CUDA driver",
        "== GPUs",
        "== fla's backend registry",
        "== environment switches",
        "== routes of the README's shapes",
    ):
        assert title in out, title
    assert f"kda_dhu                  {kda_dhu.__version__}" in out
    assert f"torch                    {torch.__version__}" in out
    from kda_dhu import _core

    for stem, arch, image in _core.embedded_kernels():
        assert f"{stem} ({arch}, {image})" in out
    assert "built with               " + "; ".join(doctor.compilers(_core.build_info())) in out
    if HAS_FLA:
        assert "kda_dhu in the registry  yes" in out


def test_doctor_is_short_and_keeps_the_build_log_for_verbose(doctor_out, doctor_verbose_out):
    """The default output names the compilers but leaves the build log (paths, flags,
    registers per entry point) to --verbose, which prints every line of it."""
    from kda_dhu import _core

    info = _core.build_info().splitlines()
    assert " registers, " not in doctor_out
    assert "python -m kda_dhu --doctor --verbose" in doctor_out
    assert len(doctor_out.splitlines()) < 80, doctor_out
    for line in info:
        assert doctor.build_log_line(line) in doctor_verbose_out, line
    assert sum(" registers, " in ln for ln in doctor_verbose_out.splitlines()) == sum(
        " registers, " in ln for ln in info
    )


def test_doctor_prints_no_path_that_is_gone(doctor_out, doctor_verbose_out):
    """Every absolute path the doctor prints exists here: a path of the build (pip's
    build environment, the machine that built the wheel) that is gone is shown by its
    tail and marked."""
    for out in (doctor_out, doctor_verbose_out):
        for m in doctor._PATH.finditer(out):
            path = m.group(0).rstrip(":.")
            assert os.path.exists(path), (path, out)


def test_build_log_line_marks_a_path_that_is_gone(tmp_path):
    gone = "/nonexistent-build-env/overlay/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc"
    line = f"cuda13: nvcc {gone} (release 13.0, V13.0.88)"
    shown = doctor.build_log_line(line)
    assert "/nonexistent-build-env" not in shown
    assert f"{doctor.GONE}/nvidia/cu13/bin/nvcc (release 13.0, V13.0.88)" in shown
    # The marked tail is not read back as a path (test_doctor_prints_no_path_that_is_gone
    # looks for paths as the doctor does: on a machine whose build folder is gone).
    assert [m.group(0) for m in doctor._PATH.finditer(shown)] == []
    here = str(tmp_path)
    assert doctor.build_log_line(f"cutlass include: {here}") == f"cutlass include: {here}"
    assert doctor.build_log_line("cutlass include: /nonexistent-x/a/include") == (
        f"cutlass include: {doctor.GONE}/a/include"
    )
    assert doctor.compilers(line + "\ncuda13 flags: -O3\ncuda12: NVRTC 12.9 /x/lib.so, headers /y") == [
        "cuda13: nvcc (release 13.0, V13.0.88)",
        "cuda12: NVRTC 12.9",
    ]


def test_verbose_goes_with_doctor():
    proc = _run(["-X", "importtime", "-m", "kda_dhu", "--verbose"])
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "--verbose goes with --doctor" in proc.stderr
    assert not _imported(proc.stderr) & {"torch", "fla"}


def test_doctor_without_a_gpu_says_so(doctor_out):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present (test_doctor_routes_every_readme_shape runs instead)")
    assert "torch sees no CUDA device" in doctor_out
    assert "no GPU here" in doctor_out


@pytest.mark.skipif(not HAS_FLA, reason="fla is not installed")
def test_no_autoregister_leaves_the_registry_alone():
    """KDA_DHU_NO_AUTOREGISTER=1: fla imported after kda_dhu holds no kda_dhu backend (the
    doctor reads fla's registry); FLA_KDA_DHU=0 is reported as the backend's switch."""
    out = _doctor(env={"KDA_DHU_NO_AUTOREGISTER": "1", "FLA_KDA_DHU": "0"})
    assert "auto-registration        off" in out
    assert "kda_dhu in the registry  no" in out
    assert "FLA_KDA_DHU              '0': the backend is off" in out


@pytest.mark.gpu
def test_doctor_routes_every_readme_shape(doctor_out):
    import torch

    out = doctor_out
    routes = out.split("== routes of the README's shapes", 1)[1]
    for name, *_ in _measure.SHAPES:
        line = next((ln for ln in routes.splitlines() if ln.strip().startswith(name + " ")), None)
        assert line is not None, (name, routes)
        assert "kernel-sm" in line or "fla (" in line, line
    assert torch.cuda.get_device_name(0) in out
