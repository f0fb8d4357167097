#!/usr/bin/env bash
# test_uneven_stages.sh: uneven pipeline stages (issue 72) train the single-rank model. With an odd
# layer count (5; DeepSeek's 5 + one MTP layer) and dropout on, every iteration's loss of 20 equals
# the single-rank run's to 1e-6 relative in f32 at PP2 (--decoder-first-pipeline-num-layers), PP3
# (first and last), PP4 (a layout string with an empty stage) and PP2 x VP2 (a layout string), and
# beside every other dimension: TP2 + SP, CP2, DP2 with the distributed optimizer, Megatron-FSDP,
# full and selective recomputation, the embedding and loss counted as layers; for GPT-2, Llama,
# Qwen3, Mixtral (EP2) and DeepSeek-V3 (MLA, its router, MTP beside the loss and on a stage of
# its own, at PP4, PP2 x VP2 on the first rank, with TP2 + SP, the distributed optimizer,
# Megatron-FSDP, tied and untied); Llama 3.1 405B's
# published PP8 x VP8 with the embedding and loss counted on 126 layers bitwise, and DeepSeek-V3's
# PP16 x VP2 layout string on 61 + 1 MTP layers on 16 ranks. A checkpoint
# saved at an uneven split resumes on one rank, and one saved on one rank resumes at an uneven
# split, each giving the uninterrupted run's losses (1e-6). Bad splits: one error
# line naming the option, exit 2.
# Usage: test_uneven_stages.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses
common=(--num-layers 5 --hidden-size 32 --num-attention-heads 4 --seq-length 32
        --max-position-embeddings 64 --vocab-size 200 --mock-data --global-batch-size 8
        --micro-batch-size 2 --train-iters 20 --log-interval 1 --lr-warmup-iters 2 --threads 1
        --device cpu --eval-interval 0 --seed 1 --attention-dropout 0.1 --hidden-dropout 0.1)
# shellcheck source=layout_runs.sh
source "$(dirname "$0")/layout_runs.sh"  # run, worst, within
tol=1e-6
# pairs_worst N: the worst relative difference of the number pairs on stdin ("missing" unless N).
pairs_worst() {
  awk -v want="$1" '{ d = $1 - $2; if (d < 0) d = -d; r = d / $1; if (r > w) w = r; n++ }
    END { if (n != want) print "missing"; else printf "%.3g", w }'
}
# within_tol W WHAT: ok when W is a number within the tolerance.
within_tol() {
  if [ "$1" != missing ] && awk -v w="$1" -v t="$tol" 'BEGIN { exit !(w <= t) }'; then
    ok "$2 within $1"
  else
    bad "$2: differs by $1 (bound $tol)"
  fi
}
after10() { iteration_losses "$1" | awk '$1 > 10 { print $2 }'; }  # iterations 11-20's losses

family() {  # family NAME CONFIG [options]: the single-rank base run of a family
  local name=$1 config=$2
  shift 2
  run "$name" 1 --config "$configs/$config" "$@"
}
layouts() {  # layouts BASE CONFIG "NAME NP options..." ...: each against BASE
  local base=$1 config=$2 spec
  shift 2
  for spec in "$@"; do
    set -- $spec
    local name=$1 np=$2
    shift 2
    run "$name" "$np" --config "$configs/$config" "${extra[@]}" "$@" &&
      within "$base" "$name" "np $np $*" "$tol"
  done
}

# GPT-2: every split kind, and beside every other dimension.
extra=()
family gpt2 gpt2-tiny.ini || exit 1
layouts gpt2 gpt2-tiny.ini \
  "gpt2-pp2-first2 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2" \
  "gpt2-pp3-first1-last2 3 --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2" \
  "gpt2-pp4-layout 4 --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout E|tt||tttL" \
  "gpt2-pp2-vp2 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tt|t|tL" \
  "gpt2-pp2-accounted 2 --pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split" \
  "gpt2-tp2sp-pp2 4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 1" \
  "gpt2-cp2-pp2 4 --context-parallel-size 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3" \
  "gpt2-dp2-pp2-dist 4 --use-distributed-optimizer --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2" \
  "gpt2-dp2-pp2-fsdp 4 --use-megatron-fsdp --pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 2" \
  "gpt2-pp3-full 3 --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2" \
  "gpt2-pp2-vp2-selective 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|t|t|tL --recompute-granularity selective"

# Llama and Qwen3 (RoPE, SwiGLU, grouped-query attention; Qwen3's q/k norms).
family llama llama-tiny.ini || exit 1
layouts llama llama-tiny.ini \
  "llama-pp3 3 --pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Ett|t|ttL" \
  "llama-tp2-pp2-vp2 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|t|tt|tL"
family qwen3 qwen3-tiny.ini || exit 1
layouts qwen3 qwen3-tiny.ini \
  "qwen3-pp2 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3"

# Mixtral (a MoE MLP in every layer) with expert parallelism.
family mixtral mixtral-tiny.ini || exit 1
layouts mixtral mixtral-tiny.ini \
  "mixtral-ep2-pp2 4 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2"

# DeepSeek-V3: MLA, a dense first layer then its router, one MTP layer with the loss.
ds=(--moe-layer-freq "[0,1,1,1,1]" --mtp-num-layers 1)
extra=("${ds[@]}")
family deepseek deepseek-tiny.ini "${ds[@]}" || exit 1
layouts deepseek deepseek-tiny.ini \
  "deepseek-pp2-layout 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|tttmL" \
  "deepseek-pp2-accounted 2 --pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split" \
  "deepseek-ep2-pp2 4 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1" \
  "deepseek-pp4-mtp-alone 4 --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout Ett|ttt|m|L" \
  "deepseek-pp2vp2-mtp-alone-first 2 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttt|m|L" \
  "deepseek-tp2sp-pp2vp2-mtp-alone 4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttt|m|L" \
  "deepseek-dp2-pp2vp2-mtp-alone-dist 4 --use-distributed-optimizer --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttt|m|L" \
  "deepseek-dp2-pp2vp2-mtp-alone-fsdp 4 --use-megatron-fsdp --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttt|m|L"
# The MTP loss of those runs too (logged by the stage that runs it).
for r in deepseek-pp4-mtp-alone deepseek-dp2-pp2vp2-mtp-alone-dist deepseek-tp2sp-pp2vp2-mtp-alone; do
  within_tol "$(paste <(metric "$work/deepseek.jsonl" mtp_1_loss) <(metric "$work/$r.jsonl" mtp_1_loss) |
    pairs_worst 20)" "$r: mtp_1 loss against one rank's"
done
# Saved with the MTP stage's copies, verified, resumed on one rank.
run ck-mtp 4 --config "$configs/deepseek-tiny.ini" "${ds[@]}" --pipeline-model-parallel-size 4 \
  --pipeline-model-parallel-layout "Ett|ttt|m|L" --save "$work/ck-mtp" --save-interval 10 \
  --exit-interval 10 &&
run resume-mtp 1 --config "$configs/deepseek-tiny.ini" "${ds[@]}" --load "$work/ck-mtp"
if "$bin/tessera-checkpoint" verify "$work/ck-mtp" 2>&1 | grep -q ": clean$"; then
  ok "the checkpoint with a multi-token prediction stage verifies clean"
else
  bad "tessera-checkpoint verify of the multi-token prediction stage's checkpoint"
fi
within_tol "$(paste <(after10 "$work/deepseek.jsonl") <(losses "$work/resume-mtp.jsonl") | pairs_worst 10)" \
  "resume-mtp: iterations 11-20 on one rank against the uninterrupted run's"
# Tied: the multi-token prediction stage's one copy is the embedding and the output layer.
extra=("${ds[@]}" --untie-embeddings-and-output-weights false)
family deepseek-tied deepseek-tiny.ini "${extra[@]}" || exit 1
layouts deepseek-tied deepseek-tiny.ini \
  "deepseek-tied-pp4-mtp-alone 4 --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout Ett|ttt|m|L"
extra=()

# Llama 3.1 405B's published pipeline options on its 126 layers (a tiny width): PP8 x VP8 with the
# embedding and loss counted, 8 ranks, 2 iterations: the one rank's losses bitwise.
big=(--config "$configs/llama-tiny.ini" --num-layers 126 --global-batch-size 16 --micro-batch-size 1
     --train-iters 2)
run llama405 1 "${big[@]}" &&
run llama405-pp8vp8 8 "${big[@]}" --pipeline-model-parallel-size 8 \
  --num-virtual-stages-per-pipeline-rank 8 --account-for-embedding-in-pipeline-split \
  --account-for-loss-in-pipeline-split &&
if [ "$(losses "$work/llama405.jsonl" | wc -l)" -eq 2 ] &&
   diff <(losses "$work/llama405.jsonl") <(losses "$work/llama405-pp8vp8.jsonl") >/dev/null; then
  ok "126 layers at PP8 x VP8, embedding and loss counted: the one rank's losses bitwise"
else
  bad "126 layers at PP8 x VP8: $(losses "$work/llama405-pp8vp8.jsonl" | tr '\n' ' ') against $(losses "$work/llama405.jsonl" | tr '\n' ' ')"
fi

# DeepSeek-V3's layout from Megatron's docs on its 61 layers + 1 MTP layer (a tiny width): PP16 x
# VP2, "Et*3|(tt|)*29,m|L" (the MTP layer on PP rank 14's second virtual stage), 16 ranks, 2
# iterations: the one rank's LM and MTP losses.
dsv3=(--config "$configs/deepseek-tiny.ini" --num-layers 61 --moe-layer-freq "([0]*3+[1]*58)"
      --mtp-num-layers 1 --global-batch-size 16 --micro-batch-size 1 --train-iters 2)
run dsv3 1 "${dsv3[@]}" &&
run dsv3-pp16vp2 16 "${dsv3[@]}" --pipeline-model-parallel-size 16 \
  --pipeline-model-parallel-layout "Et*3|(tt|)*29,m|L" &&
for key in lm_loss mtp_1_loss; do
  within_tol "$(paste <(metric "$work/dsv3.jsonl" $key) <(metric "$work/dsv3-pp16vp2.jsonl" $key) |
    pairs_worst 2)" "DeepSeek-V3's layout at PP16 x VP2 on 16 ranks: $key against one rank's"
done

# Checkpoints carry no split: saved uneven, resumed on one rank; saved on one rank, resumed uneven
# (5 layers have no even split at PP 2 to 4).
run ck-uneven 3 --config "$configs/gpt2-tiny.ini" --pipeline-model-parallel-size 3 \
  --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2 \
  --save "$work/ck-uneven" --save-interval 10 --exit-interval 10 &&
run resume-r1 1 --config "$configs/gpt2-tiny.ini" --load "$work/ck-uneven" &&
run ck-r1 1 --config "$configs/gpt2-tiny.ini" --save "$work/ck-r1" --save-interval 10 \
  --exit-interval 10 &&
run resume-uneven 2 --config "$configs/gpt2-tiny.ini" --pipeline-model-parallel-size 2 \
  --pipeline-model-parallel-layout "Et|tt|t|tL" --load "$work/ck-r1"
# The checkpoint records its split (pipeline_model_parallel_layout) for the verifier, and reshards.
if "$bin/tessera-checkpoint" verify "$work/ck-uneven" > "$work/verify.log" 2>&1 &&
   grep -q ": clean$" "$work/verify.log"; then
  ok "tessera-checkpoint verify: the uneven checkpoint is clean"
else
  bad "tessera-checkpoint verify of the uneven checkpoint: $(tail -2 "$work/verify.log")"
fi
if "$bin/tessera-reshard" --load "$work/ck-uneven" --save "$work/ck-resharded" \
     --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1 > "$work/reshard.log" 2>&1 &&
   "$bin/tessera-checkpoint" verify "$work/ck-resharded" 2>&1 | grep -q ": clean$"; then
  ok "tessera-reshard: the uneven checkpoint to one stage, verified clean"
else
  bad "tessera-reshard of the uneven checkpoint: $(tail -2 "$work/reshard.log")"
fi
for r in resume-r1 resume-uneven; do  # iterations 11-20 against the uninterrupted run's
  within_tol "$(paste <(after10 "$work/gpt2.jsonl") <(losses "$work/$r.jsonl") | pairs_worst 10)" \
    "$r: iterations 11-20 against the uninterrupted run's"
done

# --dry-run names each rank's stages (Megatron's pretty_repr, equal ranks grouped).
line=$("$bin/tessera-train" --config "$configs/llama-tiny.ini" "${common[@]}" --num-layers 7 \
  --dry-run --world-size 4 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 2>&1 |
  grep '^pipeline split')
want="pipeline split (--decoder-first/last-pipeline-num-layers; 1 virtual stage per rank): PP rank 0: embedding,decoder | PP ranks 1-2: decoder*2 | PP rank 3: decoder*2,loss"
if [ "$line" = "$want" ]; then ok "--dry-run: $line"; else bad "--dry-run printed '$line'"; fi

# Bad splits: one line naming the option, exit 2.
refuse() {  # refuse PATTERN options...
  local pattern=$1 out rc
  shift
  out=$("$bin/tessera-train" --config "$configs/gpt2-tiny.ini" "${common[@]}" --dry-run "$@" 2>&1)
  rc=$?
  if [ $rc -eq 2 ] && [ "$(echo "$out" | grep -c 'error:')" -eq 1 ] && echo "$out" | grep -Eq -- "$pattern"; then
    ok "refused: $*"
  else
    bad "not refused as '$pattern' (exit $rc): $* -> $(echo "$out" | tail -2)"
  fi
}
refuse "needs --pipeline-model-parallel-size > 1" --decoder-first-pipeline-num-layers 2
refuse "--decoder-first-pipeline-num-layers=0 is out of range" --world-size 2 \
  --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 0
refuse "leaves 1 layers for 0 middle pipeline stages" --world-size 2 \
  --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2
refuse "places 4 decoder layers \(t\), but --num-layers=5" --world-size 2 \
  --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "Ett|ttL"
refuse "invalid layer character 'x'" --world-size 2 --pipeline-model-parallel-size 2 \
  --pipeline-model-parallel-layout "Ettx|tttL"
refuse "--virtual-pipeline-model-parallel-size=3 disagrees with --pipeline-model-parallel-layout" \
  --world-size 2 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 3 \
  --pipeline-model-parallel-layout "Et|tt|t|tL"
refuse "places every layer itself: drop --decoder-first-pipeline-num-layers" --world-size 2 \
  --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 \
  --pipeline-model-parallel-layout "Ett|tttL"
refuse "--num-layers-per-virtual-pipeline-stage cannot be given with uneven stages" \
  --world-size 2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 \
  --num-layers-per-virtual-pipeline-stage 1
refuse "6 layers \(--num-layers=5 \+ 1 for the embedding\) are not divisible by --pipeline-model-parallel-size=4" \
  --world-size 4 --pipeline-model-parallel-size 4 --account-for-embedding-in-pipeline-split
exit $fail
