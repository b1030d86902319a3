#!/usr/bin/env bash
# Host time per call of this commit against an older one, in one device call: each with its
# own wheel and its own benches/host_overhead.py, alternating this, base, this, base
# (ROUNDS rounds each), the four records into $OUT/ab/.
#   here:  bash scripts/device/device_prepare.sh        (this commit's wheel into .carry/)
#          git worktree add /tmp/base BASE && (cd /tmp/base && python -m maturin build --release --out wheel)
#          mkdir -p .carry/base && cp /tmp/base/wheel/*.whl /tmp/base/benches/host_overhead.py .carry/base/
#   there: run(command="BASE_COMMIT=BASE bash scripts/device/host_ab.sh", carry=[".carry"])
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT: the device call output folder}"
SESSION_DIR=/tmp/gs_smoke TRITON_CACHE_OUT=0 SESSION_BUDGET=40 DEVICE_LIMIT_S=60 \
  bash scripts/device/gpu_session.sh smoke > /tmp/smoke.txt 2>&1
tail -n 3 /tmp/smoke.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/base .carry/base/*.whl
mkdir -p "$OUT/ab"
export TRITON_CACHE_DIR=/tmp/triton_cache
this=$(cat .carry/COMMIT 2>/dev/null || echo unknown)
for i in 1 2; do
  PYTHONPATH=/tmp/site KDA_DHU_COMMIT=$this timeout 80 python3 benches/host_overhead.py \
    --rounds "${ROUNDS:-6}" --out "/tmp/ab/new$i" > "/tmp/ab_new$i.log" 2>&1; echo "new$i rc=$?"
  PYTHONPATH=/tmp/base:/tmp/site KDA_DHU_COMMIT=${BASE_COMMIT:-base} timeout 80 python3 .carry/base/host_overhead.py \
    --rounds "${ROUNDS:-6}" --out "/tmp/ab/base$i" > "/tmp/ab_base$i.log" 2>&1; echo "base$i rc=$?"
done
for r in new1 base1 new2 base2; do
  cp "/tmp/ab/$r/host-latest.json" "$OUT/ab/$r.json" 2>/dev/null
  echo "== $r"; sed -n 3,9p "/tmp/ab/$r/host-latest.md"
done
