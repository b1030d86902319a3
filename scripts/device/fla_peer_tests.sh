#!/usr/bin/env bash
# There (the GPU machine, via the device tool): fla's own tests, a peer's suite for the
# drop-in, with kda-dhu registered in fla's backend registry (both scans on), sharded over
# pytest processes on the one GPU; kda-dhu's kernel launches per test module
# (scripts/device/kda_launch_count.py), so that a run whose calls all went to fla shows it.
#   here:   FLA_TESTS_FROM=/work/.mirror/fla-org+flash-linear-attention/repo bash scripts/device/device_prepare.sh
#   there:  run(command="bash scripts/device/fla_peer_tests.sh ops/test_kda.py -k 'test_chunk and not prefill'", carry=[".carry"])
# The arguments are pytest's selection inside .carry/fla_tests/; or PEER_IDS=<file of test
# ids> (relative to .carry/fla_tests/). Environment: PEER_SHARDS (8), PEER_BUDGET (seconds
# for the whole script, 560), PEER_TIMEOUT (per test, 450), PEER_ENV (extra VAR=VALUE ...,
# e.g. "KDA_DHU_FWD_H=off"; KDA_DHU_FWD_H=on otherwise), PEER_REGISTER=0 to run fla alone
# (kda-dhu not imported: is a failure fla's own?).
# A fresh machine spends ~200 s per shard on its first case (Triton compiles and tunes fla's
# kernels for each new head size): ask for few cases per shard, or carry Triton's cache.
# Output in $OUT: peer-summary.txt (one line per test with its verdict, the launch counts,
# each shard's pytest summary line and exit status) and peer-logs.tar.xz (every shard's log).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
REPO=$(pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${PEER_BUDGET:-560}
SHARDS=${PEER_SHARDS:-8}
DIR=.carry/fla_tests
[ -d "$DIR/ops" ] || { echo "fla_peer_tests: no $DIR/ops (FLA_TESTS_FROM=... device_prepare.sh here)"; exit 2; }
if compgen -G ".carry/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} FLA_CACHE_RESULTS=0
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .carry/triton_cache.tar.xz ]; then tar xJf .carry/triton_cache.tar.xz -C "$TRITON_CACHE_DIR"; fi
plugin=(-p kda_launch_count)
if [ "${PEER_REGISTER:-1}" = 0 ]; then
  plugin=()
  export PYTHONPATH=/tmp/site KDA_DHU_NO_AUTOREGISTER=1 FLA_KDA_DHU=0
else
  export PYTHONPATH=/tmp/site:$REPO/scripts/device KDA_DHU_FWD_H=on
fi
# a per-test limit where pytest-timeout is installed (the GPU image has it)
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout="${PEER_TIMEOUT:-450}")
RES=$(mktemp -d)
cd "$DIR"
if [ -n "${PEER_IDS:-}" ]; then
  cp "$PEER_IDS" "$RES/ids.txt"
else
  # ids relative to this folder (pytest prints them from its rootdir: the repository's, where
  # its pyproject.toml is)
  timeout 120 python3 -m pytest --collect-only -q -p no:cacheprovider "$@" 2>"$RES/collect.err" | grep "::" \
    | sed -E 's#^(.*/)?fla_tests/##' > "$RES/ids.txt"
fi
n=$(wc -l < "$RES/ids.txt")
echo "fla_peer_tests: $n tests, $SHARDS shards, fla's tests at $(cat REV 2>/dev/null || echo '?')"
pids=()
for i in $(seq 0 $((SHARDS - 1))); do
  awk -v s="$i" -v n="$SHARDS" 'NR % n == s' "$RES/ids.txt" > "$RES/shard_$i.txt"
  [ -s "$RES/shard_$i.txt" ] || continue
  left=$(( BUDGET - 30 - ($(date +%s) - T0) ))
  (
    mapfile -t ids < "$RES/shard_$i.txt"
    # shellcheck disable=SC2086
    env ${PEER_ENV:-} timeout --kill-after=5 "$left" python3 -m pytest "${plugin[@]}" -p no:cacheprovider -v -rfE \
      "${per_test[@]}" "${ids[@]}" > "$RES/pytest_$i.log" 2>&1
    echo "exit status $?" >> "$RES/pytest_$i.log"
  ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
{
  echo "fla_peer_tests: $n tests, $SHARDS shards, $(( $(date +%s) - T0 )) s; fla's tests at $(cat REV 2>/dev/null || echo '?')"
  grep -hE " (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)" "$RES"/pytest_*.log | sed -E 's/ +\[ *[0-9]+%\]$//'
  grep -hE "^kda_dhu launches" "$RES"/pytest_*.log
  for f in "$RES"/pytest_*.log; do
    echo "$(basename "$f"): $(grep -E '^=+ .*(passed|failed|error).* in ' "$f" | tail -n 1) $(tail -n 1 "$f")"
  done
} > "$OUT/peer-summary.txt"
tar cJf "$OUT/peer-logs.tar.xz" -C "$RES" .
awk '{print $NF}' "$OUT/peer-summary.txt" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)$" | sort | uniq -c
grep -E "FAILED$|ERROR$|launches: total|exit status" "$OUT/peer-summary.txt" | head -n 30
