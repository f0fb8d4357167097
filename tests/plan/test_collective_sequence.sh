#!/usr/bin/env bash
# test_collective_sequence.sh (issue 57, point 2): the step-time predictor's collective plan
# (plan/collectives.hpp, `tessera-train --dry-run --collective-plan PREFIX`) against what a real MPI
# run of the same layout issues (the test hook TESSERA_TEST_COLLECTIVE_LOG records every tensor
# collective and point-to-point call of each rank). For each layout, each rank's recorded calls of
# iteration 2 must equal its planned step line by line: group, operation, elements, bytes per
# element and peer. An all-to-all's size follows the routing (the combine sends back what the
# rank's experts received): its lines are compared without the size, and the sizes summed over
# all ranks must equal the plan's (dispatch and combine move every token copy once each way).
# Usage: test_collective_sequence.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
gpt=(--config "$configs/gpt2-tiny.ini" --num-layers 4 --hidden-size 32 --num-attention-heads 4
     --seq-length 32 --max-position-embeddings 32 --vocab-size 200 --global-batch-size 8
     --micro-batch-size 2 --train-iters 2 --log-interval 1 --lr-warmup-iters 2 --threads 1)
moe=(--config "$configs/mixtral-tiny.ini" --num-layers 2 --global-batch-size 8
     --micro-batch-size 2 --mock-data --vocab-size 200 --train-iters 2 --log-interval 1
     --lr-warmup-iters 2 --threads 1)
qwen3=(--config "$configs/qwen3-tiny.ini" --num-layers 2 --global-batch-size 8
       --micro-batch-size 2 --mock-data --vocab-size 200 --train-iters 2 --log-interval 1
       --lr-warmup-iters 2 --threads 1)
deepseek=(--config "$configs/deepseek-tiny.ini" --global-batch-size 8 --micro-batch-size 2
          --mock-data --vocab-size 200 --train-iters 2 --log-interval 1 --lr-warmup-iters 2
          --threads 1)
fail=0
check() {  # check NAME NP MODEL OPTIONS...: MODEL is gpt, moe, qwen3 or deepseek
  local name=$1 np=$2 model=$3
  shift 3
  local -n common=$model
  if ! TESSERA_TEST_COLLECTIVE_LOG="$work/$name" timeout 300 mpirun --oversubscribe --bind-to none \
      -np "$np" "$bin/tessera-train" "${common[@]}" "$@" > "$work/$name.log" 2>&1; then
    echo "FAIL: $name: the MPI run exited non-zero"; tail -3 "$work/$name.log"; fail=1; return
  fi
  if ! "$bin/tessera-train" "${common[@]}" "$@" --dry-run --world-size "$np" \
      --collective-plan "$work/$name.plan" > "$work/$name.dry" 2>&1; then
    echo "FAIL: $name: the dry run exited non-zero"; tail -3 "$work/$name.dry"; fail=1; return
  fi
  local r calls=0 bad=0 rec_a2a=0 plan_a2a=0 n
  for ((r = 0; r < np; r++)); do
    # Iteration 2's calls (iteration 1 is the same; the plan is one step).
    awk '/^iteration 2$/ { on = 1; next } /^iteration / { on = 0 } on' "$work/$name.rank$r" \
      > "$work/$name.rec$r"
    n=$(awk '$2 == "all_to_all" { s += $3 } END { print s + 0 }' "$work/$name.rec$r")
    rec_a2a=$((rec_a2a + n))
    n=$(awk '$2 == "all_to_all" { s += $3 } END { print s + 0 }' "$work/$name.plan.rank$r")
    plan_a2a=$((plan_a2a + n))
    if ! diff <(awk '$2 == "all_to_all" { $3 = "*" } 1' "$work/$name.rec$r") \
              <(awk '$2 == "all_to_all" { $3 = "*" } 1' "$work/$name.plan.rank$r") \
              > "$work/$name.diff$r"; then
      echo "FAIL: $name rank $r: recorded (<) and planned (>) calls differ:"
      head -8 "$work/$name.diff$r"
      bad=1
    fi
    calls=$((calls + $(wc -l < "$work/$name.rec$r")))
  done
  if [ "$calls" -eq 0 ]; then echo "FAIL: $name: no call recorded"; bad=1; fi
  if [ "$rec_a2a" -ne "$plan_a2a" ]; then
    echo "FAIL: $name: all-to-all elements over all ranks: recorded $rec_a2a, planned $plan_a2a"
    bad=1
  fi
  if [ "$bad" -eq 0 ]; then
    echo "ok: $name: $np ranks, $calls calls equal to the plan$([ "$rec_a2a" -gt 0 ] && echo ", all-to-all $rec_a2a elements")"
  else
    fail=1
  fi
}
# TP2 + SP x PP2 (1F1B) x DP2 with the distributed optimizer: the SP gathers and reduce-scatters,
# the stages' sends and receives, the buckets' reduce-scatters as the backward completes them,
# the embedding group, the gathers.
check tp2sp-pp2-dp2-distopt 8 gpt --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-param-gather \
  --ddp-bucket-size 3000
# Interleaved 1F1B on 4 stages with 2 model chunks each (the wrap-around groups), 8 layers.
check pp4-interleaved 4 gpt --pipeline-model-parallel-size 4 \
  --num-layers-per-virtual-pipeline-stage 1 --num-layers 8 --global-batch-size 16
# The context-parallel ring of 4 in bf16 (2-byte blocks), DP over the CP ranks' gradients.
check cp4-bf16 4 gpt --context-parallel-size 4 --bf16
# Selective recomputation (the gathers and the ring again) at TP2 + SP x CP2.
check tp2sp-cp2-selective 4 gpt --tensor-model-parallel-size 2 --sequence-parallel \
  --context-parallel-size 2 --recompute-granularity selective
# Full recomputation of 2-layer chunks at TP2 (all-reduces), DP2 reducing its buckets after the
# backward, in bucket order.
check tp2-dp2-full 4 gpt --tensor-model-parallel-size 2 --recompute-granularity full \
  --recompute-method uniform --recompute-num-layers 2 --overlap-grad-reduce false \
  --ddp-bucket-size 4000
# MoE: EP2 (the all-to-alls), and TP2 + SP x EP2 (the router's gathers and sums).
check ep2 2 moe --expert-model-parallel-size 2
check tp2sp-ep2 4 moe --tensor-model-parallel-size 2 --sequence-parallel \
  --expert-model-parallel-size 2
# Muon (issue 59): the TP-cut matrices gathered (duplicated) or their Gram matrices summed at
# each Newton-Schulz step (distributed); over the distributed optimizer each bucket's direction
# gathered, the rank's dealt matrices, the update reduce-scattered.
check muon-tp2 2 gpt --tensor-model-parallel-size 2 --optimizer muon
check muon-tp2-distributed 2 gpt --tensor-model-parallel-size 2 --optimizer muon \
  --muon-tp-mode distributed
check dist-muon-tp2-dp2 4 gpt --tensor-model-parallel-size 2 --optimizer dist_muon \
  --ddp-bucket-size 3000
# Qwen3's q/k norms (their gradients summed over TP once a step), RMSNorm.
check qwen3-tp2sp 2 qwen3 --tensor-model-parallel-size 2 --sequence-parallel
# DeepSeek-V3-shaped: MLA's latents (their TP-partial gradients), a dense first layer, shared
# experts, the grouped sigmoid router, at TP2 x EP2.
check deepseek-tp2-ep2 4 deepseek --tensor-model-parallel-size 2 --expert-model-parallel-size 2
# Multi-token prediction (issue 69): its layer, embedding and head on the last stage at TP2 + SP x
# PP2 (a MoE layer at EP2 over DP2 with 8 ranks would not fit CI; EP2 at PP1 here instead).
check deepseek-mtp-tp2sp-pp2 4 deepseek --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 2 --mtp-num-layers 1
check deepseek-mtp-ep2 2 deepseek --expert-model-parallel-size 2 --mtp-num-layers 1
# Megatron-FSDP (issue 59): each unit's gathers before its forward and backward pieces (with full
# recomputation, again for the chunk's forward), its reduce-scatter once its pieces ran, every
# micro-batch, and the TP sums every micro-batch: TP2 + SP x PP2 x DP2 (optim_grads_params,
# full recomputation), and a Mixtral-shaped MoE at EP2 with the bf16 gathers (optim_grads_params)
# and optim_grads at DP2 (the optimizer's gathers after the step).
check fsdp-tp2sp-pp2-dp2 8 gpt --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 2 --use-megatron-fsdp --data-parallel-sharding-strategy \
  optim_grads_params --recompute-granularity full --recompute-method uniform --recompute-num-layers 2
check fsdp-ep2-bf16 2 moe --expert-model-parallel-size 2 --bf16 --use-megatron-fsdp \
  --data-parallel-sharding-strategy optim_grads_params
check fsdp-optim-grads-dp2 2 gpt --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads
# HSDP: the units over one instance of two DP ranks, the shards summed across the two instances
# (reduce-scattered, and the updated cut gathered back, with --outer-dp-sharding-strategy optim)
# at DP4 x PP2 (the tied embedding's block summed after), and the partial distributed optimizer
# with a Mixtral-shaped MoE at EP2 x DP4 in bf16 (the experts' instances of one rank each).
check hsdp-optim-dp4-pp2 8 gpt --pipeline-model-parallel-size 2 --use-megatron-fsdp \
  --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim
check hsdp-distopt-ep2-dp4 4 moe --expert-model-parallel-size 2 --bf16 --use-distributed-optimizer \
  --num-distributed-optimizer-instances 2 --overlap-param-gather
# Uneven stages (issue 72): 5 layers at TP2 + SP x PP3 (first 1, last 2), a layout with an
# empty virtual stage at PP2 x VP2 (the ring), and DeepSeek's MTP beside the loss in a layout.
check uneven-tp2sp-pp3 6 gpt --num-layers 5 --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 \
  --decoder-last-pipeline-num-layers 2
check layout-pp2-vp2-empty 2 gpt --num-layers 5 --pipeline-model-parallel-size 2 \
  --pipeline-model-parallel-layout "Et|tt||ttL"
check deepseek-mtp-layout-pp2 2 deepseek --pipeline-model-parallel-size 2 --mtp-num-layers 1 \
  --pipeline-model-parallel-layout "Et|tttmL"
# Zero-bubble (issue 72): the W passes issue the pieces' TP sums and start their buckets, after
# the B passes that no longer do: uneven TP2 + SP x PP3 (the last stage splits its backwards),
# and PP4 x DP2 with the distributed optimizer's overlapped buckets.
check zb-tp2sp-pp3 6 gpt --num-layers 5 --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 \
  --decoder-last-pipeline-num-layers 2 --pipeline-schedule zero-bubble
check zb-pp4-dp2-distopt 8 gpt --pipeline-model-parallel-size 4 --use-distributed-optimizer \
  --ddp-bucket-size 3000 --pipeline-schedule zero-bubble
exit $fail
