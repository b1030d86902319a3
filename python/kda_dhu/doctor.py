"""``python -m kda_dhu --doctor``: what this machine gives kda-dhu, section by section.

Versions (kda_dhu, Python, torch, fla), the compiled extension (its embedded kernel
images and the compilers that built them), the CUDA driver, the GPUs, fla's backend
registry, the environment switches, and the route each shape of the README's table would
take on this machine's first GPU (the planner's verdict under the rule of fla's backend
and ``chunk_gated_delta_rule_bwd_dhu``, and under ``kda_dhu_b2a``'s).

``--doctor --verbose`` adds the build log: compiler paths, flags, and registers, shared
memory and stack frame of every kernel entry point (ptxas). A path of the build that no
longer exists here (pip's build environment, removed after the build; the machine that
built a cluster wheel) is shown by its tail and marked as such (``build_log_line``).

Every section reports its own failure and the next one runs; the command exits 0
whatever it finds (it diagnoses, it does not judge). It imports fla (seconds, and
fla's warnings, which it shows in the fla section) to read fla's registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import re
import sys
import traceback
import warnings

# Environment variables shown: kda_dhu's own (by prefix, so the list has no owner here)
# and the two that decide whether fla consults its backends at all.
ENV_PREFIX = "KDA_DHU_"
FLA_SWITCHES = ("FLA_KDA_DHU", "FLA_DISABLE_BACKEND_DISPATCH")


def _section(title: str):
    """A decorator printing ``title``, then the section (``options`` passed on to it); an
    exception becomes a line."""

    def wrap(fn):
        def run(out, **options) -> None:
            print(f"\n== {title}", file=out)
            try:
                fn(out, **options)
            except Exception as err:  # noqa: BLE001 - a doctor reports, it does not stop
                print(f"  could not check: {type(err).__name__}: {err}", file=out)
                if os.environ.get("KDA_DHU_DOCTOR_TRACE"):
                    traceback.print_exc(file=out)

        return run

    return wrap


def _line(out, name: str, value) -> None:
    print(f"  {name:<24} {value}", file=out)


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@_section("versions")
def _versions(out) -> None:
    import kda_dhu

    _line(out, "kda_dhu", f"{kda_dhu.__version__} ({os.path.dirname(kda_dhu.__file__)})")
    _line(out, "Python", f"{platform.python_version()} ({sys.executable})")
    import torch

    _line(out, "torch", f"{torch.__version__} (built for CUDA {torch.version.cuda or 'none: CPU build'})")
    fla = _dist_version("fla-core") or _dist_version("flash-linear-attention")
    _line(out, "fla", fla or "not installed (kda_dhu falls back to fla: pip install 'kda-dhu[fla]')")
    triton = _dist_version("triton")
    _line(out, "triton", triton or "not installed")


# An absolute path in the build log, up to a space, comma, semicolon or bracket (not the
# tail after GONE's closing ">", which is shown in place of a path that is gone).
_PATH = re.compile(r"(?<![\w.>])/[^\s,;()]+")
GONE = "<build-time path, not on this machine>"


def build_log_line(line: str) -> str:
    """A line of ``_core.build_info()`` as the doctor prints it: each absolute path that
    does not exist on this machine becomes ``GONE + "/" + tail`` (the tail from
    ``site-packages/`` on, else the last two components), so the log names the compiler
    without pointing into a folder that is gone (pip's build environment, the machine
    that built a cluster wheel)."""

    def shown(m: re.Match) -> str:
        path = m.group(0)
        if os.path.exists(path):
            return path
        parts = path.split("/site-packages/", 1)
        tail = parts[1] if len(parts) == 2 else "/".join(path.rstrip("/").split("/")[-2:])
        return f"{GONE}/{tail}"

    return _PATH.sub(shown, line)


def compilers(info: str) -> list:
    """The toolchain lines of a build log without their paths: ["cuda13: nvcc (release
    13.0, V13.0.88)", "cuda12: NVRTC 12.9", ...]."""
    found = []
    for line in info.splitlines():
        m = re.match(r"(cuda\d+): (.*)", line)
        if not m:
            continue
        what = m.group(2).split(", headers ", 1)[0]
        what = re.sub(r"\s+", " ", _PATH.sub("", what)).strip()
        found.append(f"{m.group(1)}: {what}")
    return found


@_section("compiled extension (kda_dhu._core)")
def _extension(out, verbose: bool = False) -> None:
    from . import _dispatch

    core = _dispatch._core
    if core is None:
        _line(out, "status", f"not built: {_dispatch._core_error}")
        return
    _line(out, "file", core.__file__)
    images = ", ".join(f"{stem} ({arch}, {image})" for stem, arch, image in core.embedded_kernels())
    _line(out, "embedded kernel images", images or "none")
    info = core.build_info()
    _line(out, "built with", "; ".join(compilers(info)) or "unknown")
    if not verbose:
        entries = sum(1 for ln in info.splitlines() if " registers, " in ln)
        _line(
            out,
            "build log",
            f"{entries} kernel entry points; registers and flags: python -m kda_dhu --doctor --verbose",
        )
        return
    print("  build log (compilers, headers, flags, ptxas per entry point):", file=out)
    for ln in info.splitlines():
        print(f"    {build_log_line(ln)}", file=out)


@_section("CUDA driver")
def _driver(out) -> None:
    import kda_dhu

    usable, message = kda_dhu.cuda_status()
    _line(out, "usable", "yes" if usable else "no")
    _line(out, "driver says", message)


def _gpus() -> list:
    """[(index, name, (major, minor), total bytes)] of torch's CUDA devices ([] without)."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append((i, p.name, (p.major, p.minor), p.total_memory))
    return found


def _kernel_on(index: int) -> str:
    """The planner's "capable" verdict for a small call (B1 T64 H1 K128 V64 bf16, gk) on
    cuda:<index>: which kernel this GPU runs, or why none (the planner owns that rule)."""
    import torch

    from . import _dispatch
    from . import _measure as bench

    if _dispatch._core is None:
        return "unknown (no compiled extension)"
    device = f"cuda:{index}"
    a = bench.make_inputs(1, 64, 1, 1, 128, 64, torch.bfloat16, "gk", device=device)
    with torch.cuda.device(index):
        ok, reason = _dispatch._core.decide(
            "capable", a["q"], a["k"], a["w"], a["do"], a["dv"], gk=a["gk"], h0=a["h0"], dht=a["dht"]
        ).verdict
    return reason if ok else f"no kernel: fla's function runs ({reason})"


def _image_on(index: int) -> str:
    """The kernel image cuda:<index> loads (KDA_DHU_IMAGE picks one), or why none runs."""
    from . import _dispatch

    core = _dispatch._core
    if core is None:
        return "unknown (no compiled extension)"
    return core.kernel_image(index) or core.kernel_unavailable(index) or "none"


@_section("GPUs")
def _gpu_section(out) -> None:
    gpus = _gpus()
    if not gpus:
        _line(
            out, "GPUs", "none: torch sees no CUDA device (CPU tensors run on the CPU path of the Rust core)"
        )
        return
    for i, name, (major, minor), total in gpus:
        _line(out, f"cuda:{i}", f"{name}, sm_{major}{minor}, {total / 2**30:.0f} GiB")
        _line(out, "  kernel", _kernel_on(i))
        _line(out, "  kernel image", _image_on(i))


@_section("fla's backend registry")
def _registry(out) -> None:
    from . import _autoregister

    _line(out, "auto-registration", _autoregister.state["status"])
    if importlib.util.find_spec("fla") is None:
        _line(out, "fla", "not installed: no registry")
        return
    with warnings.catch_warnings(record=True) as said:
        importlib.import_module(_autoregister.TARGET)  # fla's stage 4 and its registry
    for text in dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in said):
        _line(out, "fla warned on import", text)
    from . import fla_backend

    state = _autoregister.state
    _line(out, "after importing fla", state["status"] + (f" ({state['error']})" if state["error"] else ""))
    held = fla_backend.is_registered()
    _line(out, "kda_dhu in the registry", "yes" if held else "no")
    if not held:
        print(
            "  (kda_dhu.register_backend() registers by hand; kda_dhu.patch() works with any fla)",
            file=out,
        )
    value = os.environ.get(fla_backend.ENV_VAR)
    on = value is None or value != "0"
    _line(
        out,
        fla_backend.ENV_VAR,
        f"{'unset' if value is None else repr(value)}: the backend is {'on' if on else 'off'}",
    )


@_section("environment switches")
def _environment(out) -> None:
    from . import _core

    for name, meaning, value in _core.switches():
        _line(out, name, f"{'unset' if value is None else repr(value)}  ({meaning})")
    others = sorted(
        n for n in os.environ if n.startswith(ENV_PREFIX) and n not in {s[0] for s in _core.switches()}
    )
    for name in others:
        _line(out, name, f"{os.environ[name]!r} (not a switch kda-dhu reads)")


@_section("the planner's measured clauses (where the kernel measured slower than fla)")
def _policy(out) -> None:
    from . import _core

    gpus = _gpus()
    if not gpus:
        print("  no GPU here: the clauses depend on the GPU's SM count", file=out)
        return
    clauses = _core.policy(0)
    if not clauses:
        print("  none: every call the kernel computes runs on it (src/plan.rs, POLICY)", file=out)
    for name, when, _measured_on, record, note in clauses:
        print(f"  {name}: fla when {when}", file=out)
        print(f"      cuda:0: {note}; record {record}", file=out)


def _verdicts(row) -> tuple:
    """(route, b2a route) of a SHAPES row on cuda:0: the planner's verdicts on the row's
    inputs, built there and freed on return."""
    import kda_dhu

    from . import _measure as bench

    a, _ = bench.row_inputs(row, device="cuda:0")
    ok, reason = kda_dhu.plan_call(**a)
    route = reason if ok else f"fla ({reason})"
    if a.get("gk") is None or a.get("cu_seqlens") is not None or a.get("state_v_first"):
        return route, "not expressible"
    b_ok, b_reason = kda_dhu.plan_b2a(
        a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], a["scale"], a["chunk_size"]
    )
    return route, b_reason if b_ok else f"fla ({b_reason})"


@_section("routes of the README's shapes on cuda:0 (the planner's verdicts)")
def _routes(out) -> None:
    if not _gpus():
        print(
            "  no GPU here: the planner judges calls on a CUDA device, so there is no route to show", file=out
        )
        return
    import torch

    from . import _measure as bench

    print("  shape: fla's backend / chunk_gated_delta_rule_bwd_dhu; kda_dhu_b2a", file=out)
    for row in bench.SHAPES:
        try:
            route, b2a = _verdicts(row)
        except torch.cuda.OutOfMemoryError:
            route, b2a = "not judged: not enough free GPU memory for its inputs", "-"
        finally:
            torch.cuda.empty_cache()
        print(f"  {row[0]:<26} {route}; b2a: {b2a}", file=out)


def main(out=None, verbose: bool = False) -> int:
    """Prints every section to ``out`` (stdout); ``verbose`` adds the build log (paths,
    flags, registers per kernel entry point). Returns 0."""
    out = out or sys.stdout
    print("kda_dhu doctor" + (" (verbose)" if verbose else ""), file=out)
    _versions(out)
    _extension(out, verbose=verbose)
    for section in (_driver, _gpu_section, _registry, _environment, _policy, _routes):
        section(out)
    return 0
