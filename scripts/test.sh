#!/usr/bin/env bash
# test.sh: installs what is missing, builds, and runs the whole test suite with ctest.
# Usage: scripts/test.sh [--sanitize] [ctest args...]   (--sanitize: ASan+UBSan build in build-asan/;
# it skips the Slurm test, which exercises the scripts and the scheduler rather than the code, and
# the timing-driven kill -9 test)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=build
setup_args=()
ctest_args=()
if [ "${1:-}" = "--sanitize" ]; then
  build_dir=build-asan
  setup_args+=(--sanitize)
  ctest_args+=(-LE 'slurm|faults')
  shift
fi
scripts/setup.sh --build-dir "$build_dir" "${setup_args[@]}"
# Multi-rank tests start mpirun as whatever user runs them, root included (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# LeakSanitizer cannot trace under some sandboxes; the address and UB checks stay on.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
ctest --test-dir "$build_dir" -j 2 --output-on-failure "${ctest_args[@]}" "$@"
