#!/usr/bin/env bash
# Here (the CPU machine): build the abi3 wheel and gather what the GPU machine lacks
# into .carry/ (ignored by git; name it in the device call's `carry`).
#   bash scripts/device/device_prepare.sh
# Then, with the device tool:  run(command="bash scripts/device/gpu_session.sh STAGE...", carry=[".carry"])
# (or scripts/device/device_run.sh / device_all.sh). To reuse fla's compiled and tuned Triton kernels,
# copy a session's triton_cache.tar.xz (from its $OUT) to .carry/ before the next call.
# FLA_TESTS_FROM=<fla git dir or checkout> [FLA_TESTS_REV=HEAD] also copies fla's own test
# files (tests/conftest.py, tests/ops/*.py: a peer's suite, never committed here) into
# .carry/fla_tests/ for scripts/device/fla_peer_tests.sh.
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
if [ -n "${FLA_TESTS_FROM:-}" ]; then
  rev=${FLA_TESTS_REV:-HEAD}
  mkdir -p .carry/fla_tests/ops
  git -C "$FLA_TESTS_FROM" show "$rev:tests/conftest.py" > .carry/fla_tests/conftest.py
  for f in $(git -C "$FLA_TESTS_FROM" ls-tree --name-only "$rev" tests/ops/ | grep '\.py$'); do
    git -C "$FLA_TESTS_FROM" show "$rev:$f" > ".carry/fla_tests/ops/${f#tests/ops/}"
  done
  git -C "$FLA_TESTS_FROM" rev-parse "$rev" > .carry/fla_tests/REV
  echo "fla's tests at $(cat .carry/fla_tests/REV): $(ls .carry/fla_tests/ops | wc -l) files in .carry/fla_tests/ops"
fi
git rev-parse --short HEAD > .carry/COMMIT 2>/dev/null || echo unknown > .carry/COMMIT
ls -la .carry
