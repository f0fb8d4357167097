#!/usr/bin/env bash
# run_parallel_bench.sh: bench_parallel for TP2 x PP2 x DP2 (8 ranks) against 1 rank on the same
# global batch; TP2 with and without sequence parallelism (equal TP bytes, the split regions'
# activations / TP); PP2 with 1, 2 and 4 virtual stages (the measured bubble against
# (P-1)/(V m); a small vocabulary keeps the stages balanced, as the formula assumes); context
# parallelism at CP 1, 2 and 4 on a sequence of 2048 (the ring's bytes against its formula).
# Usage: bench/run_parallel_bench.sh [build-dir]
set -euo pipefail
build=${1:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun --oversubscribe --bind-to none)
"$build/bin/bench_parallel" 1 1
"${mpi[@]}" -np 8 "$build/bin/bench_parallel" 2 2
"${mpi[@]}" -np 2 "$build/bin/bench_parallel" 2 1 3 4 128 64 8 2
"${mpi[@]}" -np 2 "$build/bin/bench_parallel" 2 1 3 4 128 64 8 2 --sequence-parallel
for v in 1 2 4; do
  "${mpi[@]}" -np 2 "$build/bin/bench_parallel" 1 2 9 8 256 128 16 2 --vocab 256 --virtual-stages "$v"
done
for cp in 1 2 4; do
  "${mpi[@]}" -np "$cp" "$build/bin/bench_parallel" 1 1 3 4 128 2048 4 1 --vocab 512 --context-parallel-size "$cp"
done
