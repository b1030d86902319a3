"""The Hopper kernel (cuda/dhu_sm90_regstate.cuh: the state held in registers) is in the
installed extension (CPU-only checks).

That each of its thirty-two entry points is a function of the embedded sm_90a image is
checked by the Rust test `kernels::tests::sm90_images_hold_the_sm90a_kernels` (it
walks `KernelConfig::all`, which lists them); the planner's plans by
`plan::tests::every_kernel_plan_names_an_entry_point_of_its_image`. The fragment geometry
is checked on the CPU by scripts/build/layout_check_regstate.sh (below).
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO_ROOT
from kda_dhu import _core

REPO = REPO_ROOT

# Without and with the scalar gate g (`_g`: the gate is a template parameter).
RS_ENTRY_POINTS = [
    f"kda_dhu_sm90_rs_k{k}_{dt}{wg}{svf}{g}"
    for g in ("", "_g")
    for svf in ("", "_svf")
    for wg in ("", "_wg2")
    for k in (64, 128)
    for dt in ("bf16", "fp16")
]


# The sequence split's (src/split.rs SPLIT_ENTRIES): its first pass, the kernel above with V
# widened by K identity columns (one warpgroup), and the merge of its boundary states; then
# the forward scan's first pass.
SPLIT_ENTRY_POINTS = [
    f"kda_dhu_sm90_rs_k{k}_{dt}_sum{svf}{g}"
    for g in ("", "_g")
    for svf in ("", "_svf")
    for k in (64, 128)
    for dt in ("bf16", "fp16")
] + ["kda_dhu_sm90_seg_merge_k64", "kda_dhu_sm90_seg_merge_k128"]
# The forward scan's first pass (the FWD instance with V widened by K identity columns) and
# its merge (oldest first).
FWD_SPLIT_ENTRY_POINTS = [name.replace("_rs_", "_fwd_") for name in SPLIT_ENTRY_POINTS[:16]]
FWD_MERGE_ENTRY_POINTS = ["kda_dhu_sm90_fwd_seg_merge_k64", "kda_dhu_sm90_fwd_seg_merge_k128"]
MERGE_ENTRY_POINTS = SPLIT_ENTRY_POINTS[16:] + FWD_MERGE_ENTRY_POINTS


# The forward scan's (src/plan.rs FWD_ENTRIES: fla's chunk_gated_delta_rule_fwd_h on the
# kernel's FWD instance, one warpgroup).
FWD_ENTRY_POINTS = [name.replace("_rs_", "_fwd_") for name in RS_ENTRY_POINTS]


def test_thirty_two_register_state_entry_points():
    assert len(set(RS_ENTRY_POINTS)) == 32
    assert len(set(SPLIT_ENTRY_POINTS)) == 18
    assert len(set(FWD_SPLIT_ENTRY_POINTS)) == 16
    assert len(set(FWD_ENTRY_POINTS)) == 32


def test_each_entry_point_was_built_without_spills_or_a_stack_frame():
    """build.rs fails on a spill; a stack frame would mean local memory in the chain.
    One warpgroup: the state, QD and DV accumulators and bf16(b) need > 200 registers at
    K = 128 (<= 255, and K = 64 keeps two CTAs per SM: <= 204); two warpgroups report
    the launch's 168 (setmaxnreg gives the consumers 240)."""
    info = _core.build_info()
    for name in RS_ENTRY_POINTS + SPLIT_ENTRY_POINTS[:16] + FWD_ENTRY_POINTS + FWD_SPLIT_ENTRY_POINTS:
        line = next((ln for ln in info.splitlines() if f" {name}:" in ln), None)
        assert line is not None, f"{name} missing from build_info():\n{info}"
        assert line.startswith("dhu_sm90 sm_90a "), line
        m = re.search(r": (\d+) registers, \d+ bytes static smem, (\d+) bytes stack frame$", line)
        assert m, line
        regs, stack = int(m.group(1)), int(m.group(2))
        assert stack == 0, line
        if "_wg2" in name:
            assert regs == 168, line
        elif "_k64_" in name:
            assert 64 <= regs <= 204, line
        elif "_fwd_" in name:  # no QD accumulator
            assert 128 <= regs <= 255, line
        else:
            assert 200 <= regs <= 255, line


def test_the_image_holds_only_these_sm90a_entry_points():
    names = sorted(m.group(1) for m in re.finditer(r" (kda_dhu_sm90_\w+): \d+ registers", _core.build_info()))
    assert set(names) == set(
        RS_ENTRY_POINTS
        + SPLIT_ENTRY_POINTS
        + FWD_ENTRY_POINTS
        + FWD_SPLIT_ENTRY_POINTS
        + FWD_MERGE_ENTRY_POINTS
    ), names


def test_the_merge_kernel_has_no_stack_frame():
    info = _core.build_info()
    for name in MERGE_ENTRY_POINTS:
        line = next((ln for ln in info.splitlines() if f" {name}:" in ln), None)
        assert line is not None and line.startswith("dhu_sm90 sm_90a "), (name, line)
        assert line.endswith(" 0 bytes stack frame"), line


def _toolchain() -> tuple[str | None, str]:
    """nvcc and the CUTLASS headers as build.rs finds them: (nvcc, "") or (None, why not).

    The check compiles against the CUDA headers beside nvcc, which CCCL requires to be
    nvcc's own release; pip may have moved them on (nvidia-cuda-runtime upgraded for a
    newer torch after the build's pinned nvcc was installed): then the check cannot
    compile here. .ci/run runs it before the package install, where they match."""
    try:
        import cutlass_library  # noqa: F401
        import nvidia
    except ImportError:
        return None, "needs the CUTLASS headers (nvidia-cutlass) and nvcc (nvidia-cuda-nvcc)"
    nvcc = os.environ.get("NVCC") or os.path.join(list(nvidia.__path__)[0], "cu13", "bin", "nvcc")
    if not (os.path.exists(nvcc) and shutil.which("g++")):
        return None, "needs nvcc and g++ (the build's toolchain)"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    header = os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include", "cuda_runtime_api.h")
    h = re.search(r"#define CUDART_VERSION\s+(\d+)", open(header).read()) if os.path.exists(header) else None
    if m and h:
        nv, rt = (int(m.group(1)), int(m.group(2))), (int(h.group(1)) // 1000, int(h.group(1)) % 1000 // 10)
        if nv != rt:
            return None, f"nvcc is CUDA {nv[0]}.{nv[1]} but the runtime headers beside it are {rt[0]}.{rt[1]}"
    return nvcc, ""


def test_fragment_geometry_on_the_host():
    """CuTe's wgmma layouts, the descriptors' shared-memory layouts and the ldmatrix /
    stmatrix lane addresses against the kernel's fragment geometry (a host program)."""
    nvcc, why = _toolchain()
    if nvcc is None:
        pytest.skip(why)
    env = dict(os.environ, PYTHON=sys.executable, NVCC=nvcc)
    r = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "build", "layout_check_regstate.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "layout_check_regstate: all checks hold" in r.stdout
