#!/usr/bin/env bash
# gpu-check.sh: on a machine with an NVIDIA GPU (H100/H200: sm_90), builds Tessera for that
# architecture and runs the CUDA tests (every CUDA op against the CPU reference, device memory,
# NCCL). Usage: scripts/gpu-check.sh [BUILD_DIR=build-gpu]   (CUDA_ARCH overrides 90)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || {
  echo "gpu-check.sh: error: nvidia-smi found no GPU; run this on the GPU machine" >&2
  exit 2
}
CUDA_ARCH=${CUDA_ARCH:-90} scripts/setup.sh --build-dir "$build" --no-build
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DTESSERA_BUILD_BENCH=OFF > /dev/null
cmake --build "$build" -j "$(nproc)" --target test_cuda_device test_cuda_ops test_cpu_ops
status=0
for t in test_cuda_device test_cuda_ops; do
  echo "== $t =="
  "$build/bin/$t" || status=1
done
exit $status
