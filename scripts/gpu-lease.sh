#!/usr/bin/env bash
# gpu-lease.sh: one call of the device tool that does as much of issues 26 and 56 as a lease
# allows. It runs scripts/gpu-run.sh's steps in order of importance (issue 56's NCCL runs first), each under `timeout` against one
# deadline, so that a slow step costs the steps after it and never the logs: correctness first
# (the CUDA tests, the trainer on cuda vs cpu), then the benchmarks (attention with the PyTorch
# peer, GPT-2 124M, decode/prefill, PyTorch's GPT-2 124M (bench/train_peer.py), 1.3B, Llama 1B,
# the Mixtral-shaped MoE step), then compute-sanitizer: initcheck and memcheck (8 gtest shards at
# once), racecheck and synccheck on the kernels with shared memory. Logs are packed into $OUT/logs.tar.gz (the tool
# returns 8 files at most); a summary of every step's exit status and time is printed, then
# issue 37's table of figures beside the peer's of the same run (scripts/gpu-figures.py).
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-lease.sh [SECONDS=540]
#   GPU_LEASE_STEPS overrides the list, e.g. "tests train attention".
set -uo pipefail
set -f  # the commands below are split into words unquoted: no file-name expansion of their patterns
cd "$(dirname "$0")/.."
budget=${1:-540}
start=$(date +%s)
deadline=$((start + budget))
final=${OUT:-/tmp/tessera-gpu-out}
logs=$(mktemp -d)/logs
mkdir -p "$logs" "$final"
# The test_cuda_ops cases with shared memory and barriers, for racecheck and synccheck.
kernels='*AttentionForwardBackward*:*RmsNorm*:*LayerNorm*:*Moe*:*EmbeddingsAndCrossEntropy*:*KvAttentionBf16*'
# step name, longest time it may take (seconds), command
# Issue 56 first: the NCCL smoke test and the 2-rank layouts (one lease, ~6 min), then the 4-rank
# layouts and the predictor's rates (the default bundle, scripts/gpu-bundle.sh); what does not fit
# waits for the next lease, whose bundle names the benchmarks' programs (GPU_BUNDLE_TARGETS=
# "bench_gpu_train bench_fp8 bench_generate bench_attention test_cuda_ops test_cuda_train"), and
# GPU_LEASE_STEPS picks the steps.
plan=(
  "nccl2|330|bash scripts/gpu-run.sh --steps=nccl2"
  "nccl4|240|bash scripts/gpu-run.sh --steps=nccl4"
  "rates|90|bash scripts/gpu-run.sh --steps=rates"
  "fp8|150|bash scripts/gpu-run.sh --steps=fp8"
  "fused|120|bash scripts/gpu-run.sh --steps=fused"
  "tests|300|bash scripts/gpu-run.sh --steps=tests"
  "train|60|bash scripts/gpu-run.sh --steps=train"
  "save|120|bash scripts/gpu-run.sh --steps=save"
  "attention|90|bash scripts/gpu-run.sh --steps=attention"
  "bench-124m|60|bash scripts/gpu-run.sh --steps=bench 124m 10 0 0 bf16 --breakdown"
  "generate|90|bash scripts/gpu-run.sh --steps=generate"
  "peer-124m|120|python3 bench/train_peer.py 124m 10"
  "bench-1.3b|90|bash scripts/gpu-run.sh --steps=bench 1.3b 10"
  "llama1b|90|bash scripts/gpu-run.sh --steps=llama1b"
  "mixtral|90|bash scripts/gpu-run.sh --steps=bench mixtral 10"
  "muon-1.3b|90|bash scripts/gpu-run.sh --steps=bench 1.3b 5 0 0 bf16 --muon --breakdown"
  "muon-1.3b-f32|60|bash scripts/gpu-run.sh --steps=bench 1.3b 2 0 0 bf16 --muon=high"
  "mixtral-breakdown|60|bash scripts/gpu-run.sh --steps=bench mixtral 5 0 0 bf16 --breakdown"
  "mixtral-per-expert|60|env TESSERA_BENCH_NO_GROUPED_GEMM=1 bash scripts/gpu-run.sh --steps=bench mixtral 10"
  "decode-profile|100|bash scripts/gpu-run.sh --steps=decode-profile"
  "memory|240|bash scripts/gpu-run.sh --memory"
  "save-1.3b|300|env SAVE_MODEL=gpt2-1.3b SAVE_MB=8 SAVE_GBS=8 SAVE_INTERVAL=100 bash scripts/gpu-run.sh --steps=save"
  "rerun|150|bash scripts/gpu-run.sh --steps=rerun"
  "initcheck|150|env SANITIZE_SHARDS=8 bash scripts/gpu-run.sh --sanitize=initcheck"
  "memcheck|150|env SANITIZE_SHARDS=8 bash scripts/gpu-run.sh --sanitize=memcheck"
  "racecheck|90|env SANITIZE_FILTER_test_cuda_ops=$kernels bash scripts/gpu-run.sh --sanitize=racecheck"
  "synccheck|60|env SANITIZE_FILTER_test_cuda_ops=$kernels bash scripts/gpu-run.sh --sanitize=synccheck"
)
want=${GPU_LEASE_STEPS:-}
summary=()
first=1
for entry in "${plan[@]}"; do
  IFS='|' read -r name longest cmd <<< "$entry"
  if [ -n "$want" ] && [[ " $want " != *" $name "* ]]; then continue; fi
  left=$((deadline - $(date +%s) - 10))
  if [ $left -lt 20 ]; then summary+=("$(printf '%-11s skipped (deadline)' "$name")"); continue; fi
  t=$((longest < left ? longest : left))
  echo "=== gpu-lease: $name (at most ${t}s) ==="
  s=$(date +%s)
  # The first step unpacks the archive; the others reuse it.
  GPU_RUN_REUSE=$((1 - first)) OUT="$logs/$name" timeout -k 5 "$t" $cmd 2>&1 | tee "$logs/$name.out"
  rc=${PIPESTATUS[0]}
  first=0
  summary+=("$(printf '%-11s rc %-3s %4ss%s' "$name" "$rc" "$(( $(date +%s) - s ))" \
    "$([ "$rc" = 124 ] && echo ' (timed out)')")")
done
tar -C "$(dirname "$logs")" -czf "$final/logs.tar.gz" logs
f=$(find "$logs" -name device.txt | head -1)  # one of them (set -f: no globs here)
[ -n "$f" ] && cp "$f" "$final/device.txt"
echo "=== gpu-lease summary ($(cat "$final/device.txt" 2>/dev/null)) ==="
printf '%s\n' "${summary[@]}"
# Issue 37's table of figures against the peer of the same run (point 4), last.
python3 scripts/gpu-figures.py "$logs" | tee "$final/figures.txt"
