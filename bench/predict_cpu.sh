#!/usr/bin/env bash
# predict_cpu.sh (issue 57, point 5c): the step-time predictor against measured steps on this
# machine's CPU. bench_rates measures Tessera's CPU rates (GEMMs, attention, memory-bound passes,
# one thread) and the MPI all-reduce between two ranks; a cluster file for this host names them
# ([gpu] rates). Then a small GPT runs 1-rank, TP2, PP2 (4 micro-batches: its bubble) and DP2,
# one thread per rank, and each measured step (the median of iterations 4-15 of the log's
# "elapsed time per iteration", with the spread of those iterations: the machine's noise) is
# printed beside `--dry-run --cluster` of the same options. Nothing is fitted: the rates come
# from bench_rates' own shapes.
# Usage: bench/predict_cpu.sh [BIN_DIR=build/bin]
set -euo pipefail
bin=${1:-build/bin}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun --oversubscribe --bind-to none)
"$bin/bench_rates" --out "$work/rates.ini" > /dev/null
"${mpi[@]}" -np 2 "$bin/bench_rates" --link > "$work/link.ini"
bw=$(awk '/^bandwidth-gbs/ { print $3 }' "$work/link.ini")
lat=$(awk '/^latency-us/ { print $3 }' "$work/link.ini")
peak=$(awk '/^bf16-tflops/ { print $3 }' "$work/rates.ini")
mem=$(awk '/^hbm-tbs/ { print $3 }' "$work/rates.ini")
host_gib=$(awk '/MemTotal/ { printf "%.1f", $2 / 1048576 }' /proc/meminfo)
cat > "$work/this-host.ini" <<EOF
description = this host's CPU, measured by bench_rates (one thread per rank)
[gpu]
model = $(awk -F' = ' '/^gpu/ { print $2; exit }' "$work/rates.ini") CPU, 1 thread
memory-gib = $host_gib
hbm-tbs = $mem
bf16-tflops = $peak
fp8-tflops = 0
rates = rates.ini
[node]
gpus = 2
[intra-node]
fabric = MPI shared memory
bandwidth-gbs = $bw
latency-us = $lat
[inter-node]
fabric = none (one host)
bandwidth-gbs = $bw
latency-us = $lat
EOF
echo "rates: $(grep '^bf16 =' "$work/rates.ini"), attention $(awk '/forward-tflops|backward-tflops/ { printf "%s %s ", $1, $3 }' "$work/rates.ini"), memory $mem TB/s; MPI all-reduce ${bw} GB/s, ${lat} us"
model=(--config configs/gpt2-tiny.ini --num-layers 4 --hidden-size 128 --num-attention-heads 4
       --seq-length 128 --max-position-embeddings 128 --vocab-size 1024 --micro-batch-size 2
       --global-batch-size 8 --train-iters 15 --log-interval 1 --threads 1 --mock-data)
echo "| layout | measured step ms (median, min-max of iterations 4-15) | predicted ms | error | predicted bubble, exposed comm |"
echo "|---|---|---|---|---|"
for layout in "1-rank:1:" "TP2:2:--tensor-model-parallel-size 2" \
              "PP2:2:--pipeline-model-parallel-size 2" "DP2:2:"; do
  name=${layout%%:*}; rest=${layout#*:}; np=${rest%%:*}; opts=${rest#*:}
  # shellcheck disable=SC2086
  if [ "$np" -gt 1 ]; then
    "${mpi[@]}" -np "$np" "$bin/tessera-train" "${model[@]}" $opts > "$work/$name.log" 2>&1
  else
    "$bin/tessera-train" "${model[@]}" $opts > "$work/$name.log" 2>&1
  fi
  measured=$(awk -F'elapsed time per iteration \\(ms\\): ' '/elapsed time per iteration/ {
      split($1, a, "/"); it = a[1]; sub(/.*iteration +/, "", it); split($2, b, " ");
      if (it + 0 >= 4) print b[1] }' "$work/$name.log" | sort -g |
    awk '{ v[NR] = $1 } END { printf "%.2f (%.2f-%.2f)", v[int((NR + 1) / 2)], v[1], v[NR] }')
  # shellcheck disable=SC2086
  line=$("$bin/tessera-train" "${model[@]}" $opts --dry-run --world-size "$np" \
    --cluster "$work/this-host.ini" | grep '^predicted:')
  predicted=$(echo "$line" | awk '{ printf "%.2f", $3 * 1000 }')
  echo "$line" | awk -v name="$name" -v m="$measured" -v p="$predicted" -F'|' '{
    split(m, a, " "); err = (p - a[1]) / a[1] * 100; sub(/^ *bubble /, "", $5); sub(/^ *exposed comm /, "", $6);
    printf "| %s | %s | %s | %+.1f %% | %s, %s |\n", name, m, p, err, $5, $6 }'
done
