#!/usr/bin/env bash
# test.sh: installs what is missing, builds, and runs the whole test suite with ctest.
# Usage: scripts/test.sh [--sanitize] [ctest args...]   (--sanitize: ASan+UBSan build in build-asan/,
# without the CUDA backend and the benchmarks, which cannot run without a GPU; it runs the
# GoogleTest binaries, the kernel emulator tests included, and leaves out the end-to-end scripts
# (label e2e: the apps driven as a user does, the Slurm and kill -9 tests among them), which the
# normal build runs)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=build
setup_args=()
ctest_args=()
if [ "${1:-}" = "--sanitize" ]; then
  build_dir=build-asan
  setup_args+=(--sanitize)
  ctest_args+=(-LE e2e)
  shift
fi
scripts/setup.sh --build-dir "$build_dir" "${setup_args[@]}"
# Multi-rank tests start mpirun as whatever user runs them, root included (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# LeakSanitizer cannot trace under some sandboxes; the address and UB checks stay on.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
t0=$SECONDS
rc=0
ctest --test-dir "$build_dir" -j 2 --output-on-failure "${ctest_args[@]}" "$@" || rc=$?
# Each test's time is in $build_dir/Testing/Temporary/CTestCostData.txt (docs/testing.md).
echo "test.sh: $build_dir: tests $((SECONDS - t0)) s (ctest exit $rc)"
exit $rc
