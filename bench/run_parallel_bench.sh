#!/usr/bin/env bash
# run_parallel_bench.sh: bench_parallel for TP2 x PP2 x DP2 (8 ranks) against 1 rank on the same
# global batch. Usage: bench/run_parallel_bench.sh [build-dir]
set -euo pipefail
build=${1:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$build/bin/bench_parallel" 1 1
mpirun --oversubscribe --bind-to none -np 8 "$build/bin/bench_parallel" 2 2
