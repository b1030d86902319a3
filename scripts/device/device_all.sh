#!/usr/bin/env bash
# There (the GPU machine, via the device tool): the whole GPU check in one call.
#   1. the GPU tests, sharded over SHARDS parallel pytest processes (fla's Triton
#      autotuning compiles on the CPU: shards overlap it), with compute-sanitizer's
#      memcheck / racecheck / synccheck (scripts/device/sanitize.sh) running alongside;
#   2. then, alone on the GPU, the benchmark (BENCH_ARGS, default --all).
# Logs come back as $OUT/logs.tgz.
#   run(command="bash scripts/device/device_all.sh [pytest -k expr]", carry=[".carry"])
# Environment: SHARDS (4), TEST_PATHS (tests: the GPU tests collected), PHASE1_TIMEOUT (330 s), BENCH_TIMEOUT (220 s), SKIP_SAN=1,
# SKIP_BENCH=1, SKIP_TESTS=1, E2E=1 (+E2E_ARGS, E2E_DEVICE), CP=1 (+CP_ARGS), BENCH_CMD (python3 benches/bench.py), BENCH_ARGS (--all).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# $OUT brings back at most 8 files: logs go to $RES, tarred into $OUT/logs.tgz at the end.
RES=/tmp/res; rm -rf "$RES"; mkdir -p "$RES"
t_start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t_start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl || exit 1
export PYTHONPATH=/tmp/site
export KDA_DHU_COMMIT=$(cat .carry/COMMIT 2>/dev/null || echo unknown)
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p "$TRITON_CACHE_DIR"
[ -f .carry/triton_cache.tgz ] && tar xzf .carry/triton_cache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
[ -f .carry/triton_cache.tar.xz ] && tar xJf .carry/triton_cache.tar.xz -C "$TRITON_CACHE_DIR" 2>/dev/null
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, fla, kda_dhu; print('torch', torch.__version__, 'fla', fla.__version__, 'kda_dhu', kda_dhu.cuda_status())"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  SHARDS=${SHARDS:-4}
  # shellcheck disable=SC2086
  python3 -m pytest ${TEST_PATHS:-tests} -q -m gpu -p no:cacheprovider --collect-only "$@" 2>/dev/null | grep "::" > "$RES/ids.txt"
  stamp "collected $(wc -l < "$RES/ids.txt") GPU tests, $SHARDS shards"
  pids=()
  for s in $(seq 0 $((SHARDS - 1))); do
    awk -v s="$s" -v n="$SHARDS" 'NR % n == s' "$RES/ids.txt" > "/tmp/shard_$s.txt"
    timeout --kill-after=10 "${PHASE1_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider --timeout=200 \
      $(cat "/tmp/shard_$s.txt") > "$RES/pytest_$s.log" 2>&1 &
    pids+=($!)
  done
  if [ -z "${SKIP_SAN:-}" ]; then
    OUT=$RES SKIP_INSTALL=1 SAN_TIMEOUT=$(( ${PHASE1_TIMEOUT:-330} / 3 - 5 )) timeout "${PHASE1_TIMEOUT:-330}" bash scripts/device/sanitize.sh > "$RES/sanitize.log" 2>&1 &
    san=$!
  fi
  # On a machine of two GPUs: the end-to-end run (on cuda:1, E2E=1) and fla's context-
  # parallel check (both GPUs, CP=1) alongside the tests.
  extra=()
  if [ -n "${E2E:-}" ]; then
    CUDA_VISIBLE_DEVICES=${E2E_DEVICE:-1} timeout --kill-after=10 "${PHASE1_TIMEOUT:-330}" \
      python3 benches/e2e.py --out "$RES" ${E2E_ARGS:-} > "$RES/e2e.log" 2>&1 &
    extra+=($!)
  fi
  if [ -n "${CP:-}" ]; then
    OUT=$RES timeout --kill-after=10 "${PHASE1_TIMEOUT:-330}" python3 -m torch.distributed.run --standalone \
      --nproc_per_node=2 benches/cp_check.py --require-kernel all --out "$RES" ${CP_ARGS:-} > "$RES/cp_check.log" 2>&1 &
    extra+=($!)
  fi
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  stamp "tests done (rc $rc)"
  for p in "${extra[@]}"; do wait "$p" || rc=1; done
  [ -n "${E2E:-}" ] && { stamp "e2e done"; tail -n 25 "$RES/e2e.log"; }
  [ -n "${CP:-}" ] && { stamp "cp_check done"; tail -n 25 "$RES/cp_check.log"; }
  for s in $(seq 0 $((SHARDS - 1))); do
    grep -E "passed|failed|error|FAILED|ERROR" "$RES/pytest_$s.log" | tail -n 12
  done
  if [ -n "${san:-}" ]; then wait "$san" || rc=1; stamp "sanitizers done"; tail -n 6 "$RES/sanitize.log"; fi
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  # shellcheck disable=SC2086
  timeout --kill-after=10 "${BENCH_TIMEOUT:-220}" ${BENCH_CMD:-python3 benches/bench.py} ${BENCH_ARGS:---all} --out "$OUT" > "$RES/bench.log" 2>&1 || rc=1
  stamp "bench done"; grep -v "it/s\|s/it" "$RES/bench.log" | tail -n 20
fi
(cd "$RES" && tar czf "$OUT/logs.tgz" .)
stamp "end (rc $rc)"
exit $rc
