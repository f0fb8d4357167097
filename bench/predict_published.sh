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
python3 -c "
import statistics
e=[abs(float(x)) for x in '${errors[*]}'.split()]
print(f'median |error| {statistics.median(e):.1f} %, largest {max(e):.1f} %')"
