#!/usr/bin/env bash
# There (the GPU machine, via the device tool): compute-sanitizer's memcheck, racecheck and
# synccheck over scripts/device/sanitize_driver.py (small kernel-only calls: envelope K 64/128,
# dense tail, varlen [1, 63, 65, 7] with int64 / int32 chunk tables, padded packed batch,
# GVA, g gate, no gate, fp16, two warpgroups, state_v_first, strided / sliced / expanded /
# misaligned inputs; then corrupt packed batches -- cu_seqlens[0] != 0, decreasing, past T,
# wrong chunk_offsets, chunks past NT, garbage values -- whose kernels must store nothing
# outside their outputs: memcheck clean).
#   bash scripts/device/sanitize.sh [tool ...]        (default: memcheck racecheck synccheck)
# Installs the carried wheels (.carry/, from scripts/device/device_prepare.sh) as device_run.sh
# does; after device_run.sh in the same device command it reuses /tmp/site.
#   run(command="bash scripts/device/sanitize.sh", carry=[".carry"])
# Environment: SAN_TIMEOUT seconds per tool (default 170: the three fit one 600 s call),
# SAN_API_ERRORS (default "no": torch's and the CUDA loader's probing API errors are
# noise; "explicit" / "all" to see them), SAN_EXTRA extra compute-sanitizer flags,
# SAN_CASES comma-separated driver cases, SKIP_INSTALL=1 to use /tmp/site as it is.
# Logs: $OUT/sanitize_<tool>.log.
# Exit status: 0 when every tool is clean and the driver's checks passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"

# SKIP_INSTALL=1: the caller installed the wheels and may be running from /tmp/site now.
if [ -z "${SKIP_INSTALL:-}" ] && compgen -G ".carry/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
python3 -c "import kda_dhu._core" 2>/dev/null || { echo "sanitize: kda_dhu is not installed (carry .carry from scripts/device/device_prepare.sh)"; exit 1; }

CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
if [ -z "$CS" ]; then
  for c in /usr/local/cuda/bin/compute-sanitizer $(ls -d /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | sort -V -r); do
    [ -x "$c" ] && { CS=$c; break; }
  done
fi
[ -n "$CS" ] || { echo "sanitize: compute-sanitizer not found"; exit 1; }
echo "sanitize: $("$CS" --version | tail -n 1) ($CS); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"

# The driver: kernel only (no fla import, no Triton), every torch allocation its own
# cudaMalloc so memcheck sees exact bounds.
export KDA_DHU_FORCE=kernel KDA_DHU_NO_AUTOREGISTER=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
driver=(python3 scripts/device/sanitize_driver.py)
[ -n "${SAN_CASES:-}" ] && driver+=(--cases "$SAN_CASES")

tools=("$@"); [ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck)
timeout_s=${SAN_TIMEOUT:-170}
summaries=(); status=0
for tool in "${tools[@]}"; do
  log="$OUT/sanitize_$tool.log"
  extra=()
  [ "$tool" = memcheck ] && extra+=(--leak-check no)
  # shellcheck disable=SC2206
  [ -n "${SAN_EXTRA:-}" ] && extra+=($SAN_EXTRA)
  start=$(date +%s)
  timeout --kill-after=15 "$timeout_s" "$CS" --tool "$tool" --error-exitcode 1 \
    --kernel-name kns=kda_dhu --report-api-errors "${SAN_API_ERRORS:-no}" --print-limit 50 \
    "${extra[@]}" "${driver[@]}" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  errors=$(grep -oE "ERROR SUMMARY: [0-9]+ errors?" "$log" | tail -n 1)
  race=$(grep -oE "RACECHECK SUMMARY: .*" "$log" | tail -n 1)
  cases=$(grep -c "^case .*: OK" "$log")
  driver_ok=$(grep -q "^sanitize_driver: .* cases OK" "$log" && echo yes || echo no)
  if [ $rc -eq 0 ] && [ "$driver_ok" = yes ]; then
    verdict=clean
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict="TIMEOUT after ${timeout_s} s"; status=1
  elif [ $rc -eq 3 ] || { [ "$driver_ok" = no ] && [ $rc -ne 1 ]; }; then
    verdict="DRIVER FAILED (rc $rc)"; status=1
  else
    verdict="ERRORS (rc $rc)"; status=1
  fi
  line="sanitize $tool: $verdict; ${errors:-no ERROR SUMMARY}${race:+; $race}; $cases cases OK; ${secs} s; log $log"
  summaries+=("$line")
  if [ "$verdict" != clean ]; then
    echo "---- $tool: first reports ----"
    grep -E "^========= (Invalid|Error|Race|Warning|Barrier|Program hit|    at|Saved host)|^(case|Traceback|  File|[A-Za-z]*Error|sanitize_driver)" "$log" | head -n 40
  fi
done
echo "---- summary ----"
printf '%s\n' "${summaries[@]}"
exit $status
