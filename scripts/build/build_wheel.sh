#!/usr/bin/env bash
# Builds kda-dhu's wheel for clusters: one abi3 wheel (CPython >= 3.10) for
# manylinux_2_28 x86_64, with the CUDA 12 and CUDA 13 kernel images inside, linked
# against no CUDA library (libcuda is opened at run time). Installing it needs neither
# Rust nor a CUDA compiler. Then proves that: installs the wheel into a fresh venv whose
# PATH has no cargo, rustc or nvcc and whose site holds only torch, fla-core, numpy and
# pytest (with what they require), and runs the CPU tests there, from a copy of tests/
# outside the source tree. Prints the time of each step.
#
#   bash scripts/build/build_wheel.sh             # build into dist/, then test the wheel
#   bash scripts/build/build_wheel.sh --no-test   # build only
#
# Environment:
#   PYTHON     the Python that builds (default python3); it needs pip. maturin, ziglang
#              (maturin --zig links against glibc 2.28 with zig), auditwheel and
#              pyproject's [build-system] requires (nvcc 13, NVRTC 12.9, the CUDA 12
#              headers, CUTLASS; about 1.3 GB) are pip-installed into it when missing.
#   WHEEL_DIR  where the wheel goes (default dist/)
#   TEST_DEPS  "link" (default): the test venv sees PYTHON's own torch, fla-core,
#              numpy and pytest through symlinks (scripts/build/site_view.py; no download);
#              "pypi": they are pip-installed into the test venv (torch: a few GB).
#   KEEP_TEST  1: keep the test folder (printed) instead of removing it.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT=${WHEEL_DIR:-dist}
TEST_DEPS=${TEST_DEPS:-link}
test_it=1
[ "${1:-}" = "--no-test" ] && test_it=0
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

now() { date +%s; }
declare -a timings=()
step() { timings+=("$1: $(($(now) - $2)) s"); }

t=$(now)
echo "== build environment ($PY)"
reqs=$("$PY" -c '
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["build-system"]["requires"]))
')
# shellcheck disable=SC2086 # one requirement per line, none with spaces
"$PY" -m pip install -q ziglang auditwheel $reqs
step "build environment" "$t"

t=$(now)
echo "== maturin build --zig --compatibility manylinux_2_28 (nvcc 13 and NVRTC 12 compile the kernels)"
mkdir -p "$OUT"
rm -f "$OUT"/kda_dhu-*-manylinux_2_28_x86_64.whl
# maturin's own executable (python -m maturin looks only in PYTHON's scripts folder).
MATURIN=$(dirname "$PY")/maturin
[ -x "$MATURIN" ] || MATURIN=$(command -v maturin) || { echo "error: no maturin executable" >&2; exit 1; }
# zig from the ziglang wheel, on PATH (maturin looks there first).
ZIG_DIR=$("$PY" -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')
PATH="$ZIG_DIR:$PATH" "$MATURIN" build --release --zig --compatibility manylinux_2_28 --interpreter "$PY" --out "$OUT"
WHEEL=$(ls "$OUT"/kda_dhu-*-cp310-abi3-manylinux_2_28_x86_64.whl)
step "wheel build" "$t"
echo "== $WHEEL ($(du -h "$WHEEL" | cut -f1))"
# auditwheel reads the extension's ELF: no library outside the manylinux_2_28 set, no
# glibc symbol newer than 2.28 (prints the tag the wheel is consistent with).
shown=$("$PY" -m auditwheel show "$WHEEL")
echo "$shown" | sed 's/^/   /'
echo "$shown" | tr -s ' \n' ' ' | grep -q 'platform tag: "manylinux_2_28_x86_64"' \
    || { echo "error: the wheel is not manylinux_2_28" >&2; exit 1; }

if [ "$test_it" = 0 ]; then
    printf '== timings\n'; printf '   %s\n' "${timings[@]}"
    exit 0
fi

t=$(now)
TEST=$(mktemp -d "${TMPDIR:-/tmp}/kda_dhu_wheel_test.XXXXXX")
if [ "${KEEP_TEST:-0}" = 1 ]; then
    echo "== test folder: $TEST (kept)"
else
    trap 'rm -rf "$TEST"' EXIT
fi
echo "== clean venv ($TEST/venv), dependencies: $TEST_DEPS"
"$PY" -m venv "$TEST/venv"
VPY=$TEST/venv/bin/python
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$TEST_DEPS" = pypi ]; then
    "$VPY" -m pip install -q torch fla-core numpy pytest
else
    "$PY" scripts/build/site_view.py "$TEST/deps" torch fla-core numpy pytest | sed 's/^/   /'
    echo "$TEST/deps" > "$SITE/kda_dhu_test_deps.pth"
    # The venv's own setuptools (Python < 3.12) would shadow the one torch requires.
    "$VPY" -m pip uninstall -q -y setuptools 2>/dev/null || true
fi
step "test venv" "$t"

t=$(now)
echo "== pip install the wheel (no index: nothing is downloaded or built)"
# Only what a cluster node has: the venv, the system's binaries, no Rust, no CUDA toolkit.
clean_env=(env -i HOME="$HOME" LANG=C.UTF-8 TMPDIR="${TMPDIR:-/tmp}" PATH="$TEST/venv/bin:/usr/bin:/bin")
"${clean_env[@]}" "$VPY" -m pip install -q --no-index --no-deps "$WHEEL"
# The wheel's own requirements are met (the environment's other conflicts, if any, are
# PYTHON's and only shown).
checked=$("${clean_env[@]}" "$VPY" -m pip check 2>&1) || true
echo "$checked" | sed 's/^/   pip check: /'
if echo "$checked" | grep -qi '^kda[-_]dhu '; then
    echo "error: the wheel's requirements are not met" >&2
    exit 1
fi
"${clean_env[@]}" "$VPY" - "$TEST/venv" <<'EOF'
import os, shutil, sys
import kda_dhu
from kda_dhu import _core

venv = sys.argv[1]
assert kda_dhu.__file__.startswith(venv), f"kda_dhu imported from {kda_dhu.__file__}, not the wheel"
for tool in ("cargo", "rustc", "nvcc"):
    assert shutil.which(tool) is None, f"{tool} on PATH: {shutil.which(tool)}"
for d in sys.path:
    for rel in ("nvidia/cu13/bin/nvcc", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "cutlass_library"):
        assert not os.path.exists(os.path.join(d, rel)), f"a compiler is importable: {d}/{rel}"
print("   kda_dhu", kda_dhu.__version__, "from", os.path.dirname(kda_dhu.__file__))
print("   images:", sorted(_core.embedded_kernels()))
print("   cuda_status:", kda_dhu.cuda_status())
EOF
step "wheel install + import" "$t"

t=$(now)
echo "== CPU tests from the installed wheel"
mkdir -p "$TEST/src"
# The tests read benches/, scripts/ (scripts they run), docs/, README.md and
# cuda/dhu_layout.h; the package comes from the wheel (tests/conftest.py only adds
# python/ when no kda_dhu is importable).
cp -r "$ROOT/tests" "$ROOT/benches" "$ROOT/scripts" "$ROOT/docs" "$ROOT/README.md" "$TEST/src/"
# The kernels' numbers' one owner, which tests/unit/test_kernel_facts.py reads beside the core's.
mkdir -p "$TEST/src/cuda" && cp "$ROOT/cuda/dhu_layout.h" "$TEST/src/cuda/"
(cd "$TEST/src" && "${clean_env[@]}" "$VPY" -m pytest tests -q -p no:cacheprovider)
step "CPU tests" "$t"

printf '== timings\n'; printf '   %s\n' "${timings[@]}"
