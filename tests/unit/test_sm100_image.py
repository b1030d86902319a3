"""The installed extension carries the Blackwell kernel (CPU-only checks).

The ELF itself (SM 100 in e_flags, "-arch sm_100a" in ptxas's note, the four entry
points as functions with their own .text/.nv.info sections, not the trap stub) is
checked by the Rust test `kernels::tests::sm100_image_holds_the_four_sm100a_kernels`
on the embedded bytes; this checks what the wheel reports about them.
"""

import re

from kda_dhu import _core

SM100_ENTRY_POINTS = [f"kda_dhu_sm100_k{k}_{dt}" for k in (64, 128) for dt in ("bf16", "fp16")]


def test_sm100a_cubins_are_embedded():
    for image in ("cuda12", "cuda13"):
        assert ("dhu_sm100", "sm_100a", image) in _core.embedded_kernels()


def test_each_sm100_entry_point_was_built_without_a_stack_frame():
    info = _core.build_info()
    for name in SM100_ENTRY_POINTS:
        for image in ("cuda12", "cuda13"):
            line = next((ln for ln in info.splitlines() if f" {image} {name}:" in ln), None)
            assert line is not None, f"{name} ({image}) missing from build_info():\n{info}"
            assert line.startswith(f"dhu_sm100 sm_100a {image} "), line
            m = re.search(r": (\d+) registers, \d+ bytes static smem, (\d+) bytes stack frame$", line)
            assert m, line
            regs, stack = int(m.group(1)), int(m.group(2))
            # The real kernel keeps the fp32 state in registers (the stub used 4).
            assert 64 <= regs <= 255, line
            assert stack == 0, line
