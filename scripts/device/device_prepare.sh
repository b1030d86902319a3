#!/usr/bin/env bash
# Here (the CPU machine): build the abi3 wheel and gather what the GPU machine lacks
# into .carry/ (ignored by git; name it in the device call's `carry`).
#   bash scripts/device/device_prepare.sh
# Then, with the device tool:  run(command="bash scripts/device/gpu_session.sh STAGE...", carry=[".carry"])
# (or scripts/device/device_run.sh / device_all.sh). To reuse fla's compiled and tuned Triton kernels,
# copy a session's triton_cache.tar.xz (from its $OUT) to .carry/ before the next call.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
[ -x /work/.venv/bin/python ] && PY=/work/.venv/bin/python
# Triton's cache from an earlier session (scripts/device/gpu_session.sh brings it back) stays.
keep=""
if [ -f .carry/triton_cache.tar.xz ]; then keep=$(mktemp); mv .carry/triton_cache.tar.xz "$keep"; fi
rm -rf .carry && mkdir -p .carry
if [ -n "$keep" ]; then mv "$keep" .carry/triton_cache.tar.xz; fi
"$PY" -m maturin build --release --out .carry -q 2>&1 | tail -n 5
# fla-core is pure Python (its one dependency, einops, is on the GPU image).
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .carry "fla-core==${FLA_VERSION:-0.6.0}"
git rev-parse --short HEAD > .carry/COMMIT 2>/dev/null || echo unknown > .carry/COMMIT
ls -la .carry
