#!/usr/bin/env bash
# test_moe.sh: MoE with expert parallelism as a user runs it (mixtral-tiny, mock data): a run
# saved at EP 4 with the distributed optimizer resumes at EP 1 (one rank) and at EP 2 with the
# losses of the uninterrupted single-rank run; tessera-reshard takes it to TP 2 (with
# --target-expert-model-parallel-size) and TP 2 x EP 2 resumes the same; the expert tensors are
# stored once each, by global index, whatever the EP that saved them; tessera-generate reads it;
# a capacity factor's runs at EP 4 and EP 2 (allgather) equal the single rank's; the log, metrics
# file and --dry-run carry the MoE figures; bad input is one line, exit 2.
# Usage: test_moe.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
common=(--config "$configs/mixtral-tiny.ini" --num-layers 2 --train-iters 10 --log-interval 1
        --threads 1 --global-batch-size 16 --micro-batch-size 4 --mock-data --vocab-size 200
        --lr-warmup-iters 2 --device cpu)
train() {  # train NAME NP [options]: the log in NAME.log, metrics in NAME.jsonl
  local name=$1 np=$2
  shift 2
  local cmd=("$bin/tessera-train" "${common[@]}" --metrics-file "$work/$name.jsonl" "$@")
  if [ "$np" -gt 1 ]; then
    timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}" > "$work/$name.log" 2>&1
  else
    timeout 300 "${cmd[@]}" > "$work/$name.log" 2>&1
  fi
}
# same BASE NAME WHAT: NAME's iterations equal BASE's same iterations (1e-5 relative)
same() {
  local out
  out=$(awk 'NR == FNR { base[$1] = $2; next }
    ($1 in base) { d = base[$1] - $2; if (d < 0) d = -d; r = d / base[$1]; if (r > w) w = r; n++ }
    END { printf "%d %.3g", n, w }' <(run_losses "$1") <(run_losses "$2"))
  set -- "$1" "$2" "$3" $out
  if [ "$4" -ge 5 ] && awk -v w="$5" 'BEGIN { exit !(w <= 1e-5) }'; then
    ok "$3: $4 iterations within $5 of the uninterrupted run"
  else
    bad "$3: $4 iterations compared, worst relative difference $5"
  fi
}

train full 1 || bad "the single-rank run: $(tail -2 "$work/full.log")"
grep -q "load_balancing_loss: .* | z_loss: " "$work/full.log" && grep -q '"load_balancing_loss": .*"z_loss": ' "$work/full.jsonl" \
  && ok "the log line and the metrics file carry load_balancing_loss and z_loss" || bad "no MoE figures in the log: $(grep 'iteration  *1/' "$work/full.log")"
train ep4 4 --expert-model-parallel-size 4 --use-distributed-optimizer --save "$work/ck" --save-interval 5 --exit-interval 5 \
  || bad "EP 4 save: $(tail -3 "$work/ep4.log")"
grep -q "expert-parallel size 4" "$work/ep4.log" && ok "the start-up table names the expert-parallel size" || bad "start-up table: $(grep 'process grid' "$work/ep4.log")"
train res-ep1 1 --load "$work/ck" || bad "EP 1 resume: $(tail -2 "$work/res-ep1.log")"
same full res-ep1 "saved at EP 4 (distributed optimizer), resumed on one rank"
train res-ep2 2 --load "$work/ck" --expert-model-parallel-size 2 --async-save --save "$work/ck2" --save-interval 8 \
  || bad "EP 2 resume: $(tail -2 "$work/res-ep2.log")"
same full res-ep2 "saved at EP 4, resumed at EP 2 (async saves)"
# A capacity (issue 58): each expert takes at most ceil(N K / E x 0.5) copies from each rank, so
# the expert side's buffers are sized by it (GPTConfig::moe_received_rows, an eighth of the
# dropless bound at EP 4) and the copies over it are dropped; EP 4 and the allgather dispatcher at
# EP 2 train as the single rank does.
train cap 1 --moe-expert-capacity-factor 0.5 || bad "capacity 0.5: $(tail -2 "$work/cap.log")"
train cap-ep4 4 --moe-expert-capacity-factor 0.5 --expert-model-parallel-size 4 \
  || bad "capacity 0.5 at EP 4: $(tail -2 "$work/cap-ep4.log")"
same cap cap-ep4 "capacity 0.5 at EP 4 (buffers sized by the capacity)"
train cap-ag 2 --moe-expert-capacity-factor 0.5 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather \
  || bad "capacity 0.5 at EP 2, allgather: $(tail -2 "$work/cap-ag.log")"
same cap cap-ag "capacity 0.5 at EP 2 with the allgather dispatcher"
# The file holds each expert once, by its global index (8 experts x 2 layers x fc1, fc2).
n=$(python3 - "$work/ck/iter_0000005/mp_rank_00_000.h5" <<'PY'
import subprocess, sys
out = subprocess.run(["h5ls", "-r", sys.argv[1]], capture_output=True, text=True).stdout
print(sum(1 for l in out.splitlines() if "/model/layers." in l and ".mlp.experts." in l))
PY
)
[ "$n" = 32 ] && ok "the EP 4 checkpoint holds the 32 expert tensors of every expert" || bad "expert tensors in the EP 4 checkpoint: $n (expected 32)"
"$bin/tessera-reshard" --load "$work/ck" --save "$work/ck-tp2" --target-tensor-model-parallel-size 2 --target-expert-model-parallel-size 2 > "$work/reshard.log" 2>&1 \
  || bad "tessera-reshard: $(tail -2 "$work/reshard.log")"
train res-tp2ep2 4 --load "$work/ck-tp2" --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel \
  || bad "TP 2 x EP 2 resume: $(tail -2 "$work/res-tp2ep2.log")"
same full res-tp2ep2 "resharded to TP 2, resumed at TP 2 x EP 2 with sequence parallelism"
gen=$("$bin/tessera-generate" --load "$work/ck" --threads 1 --prompt-ids "3 14 15" --max-new-tokens 4 --greedy 2>/dev/null | tail -1)
[[ "$gen" =~ ^3\ 14\ 15\ \|\ [0-9]+\ [0-9]+\ [0-9]+\ [0-9]+$ ]] && ok "tessera-generate reads the EP checkpoint: $gen" || bad "tessera-generate: '$gen'"
dry=$("$bin/tessera-train" --config "$configs/mixtral-8x7b.ini" --dry-run --expert-model-parallel-size 8 2>&1)
grep -q "EP 8 x expert-data-parallel 1" <<<"$dry" && grep -q "routed experts 704643072 parameters per rank" <<<"$dry" \
  && ok "--dry-run at EP 8: one expert of each layer per rank" || bad "--dry-run at EP 8: $dry"

# Bad input: one line, exit 2.
expect() {  # expect WHAT PATTERN NP [options]
  local what=$1 pattern=$2 np=$3 out rc
  shift 3
  if [ "$np" -gt 1 ]; then
    out=$(timeout 120 mpirun --oversubscribe --bind-to none -np "$np" "$bin/tessera-train" "${common[@]}" "$@" 2>&1); rc=$?
  else
    out=$(timeout 120 "$bin/tessera-train" "${common[@]}" "$@" 2>&1); rc=$?
  fi
  if [ $rc -eq 2 ] && grep -qE -- "$pattern" <<<"$out" && [ "$(grep -c 'error:' <<<"$out")" -le "$np" ]; then ok "$what -> rc 2"
  else bad "$what: rc $rc: $(echo "$out" | grep -m3 -E 'error|Error')"; fi
}
expect "EP not dividing DP" "expert-model-parallel-size=4 does not divide the data-parallel size 2" 2 --expert-model-parallel-size 4
expect "EP not dividing the experts" "expert-model-parallel-size=3 does not divide --num-experts=8" 1 --expert-model-parallel-size 3
expect "a checkpoint of another expert count" "has --num-experts=8 but this run has 4" 1 --load "$work/ck" --num-experts 4
out=$("$bin/tessera-reshard" --load "$work/ck" --save "$work/x" --target-expert-model-parallel-size 3 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "does not divide the 8 experts" <<<"$out" && ok "tessera-reshard with EP 3 -> rc 2" || bad "tessera-reshard EP 3: rc $rc: $out"
[ $fail -eq 0 ] && echo "MoE: all passed"
exit $fail
