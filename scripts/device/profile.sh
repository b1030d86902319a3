#!/usr/bin/env bash
# There (the GPU machine, via the device tool; Firecracker machines read the counters):
# Nsight Compute over one steady-state launch of kda-dhu's kernel per shape
# (benches/profile_driver.py), to find what bounds the shapes between one and two waves
# (benches/NOTES.md, "Below two waves"): DRAM and L2 throughput against the SM's, and the
# warp stall reasons (waiting on the TMA ring's mbarriers = loads; on wgmma; on named
# barriers = the serial chain).
#   run(command="bash scripts/device/profile.sh [driver args]", carry=[".carry"])
#   e.g. bash scripts/device/profile.sh --shapes b4_t8192_h16,b8_t4096_h32 --nwg 1
#        bash scripts/device/profile.sh --op fwd_h --shapes b1_t65536_h32   (the forward scan)
# Environment: NCU (path), NCU_SET (sections; default below), PROFILE_TIMEOUT (300 s).
# Output: $OUT/profile.ncu-rep (open with ncu-ui or `ncu --import`), $OUT/profile.csv
# (every metric of the sections, one row per launch) and $OUT/profile.txt (the details page).
# Clocks are left as they are (--clock-control none), as the device notes ask.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 KDA_DHU_NO_AUTOREGISTER=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if compgen -G ".carry/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
NCU=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -n 1)}
[ -n "$NCU" ] && [ -x "$NCU" ] || { echo "profile: ncu not found"; exit 1; }
echo "profile: $("$NCU" --version | tail -n 1) ($NCU)"
# Every launch is captured: with --warmup 1 the driver makes two per shape, the second
# the steady-state one (module loaded, descriptors cached, L2 warm from the first).
SECTIONS=${NCU_SET:-"--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy"}
# shellcheck disable=SC2086
timeout "${PROFILE_TIMEOUT:-300}" "$NCU" --clock-control none --kernel-name regex:kda_dhu_sm90 \
  $SECTIONS --export "$OUT/profile" --force-overwrite \
  python3 benches/profile_driver.py --warmup 1 "$@" 2>&1 | tail -n 40
rc=${PIPESTATUS[0]}
if [ -f "$OUT/profile.ncu-rep" ]; then
  "$NCU" --import "$OUT/profile.ncu-rep" --csv --page raw > "$OUT/profile.csv" 2>/dev/null
  "$NCU" --import "$OUT/profile.ncu-rep" --page details > "$OUT/profile.txt" 2>/dev/null
  grep -E "kda_dhu_sm90|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Stall|Warp Cycles Per Issued" "$OUT/profile.txt" | head -n 80
fi
exit "$rc"
