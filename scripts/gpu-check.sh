#!/usr/bin/env bash
# gpu-check.sh: on a machine with an NVIDIA GPU (H100/H200: sm_90), builds Tessera for that
# architecture, runs the CUDA tests (every CUDA op against the CPU reference, device memory,
# NCCL, the simulated-device trainer test), a short training run on --device cuda compared with
# the same run on the CPU, and the GPU benchmark (tokens/s, TFLOP/s, MFU, peak memory).
# Usage: scripts/gpu-check.sh [BUILD_DIR=build-gpu] [--no-bench]   (CUDA_ARCH overrides 90)
# For a machine with the build dependencies installed (scripts/setup.sh). The lent GPU machine of
# this workplace has none and no package access: there, run scripts/gpu-run.sh on the archive that
# scripts/gpu-bundle.sh builds here (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-gpu
bench=1
for a in "$@"; do
  case $a in
    --no-bench) bench=0 ;;
    *) build=$a ;;
  esac
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || {
  echo "gpu-check.sh: error: nvidia-smi found no GPU; run this on the GPU machine" >&2
  exit 2
}
CUDA_ARCH=${CUDA_ARCH:-90} scripts/setup.sh --build-dir "$build" --no-build
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DTESSERA_BUILD_BENCH=ON > /dev/null
cmake --build "$build" -j "$(nproc)" --target test_cuda_device test_cuda_ops test_cuda_train test_device_staging \
  tessera-train bench_gpu_train
status=0
for t in test_cuda_device test_cuda_ops test_cuda_train test_device_staging; do
  echo "== $t =="
  "$build/bin/$t" || status=1
done

# The trainer on the GPU against the CPU reference: 10 iterations of the tiny model, fp32.
echo "== tessera-train --device cuda vs --device cpu =="
tmp=$(mktemp -d)
for d in cpu cuda; do
  "$build/bin/tessera-train" --config configs/gpt2-tiny.ini --device "$d" --train-iters 10 \
    --log-interval 1 --metrics-file "$tmp/$d.jsonl" > "$tmp/$d.log" 2>&1 || {
    echo "tessera-train --device $d failed:"; tail -5 "$tmp/$d.log"; status=1; }
done
if [ -s "$tmp/cpu.jsonl" ] && [ -s "$tmp/cuda.jsonl" ]; then
  scripts/compare-losses "$tmp/cpu.jsonl" "$tmp/cuda.jsonl" 1e-4 cpu cuda || status=1
fi
rm -rf "$tmp"

if [ $bench -eq 1 ]; then
  echo "== bench_gpu_train =="
  "$build/bin/bench_gpu_train" all 10 || status=1
fi
exit $status
