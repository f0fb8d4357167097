#!/usr/bin/env bash
# gpu-bundle.sh: packs what the lent GPU machine lacks into one archive, for scripts/gpu-run.sh.
# That machine has the CUDA toolkit, cuBLAS and NCCL but no Open MPI, HDF5, Boost, OpenBLAS or
# GoogleTest, and cannot install packages. So the CUDA programs are built here, for sm_90, and
# travel with every shared library they load except the C/C++ runtime and CUDA's own, plus the
# Open MPI runtime (plugins, help files, orted, the mpirun launcher) relocated with OPAL_PREFIX,
# and the CPU runs the NCCL layouts are checked against (scripts/nccl-layouts.sh ref).
# The programs are those of the next lease's steps (scripts/gpu-manifest through scripts/gpu-plan:
# the steps not yet passed that fit the lease's deadline, GPU_LEASE_SECONDS, default 540), the
# same steps scripts/gpu-lease.sh will run; the CPU references only when the nccl2 / nccl4 steps
# are among them. The commit bundled goes beside the archive (.gpu/commit.txt), for the summary.
# Usage: [GPU_BUNDLE_TARGETS="PROGRAM ..."] [GPU_LEASE_STEPS="STEP ..."] scripts/gpu-bundle.sh
#   [BUILD_DIR=build-gpu]  -> .gpu/tessera-gpu.tar.xz (git-ignored)
# Then, with the device tool: run "bash scripts/gpu-lease.sh" with carry [".gpu"].
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
all=(test_cuda_device test_cuda_ops test_cuda_train test_device_staging tessera-train
     bench_gpu_train bench_attention bench_generate bench_fp8 bench_rates test_nccl)
# Each program carries all of Tessera's kernels (~4 MB compressed): every one of them together
# passes the device tool's 64 MiB carry limit, so a lease takes the ones its steps run.
plan_args=(--deadline "${GPU_LEASE_SECONDS:-540}")
[ -n "${GPU_LEASE_STEPS:-}" ] && plan_args+=(--only "$GPU_LEASE_STEPS")
[ "${GPU_LEASE_ALL:-0}" = 1 ] && plan_args+=(--all)
steps=$(python3 scripts/gpu-plan steps "${plan_args[@]}" | cut -d'|' -f1 | tr '\n' ' ')
read -r -a targets <<< "${GPU_BUNDLE_TARGETS:-$(python3 scripts/gpu-plan programs "${plan_args[@]}")}"
echo "gpu-bundle.sh: the lease's steps: ${steps:-none}; programs: ${targets[*]}"
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "gpu-bundle.sh: error: GPU_BUNDLE_TARGETS: unknown program '$t' (allowed: ${all[*]})" >&2; exit 2; }
done
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
  -DTESSERA_BUILD_BENCH=ON > /dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage=$work/tessera-gpu
mkdir -p "$stage/bin" "$stage/lib" "$stage/configs" "$stage/ompi/bin" \
  "$stage/ompi/lib/x86_64-linux-gnu" "$stage/ompi/share"
for t in "${targets[@]}"; do cp "$build/bin/$t" "$stage/bin/"; done
cp configs/gpt2-tiny.ini configs/llama-tiny.ini configs/mixtral-tiny.ini configs/gpt2-124m.ini \
  configs/gpt2-1.3b.ini "$stage/configs/"
# The shipped cluster kinds and rates beside bin/, where the programs look (issue 71).
cp -r configs/clusters configs/rates "$stage/configs/"
# Issue 56: the CPU MPI runs of every layout scripts/nccl-layouts.sh runs over NCCL there.
for np in 2 4; do
  [[ " $steps " == *" nccl$np "* ]] || continue
  NP=$np bash scripts/nccl-layouts.sh ref "$build/bin" "$stage/ref" > "$work/ref$np.log" 2>&1 ||
    { cat "$work/ref$np.log"; echo "gpu-bundle.sh: error: the CPU reference runs failed" >&2; exit 1; }
done
rm -f "$stage"/ref/*.log

# Open MPI 4 and PMIx as installed under /usr, laid out again under ompi/ (OPAL_PREFIX).
mpilib=/usr/lib/x86_64-linux-gnu
cp -a "$mpilib/openmpi" "$stage/ompi/lib/x86_64-linux-gnu/"
rm -rf "$stage/ompi/lib/x86_64-linux-gnu/openmpi/include"
[ -d "$mpilib/pmix2" ] && cp -a "$mpilib/pmix2" "$stage/ompi/lib/x86_64-linux-gnu/"
rm -f "$stage"/ompi/lib/x86_64-linux-gnu/pmix2/lib/*.a
cp -a /usr/share/openmpi "$stage/ompi/share/"
cp -L "$(command -v orted)" "$stage/ompi/bin/"
cp -L "$(command -v mpirun)" "$stage/ompi/bin/mpirun"  # orterun: the launcher (no MPI there)

# Every library those load, once, except the C/C++ runtime and CUDA's (the GPU machine has them,
# matching its driver; cuDNN there is PyTorch's wheel, which gpu-run.sh finds).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libgcc_s|libstdc\+\+|libcuda\.so|libcudart|libcublas|libcublasLt|libnccl|libnvidia|libcudnn)'
collect() {
  ldd "$1" 2>/dev/null | awk '/=> \// {print $3}' | while read -r lib; do
    name=$(basename "$lib")
    [[ $name =~ $skip ]] && continue
    [ -e "$stage/lib/$name" ] || cp -L "$lib" "$stage/lib/$name"
  done
}
for f in "$stage"/bin/* "$stage/ompi/bin/orted" "$stage/ompi/bin/mpirun"; do collect "$f"; done
while IFS= read -r -d '' f; do collect "$f"; done < <(find "$stage/ompi" -name '*.so*' -type f -print0)

mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
tar -C "$work" -cJf .gpu/tessera-gpu.tar.xz tessera-gpu
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu' || echo '+changes')" > .gpu/commit.txt
size=$(stat -c %s .gpu/tessera-gpu.tar.xz)
if [ "$size" -gt $((60 << 20)) ]; then
  echo "gpu-bundle.sh: error: .gpu/tessera-gpu.tar.xz is $((size >> 20)) MiB, over the device tool's 64 MiB carry limit with the working tree; give fewer programs in GPU_BUNDLE_TARGETS (now: ${targets[*]})" >&2
  exit 1
fi
echo "gpu-bundle.sh: .gpu/tessera-gpu.tar.xz ($(du -h .gpu/tessera-gpu.tar.xz | cut -f1)," \
  "$(ls "$stage/lib" | wc -l) libraries); on the GPU machine: bash scripts/gpu-run.sh (carry .gpu)"
