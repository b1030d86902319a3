"""SASS instructions per chunk per warp of the sm_90a kernels' chunk loops (no GPU).

For each gate configuration (gk, none, g; dense batch) it compiles a copy of cuda/ in
which the kernels' runtime flags (``use_gk``, ``varlen``) are constants (the scalar gate is
the instance's: the ``_g`` entry point for g), so that
each chunk loop is straight-line code for that configuration, disassembles the entry
points with nvdisasm and counts the instructions of the innermost loop that holds a
whole chunk's wgmma (>= 8 HGMMA). Warps 1-3 skip the leader's TMA-store blocks (found
as the forward branches around UTMASTG / the leader's bulk wait); warp 0 runs them.
The loop's inner loops (the g path's do-row weighting) are unrolled into one trip, so
the static count is the count issued per chunk. For the register-state kernel it also
splits the loop at its wgmma issues and waits (the chain's segments: stage 4's DV and WD,
the forward scan's WH and KV).

    python3 scripts/build/sass_chunk_count.py [--entries rs_k128_bf16,rs_k64_bf16,fwd_k128_bf16,...]
        [--defines "KDA_DHU_EXP_<NAME>=<n> ..."]

--defines (default: $KDA_DHU_KERNEL_DEFINES, as build.rs reads it) compiles an experiment's
instance instead of the release one.

nvcc and the CUTLASS headers as build.rs finds them ($NVCC / the nvidia-cuda-nvcc wheel,
$CUTLASS_DIR / the nvidia-cutlass wheel); nvdisasm from $NVDISASM, else on PATH, else next to nvcc.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The runtime flags' lines of the kernel, and what they become.
FLAGS = {
    "  const bool varlen = !KDA_DHU_EXP_DENSE_ONLY && (p.flags & FLAG_VARLEN);\n": "  const bool varlen = CNT_VARLEN;\n",
    "  const bool use_gk = gk_only || (p.flags & FLAG_GK);\n": "  const bool use_gk = CNT_GK;\n",
}
CONFIGS = {"gk": (False, True), "none": (False, False), "g": (True, False)}


def toolchain():
    import cutlass_library
    import nvidia

    nvcc = os.environ.get("NVCC") or os.path.join(list(nvidia.__path__)[0], "cu13", "bin", "nvcc")
    cut = os.environ.get("CUTLASS_DIR")
    cut = (
        os.path.join(cut, "include")
        if cut
        else os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    )
    nvdisasm = (
        os.environ.get("NVDISASM")
        or shutil.which("nvdisasm")
        or os.path.join(os.path.dirname(nvcc), "nvdisasm")
    )
    return nvcc, cut, nvdisasm


def parse(text):
    """[(address, instruction)], {label: address} of nvdisasm -c output."""
    ins, labels, pending = [], {}, []
    for line in text.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            a = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = a
            pending = []
            ins.append((a, m.group(2)))
    return ins, labels


def chunk_loop(ins, labels):
    best = None
    for a, t in ins:
        m = re.search(r"BRA\S* `\((\.L_x_\d+)\)", t)
        if m and labels[m.group(1)] < a:
            lo = labels[m.group(1)]
            h = sum("HGMMA" in x[1] for x in ins if lo <= x[0] <= a)
            if h >= 8 and (best is None or a - lo < best[1] - best[0]):
                best = (lo, a)
    lo, hi = best
    return [x for x in ins if lo <= x[0] <= hi]


def leader_only(body, labels):
    out = set()
    for a, t in body:
        m = re.search(r"@!?U?P\d BRA `\((\.L_x_\d+)\)", t)
        if m and labels[m.group(1)] > a:
            reg = [x for x in body if a < x[0] < labels[m.group(1)]]
            if any("UTMASTG" in x[1] or "DEPBAR.LE SB0" in x[1] for x in reg) and not any(
                "HGMMA" in x[1] for x in reg
            ):
                out.update(x[0] for x in reg)
    return out


def where(body, pred):
    """Positions in the loop body of the instructions whose text satisfies pred."""
    return [i for i, (_, t) in enumerate(body) if pred(t)]


def segments(body):
    """Register-state loop: instructions between its wgmma issues and waits."""
    first = next(t for _, t in body if "HGMMA" in t)
    if "-R" in first:  # the forward scan's loop opens with WH, stage 4's with DV
        return segments_fwd(body)
    dv = where(body, lambda t: "HGMMA.64x64x16" in t and "-R" not in t and "tnspA" not in t)
    wd = where(body, lambda t: "HGMMA" in t and "-R" in t)
    w1 = where(body, lambda t: "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t)
    w0 = where(body, lambda t: "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t)
    if not (dv and wd and w1 and w0):
        return None
    n = len(body)
    return {
        "WD wait -> DV issue": dv[0] + (n - w0[-1]),
        "DV issue window": dv[-1] - dv[0] + 1,
        "DV flight": w1[0] - dv[-1] - 1,
        "DV wait -> WD issue": wd[0] - w1[0],
        "WD issue window": wd[-1] - wd[0] + 1,
        "WD flight": w0[-1] - wd[-1] - 1,
    }


def segments_fwd(body):
    """The forward scan's loop: WH (v_new^T = u^T - h^T w^T, A = -h^T from registers) and
    KV (h^T <- h^T + v_new^T k, A from registers, B = k transposed), each waited for."""
    wh = where(body, lambda t: "HGMMA" in t and "-R" in t)
    kv = where(body, lambda t: "HGMMA" in t and "tnspB" in t)
    w0 = where(body, lambda t: "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t)
    if not (wh and kv and len(w0) >= 2):
        return None
    n = len(body)
    whw = [i for i in w0 if i > wh[-1]][0]
    kvw = [i for i in w0 if i > kv[-1]][0]
    return {
        "KV wait -> WH issue": wh[0] + (n - kvw),
        "WH issue window": wh[-1] - wh[0] + 1,
        "WH flight": whw - wh[-1] - 1,
        "WH wait -> KV issue": kv[0] - whw,
        "KV issue window": kv[-1] - kv[0] + 1,
        "KV flight": kvw - kv[-1] - 1,
    }


def experiment_flags(raw):
    """`-DNAME[=VALUE]` flags of the space-separated experiment macros, as build.rs accepts them."""
    flags = []
    for item in raw.split():
        name, _, value = item.partition("=")
        if not re.fullmatch(r"KDA_DHU_EXP_[A-Z0-9_]+", name) or (
            value and not re.fullmatch(r"-?[0-9]+", value)
        ):
            raise SystemExit(f"--defines: {item!r} is not KDA_DHU_EXP_<NAME>[=<integer>]")
        flags.append(f"-D{item}")
    return flags


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", default="rs_k128_bf16,rs_k64_bf16")
    ap.add_argument("--defines", default=os.environ.get("KDA_DHU_KERNEL_DEFINES", ""))
    ap.add_argument(
        "--dump", default=None, help="a folder for each chunk loop's SASS (<kernel>_<gates>.sass)"
    )
    args = ap.parse_args(argv)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    regs = []
    defines = experiment_flags(args.defines)
    nvcc, cut, nvdisasm = toolchain()
    entries = [f"kda_dhu_sm90_{e}" for e in args.entries.split(",")]
    print("| kernel | gates | instructions per chunk, warps 1-3 | warp 0 | HGMMA | chain segments |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "cuda")
        shutil.copytree(os.path.join(REPO, "cuda"), src)
        for path in ("dhu_sm90_regstate.cuh",):
            p = os.path.join(src, path)
            with open(p) as f:
                text = f.read()
            for old, new in FLAGS.items():
                assert old in text, f"{path}: the flag line this script replaces changed: {old!r}"
                text = text.replace(old, new)
            with open(p, "w") as f:
                f.write(text)
        with open(os.path.join(src, "dhu_sm90.cu")) as f:
            lines = f.read().splitlines()
        for base in entries:
            for cfg, (g, gk) in CONFIGS.items():
                name = base + "_g" if g else base
                one = [
                    ln
                    for ln in lines
                    if not re.match(r"^KDA_DHU_(SM90(_RS|_SUM|_FWD|_FWD_SUM)?|SEG_MERGE)_ENTRY\(", ln)
                    or f"({name}," in ln
                ]
                with open(os.path.join(src, "one.cu"), "w") as f:
                    f.write("\n".join(one) + "\n")
                cubin = os.path.join(tmp, "one.cubin")
                cmd = [nvcc, "-cubin", "-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                       "--expt-relaxed-constexpr", "-DNDEBUG", "-I", src, "-I", cut, "-DCNT_VARLEN=false",
                       f"-DCNT_GK={'true' if gk else 'false'}", *defines,
                       "-Xptxas", "-v", "-o", cubin, os.path.join(src, "one.cu")]  # fmt: skip
                built = subprocess.run(cmd, check=True, capture_output=True, text=True)
                used = re.search(r"Used (\d+) registers", built.stderr)
                spills = re.findall(r"(\d+) bytes spill (stores|loads)", built.stderr)
                regs.append((name, cfg, used.group(1) if used else "?", sum(int(n) for n, _ in spills)))
                sass = subprocess.run(
                    [nvdisasm, "-c", cubin], check=True, capture_output=True, text=True
                ).stdout
                ins, labels = parse(sass)
                body = chunk_loop(ins, labels)
                lead = leader_only(body, labels)
                h = sum("HGMMA" in t for _, t in body)
                seg = segments(body)
                seg_s = ", ".join(f"{k} {v}" for k, v in seg.items()) if seg else ""
                if args.dump:
                    with open(os.path.join(args.dump, f"{name}_{cfg}.sass"), "w") as f:
                        f.write("\n".join(f"{a:#06x}  {t}" for a, t in body) + "\n")
                print(
                    f"| {name} | {cfg} | {len(body) - len(lead)} | {len(body)} | {h} | {seg_s} |", flush=True
                )
    print()
    print("ptxas: " + "; ".join(f"{n} ({c}) {r} registers, {sp} bytes spilled" for n, c, r, sp in regs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
