#!/usr/bin/env bash
# test_context_parallel.sh: context parallelism (issue 30) as a user runs it. The sequence split
# over CP ranks (chunks r and 2CP-1-r), attention around their ring: every layout's 20 losses are
# the single-rank run's within 1e-5 -- CP 2 and 4, TP 2 + SP x CP 2, DP 2 x CP 2 with the
# distributed optimizer, TP 2 x PP 2 x CP 2, PP 2 interleaved x CP 2 with full recomputation, a
# Llama at CP 2 and TP 2 x CP 2, GPT-2's dropout 0.1 at CP 2 and CP 4, dropless MoE at CP 2, with
# EP 2 and with TP 2 + SP (LM and load-balancing losses), seq_aux at CP 4; two mutations (a block
# merged without its log-sum-exp correction, the naive contiguous split) must disagree; a CP 4 run
# saved with the distributed optimizer resumes at CP 1 with the uninterrupted run's losses; the
# start-up table and --dry-run show the CP group and its figures; bad input is one line, exit 2.
# Usage: test_context_parallel.sh BIN_DIR CONFIG_DIR
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
# 4 layers, sequence 32 (CP 4: 8 chunks of 4 tokens), global batch 8.
common=(--config "$configs/gpt2-tiny.ini" --num-layers 4 --hidden-size 32 --num-attention-heads 4
        --seq-length 32 --max-position-embeddings 32 --vocab-size 200 --global-batch-size 8
        --micro-batch-size 2 --train-iters 20 --log-interval 1 --lr-warmup-iters 2 --threads 1
        --device cpu)
run() {  # run NAME NP [options]
  local name=$1 np=$2
  shift 2
  local cmd=("$bin/tessera-train" "${common[@]}" --metrics-file "$work/$name.jsonl" "$@")
  if [ "$np" -gt 1 ]; then
    timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}" > "$work/$name.log" 2>&1
  else
    timeout 300 "${cmd[@]}" > "$work/$name.log" 2>&1
  fi
  local rc=$?
  [ $rc -eq 0 ] || { bad "$name exited $rc: $(grep -m2 -E 'error|Error' "$work/$name.log")"; return 1; }
}
worst() {  # worst BASE NAME: "N WORST" over the iterations both logged
  awk 'NR == FNR { base[$1] = $2; next }
    ($1 in base) { d = base[$1] - $2; if (d < 0) d = -d; r = d / base[$1]; if (r > w) w = r; n++ }
    END { printf "%d %.3g", n, w }' <(run_losses "$1") <(run_losses "$2")
}
within() {  # within BASE NAME N WHAT: N iterations, each within 1e-5
  set -- "$1" "$2" "$3" "$4" $(worst "$1" "$2")
  if [ "$5" -eq "$3" ] && awk -v w="$6" 'BEGIN { exit !(w <= 1e-5) }'; then
    ok "$4: $5 iterations within $6 of one rank"
  else
    bad "$4: $5 iterations compared, worst relative difference $6"
  fi
}
differs() {  # differs BASE NAME WHAT: the mutation must show
  set -- "$1" "$2" "$3" $(worst "$1" "$2")
  if [ "$4" -eq 20 ] && awk -v w="$5" 'BEGIN { exit !(w > 1e-4) }'; then
    ok "mutation '$3' changes the losses by $5 (the test can fail)"
  else
    bad "mutation '$3' went unnoticed: $4 iterations, worst difference $5"
  fi
}

run base 1 || exit 1
run cp2 2 --context-parallel-size 2 && within base cp2 20 "CP 2"
run cp4 4 --context-parallel-size 4 && within base cp4 20 "CP 4"
run tp2-sp-cp2 4 --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 \
  && within base tp2-sp-cp2 20 "TP 2 + SP x CP 2"
run dp2-cp2 4 --context-parallel-size 2 --use-distributed-optimizer \
  && within base dp2-cp2 20 "DP 2 x CP 2, distributed optimizer over DP x CP"
run tp2pp2cp2 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 2 \
  && within base tp2pp2cp2 20 "TP 2 x PP 2 x CP 2"
run pp2-vp2-cp2 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
  --context-parallel-size 2 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  && within base pp2-vp2-cp2 20 "PP 2 interleaved x CP 2, full recomputation"
grep -q "process grid: world 8 = TP 2 x CP 2 x DP 1 x PP 2" "$work/tp2pp2cp2.log" \
  && grep -qE "^ +5 +1 +0 +0 +1 " <(sed -n '/rank   tp   cp   dp   pp/,/^[^ ]/p' "$work/tp2pp2cp2.log") \
  && ok "the start-up table shows the CP group (rank 5 = tp 1, cp 0, pp 1)" \
  || bad "start-up table: $(grep -m1 'process grid' "$work/tp2pp2cp2.log")"

# Dropout 0.1 on the attention probabilities and the hidden states: masks keyed by global
# sample and position, the same at every CP size.
drop=(--attention-dropout 0.1 --hidden-dropout 0.1)
run base-drop 1 "${drop[@]}" || fail=1
run cp2-drop 2 --context-parallel-size 2 "${drop[@]}" && within base-drop cp2-drop 20 "CP 2, dropout 0.1"
run cp4-sp-drop 8 --context-parallel-size 4 --tensor-model-parallel-size 2 --sequence-parallel \
  --recompute-activations "${drop[@]}" && within base-drop cp4-sp-drop 20 "TP 2 + SP x CP 4, dropout 0.1, selective recomputation"

# The Llama family: RoPE at the global positions, grouped-query attention (only the 2 key/value
# heads travel the ring), RMSNorm, SwiGLU, untied head.
llama=(--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
       --ffn-hidden-size 88 --group-query-attention --num-query-groups 2
       --untie-embeddings-and-output-weights --disable-bias-linear)
run base-llama 1 "${llama[@]}" || fail=1
run cp2-llama 2 --context-parallel-size 2 "${llama[@]}" && within base-llama cp2-llama 20 "Llama, CP 2"
run tp2-cp2-llama 4 --tensor-model-parallel-size 2 --context-parallel-size 2 "${llama[@]}" \
  && within base-llama tp2-cp2-llama 20 "Llama, TP 2 x CP 2"

# Dropless MoE (4 SwiGLU experts, top 2, load-balancing and z losses, dropout): each CP rank
# routes its tokens; the load-balancing counts and statistics are summed over the ring, so the
# LM loss and the logged load-balancing loss are one rank's; with expert parallelism (EP inside
# one CP rank, expert gradients over expert-DP x CP) and with seq_aux_loss (per sample).
moe=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --swiglu --normalization RMSNorm
     --position-embedding-type rope --disable-bias-linear --moe-aux-loss-coeff 0.05
     --moe-z-loss-coeff 0.001 --hidden-dropout 0.1)
field() { sed -n "s/.*\"$2\": \([^,}]*\).*/\1/p" "$work/$1.jsonl"; }
same_field() {  # same_field BASE NAME FIELD: every iteration within 1e-5
  local w
  w=$(paste <(field "$1" "$3") <(field "$2" "$3") | awk '
    { d = $1 - $2; if (d < 0) d = -d; r = d / $1; if (r > w) w = r; n++ }
    END { if (n != 20) print "missing"; else printf "%.3g", w }')
  if [ "$w" != missing ] && awk -v w="$w" 'BEGIN { exit !(w <= 1e-5) }'; then ok "$2: $3 within $w of one rank"
  else bad "$2: $3 differs from one rank: $w"; fi
}
run base-moe 1 "${moe[@]}" || fail=1
for layout in "cp2-moe 2 --context-parallel-size 2" \
              "dp2-cp2-ep2-moe 4 --context-parallel-size 2 --expert-model-parallel-size 2 --use-distributed-optimizer" \
              "tp2-sp-cp2-moe 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --recompute-activations"; do
  set -- $layout
  name=$1 np=$2
  shift 2
  run "$name" "$np" "$@" "${moe[@]}" && within base-moe "$name" 20 "MoE, $*" && same_field base-moe "$name" load_balancing_loss \
    && same_field base-moe "$name" z_loss
done
run base-moe-seq 1 "${moe[@]}" --moe-router-load-balancing-type seq_aux_loss || fail=1
run cp4-moe-seq 4 --context-parallel-size 4 "${moe[@]}" --moe-router-load-balancing-type seq_aux_loss \
  && within base-moe-seq cp4-moe-seq 20 "MoE seq_aux_loss, CP 4" && same_field base-moe-seq cp4-moe-seq load_balancing_loss

# Mutations: the test must be able to fail.
TESSERA_FAULT_CP=no-lse-merge run cp2-no-lse 2 --context-parallel-size 2 && differs base cp2-no-lse "merge without the log-sum-exp correction"
TESSERA_FAULT_CP=contiguous-split run cp2-contiguous 2 --context-parallel-size 2 && differs base cp2-contiguous "the naive contiguous split"

# Checkpoints hold nothing of CP: saved at CP 4 (distributed optimizer over DP x CP) after 10
# iterations, resumed on one rank.
run ck-cp4 4 --context-parallel-size 4 --use-distributed-optimizer --save "$work/ck" --save-interval 10 \
  --exit-interval 10 || fail=1
run res-cp1 1 --load "$work/ck" && within base res-cp1 10 "saved at CP 4 (distributed optimizer), resumed at CP 1"
run res-cp2 2 --load "$work/ck" --context-parallel-size 2 && within base res-cp2 10 "saved at CP 4, resumed at CP 2"

# --dry-run: Llama 3 1B (its config: TP 2, SP, selective recomputation) at 128k tokens over CP 16.
dry=$("$bin/tessera-train" --config "$configs/llama3-1b.ini" --seq-length 131072 --max-position-embeddings 131072 \
      --context-parallel-size 16 --mock-data --train-iters 1 --dry-run 2>&1)
if grep -q "layout: world 32 = TP 2 x CP 16 x PP 1 x DP 1" <<<"$dry" \
   && grep -q "context parallelism: CP 16; each rank holds 8192 of the 131072 tokens" <<<"$dry"; then
  ok "--dry-run at CP 16: $(grep -m1 'context parallelism' <<<"$dry" | cut -c1-160)"
else
  bad "--dry-run at CP 16: $dry"
fi
one=$("$bin/tessera-train" --config "$configs/llama3-1b.ini" --seq-length 8192 --mock-data --train-iters 1 --dry-run 2>&1 \
      | sed -n 's/.*activations kept per layer per micro-batch \([0-9.]*\) MiB.*/\1/p' | head -1)
four=$("$bin/tessera-train" --config "$configs/llama3-1b.ini" --seq-length 8192 --context-parallel-size 4 --mock-data \
       --train-iters 1 --dry-run 2>&1 | sed -n 's/.*activations kept per layer per micro-batch \([0-9.]*\) MiB.*/\1/p' | head -1)
awk -v a="$one" -v b="$four" 'BEGIN { r = a / b; exit !(r > 3.99 && r < 4.01) }' \
  && ok "--dry-run: activations kept per layer $one MiB at CP 1, $four MiB at CP 4 (/ 4)" \
  || bad "--dry-run activations at CP 1 $one MiB, CP 4 $four MiB"

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
expect "sequence not divisible by 2 x CP" "seq-length=36 is not divisible by 2 x --context-parallel-size=4 = 8" 4 \
  --context-parallel-size 4 --seq-length 36 --max-position-embeddings 36
expect "world not divisible by TP x CP x PP" "world size 2 is not divisible by --tensor-model-parallel-size=1 x --context-parallel-size=4" 2 \
  --context-parallel-size 4
expect "SP tokens per CP rank not divisible by TP" "tokens per CP rank is not divisible by --tensor-model-parallel-size=4" 8 \
  --context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel --seq-length 36 --max-position-embeddings 36
expect "CP with MoE capacity dropping" "context-parallel-size=2 with --moe-expert-capacity-factor=1" 2 --context-parallel-size 2 \
  --num-experts 4 --moe-router-topk 2 --moe-expert-capacity-factor 1.0
expect "CP 0" "context-parallel-size=0 is out of range" 1 --context-parallel-size 0
expect "--cp-comm-type a2a" "cp-comm-type=a2a is not available" 1 --context-parallel-size 1 --cp-comm-type a2a
echo "first/last single-rank loss: $(losses base | head -1) -> $(losses base | tail -1)"
[ $fail -eq 0 ] && echo "context parallelism: all passed"
exit $fail
