#!/usr/bin/env bash
# There (the GPU machine, via the device tool): the project's GPU work in one call, by stage.
#   here:   bash scripts/device/device_prepare.sh        (wheel + fla-core into .carry/)
#   there:  run(command="bash scripts/device/gpu_session.sh tests sanitize host", carry=[".carry"], timeout_s=600)
#   plan:   bash scripts/device/gpu_session.sh --plan e2e bench ab    (what would run, in which order, within
#           which limits; no GPU, nothing installed)
#
# Stages (run in this order whatever the order given; default: tests sanitize host e2e):
#   smoke     always, first: install .carry/*.whl into /tmp/site, import kda_dhu and fla, print
#             kda_dhu.cuda_status(), run two kernel calls against the float64 reference
#             (scripts/device/sanitize_driver.py's first cases). If it fails, nothing else runs.
#   tests     the GPU tests (pytest -m gpu over TEST_PATHS, default tests), dealt from a fixed shuffle over
#             TEST_SHARDS (8) pytest processes on the one GPU, the ids matching TEST_HEAVY (a grep -E
#             pattern of the slow kinds) dealt first; TEST_ARGS extra pytest arguments.
#             They share Triton's compiled kernels with the later stages but store no autotuning
#             result (FLA_CACHE_RESULTS=0: tuned beside other shards, fla's choices could be off)
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck (scripts/device/sanitize.sh); beside the
#             tests when both are asked (neither times anything)
#   image12   the same GPU suite with the CUDA 12 image (NVRTC 12.9) forced (KDA_DHU_IMAGE=cuda12;
#             the image loaded is printed first)
#             tests and image12 each write their counts (collected, passed, failed, skipped, the
#             failed tests), gathered with the commit, GPU and date into gpu-suite-latest.json
#   main      the main job, `python -m kda_dhu`, twice: as on a fresh machine (an empty Triton
#             cache: fla compiles and tunes its kernel) and warm (that cache kept); the seconds of
#             each in the summary (MAIN_ARGS: extra arguments)
#   host      benches/host_overhead.py (HOST_ARGS)            -> host-latest.json
#   e2e       benches/e2e.py (E2E_ARGS)                       -> e2e-latest.json
#   bench     python benches/bench.py (BENCH_ARGS, default --all; BENCH_SHAPES=a,b for a subset)
#                                                             -> bench-latest.json
#   ab        benches/variants.py: AB_VARIANTS (default "1 2": warpgroups per CTA), the switch AB_SWITCH
#             (default KDA_DHU_SM90_NWG), AB_SHAPES (a default subset), AB_ARGS -> variants.json
# main, host, e2e, bench and ab run one after another, alone on the GPU.
#
# Time: SESSION_BUDGET seconds (default 540) from this script's start, RESERVE_S (25) of it kept
# for packing. Each stage runs under `timeout` for the smaller of its cap and what is left; a
# stage with less left than its minimum is skipped (the summary says so). Caps / minimums in
# seconds, override with <STAGE>_CAP: tests 330/120, sanitize 170/45, image12 330/120, main 240/60,
# host 150/60, e2e 480/150,
# bench 240/60, ab 180/45. Expected on an H200 (fresh machine, no Triton cache carried): smoke
# 20-40, tests 190-300 (sanitize beside it, 30-60), host 60-120 (fla's stage-4 kernel compiled for
# four keys), e2e 300-420 (fla compiles and tunes KDA's kernels: ~250 s for the dense shape,
# more for the packed one), bench 200-240, ab 60-180. With the Triton cache of an earlier
# session carried (.carry/triton_cache.tar.xz), e2e should drop to about 60-120 s.
#
# SESSION_DIR (default /tmp/gpu_session): where the stages write before packing.
# Every stage survives the others failing; the exit status is 0 when every stage asked ran
# and passed, 3 when the smoke step failed, else 1. Output in $OUT (8 files at most):
#   summary.txt          the summary table (also printed last)
#   logs.tar.xz          every log and record of every stage (per-shard pytest logs, sanitizer
#                        logs, the dated record copies, the markdown tables)
#   host-latest.json, e2e-latest.json, bench-latest.json, variants.json   the stages' records
#                        (a stage cut short: its partial record, *-partial.json, instead)
#   triton_cache.tar.xz  Triton's cache (compiled kernels and fla's autotuning results) for the
#                        next session: copy it to .carry/ (device_prepare.sh keeps it there).
#                        TRITON_CACHE_OUT=0 to leave it out; over 15 MiB, only the tuning results;
#                        packed in what is left before DEVICE_LIMIT_S (590 s) from the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
ALL_STAGES=(smoke tests sanitize image12 main host e2e bench ab)
declare -A CAP=([smoke]=0 [main]=240 [tests]=330 [sanitize]=170 [image12]=330 [host]=150 [e2e]=480 [bench]=240 [ab]=180)
declare -A MIN=([smoke]=0 [main]=60 [tests]=120 [sanitize]=45 [image12]=120 [host]=60 [e2e]=150 [bench]=60 [ab]=45)
for s in "${ALL_STAGES[@]}"; do
  v="${s^^}_CAP"
  [ -n "${!v:-}" ] && CAP[$s]=${!v}
done
BUDGET=${SESSION_BUDGET:-540}
RESERVE=${RESERVE_S:-25}

plan=0
asked=()
for a in "$@"; do
  case "$a" in
    --plan) plan=1;;
    -h|--help) sed -n '2,56p' "$0"; exit 0;;
    smoke|main|tests|sanitize|image12|host|e2e|bench|ab) asked+=("$a");;
    *) echo "gpu_session: unknown stage '$a' (stages: ${ALL_STAGES[*]:1})" >&2; exit 2;;
  esac
done
[ ${#asked[@]} -eq 0 ] && asked=(tests sanitize host e2e)
declare -A WANT=([smoke]=1)
for a in "${asked[@]}"; do WANT[$a]=1; done
STAGES=()
for s in "${ALL_STAGES[@]}"; do [ -n "${WANT[$s]:-}" ] && STAGES+=("$s"); done

if [ "$plan" = 1 ]; then
  echo "gpu_session plan: budget ${BUDGET} s (${RESERVE} s kept for packing)"
  for s in "${STAGES[@]}"; do
    if [ "$s" = smoke ]; then echo "  smoke: first, always; the session stops if it fails"; continue; fi
    extra=""
    [ "$s" = sanitize ] && [ -n "${WANT[tests]:-}" ] && extra=" (beside tests)"
    echo "  $s: cap ${CAP[$s]} s, skipped under ${MIN[$s]} s$extra"
  done
  exit 0
fi

export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES=${SESSION_DIR:-/tmp/gpu_session}; rm -rf "$RES"; mkdir -p "$RES"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}; mkdir -p "$TRITON_CACHE_DIR"
declare -A STATUS SECS DETAIL
elapsed() { echo $(( $(date +%s) - T0 )); }
stamp() { echo "[$(elapsed) s] $*"; }

# limit NAME: sets LIMIT to the seconds this stage may run now, 0 (and the stage's status)
# when too little is left
limit() {
  local left=$(( BUDGET - RESERVE - $(elapsed) ))
  LIMIT=${CAP[$1]}
  (( left < LIMIT )) && LIMIT=$left
  if (( left < ${MIN[$1]} )); then
    STATUS[$1]="skipped"; DETAIL[$1]="budget: ${left} s left, needs ${MIN[$1]} s"; SECS[$1]=0
    LIMIT=0
  fi
}

# verdict NAME RC SECONDS: the stage's status from its exit code
verdict() {
  SECS[$1]=$3
  case "$2" in
    0) STATUS[$1]="ok";;
    124|137) STATUS[$1]="TIMEOUT";;
    *) STATUS[$1]="FAILED (rc $2)";;
  esac
}

# ---------------------------------------------------------------------------- smoke
smoke() {
  local s; s=$(date +%s)
  mkdir -p "$RES/smoke"
  (
    nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1
    if ! compgen -G ".carry/*.whl" >/dev/null; then
      echo "smoke: no wheel in .carry/ (run scripts/device/device_prepare.sh here and carry .carry)"; exit 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl || exit 1
    if [ -f .carry/triton_cache.tar.xz ]; then
      tar xJf .carry/triton_cache.tar.xz -C "$TRITON_CACHE_DIR" && echo "smoke: Triton cache unpacked ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
    fi
    python3 - <<'EOF' || exit 1
import os, sys
import torch
import kda_dhu
import fla
ok, why = kda_dhu.cuda_status()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), fla {fla.__version__}, kda_dhu {kda_dhu.__version__} "
      f"at {os.environ.get('KDA_DHU_COMMIT')} from {kda_dhu.__file__}")
print(f"cuda_status: {ok}, {why}")
print(f"device: {torch.cuda.get_device_name()} {torch.cuda.get_device_capability()}")
sys.exit(0 if ok and torch.cuda.is_available() else 1)
EOF
    timeout 60 python3 scripts/device/sanitize_driver.py --cases envelope_k128_bf16,varlen_1_63_65_7
  ) > "$RES/smoke/smoke.log" 2>&1
  local rc=$?
  verdict smoke $rc $(( $(date +%s) - s ))
  DETAIL[smoke]=$(grep -E "^(torch |device:|sanitize_driver:)" "$RES/smoke/smoke.log" | paste -sd ';' | cut -c1-200)
  [ $rc -ne 0 ] && DETAIL[smoke]="$(tail -n 3 "$RES/smoke/smoke.log" | tr '\n' ' ' | cut -c1-200)"
  return $rc
}

# ---------------------------------------------------------------------------- the GPU suite
# run_suite STAGE LIMIT [VAR=VALUE...]: the GPU tests dealt (shuffled, round-robin) over TEST_SHARDS pytest
# processes under LIMIT seconds, in this environment plus VAR=VALUE; logs in $RES/STAGE, the
# counts in $RES/STAGE/counts.json (gpu-suite-latest.json gathers them)
run_suite() {
  local stage=$1 limit=$2; shift 2
  local dir=$RES/$stage s pids=() shards=${TEST_SHARDS:-8}
  mkdir -p "$dir"
  s=$(date +%s)
  # shellcheck disable=SC2086
  env "$@" timeout 120 python3 -m pytest ${TEST_PATHS:-tests} -q -m gpu -p no:cacheprovider --collect-only ${TEST_ARGS:-} \
    > "$dir/collect.log" 2>&1
  grep "::" "$dir/collect.log" > "$dir/ids.txt"
  local n; n=$(wc -l < "$dir/ids.txt")
  local left=$(( limit - ($(date +%s) - s) ))
  stamp "$stage: $n collected, $shards shards (limit ${left} s)"
  if (( n == 0 )); then
    STATUS[$stage]="FAILED (no test collected)"; SECS[$stage]=$(( $(date +%s) - s ))
    DETAIL[$stage]=$(tail -n 2 "$dir/collect.log" | tr '\n' ' ' | cut -c1-200)
    return
  elif (( left < 30 )); then
    STATUS[$stage]="skipped"; SECS[$stage]=$(( $(date +%s) - s )); DETAIL[$stage]="collection left ${left} s"
    return
  fi
  # Dealt round-robin from a fixed shuffle of the ids (shuf, seeded by a constant stream), the
  # slow kinds first (HEAVY: the cases that compile and tune fla's kernels or torch.compile), so
  # that they spread evenly: dealt in collection order, a parametrized test whose period divides
  # the shard count put its 18 FORCE=fla cases in two of eight shards, one of which ran past the limit.
  local heavy=${TEST_HEAVY:-FORCE=fla|kernel_unavailable|selfcheck|compile}
  shuf --random-source=<(yes kda-dhu) "$dir/ids.txt" > "$dir/ids_shuffled.txt"
  { grep -E -- "$heavy" "$dir/ids_shuffled.txt"; grep -v -E -- "$heavy" "$dir/ids_shuffled.txt"; } > "$dir/ids_dealt.txt"
  for i in $(seq 0 $((shards - 1))); do
    awk -v s="$i" -v n="$shards" 'NR % n == s' "$dir/ids_dealt.txt" > "$dir/shard_$i.txt"
    [ -s "$dir/shard_$i.txt" ] || continue
    (
      mapfile -t ids < "$dir/shard_$i.txt"
      # shellcheck disable=SC2086
      # FLA_CACHE_RESULTS=0: Triton's compiled kernels are shared through the cache, but fla's
      # autotuning, timed here beside seven other shards, is not stored for the timed stages.
      env "$@" FLA_CACHE_RESULTS=0 timeout --kill-after=10 "$left" python3 -m pytest -q -p no:cacheprovider --timeout=200 -rfE --durations=15 \
        ${TEST_ARGS:-} "${ids[@]}" > "$dir/pytest_$i.log" 2>&1
    ) &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  local timed_out; timed_out=$(grep -L -E "[0-9]+ (passed|failed|error)" "$dir"/pytest_*.log | wc -l)
  verdict "$stage" $rc $(( $(date +%s) - s ))
  (( timed_out > 0 )) && STATUS[$stage]="FAILED ($timed_out shard(s) cut short)"
  DETAIL[$stage]="$n tests, $shards shards: $(tail -q -n 1 "$dir"/pytest_*.log | grep -oE "[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed)" \
    | sed 's/errors$/error/' | awk '{c[$2]+=$1} END {for (k in c) printf "%d %s, ", c[k], k}' | sed 's/, $//')"
  grep -h -E "^(FAILED|ERROR) " "$dir"/pytest_*.log | cut -c1-160 > "$dir/failed.txt"
  python3 scripts/device/suite_counts.py "$dir" "$n" "$timed_out" "${SECS[$stage]}" "$@" || true
}

# ---------------------------------------------------------------------------- tests (+ sanitize beside)
tests_and_sanitize() {
  local t_tests=0 t_san=0 s san_pid=""
  if [ -n "${WANT[tests]:-}" ]; then limit tests; t_tests=$LIMIT; fi
  if [ -n "${WANT[sanitize]:-}" ]; then limit sanitize; t_san=$LIMIT; fi
  if (( t_san > 0 )); then
    mkdir -p "$RES/sanitize"
    s=$(date +%s)
    ( OUT=$RES/sanitize SKIP_INSTALL=1 SAN_TIMEOUT=$(( t_san / 3 - 5 )) timeout --kill-after=15 "$t_san" \
        bash scripts/device/sanitize.sh > "$RES/sanitize/sanitize.log" 2>&1
      echo $? > "$RES/sanitize/rc"; echo $(( $(date +%s) - s )) > "$RES/sanitize/secs" ) &
    san_pid=$!
    stamp "sanitize started (limit ${t_san} s)"
  fi
  if (( t_tests > 0 )); then
    run_suite tests "$t_tests"
    stamp "tests: ${STATUS[tests]} (${DETAIL[tests]})"
  fi
  if [ -n "$san_pid" ]; then
    wait "$san_pid"
    verdict sanitize "$(cat "$RES/sanitize/rc" 2>/dev/null || echo 1)" "$(cat "$RES/sanitize/secs" 2>/dev/null || echo 0)"
    DETAIL[sanitize]=$(grep -E "^sanitize (memcheck|racecheck|synccheck):" "$RES/sanitize/sanitize.log" \
      | sed -E 's/^sanitize ([a-z]+): ([^;]*);.*/\1 \2/' | paste -sd ';')
    stamp "sanitize: ${STATUS[sanitize]} (${DETAIL[sanitize]})"
  fi
}

# ---------------------------------------------------------------------------- timed stages
# timed NAME COMMAND...: run alone on the GPU under the stage's limit, log in $RES/NAME/NAME.log
timed() {
  local name=$1; shift
  limit "$name"
  local t=$LIMIT
  (( t == 0 )) && { stamp "$name: ${STATUS[$name]} (${DETAIL[$name]})"; return; }
  mkdir -p "$RES/$name"
  stamp "$name: start (limit $t s)"
  local s; s=$(date +%s)
  timeout --kill-after=15 "$t" "$@" > "$RES/$name/$name.log" 2>&1
  verdict "$name" $? $(( $(date +%s) - s ))
  stamp "$name: ${STATUS[$name]}"
}

stage_main() {
  # As on a fresh machine: an empty Triton cache (fla compiles and tunes its stage-4 kernel);
  # then warm, that cache kept. Wall-clock seconds of each; the job's own lines in the logs.
  limit main
  (( LIMIT == 0 )) && { stamp "main: ${STATUS[main]} (${DETAIL[main]})"; return; }
  mkdir -p "$RES/main"
  local cache; cache=$(mktemp -d /tmp/triton_fresh.XXXX)
  local s t_fresh t_warm rc1 rc2
  stamp "main: start (limit $LIMIT s)"
  s=$(date +%s)
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$cache timeout --kill-after=10 $(( LIMIT * 2 / 3 )) python3 -m kda_dhu ${MAIN_ARGS:-} \
    > "$RES/main/fresh.log" 2>&1
  rc1=$?; t_fresh=$(( $(date +%s) - s ))
  s=$(date +%s)
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$cache timeout --kill-after=10 $(( LIMIT - t_fresh )) python3 -m kda_dhu ${MAIN_ARGS:-} \
    > "$RES/main/warm.log" 2>&1
  rc2=$?; t_warm=$(( $(date +%s) - s ))
  verdict main $(( rc1 != 0 ? rc1 : rc2 )) $(( t_fresh + t_warm ))
  DETAIL[main]="fresh ${t_fresh} s (rc $rc1), warm ${t_warm} s (rc $rc2)"
  stamp "main: ${STATUS[main]} (${DETAIL[main]})"
}

stage_image12() {
  limit image12
  (( LIMIT == 0 )) && { stamp "image12: ${STATUS[image12]} (${DETAIL[image12]})"; return; }
  mkdir -p "$RES/image12"
  KDA_DHU_IMAGE=cuda12 timeout 60 python3 -m kda_dhu --doctor 2>&1 \
    | grep -i -E "kernel image|embedded kernel images" | tee "$RES/image12/image.txt"
  run_suite image12 "$LIMIT" KDA_DHU_IMAGE=cuda12
  stamp "image12: ${STATUS[image12]} (${DETAIL[image12]})"
}

stage_host() {
  # shellcheck disable=SC2086
  timed host python3 benches/host_overhead.py --out "$RES/host" ${HOST_ARGS:-}
  [ -f "$RES/host/host.log" ] && DETAIL[host]=$(grep -E "^targets: " "$RES/host/host.log" | tail -n 1)
}

stage_e2e() {
  # shellcheck disable=SC2086
  timed e2e python3 benches/e2e.py --out "$RES/e2e" ${E2E_ARGS:-}
  if [ -f "$RES/e2e/e2e.log" ]; then
    DETAIL[e2e]="$(grep -E "^targets: " "$RES/e2e/e2e.log" | tail -n 1); $(grep -cE "^\[[0-9]+/[0-9]+\]" "$RES/e2e/e2e.log") case(s)$(grep -q '^FAILED' "$RES/e2e/e2e.log" && echo '; checks FAILED')"
  fi
}

stage_bench() {
  local args=${BENCH_ARGS:---all}
  [ -n "${BENCH_SHAPES:-}" ] && args="--shapes $BENCH_SHAPES"
  # shellcheck disable=SC2086
  timed bench python3 benches/bench.py $args --out "$RES/bench"
  [ -f "$RES/bench/bench.log" ] && DETAIL[bench]="$(grep -cE "^\[[0-9]+/[0-9]+\]" "$RES/bench/bench.log") row(s)"
}

stage_ab() {
  local shapes=${AB_SHAPES:-b8_t4096_h32,b4_t8192_h16,b1_t65536_h32,b8_t1096_h4_tail,varlen_t65536_h32_avg1k,k64_b8_t4096_h32,gdn_g_b8_t4096_h32}
  # shellcheck disable=SC2086
  timed ab python3 benches/variants.py --variants "${AB_VARIANTS:-1 2}" \
    --switch "${AB_SWITCH:-KDA_DHU_SM90_NWG}" --shapes "$shapes" --out "$RES/ab" ${AB_ARGS:-}
  [ -f "$RES/ab/ab.log" ] && DETAIL[ab]="variants ${AB_VARIANTS:-1 2}; $(grep -c "ms (err" "$RES/ab/ab.log") row(s)"
}

# ---------------------------------------------------------------------------- run
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export KDA_DHU_COMMIT=${KDA_DHU_COMMIT:-$(cat .carry/COMMIT 2>/dev/null || echo unknown)}
stamp "gpu_session: stages ${STAGES[*]}; budget $BUDGET s; commit $KDA_DHU_COMMIT"
rc=0
if smoke; then
  stamp "smoke: ok"
  if [ -n "${WANT[tests]:-}${WANT[sanitize]:-}" ]; then tests_and_sanitize; fi
  for s in image12 main host e2e bench ab; do
    [ -n "${WANT[$s]:-}" ] && "stage_$s"
  done
else
  stamp "smoke: ${STATUS[smoke]}: nothing else runs"; tail -n 20 "$RES/smoke/smoke.log"
  rc=3
  for s in "${STAGES[@]}"; do
    [ "$s" = smoke ] && continue
    STATUS[$s]="not run"; DETAIL[$s]="the smoke step failed"; SECS[$s]=0
  done
fi

# ---------------------------------------------------------------------------- pack
# The stages' records as files of their own; a stage cut short: its partial record.
copy_record() {  # SRC_DIR LATEST PARTIAL DEST
  if [ -f "$1/$2" ]; then cp "$1/$2" "$OUT/$4"
  elif [ -n "$3" ] && [ -f "$1/$3" ]; then cp "$1/$3" "$OUT/${4%-latest.json}-partial.json"
  fi
}
copy_record "$RES/host" host-latest.json "" host-latest.json
copy_record "$RES/e2e" e2e-latest.json e2e-partial.json e2e-latest.json
copy_record "$RES/bench" latest.json partial.json bench-latest.json
[ -f "$RES/ab/variants.json" ] && cp "$RES/ab/variants.json" "$OUT/variants.json"
if compgen -G "$RES/*/counts.json" >/dev/null; then
  python3 scripts/device/suite_counts.py --gather "$RES" "$OUT/gpu-suite-latest.json" "$KDA_DHU_COMMIT" || true
fi

{
  if [ -s "$RES/tests/failed.txt" ]; then echo "failed tests (first 10):"; sed 's/^/  /' "$RES/tests/failed.txt"; fi
  echo "gpu_session summary: commit $KDA_DHU_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $(date -u +%Y-%m-%dT%H:%MZ), $(elapsed) s of $BUDGET"
  printf '%-9s %-28s %5s  %s\n' stage status secs detail
  for s in "${STAGES[@]}"; do
    printf '%-9s %-28s %5s  %s\n' "$s" "${STATUS[$s]:-not run}" "${SECS[$s]:-0}" "${DETAIL[$s]:-}"
  done
} > "$RES/summary.txt"
for s in "${STAGES[@]}"; do
  case "${STATUS[$s]:-not run}" in ok) ;; *) (( rc == 0 )) && rc=1;; esac
done
cp "$RES/summary.txt" "$OUT/summary.txt"
tar -C "$RES" -cf - . | xz -T0 -6 > "$OUT/logs.tar.xz"
# Last, as the least needed: Triton's cache for the next session, in the time left before the
# device command's limit (DEVICE_LIMIT_S, 590 s), written aside and moved into place when whole.
pack_s=$(( ${DEVICE_LIMIT_S:-590} - $(elapsed) ))
if [ "${TRITON_CACHE_OUT:-1}" != 0 ] && [ -n "$(ls -A "$TRITON_CACHE_DIR" 2>/dev/null)" ] && (( pack_s >= 10 )); then
  part=/tmp/triton_cache.tar.xz.part
  if timeout "$pack_s" bash -c 'tar -C "$1" -cf - . | xz -T0 -3 > "$2"' _ "$TRITON_CACHE_DIR" "$part" \
      && [ "$(stat -c %s "$part")" -le $(( 15 * 1024 * 1024 )) ]; then
    mv "$part" "$OUT/triton_cache.tar.xz"
  else
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar --null -T - -cf - | xz -T0 -6 > "$part") \
      && mv "$part" "$OUT/triton_cache.tar.xz"
    echo "triton cache: over 15 MiB or too slow to pack; only fla's autotuning results kept"
  fi
fi

echo "files: $(cd "$OUT" && ls | tr '\n' ' ')"
cat "$RES/summary.txt"
exit $rc
