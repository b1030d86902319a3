#!/usr/bin/env bash
# Here (any machine with nvcc and the CUTLASS headers; no GPU): compiles
# scripts/build/layout_check_regstate.cu as a host program against cuda/dhu_sm90_regstate.cuh
# and runs it: CuTe's wgmma A / C layouts, the shared-memory layouts behind the
# descriptors and the ldmatrix / stmatrix lane addresses against the kernel's fragment
# geometry. Exit status 0 when every check holds.
#   bash scripts/build/layout_check_regstate.sh
# nvcc: $NVCC, else the nvidia-cuda-nvcc wheel of `python3`; CUTLASS: $CUTLASS_DIR/include,
# else the nvidia-cutlass wheel (as build.rs finds them).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
NVCC=${NVCC:-$($PY -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'bin', 'nvcc'))")}
if [ -n "${CUTLASS_DIR:-}" ]; then
  CUT=$CUTLASS_DIR/include
else
  CUT=$($PY -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$NVCC" -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -L "$(dirname "$NVCC")/../lib" -I cuda -I "$CUT" -o "$tmp/layout_check" \
  scripts/build/layout_check_regstate.cu
# (CuTe prints "cast_smem_ptr_to_uint not supported" when the descriptors are built on
# the host: their start addresses are then relative to a zero base, which is all the
# check reads.)
status=0
"$tmp/layout_check" >"$tmp/out" 2>&1 || status=$?
grep -v "cast_smem_ptr_to_uint not supported" "$tmp/out" || true
exit $status
