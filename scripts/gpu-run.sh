#!/usr/bin/env bash
# gpu-run.sh: runs on the lent GPU machine, from the repository root, the archive that
# scripts/gpu-bundle.sh made here (.gpu/tessera-gpu.tar.xz, carried): the CUDA tests, the
# simulated-device tests, 10 iterations of gpt2-tiny on --device cuda against --device cpu, and
# bench_gpu_train. Logs go to $OUT (when set) and standard output.
# Usage: bash scripts/gpu-run.sh [--no-bench] [--bench-only] [BENCH_ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
archive=.gpu/tessera-gpu.tar.xz
[ -f "$archive" ] || { echo "gpu-run.sh: error: $archive missing; run scripts/gpu-bundle.sh here and carry .gpu" >&2; exit 2; }
root=/tmp/tessera-gpu
rm -rf "$root" && tar -C /tmp -xJf "$archive"
out=${OUT:-/tmp/tessera-gpu-out}
mkdir -p "$out"

# CUDA's libraries as that machine has them: the toolkit, else the Python wheels' copies.
cudalibs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && cudalibs="$cudalibs:$d"
done
for n in libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcudart.so.13; do
  if ! (IFS=:; for d in $cudalibs; do [ -n "$d" ] && [ -e "$d/$n" ] && exit 0; done; exit 1); then
    f=$(find / -name "$n" -not -path '/proc/*' -not -path "$root/*" 2>/dev/null | head -1)
    [ -n "$f" ] && cudalibs="$cudalibs:$(dirname "$f")"
  fi
done
export LD_LIBRARY_PATH="$root/lib${cudalibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$root/ompi" PATH="$root/ompi/bin:$PATH"
export PMIX_MCA_mca_base_component_path="$root/ompi/lib/x86_64-linux-gnu/pmix2/lib/pmix"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_plm_rsh_agent=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
for b in "$root"/bin/*; do
  missing=$(ldd "$b" | grep 'not found')
  [ -z "$missing" ] || { echo "gpu-run.sh: $(basename "$b") cannot load: $missing"; }
done

status=0
bench=1 tests=1
bench_args=()
for a in "$@"; do
  case $a in
    --no-bench) bench=0 ;;
    --bench-only) tests=0 ;;
    *) bench_args+=("$a") ;;
  esac
done
if [ $tests -eq 1 ]; then
  for t in test_cuda_device test_cuda_ops test_cuda_train test_device_staging; do
    echo "== $t =="
    "$root/bin/$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" | grep -vE '^\[20[0-9]{2}-' | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  echo "== tessera-train --device cuda vs --device cpu (gpt2-tiny, 10 iterations) =="
  for d in cpu cuda; do
    "$root/bin/tessera-train" --config "$root/configs/gpt2-tiny.ini" --device "$d" --train-iters 10 \
      --log-interval 1 --metrics-file "$out/train-$d.jsonl" > "$out/train-$d.log" 2>&1 ||
      { echo "tessera-train --device $d failed:"; tail -5 "$out/train-$d.log"; status=1; }
  done
  if [ -s "$out/train-cpu.jsonl" ] && [ -s "$out/train-cuda.jsonl" ]; then
    scripts/compare-losses "$out/train-cpu.jsonl" "$out/train-cuda.jsonl" 1e-4 cpu cuda || status=1
  fi
fi
if [ $bench -eq 1 ]; then
  echo "== bench_gpu_train ${bench_args[*]:-all 10} =="
  "$root/bin/bench_gpu_train" "${bench_args[@]:-all}" 2>&1 | tee "$out/bench.log" || status=1
fi
exit $status
