#!/usr/bin/env bash
# bench_rerun.sh: what result validation costs when nothing fails (issue 39): the same run with
# --rerun-mode disabled, validate_results (the default: each rank's loss and gradient buckets
# checked before their reductions, the findings in the loss all-reduce) and validate_results with
# the spike checks, interleaved over REPEATS rounds; prints the median ms per iteration of each
# (iterations after the first WARMUP) and the difference to disabled. report_stats (every
# iteration twice) is printed for scale.
# Usage: bench/bench_rerun.sh [build-dir] [extra tessera-train options...]
#   e.g. bench/bench_rerun.sh build --config configs/gpt2-124m.ini --bf16 --device cuda
# Environment: ITERS (default 40), WARMUP (5), REPEATS (3), NP (ranks under mpirun; default 1).
set -euo pipefail
build=${1:-build}
shift || true
extra=("$@")
[ ${#extra[@]} -gt 0 ] || extra=(--config configs/gpt2-tiny.ini --device cpu --threads 1 --vocab-size 500)
ITERS=${ITERS:-40} WARMUP=${WARMUP:-5} REPEATS=${REPEATS:-3} NP=${NP:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
launch=()
[ "$NP" -gt 1 ] && launch=(mpirun --oversubscribe --bind-to none -np "$NP")
modes=("disabled" "validate_results" "validate_results --check-for-spiky-loss --check-for-large-grads" "report_stats")
for r in $(seq "$REPEATS"); do
  for i in "${!modes[@]}"; do
    # shellcheck disable=SC2086
    "${launch[@]}" "$build/bin/tessera-train" --mock-data "${extra[@]}" --train-iters "$ITERS" \
      --log-interval 1 --rerun-mode ${modes[$i]} --metrics-file "$work/m$i.$r.jsonl" >/dev/null 2>&1
  done
done
python3 - "$work" "$WARMUP" "$REPEATS" "${#modes[@]}" "${modes[@]}" <<'PY'
import json, statistics, sys
work, warmup, repeats, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
names = sys.argv[5:5 + n]
med = []
for i in range(n):
    ms = []
    for r in range(1, repeats + 1):
        rows = [json.loads(l) for l in open(f"{work}/m{i}.{r}.jsonl")]
        ms += [x["ms_per_iter"] for x in rows if "ms_per_iter" in x and x["iteration"] > warmup]
    med.append(statistics.median(ms))
print(f"{'--rerun-mode':64s} {'ms/iter':>10s} {'vs disabled':>12s}")
for name, m in zip(names, med):
    print(f"{name:64s} {m:10.3f} {100 * (m / med[0] - 1):+11.2f}%")
PY
