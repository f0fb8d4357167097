#!/usr/bin/env bash
# nccl-layouts.sh (issue 56 point 2): every parallel layout over NCCL, several ranks sharing the
# lent GPU, against the same layout's CPU MPI run and the 1-rank CUDA run. One list of layouts for
# both halves:
#   ref BIN OUT        here (scripts/gpu-bundle.sh): each layout on --device cpu through MPI, the
#                      20 iterations' metrics in OUT/NAME.jsonl (carried in the GPU archive)
#   gpu BIN REF OUT    there (scripts/gpu-run.sh --steps=nccl2 / nccl4): the 1-rank CUDA runs,
#                      then each layout on --device cuda, its ranks started through
#                      scripts/nccl-share-gpu.sh with --ranks-per-gpu; prints per layout the worst
#                      relative loss difference against the CPU run and against the 1-rank CUDA run
#                      (f32; both within NCCL_TOL, default 1e-6), logs in OUT
# NP picks the layouts of that many ranks (default 2; 4 for the second lease).
# Usage: scripts/nccl-layouts.sh ref BIN OUT | gpu BIN REF OUT   [env NP=2|4]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../tests/lib.sh
source "$here/../tests/lib.sh"
mode=${1:?usage: nccl-layouts.sh ref BIN OUT | gpu BIN REF OUT}
bin=${2:?BIN: the folder of tessera-train}
if [ "$mode" = gpu ]; then
  ref=${3:?REF: the folder of the CPU runs}
  out=${4:?OUT: the folder for the logs}
else
  out=${3:?OUT: the folder for the CPU runs}
fi
np=${NP:-2}
# The gpu half's device: cuda; NCCL_LAYOUTS_DEVICE=cpu runs its logic here (MPI, no NCCL).
gdev=${NCCL_LAYOUTS_DEVICE:-cuda}
tol=${NCCL_TOL:-1e-6}
mkdir -p "$out"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
configs="$here/../configs"
gpt=(--config "$configs/gpt2-tiny.ini" --num-layers 4 --hidden-size 32 --num-attention-heads 4
     --seq-length 32 --max-position-embeddings 32 --vocab-size 200 --global-batch-size 8
     --micro-batch-size 2 --train-iters 20 --log-interval 1 --lr-warmup-iters 2 --threads 1
     --hidden-dropout 0.1 --attention-dropout 0.1 --mock-data)
moe=(--config "$configs/mixtral-tiny.ini" --num-layers 2 --global-batch-size 8 --micro-batch-size 2
     --mock-data --vocab-size 200 --train-iters 20 --log-interval 1 --lr-warmup-iters 2 --threads 1)
# name | ranks | model | its 1-rank base | options
layouts=(
  "tp2sp|2|gpt|base|--tensor-model-parallel-size 2 --sequence-parallel"
  "pp2|2|gpt|base|--pipeline-model-parallel-size 2"
  "pp2-interleaved|2|gpt|base|--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
  "pp2-zero-bubble|2|gpt|base|--pipeline-model-parallel-size 2 --pipeline-schedule zero-bubble"
  "dp2-overlap|2|gpt|base|--overlap-grad-reduce"
  "dp2-distopt|2|gpt|base|--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
  "cp2|2|gpt|base|--context-parallel-size 2"
  "ep2|2|moe|base-moe|--expert-model-parallel-size 2"
  "fsdp-dp2|2|gpt|base|--use-megatron-fsdp"
  "muon-tp2|2|gpt|base-muon|--tensor-model-parallel-size 2 --optimizer muon --lr 0.01"
  "tp2sp-bf16|2|gpt|base-bf16|--tensor-model-parallel-size 2 --sequence-parallel --bf16"
  "dp2-distopt-bf16|2|gpt|base-bf16|--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16"
  "tp2pp2|4|gpt|base|--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel"
  "pp4-zero-bubble|4|gpt|base|--pipeline-model-parallel-size 4 --pipeline-schedule zero-bubble"
  "dp4-distopt|4|gpt|base|--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
  "hsdp-dp4|4|gpt|base|--use-megatron-fsdp --num-distributed-optimizer-instances 2"
  "ep2-cp2|4|moe|base-moe|--expert-model-parallel-size 2 --context-parallel-size 2"
  "moe-cp2-ep2-fp8|4|moe|base-moe-fp8|--expert-model-parallel-size 2 --context-parallel-size 2 --bf16 --fp8-format hybrid"
  "muon-distopt-tp2dp2|4|gpt|base-muon|--tensor-model-parallel-size 2 --use-distributed-optimizer --optimizer muon --lr 0.01"
)
bases=("base|gpt|" "base-moe|moe|" "base-muon|gpt|--optimizer muon --lr 0.01")
# bf16 and FP8 layouts are held to the noise of their 1-rank run (the worst of that run against
# itself with every initial weight moved by +-1e-7 and +-2e-7, TESSERA_TEST_PERTURB_INIT), times
# NCCL_NOISE_FACTOR (2: one such sample understates the spread), not to f32's tolerance; the GPU
# half only (the CPU's bf16 kernels round differently).
low=("base-bf16|gpt|--bf16" "base-moe-fp8|moe|--bf16 --fp8-format hybrid")
declare -A noise

run() {  # run NAME NP DEVICE MODEL OPTIONS...: metrics in $out/NAME.jsonl, log in $out/NAME.log
  local name=$1 n=$2 device=$3 rc
  local -n model=$4
  shift 4
  rm -f "$out/$name.jsonl"
  local cmd=("$bin/tessera-train" "${model[@]}" --device "$device" --metrics-file "$out/$name.jsonl" "$@")
  if [ "$mode" = gpu ] && [ "$n" -gt 1 ]; then
    cmd=("$here/nccl-share-gpu.sh" "${cmd[@]}" --ranks-per-gpu "$n")
  fi
  if [ "$n" -gt 1 ]; then
    timeout 300 mpirun --oversubscribe --bind-to none -np "$n" "${cmd[@]}" > "$out/$name.log" 2>&1
  else
    timeout 300 "${cmd[@]}" > "$out/$name.log" 2>&1
  fi
  rc=$?
  [ $rc -eq 0 ] || [[ $name == hang-* ]] ||
    bad "$name ($device, $n ranks) exited $rc: $(grep -v '^\[' "$out/$name.log" | tail -2)"
  return $rc
}
worst() {  # worst A.jsonl B.jsonl: the worst relative loss difference and the iterations compared
  join <(iteration_losses "$1" | sort -k1,1) <(iteration_losses "$2" | sort -k1,1) | awk '
    { d = $2 - $3; if (d < 0) d = -d; r = d / $2; if (r > w) w = r; n++ }
    END { if (n == 0) print "missing 0"; else printf "%.3g %d", w, n }'
}

fail=0
for b in "${bases[@]}"; do  # the 1-rank runs (CPU here, CUDA there)
  IFS='|' read -r name model opts <<< "$b"
  # shellcheck disable=SC2086
  run "$name" 1 "$([ "$mode" = gpu ] && echo "$gdev" || echo cpu)" "$model" $opts || fail=1
done
if [ "$mode" = gpu ]; then
  for b in "${low[@]}"; do
    IFS='|' read -r name model opts <<< "$b"
    printf '%s\n' "${layouts[@]}" | grep -q "^[^|]*|$np|[^|]*|$name|" || continue  # unused here
    # shellcheck disable=SC2086
    run "$name" 1 "$gdev" "$model" $opts || { fail=1; continue; }
    worst_noise=0
    for p in 1e-7 -1e-7 2e-7 -2e-7; do
      # shellcheck disable=SC2086
      TESSERA_TEST_PERTURB_INIT=$p run "$name-perturbed" 1 "$gdev" "$model" $opts || { fail=1; continue; }
      read -r w _ < <(worst "$out/$name.jsonl" "$out/$name-perturbed.jsonl")
      worst_noise=$(awk -v a="$w" -v b="$worst_noise" 'BEGIN { print (a > b ? a : b) }')
    done
    noise[$name]=$(awk -v a="$worst_noise" -v f="${NCCL_NOISE_FACTOR:-2}" 'BEGIN { print a * f }')
    echo "noise of $name: $worst_noise (the run against itself from weights moved by +-1e-7, +-2e-7); tolerance ${noise[$name]} (x${NCCL_NOISE_FACTOR:-2})"
  done
fi
for l in "${layouts[@]}"; do
  IFS='|' read -r name n model base opts <<< "$l"
  [ "$n" = "$np" ] || continue
  if [ -n "${noise[$base]+set}" ] || [[ " ${low[*]} " == *" $base|"* ]]; then  # bf16 / FP8
    [ "$mode" = gpu ] || continue
    # shellcheck disable=SC2086
    run "$name" "$n" "$gdev" "$model" $opts || { fail=1; continue; }
    read -r wg ng < <(worst "$out/$base.jsonl" "$out/$name.jsonl")
    line="$name ($n ranks over NCCL): vs the 1-rank run $wg over $ng iterations, tolerance ${noise[$base]:-unmeasured}"
    if [ "$ng" = 20 ] && awk -v a="$wg" -v t="${noise[$base]:--1}" 'BEGIN { exit !(a <= t) }'; then
      ok "$line"
    else
      bad "$line"
    fi
    continue
  fi
  if [ "$mode" = ref ]; then
    # shellcheck disable=SC2086
    run "$name" "$n" cpu "$model" $opts && ok "$name: CPU reference ($n ranks)" || fail=1
    continue
  fi
  s=$(date +%s)
  # shellcheck disable=SC2086
  run "$name" "$n" "$gdev" "$model" $opts || { fail=1; continue; }
  read -r wc nc < <(worst "$ref/$name.jsonl" "$out/$name.jsonl")
  read -r wg ng < <(worst "$out/$base.jsonl" "$out/$name.jsonl")
  line="$name ($n ranks over NCCL, $(( $(date +%s) - s )) s): vs its CPU MPI run $wc over $nc iterations, vs the 1-rank CUDA run $wg over $ng"
  if [ "$nc" = 20 ] && [ "$ng" = 20 ] && awk -v a="$wc" -v b="$wg" -v t="$tol" 'BEGIN { exit !(a <= t && b <= t) }'; then
    ok "$line"
  else
    bad "$line (tolerance $tol)"
    fail=1
  fi
done
# A checkpoint saved over NCCL at TP2 + SP (iteration 10) resumes at PP2: iterations 11-20 are
# the 1-rank run's. Then the hang report over NCCL: rank 1 stalls, the watchdog names the stuck
# collective and exits 3.
if [ "$mode" = gpu ] && [ "$np" = 2 ]; then
  rm -rf "$out/ckpt"
  if run ckpt-save-tp2 2 "$gdev" gpt --tensor-model-parallel-size 2 --sequence-parallel \
       --save "$out/ckpt" --save-interval 10 --exit-interval 10 &&
     run ckpt-resume-pp2 2 "$gdev" gpt --pipeline-model-parallel-size 2 --load "$out/ckpt"; then
    read -r w k < <(worst "$out/base.jsonl" "$out/ckpt-resume-pp2.jsonl")
    if [ "$k" = 10 ] && awk -v a="$w" -v t="$tol" 'BEGIN { exit !(a <= t) }'; then
      ok "checkpoint saved over NCCL at TP2 + SP, resumed at PP2: iterations 11-20 within $w of the 1-rank run"
    else
      bad "checkpoint saved over NCCL at TP2 + SP, resumed at PP2: worst $w over $k iterations (10 expected)"
    fi
  else
    fail=1
  fi
  run hang-dp2 2 "$gdev" gpt --train-iters 4 --distributed-timeout-minutes 0.1 --straggler-injection 1:90
  rc=$?
  if [ $rc -eq 3 ] && grep -qE "no progress .* is stuck: .*did not arrive" "$out/hang-dp2.log"; then
    ok "hang over NCCL: exit 3, $(grep -oE '[a-z_]+ #[0-9]+ on the [a-z -]+group[^:]*is stuck' "$out/hang-dp2.log" | head -1)"
  else
    bad "hang over NCCL: exit $rc, $(grep -m1 'no progress' "$out/hang-dp2.log" || tail -1 "$out/hang-dp2.log")"
  fi
fi
# Races between streams (what racecheck cannot see): the overlapped layouts again with the
# collectives' stream delayed, then the compute stream; each must be bitwise its undelayed run.
if [ "$mode" = gpu ] && [ "$np" = 2 ]; then
  for l in "${layouts[@]}"; do
    IFS='|' read -r name n model base opts <<< "$l"
    case $name in dp2-overlap|dp2-distopt|cp2|ep2|fsdp-dp2|pp2-interleaved) ;; *) continue ;; esac
    [ -s "$out/$name.jsonl" ] || continue
    for hook in COMM COMPUTE; do
      export "TESSERA_TEST_DELAY_${hook}_US=${NCCL_DELAY_US:-2000}"  # mpirun's ranks inherit it
      # shellcheck disable=SC2086
      run "$name-delay-$hook" "$n" "$gdev" "$model" $opts
      rc=$?
      unset "TESSERA_TEST_DELAY_${hook}_US"
      [ $rc -eq 0 ] || { fail=1; continue; }
      if cmp -s <(iteration_losses "$out/$name.jsonl") <(iteration_losses "$out/$name-delay-$hook.jsonl"); then
        ok "$name with the ${hook,,} stream delayed ${NCCL_DELAY_US:-2000} us: bitwise the undelayed run"
      else
        bad "$name with the ${hook,,} stream delayed: differs from the undelayed run (worst $(worst "$out/$name.jsonl" "$out/$name-delay-$hook.jsonl"))"
        fail=1
      fi
    done
  done
fi
[ "$mode" = gpu ] && grep -h "NET/Socket\|via NET\|Using network" "$out"/*.log 2>/dev/null | sort | uniq -c | head -5
exit $fail
