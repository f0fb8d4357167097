#!/usr/bin/env bash
# test_zero_bubble.sh: the zero-bubble schedule (issue 72, --pipeline-schedule zero-bubble, ZB-H1)
# gives 1F1B's losses and gradient norms bit for bit (every logged digit of 8 iterations, dropout
# on) at every layout it combines with: uneven stages at PP3 and PP4, interleaved PP2 x VP2,
# TP2 + SP, DP2 with overlapped bucket reductions and the distributed optimizer, full and
# selective recomputation, GPT-2 (tied embedding across stages), Llama (SwiGLU, untied), Mixtral
# with EP2 (grouped expert GEMMs) and DeepSeek-V3 (MLA, its router, MTP beside the loss and on a
# stage of its own). Each zero-bubble run splits its backwards where its --dry-run says it holds
# W operands (the Nsight ranges backward-input / backward-weight, logged by the
# TESSERA_TEST_NVTX_LOG hook: one B and one W per micro-batch per step on those ranks, whole
# backwards elsewhere), the --enable-zero-bubble alias runs the same schedule, and bad
# combinations are refused in one line (exit 2). The hang report's B / W names are unit-tested
# (tests/comm/test_collective_trace.cpp).
# Usage: test_zero_bubble.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, metric
iters=8
common=(--num-layers 5 --hidden-size 32 --num-attention-heads 4 --seq-length 32
        --max-position-embeddings 64 --vocab-size 200 --mock-data --global-batch-size 8
        --micro-batch-size 1 --train-iters "$iters" --log-interval 1 --lr-warmup-iters 2
        --threads 1 --device cpu --eval-interval 0 --seed 1 --attention-dropout 0.1
        --hidden-dropout 0.1)

launch() {  # launch NAME NP [options]: tessera-train, metrics in $work/NAME.jsonl
  local name=$1 np=$2
  shift 2
  TESSERA_TEST_NVTX_LOG="$work/$name.nvtx" timeout 300 mpirun --oversubscribe --bind-to none \
    -np "$np" "$bin/tessera-train" "${common[@]}" --metrics-file "$work/$name.jsonl" "$@" \
    > "$work/$name.log" 2>&1 || { bad "$name exited $?: $(grep -v '^\[' "$work/$name.log" | tail -2)"; return 1; }
}
# The W passes each rank's --dry-run says it holds back, one number per stage.
held() {
  "$bin/tessera-train" "${common[@]}" --world-size "$1" --dry-run "${@:2}" 2>&1 |
    sed -n 's/^  zero-bubble: \(each backward whole (as 1F1B.s): \)\{0,1\}\([0-9]*\) B pass.*/\2/p' | tr '\n' ' '
}
# case NAME NP CONFIG [options]: 1F1B and zero-bubble, bitwise; W passes where the dry run says.
case_() {
  local name=$1 np=$2 config=$3
  shift 3
  launch "$name-1f1b" "$np" --config "$configs/$config" "$@" || return
  launch "$name-zb" "$np" --config "$configs/$config" --pipeline-schedule zero-bubble "$@" || return
  local a b
  a=$(metric "$work/$name-1f1b.jsonl" lm_loss; metric "$work/$name-1f1b.jsonl" grad_norm)
  b=$(metric "$work/$name-zb.jsonl" lm_loss; metric "$work/$name-zb.jsonl" grad_norm)
  if [ -n "$a" ] && [ "$(echo "$a" | wc -l)" -eq $((2 * iters)) ] && [ "$a" = "$b" ]; then
    ok "$name: zero-bubble's $iters losses and grad norms equal 1F1B's bit for bit ($(echo "$b" | tail -1))"
  else
    bad "$name: zero-bubble differs from 1F1B: $(paste <(echo "$a") <(echo "$b") | awk '$1 != $2' | head -2 | tr '\n' ';')"
  fi
  # Deferred W passes: on the ranks whose dry run holds some back, one backward-weight range per
  # micro-batch (of each model chunk) per iteration and as many backward-input ranges; elsewhere
  # whole backwards only.
  local plan deferring=0 r=0 d micro w in whole want pp chunks
  plan=$(held "$np" --config "$configs/$config" --pipeline-schedule zero-bubble "$@")
  for d in $plan; do deferring=$((deferring + (d > 0))); done
  pp=$(echo "$plan" | wc -w)
  micro=$("$bin/tessera-train" "${common[@]}" --world-size "$np" --dry-run --config "$configs/$config" "$@" 2>&1 |
    sed -n 's/.*micro-batch 1 x \([0-9]*\) micro-batches.*/\1/p')
  for f in "$work/$name-zb.nvtx".rank*; do
    w=$(grep -cx backward-weight "$f"); in=$(grep -cx backward-input "$f")
    whole=$(grep -cx backward "$f")
    if [ "$w" -gt 0 ]; then
      chunks=$((w / (micro * iters)))
      [ "$w" -eq "$in" ] && [ "$whole" -eq 0 ] && [ $((chunks * micro * iters)) -eq "$w" ] ||
        bad "$name: $(basename "$f"): $in B and $w W ranges, $whole whole backwards"
    elif [ "$in" -gt 0 ]; then
      bad "$name: $(basename "$f"): B passes without W passes"
    fi
    r=$((r + (w > 0)))
  done
  want=$((deferring * np / pp))
  if [ "$deferring" -gt 0 ] && [ "$r" -eq "$want" ]; then
    ok "$name: $r rank(s) ran B and W passes apart (dry run per stage: $plan)"
  else
    bad "$name: $r rank(s) ran W passes apart, the dry run ($plan) says $want"
  fi
}

case_ gpt2-pp4-first2 4 gpt2-tiny.ini --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2
case_ gpt2-pp3 3 gpt2-tiny.ini --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2
case_ gpt2-pp2vp2-layout 2 gpt2-tiny.ini --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "Et|tt|t|tL"
case_ gpt2-tp2sp-pp3 6 gpt2-tiny.ini --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2
case_ gpt2-dp2-pp2-dist 4 gpt2-tiny.ini --use-distributed-optimizer --overlap-grad-reduce --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 --ddp-bucket-size 2000
case_ llama-pp4-full 4 llama-tiny.ini --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
case_ llama-pp3-selective 3 llama-tiny.ini --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2 --recompute-granularity selective
case_ mixtral-ep2-pp2 4 mixtral-tiny.ini --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2
case_ deepseek-pp3-mtp 3 deepseek-tiny.ini --moe-layer-freq "[0,1,1,1,1]" --mtp-num-layers 1 --pipeline-model-parallel-size 3 --pipeline-model-parallel-layout "Ett|tt|tmL"
case_ deepseek-pp4-mtp-alone 4 deepseek-tiny.ini --moe-layer-freq "[0,1,1,1,1]" --mtp-num-layers 1 --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout "Ett|ttt|m|L"

# The zero-bubble fork's spelling runs the same schedule.
launch alias 4 --config "$configs/gpt2-tiny.ini" --enable-zero-bubble --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2
if [ "$(metric "$work/alias.jsonl" lm_loss)" = "$(metric "$work/gpt2-pp4-first2-zb.jsonl" lm_loss)" ] &&
   [ "$(cat "$work"/alias.nvtx.rank3)" = "$(cat "$work"/gpt2-pp4-first2-zb.nvtx.rank3)" ]; then
  ok "--enable-zero-bubble: the same losses and the same B/W ranges as --pipeline-schedule zero-bubble"
else
  bad "--enable-zero-bubble differs from --pipeline-schedule zero-bubble"
fi

# Refusals: one line naming the option, exit 2.
refuse() {  # refuse WHAT PATTERN [options]
  local what=$1 pattern=$2 out rc
  shift 2
  out=$("$bin/tessera-train" "${common[@]}" --config "$configs/gpt2-tiny.ini" --world-size 2 \
    --dry-run "$@" 2>&1)
  rc=$?
  if [ $rc -eq 2 ] && echo "$out" | grep -q -- "$pattern"; then
    ok "refused $what: $(echo "$out" | grep -m1 -- "$pattern")"
  else
    bad "$what: rc $rc, $(echo "$out" | tail -2)"
  fi
}
refuse "zero-bubble at PP 1" "zero-bubble needs --pipeline-model-parallel-size > 1" --pipeline-schedule zero-bubble
refuse "an unknown schedule" "--pipeline-schedule=gpipe is not a schedule" --pipeline-schedule gpipe --pipeline-model-parallel-size 2
refuse "zero-bubble with FSDP" "does not combine with --use-megatron-fsdp" --pipeline-schedule zero-bubble --pipeline-model-parallel-size 2 --use-megatron-fsdp
refuse "zero-bubble with FP8" "does not combine with FP8" --pipeline-schedule zero-bubble --pipeline-model-parallel-size 2 --fp8-format hybrid
refuse "the alias against 1f1b" "--enable-zero-bubble contradicts --pipeline-schedule=1f1b" --enable-zero-bubble --pipeline-schedule 1f1b --pipeline-model-parallel-size 2

[ $fail -eq 0 ] && echo "zero bubble: all passed"
exit $fail
