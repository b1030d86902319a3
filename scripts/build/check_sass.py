#!/usr/bin/env python3
"""Looks in the SASS of compiled kernels for instructions that can never run because
their predicate is the constant true of a `PLOP3.LUT Pn, PT, PT, PT, PT, 0x80` with no
branch target between them (`@!Pn ...` after it): the mark of ptxas reusing a predicate
register whose value it still needed.

ptxas 13.0 did this to a TMA store of the register-state kernel: the batch-row
coordinate's move to its uniform register (`@!P0 R2UR UR12, R11`) sat behind a predicate
that the previous store's uniformizing loop had just set to true, so the store went to a
stale row and dv2 stayed unwritten. Any dead move into a uniform register is reported.

    python3 scripts/build/check_sass.py CUBIN [CUBIN ...]     # exit 1 when something is found

cuobjdump: $CUOBJDUMP, else the one beside the nvcc wheel's (nvidia/cu13/bin: PyPI's
nvidia-cuda-cuobjdump, with nvidia-cuda-nvdisasm, which it runs) or on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

FUNC = re.compile(r"^\s*Function : (\S+)")
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(?:!?U?P\d+,\s*)?0x([0-9a-f]+)")
CONST_TRUE = re.compile(r"^PLOP3\.LUT (P\d), PT, PT, PT, PT, 0x80, 0x0$")


def cuobjdump() -> str:
    if os.environ.get("CUOBJDUMP"):
        return os.environ["CUOBJDUMP"]
    try:
        import nvidia

        for root in nvidia.__path__:
            cand = os.path.join(root, "cu13", "bin", "cuobjdump")
            if os.access(cand, os.X_OK):
                return cand
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if not found:
        sys.exit("check_sass: no cuobjdump (set CUOBJDUMP)")
    return found


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in sass.splitlines():
        m = FUNC.match(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = INSN.search(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def dead_moves(insns: list[tuple[int, str]]) -> list[str]:
    """`@!Pn` moves into uniform registers where Pn is, on every path, a constant true:
    set by CONST_TRUE with no branch target and no other mention of Pn in between (any
    mention counts as a possible redefinition: conservative, never a false alarm for
    that reason)."""
    targets = {int(m.group(1), 16) for _, text in insns for m in [BRANCH.search(text)] if m}
    const_true: dict[str, int] = {}  # predicate -> address of its constant-true definition
    found = []
    for addr, text in insns:
        if addr in targets:
            const_true.clear()  # control can arrive from elsewhere
        guard = re.match(r"^@(!?)(U?P\d+) (.*)$", text)
        body = guard.group(3) if guard else text
        if guard and guard.group(1) == "!" and guard.group(2) in const_true:
            if body.split()[0].startswith(("R2UR", "UMOV", "UIADD3", "S2UR", "ULEA", "UIMAD")):
                at = const_true[guard.group(2)]
                found.append(f"{addr:#06x}: {text}  ({guard.group(2)} set true at {at:#06x})")
        c = CONST_TRUE.match(body)
        mentioned = set(re.findall(r"\bU?P\d+\b", body.split(" ", 1)[1] if " " in body else ""))
        for p in mentioned:
            const_true.pop(p, None)
        if c and not guard:
            const_true[c.group(1)] = addr
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    tool = cuobjdump()
    bad = 0
    for cubin in argv:
        # cuobjdump runs nvdisasm, found on PATH: the one beside it first (the PyPI wheels')
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(tool), os.environ.get("PATH", "")]))
        r = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"check_sass: {tool} -sass {cubin} failed: {r.stderr.strip()[-500:]}")
        sass = r.stdout
        funcs = functions(sass)
        for name, insns in sorted(funcs.items()):
            for line in dead_moves(insns):
                print(f"{os.path.basename(cubin)} {name}: {line}")
                bad += 1
        print(f"check_sass: {cubin}: {len(funcs)} kernels, {bad} dead uniform-register moves so far")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
