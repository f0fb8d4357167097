#!/usr/bin/env bash
# predict_published.sh: Tessera's predicted step (tessera-train --dry-run --cluster, issue 57)
# beside published Megatron-LM runs. Rows: Narayanan et al., "Efficient Large-Scale Language Model
# Training on GPU Clusters Using Megatron-LM" (SC21), Table 1 (also the Megatron-LM README of
# 2021): GPT models of vocabulary 51,200 and sequence 2,048 on DGX A100 80 GB nodes (8 GPUs,
# NVLink 3, 8 x 200 Gb/s HDR InfiniBand), mixed precision, full activation recomputation. Their
# teraFLOP/s per GPU count the recomputed forward: FLOPs per step 96 B s l h^2 (1 + s/6h +
# V/16lh); the step time is that over (teraFLOP/s x GPUs). The paper does not give each row's
# micro-batch size or interleaving: the predictions use micro-batch 1 and the plain 1F1B
# schedule (docs/planning.md says what that leaves out).
# A second table: recent NeMo runs on DGX H100 (below).
# Usage: bench/predict_published.sh [BIN_DIR=build/bin]   (prints one table row per run)
set -euo pipefail
bin=${1:-build/bin}
cd "$(dirname "$0")/.."
# params(B) heads hidden layers TP PP GPUs batch published-TFLOP/s
rows="1.7 24 2304 24 1 1 32 512 137
3.6 32 3072 30 2 1 64 512 138
7.5 32 4096 36 4 1 128 512 142
18.4 48 6144 40 8 1 256 1024 135
39.1 64 8192 48 8 2 512 1536 138
76.1 80 10240 60 8 4 1024 1792 140
145.6 96 12288 80 8 8 1536 2304 148
310.1 128 16384 96 8 16 1920 2160 155"
echo "| model | GPUs | layout | batch | published TFLOP/s (step s) | predicted step s | error | predicted bubble, exposed comm |"
echo "|---|---|---|---|---|---|---|---|"
errors=()
while read -r size heads hidden layers tp pp gpus batch tflops; do
  out=$("$bin/tessera-train" --num-layers "$layers" --hidden-size "$hidden" --num-attention-heads "$heads" \
    --seq-length 2048 --max-position-embeddings 2048 --vocab-size 51200 --fp16 \
    --micro-batch-size 1 --global-batch-size "$batch" --tensor-model-parallel-size "$tp" \
    --pipeline-model-parallel-size "$pp" --recompute-granularity full --recompute-method uniform \
    --recompute-num-layers 1 --dry-run --cluster dgx-a100 --world-size "$gpus" 2>&1 | grep '^predicted: ')
  read -r step bubble comm < <(sed -E 's/predicted: step ([0-9.e+-]+) s .*bubble ([0-9.]+) % .*exposed comm ([0-9.]+) %/\1 \2 \3/' <<<"$out")
  published=$(python3 -c "
B,s,l,h,V=$batch,2048,$layers,$hidden,51200
f=96*B*s*l*h*h*(1+s/(6*h)+V/(16*l*h))
print(f'{f/($tflops*1e12*$gpus):.3f}')")
  err=$(python3 -c "print(f'{($step-$published)/$published*100:+.1f}')")
  errors+=("$err")
  dp=$((gpus / (tp * pp)))
  echo "| ${size}B ($layers x $hidden) | $gpus | TP $tp x PP $pp x DP $dp | $batch | $tflops ($published) | $step | $err % | $bubble %, $comm % |"
done <<<"$rows"
# Recent runs on DGX H100 in BF16 (NVIDIA's dgxc-benchmarking recipes for the NeMo 24.12
# container, tags v25.02 / v25.03: llama3.1/, nemo_megatron/README_175b.md, nemotron/ READMEs;
# total tokens/s of the smallest full-model scale, so the step is GBS x sequence / tokens/s).
# These runs use Megatron-Core with Transformer Engine (cuDNN flash attention) and, with TP > 1,
# TP communication overlap, which Tessera does not have (docs/planning.md). The predictions use
# the published layout, micro-batch and precision, the distributed optimizer with both overlaps
# and no recomputation (the recipes'); the memory verdict is printed on the row.
echo
echo "| model | GPUs | layout | GBS x seq | published tokens/s (step s) | predicted step s | error | predicted bubble, exposed comm | Tessera's memory at this layout |"
echo "|---|---|---|---|---|---|---|---|---|"
llama() {  # layers hidden heads ffn
  echo "--num-layers $1 --hidden-size $2 --num-attention-heads $3 --ffn-hidden-size $4" \
       "--group-query-attention --num-query-groups 8 --swiglu --position-embedding-type rope" \
       "--rotary-base 500000 --normalization RMSNorm --disable-bias-linear" \
       "--untie-embeddings-and-output-weights --vocab-size 128256 --seq-length 8192" \
       "--max-position-embeddings 8192"
}
gpt3="--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 \
  --max-position-embeddings 2048 --vocab-size 51200"
nemotron="--num-layers 32 --hidden-size 6144 --num-attention-heads 48 --group-query-attention \
  --num-query-groups 8 --ffn-hidden-size 24576 --squared-relu --position-embedding-type rope \
  --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 4096 \
  --max-position-embeddings 4096 --vocab-size 256000"
h100_row() {  # NAME GPUS GBS SEQ TOKENS_PER_S LAYOUT_TEXT OPTIONS...
  local name=$1 gpus=$2 gbs=$3 seq=$4 tps=$5 layout=$6
  shift 6
  local out verdict step bubble comm published err
  # shellcheck disable=SC2068
  out=$("$bin/tessera-train" $@ --bf16 --global-batch-size "$gbs" --use-distributed-optimizer \
    --overlap-param-gather --attention-dropout 0 --hidden-dropout 0 --dry-run --cluster dgx-h100 \
    --world-size "$gpus" 2>&1)
  read -r step bubble comm < <(grep '^predicted: ' <<<"$out" |
    sed -E 's/predicted: step ([0-9.e+-]+) s .*bubble ([0-9.]+) % .*exposed comm ([0-9.]+) %/\1 \2 \3/')
  verdict=$(grep '^memory verdict' <<<"$out" | sed -E 's/.*: the fullest rank \(stage [0-9]+\) needs ([0-9.]+ GiB).*/\1/')
  published=$(python3 -c "print(f'{$gbs*$seq/$tps:.3f}')")
  err=$(python3 -c "print(f'{($step-$published)/$published*100:+.1f}')")
  errors+=("$err")
  echo "| $name | $gpus | $layout | $gbs x $seq | $tps ($published) | $step | $err % | $bubble %, $comm % | $verdict |"
}
h100_row "Llama 3.1 8B" 8 128 8192 82028 "TP 1 x PP 1 x CP 2 x DP 4, mb 1" \
  "$(llama 32 4096 32 14336)" --micro-batch-size 1 --context-parallel-size 2
h100_row "Llama 3.1 70B" 64 128 8192 71756 "TP 4 x PP 4 (V 5) x CP 2 x DP 2, SP, mb 1" \
  "$(llama 80 8192 64 28672)" --micro-batch-size 1 --tensor-model-parallel-size 4 \
  --sequence-parallel --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4 \
  --context-parallel-size 2
h100_row "Llama 3.1 405B" 576 252 8192 117964 "TP 8 x PP 9 (V 7) x CP 2 x DP 4, SP, mb 1" \
  "$(llama 126 16384 128 53248)" --micro-batch-size 1 --tensor-model-parallel-size 8 \
  --sequence-parallel --pipeline-model-parallel-size 9 --num-layers-per-virtual-pipeline-stage 2 \
  --context-parallel-size 2
h100_row "GPT-3 175B" 128 256 2048 63099 "TP 4 x PP 8 (V 12) x DP 4, SP, mb 1" \
  "$gpt3" --micro-batch-size 1 --tensor-model-parallel-size 4 --sequence-parallel \
  --pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 1
h100_row "Nemotron-4 15B" 16 64 4096 93223 "TP 4 x DP 4, SP, mb 4" \
  "$nemotron" --micro-batch-size 4 --tensor-model-parallel-size 4 --sequence-parallel
# Runs that need uneven stages (issue 72): Megatron-Bridge's performance summary (docs/
# performance-summary.md of NVIDIA-NeMo/Megatron-Bridge, the 25.09 NeMo container's DGX-H100
# table; tokens/s per GPU there, times the GPUs here). The 405B at PP 8 x VP 8 counts the
# embedding and the loss as layers ((126 + 2) / 64); FP8 with current (tensorwise) scaling, as
# the 26.02 table names the same row's precision. DeepSeek-V3 (dropless) at PP 8 x VP 4 with the
# layout of Megatron's docs (32 stages, the MTP layer on a stage of its own), published in FP8
# (128 x 128 blocks): Tessera runs MLA and MTP in bf16 only, so this row is predicted in bf16.
h100_row "Llama 3.1 405B (FP8)" 1024 512 8192 $((302 * 1024)) \
  "TP 8 x PP 8 (V 8, E+L) x CP 2 x DP 2, SP, mb 1" \
  "$(llama 126 16384 128 53248)" --micro-batch-size 1 --tensor-model-parallel-size 8 \
  --sequence-parallel --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 8 \
  --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split \
  --context-parallel-size 2 --fp8-format hybrid --fp8-recipe tensorwise
dsv3_layout=$(python3 -c "print('Ettt' + '|tt' * 29 + '|m|L')")  # Et*3|(tt|)*29,m|L written out
h100_row "DeepSeek-V3 (FP8 published; bf16 predicted)" 1024 8192 4096 $((1297 * 1024)) \
  "TP 2 x PP 8 (V 4, layout) x EP 64 x DP 64, SP, mb 1" \
  --config configs/deepseek-v3.ini --micro-batch-size 1 --tensor-model-parallel-size 2 \
  --sequence-parallel --pipeline-model-parallel-size 8 --pipeline-model-parallel-layout "$dsv3_layout" \
  --expert-model-parallel-size 64 --moe-expert-capacity-factor none --recompute-granularity none
python3 -c "
import statistics
e=[abs(float(x)) for x in '${errors[*]}'.split()]
print(f'all {len(e)} rows: median |error| {statistics.median(e):.1f} %, largest {max(e):.1f} %')"
