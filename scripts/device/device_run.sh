#!/usr/bin/env bash
# There (the GPU machine, via the device tool): install the carried wheels into a
# private target, then run the GPU tests and the benchmark in one call.
#   bash scripts/device/device_run.sh [--bench-only|--tests-only|--e2e] [extra pytest / e2e args]
# Sanitizers are their own call: bash scripts/device/sanitize.sh [memcheck racecheck synccheck]
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl || exit 1
export PYTHONPATH=/tmp/site
export KDA_DHU_COMMIT=$(cat .carry/COMMIT 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, fla, kda_dhu; print('torch', torch.__version__, 'fla', fla.__version__, 'kda_dhu', kda_dhu.__file__, kda_dhu.cuda_status())"
mode=all
case "${1:-}" in
  --bench-only) mode=bench; shift;;
  --tests-only) mode=tests; shift;;
  --e2e) mode=e2e; shift;;
esac
rc=0
if [ "$mode" = e2e ]; then
  python3 benches/e2e.py --out "$OUT" "$@" 2>&1 | tee "$OUT/e2e.log"
  exit ${PIPESTATUS[0]}
fi
if [ "$mode" != bench ]; then
  python3 -m pytest tests -q --maxfail=8 -m gpu -p no:cacheprovider --timeout=180 "$@" 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$mode" != tests ]; then
  python3 benches/bench.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
exit $rc
