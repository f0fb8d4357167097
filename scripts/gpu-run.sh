#!/usr/bin/env bash
# gpu-run.sh: runs on the lent GPU machine, from the repository root, the archive that
# scripts/gpu-bundle.sh made here (.gpu/tessera-gpu.tar.xz, carried): the CUDA tests, the
# simulated-device tests, 10 iterations of gpt2-tiny and llama-tiny on --device cuda against
# --device cpu,
# bench_attention with PyTorch's figures from bench/attention_peer.py, bench_gpu_train, and
# bench_generate's GPU table (issue 16). Logs go to $OUT (when set) and standard output.
# Usage: bash scripts/gpu-run.sh [--no-bench] [--bench-only] [--memory] [--sanitize[=TOOL,...]]
#        [--steps=STEP,...] [BENCH_ARGS...]
#
# --steps picks pieces of the default run: cuda-short (issue 70's first lease: test_cuda_device,
# with cuBLAS loaded on first use, and test_device_staging), tests (test_cuda_ops and
# test_cuda_train), fused (cuDNN
# attention's tests, with cuDNN's error log), fp8 (issue 38: the FP8 cases of test_cuda_ops and
# test_cuda_train, then the 1.3B step in bf16 and with FP8 GEMMs one after the other, then
# bench_fp8's pass-by-pass times at the 1.3B shapes), train (gpt2-tiny
# and llama-tiny on --device cuda vs cpu), attention (bench_attention and the PyTorch peer), bench
# (bench_gpu_train BENCH_ARGS), generate (bench_generate gpu bf16), llama1b, rates (issue 57:
# bench_rates --device cuda, the step-time predictor's rates file, $OUT/rates-gpu.ini, to copy
# to configs/rates/ and name in a cluster file's [gpu] rates); and only when named:
# save (--async-save against a synchronous save, resumed bitwise; SAVE_MODEL, SAVE_MB, SAVE_GBS,
# SAVE_INTERVAL), decode-profile (ncu's kernel times of batch-1 decode steps), rerun (issue 39:
# bench/bench_rerun.sh on GPT-2 124M bf16: result validation's cost when nothing fails, and
# report_stats's spread on the GPU), nccl2 / nccl4 (issue 56: test_nccl and every layout of 2 or
# 4 ranks sharing this GPU through NCCL, scripts/nccl-layouts.sh), nccl-smoke (test_nccl on two
# ranks sharing the GPU, two communicators, NCCL's transport printed). scripts/gpu-lease.sh runs
# the steps of scripts/gpu-manifest one by one under a deadline; a step's programs (the manifest's)
# must be in the bundle. GPU_RUN_REUSE=1 keeps an archive already unpacked.
#
# --memory runs, instead of the tests and the default benchmarks, issue 13's GPU figures on the 1.3B config
# (bf16): the step at micro-batch 16 without, with selective and with full recomputation (and the
# distributed optimizer, DP 1), then the largest micro-batch that trains without and with full
# recomputation (bench_gpu_train --max-micro-batch); logs in $OUT/bench-memory-*.log.
#
# --sanitize runs, instead of the tests and the benchmark, the CUDA tests under NVIDIA's
# compute-sanitizer (found on PATH, in /usr/local/cuda*/, or anywhere by `find`) with
# --error-exitcode 1: memcheck and initcheck on test_cuda_ops, test_cuda_train and
# test_cuda_device; racecheck and synccheck on test_cuda_ops (the kernels with shared memory and
# barriers). --sanitize=initcheck,memcheck runs only those tools (one tool per call where a call
# has a time limit). Each run logs to
# $OUT/sanitize-<tool>-<test>.log; one line per run with its ERROR SUMMARY goes to standard output
# and $OUT/sanitize-summary.txt; the exit status is 1 if any run reported an error or failed.
# Runs are kept short by gtest filters (the intentional out-of-memory test is left out; the fp16
# training test too): override with SANITIZE_FILTER_<test>=PATTERN (e.g.
# SANITIZE_FILTER_test_cuda_train='*'). SANITIZE_SHARDS=N runs each test as N gtest shards
# (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX), each under its own compute-sanitizer, all at once: the
# tests' CPU references take most of a sanitized run's time, and the GPU machine has 16 cores
# (logs $OUT/sanitize-<tool>-<test>-<shard>.log, one summary line per shard).
# BENCH_ARGS go to bench_gpu_train as they are, e.g.
# `124m 10 0 0 bf16 --breakdown` for the per-phase time table (docs/profiling.md).
set -uo pipefail
cd "$(dirname "$0")/.."
archive=.gpu/tessera-gpu.tar.xz
[ -f "$archive" ] || { echo "gpu-run.sh: error: $archive missing; run scripts/gpu-bundle.sh here and carry .gpu" >&2; exit 2; }
root=/tmp/tessera-gpu
if [ "${GPU_RUN_REUSE:-0}" != 1 ] || [ ! -x "$root/bin/tessera-train" ]; then
  rm -rf "$root" && tar -C /tmp -xJf "$archive"
fi
out=${OUT:-/tmp/tessera-gpu-out}
mkdir -p "$out"

# CUDA's libraries as that machine has them: the toolkit, else the Python wheels' copies.
cudalibs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && cudalibs="$cudalibs:$d"
done
for n in libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcudart.so.13 libcudnn.so.9; do
  if ! (IFS=:; for d in $cudalibs; do [ -n "$d" ] && [ -e "$d/$n" ] && exit 0; done; exit 1); then
    f=$(find / -name "$n" -not -path '/proc/*' -not -path "$root/*" 2>/dev/null | head -1)
    [ -n "$f" ] && cudalibs="$cudalibs:$(dirname "$f")"
  fi
done
export LD_LIBRARY_PATH="$root/lib${cudalibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$root/ompi" PATH="$root/ompi/bin:$PATH"
export PMIX_MCA_mca_base_component_path="$root/ompi/lib/x86_64-linux-gnu/pmix2/lib/pmix"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_plm_rsh_agent=false
# Containers: no cross-memory attach between the ranks (ptrace is refused), so Open MPI's
# shared-memory transport copies through its own segment; no InfiniBand probing.
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader,tcp
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
[ "${GPU_RUN_REUSE:-0}" = 1 ] || cat "$out/device.txt"
for b in "$root"/bin/*; do
  missing=$(ldd "$b" | grep 'not found')
  [ -z "$missing" ] || { echo "gpu-run.sh: $(basename "$b") cannot load: $missing"; }
done

status=0
bench=1 tests=1 sanitize="" memory=0 steps=""
bench_args=()
for a in "$@"; do
  case $a in
    --no-bench) bench=0 ;;
    --bench-only) tests=0 ;;
    --memory) memory=1 tests=0 ;;
    --sanitize) sanitize="memcheck,initcheck,racecheck,synccheck" ;;
    --sanitize=*) sanitize=${a#--sanitize=} ;;
    --steps=*) steps=",${a#--steps=}," ;;
    *) bench_args+=("$a") ;;
  esac
done

if [ -n "$sanitize" ]; then
  cs=$(command -v compute-sanitizer || true)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda*/bin/compute-sanitizer \
           /usr/local/cuda*/compute-sanitizer/compute-sanitizer; do
    [ -z "$cs" ] && [ -x "$c" ] && cs=$c
  done
  [ -n "$cs" ] || cs=$(find / -name compute-sanitizer -type f -perm -u+x -not -path '/proc/*' \
                        -not -path "$root/*" 2>/dev/null | head -1)
  [ -n "$cs" ] || { echo "gpu-run.sh: error: compute-sanitizer not found (PATH, /usr/local/cuda*/, find /)" >&2; exit 2; }
  echo "== compute-sanitizer: $cs ($("$cs" --version 2>/dev/null | grep -m1 -i version)) =="
  # Per tool: the tests it runs, and its options.
  declare -A tool_tests=([memcheck]="test_cuda_ops test_cuda_train test_cuda_device"
                         [initcheck]="test_cuda_ops test_cuda_train test_cuda_device"
                         [racecheck]="test_cuda_ops" [synccheck]="test_cuda_ops")
  # memcheck: API errors are not reported because NCCL's communicator set-up probes kernels with
  # cudaFuncGetAttributes and handles the error 209 it gets (H100, 2026-11-27); Tessera checks the
  # status of every CUDA call itself (CUDA_CHECK), so a failing call fails the test anyway.
  declare -A tool_opts=([memcheck]="--report-api-errors no" [initcheck]="--nvtx yes" [racecheck]="--racecheck-report all"
                        [synccheck]="")
  default_filter() {
    case $1 in
      test_cuda_train) echo "CudaTrain.F32StepsMatchTheCpu:CudaTrain.Bf16TracksTheCpuAndF32" ;;
      test_cuda_device) echo "-CudaDevice.OutOfMemoryNamesTheRequest" ;;  # fails a cudaMalloc on purpose
      # The training-shape cases (T 2048, CPU reference included) take minutes under a tool; the
      # small attention cases run the same tensor-core kernels.
      test_cuda_ops) echo "-*TrainingShape*" ;;
      *) echo "*" ;;
    esac
  }
  for tool in ${sanitize//,/ }; do
    [ -n "${tool_tests[$tool]:-}" ] || { echo "gpu-run.sh: error: --sanitize: unknown tool '$tool' (allowed: memcheck, initcheck, racecheck, synccheck)" >&2; exit 2; }
  done
  shards=${SANITIZE_SHARDS:-1}
  [[ "$shards" =~ ^[1-9][0-9]*$ ]] || { echo "gpu-run.sh: error: SANITIZE_SHARDS must be a positive integer (got '$shards')" >&2; exit 2; }
  : > "$out/sanitize-summary.txt"
  for tool in ${sanitize//,/ }; do
    for t in ${tool_tests[$tool]}; do
      var=SANITIZE_FILTER_$t
      filter=${!var:-$(default_filter "$t")}
      echo "== compute-sanitizer --tool $tool $t --gtest_filter=$filter ($shards shard(s) at once) =="
      pids=()
      for ((k = 0; k < shards; k++)); do
        log="$out/sanitize-$tool-$t.log"
        [ "$shards" -eq 1 ] || log="$out/sanitize-$tool-$t-$k.log"
        # shellcheck disable=SC2086
        GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$k OMP_NUM_THREADS=1 \
          "$cs" --tool "$tool" --error-exitcode 1 --print-limit 200 ${tool_opts[$tool]} \
          "$root/bin/$t" --gtest_brief=1 --gtest_filter="$filter" > "$log" 2>&1 &
        pids+=($!)
      done
      for ((k = 0; k < shards; k++)); do
        wait "${pids[$k]}"
        rc=$?
        log="$out/sanitize-$tool-$t.log" name="$t"
        [ "$shards" -eq 1 ] || { log="$out/sanitize-$tool-$t-$k.log"; name="$t shard $k/$shards"; }
        summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//')
        tests_line=$(grep -E '^\[  (PASSED|FAILED) +\]' "$log" | head -2 | tr '\n' ' ')
        line="sanitize $tool $name: ${summary:-no summary (see $log)} | rc $rc | ${tests_line:-no gtest result}"
        echo "$line" | tee -a "$out/sanitize-summary.txt"
        [ $rc -eq 0 ] || { status=1; grep -m 20 -E '^=+ +(Uninitialized|Invalid|Race|Barrier|Error|Program hit|.*hazard)' "$log"; }
      done
    done
  done
  exit $status
fi
if [ -n "$steps" ]; then
  for st in ${steps//,/ }; do
    case $st in
      cuda-short|nccl-smoke|tests|fused|fp8|train|save|attention|bench|generate|decode-profile|llama1b|rerun|rates|nccl2|nccl4) ;;
      *) echo "gpu-run.sh: error: --steps: unknown step '$st' (allowed: cuda-short, nccl-smoke, tests, fused, fp8, train, save, attention, bench, generate, decode-profile, llama1b, rerun, rates, nccl2, nccl4)" >&2; exit 2 ;;
    esac
  done
  step() { [[ $steps == *",$1,"* ]]; }
else
  step() {
    case $1 in
      tests|train) [ $tests -eq 1 ] ;;
      cuda-short|nccl-smoke|save|decode-profile|rerun|nccl2|nccl4) false ;;  # only when asked
      llama1b) [ $bench -eq 1 ] && [ $memory -eq 0 ] && [ ${#bench_args[@]} -eq 0 ] ;;
      *) [ $bench -eq 1 ] && [ $memory -eq 0 ] ;;
    esac
  }
fi
# The programs this call's steps need (scripts/gpu-manifest): in the bundle, or one line saying
# which and how to bundle them (GPU_LEASE_STEP: the manifest step scripts/gpu-lease.sh runs).
if [ -n "${GPU_LEASE_STEP:-}" ] || [ -n "$steps" ]; then
  need=$(python3 scripts/gpu-plan need ${GPU_LEASE_STEP:-${steps//,/ }}) || exit 2
  for p in $need; do
    [ -x "$root/bin/$p" ] || { echo "gpu-run.sh: error: step ${GPU_LEASE_STEP:-${steps//,/ }} needs $p, which this bundle lacks: build the bundle for this lease here (scripts/gpu-bundle.sh takes the programs of the lease's steps from scripts/gpu-manifest)" >&2; exit 3; }
  done
fi
if step cuda-short; then
  # Issue 70's first lease: the device, the staging and cuBLAS's loading on first use, in seconds.
  for t in test_cuda_device test_device_staging; do
    echo "== $t =="
    "$root/bin/$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" | grep -vE '^\[20[0-9]{2}-' | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
if step nccl-smoke || step nccl2 || step nccl4; then
  # Issue 56: several ranks on this one GPU through NCCL (scripts/nccl-share-gpu.sh gives each its
  # own NCCL_HOSTID). First what could refuse them, in seconds: the compute mode (an exclusive
  # mode takes one process), the launcher (the bundle's Open MPI, not a system one), then a 2-rank
  # run of every collective on two communicators with NCCL's own account of its transport.
  echo "== NCCL on one GPU: compute mode $(nvidia-smi --query-gpu=compute_mode --format=csv,noheader | head -1) =="
  echo "mpirun: $(command -v mpirun) ($(mpirun --version 2>&1 | head -1)); its libraries: $(ldd "$(command -v mpirun)" | awk '/libopen|libmpi/ {print $3}' | tr '\n' ' ')"
  if step nccl-smoke; then
    NCCL_DEBUG=INFO timeout 120 mpirun --oversubscribe --bind-to none -np 2 \
      scripts/nccl-share-gpu.sh "$root/bin/test_nccl" --gtest_brief=1 > "$out/nccl-smoke.log" 2>&1
    rc=$?
    grep -E 'NCCL INFO (Using network|Channel 00/0|comm .* Init COMPLETE|NET/Socket : Using)|\[  (PASSED|FAILED|SKIPPED) ' "$out/nccl-smoke.log" | sort | uniq | head -12
    grep -E 'NCCL WARN|error' "$out/nccl-smoke.log" | head -5
    echo "test_nccl (2 ranks on one GPU): rc $rc"
    [ $rc -eq 0 ] || status=1
  fi
  for np in 2 4; do
    step "nccl$np" || continue
    echo "== every layout of $np ranks over NCCL against its CPU run (carried) and the 1-rank CUDA run =="
    NP=$np bash scripts/nccl-layouts.sh gpu "$root/bin" "$root/ref" "$out/nccl$np" || status=1
  done
fi
if step rates; then
  echo "== bench_rates --device cuda (issue 57: the predictor's rates of this GPU) =="
  "$root/bin/bench_rates" --device cuda --out "$out/rates-gpu.ini" 2>&1 | tail -2 || status=1
  [ -s "$out/rates-gpu.ini" ] && grep -vE '^#' "$out/rates-gpu.ini"
fi
if step tests; then  # the device and staging tests are cuda-short's
  for t in test_cuda_ops test_cuda_train; do
    echo "== $t =="
    "$root/bin/$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" | grep -vE '^\[20[0-9]{2}-' | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
if step fused; then
  # cuDNN's fused attention and the GEMM epilogues (issue 37): every attention, ring, GELU and
  # matmul case of test_cuda_ops (fused against the CPU and the flash kernels, the backend
  # choice, the DGELU epilogue), the bf16 training test that runs them by default and the
  # recomputation test (bitwise with them); cuDNN's own error log in $OUT/cudnn.log.
  echo "== cuDNN: $(ls "$(dirname "$(ldd "$root/bin/test_cuda_ops" | awk '/libcudnn.so/ {print $3}')")" 2>/dev/null | grep -m1 -E 'libcudnn_graph.so.9.[0-9]' || echo 'libcudnn not found') =="
  CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG="$out/cudnn.log" "$root/bin/test_cuda_ops" --gtest_brief=1 \
    --gtest_filter='*Attention*:*Ring*:*Gelu*:*Matmul*' 2>&1 | tee "$out/test_cuda_ops-fused.log" | grep -vE '^\[20[0-9]{2}-' | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  "$root/bin/test_cuda_train" --gtest_brief=1 --gtest_filter='*Bf16*:*Recomputation*' 2>&1 | tee "$out/test_cuda_train-fused.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  [ -s "$out/cudnn.log" ] && { echo "cudnn.log:"; grep -m 20 -iE 'error|warn' "$out/cudnn.log"; }
fi
if step fp8; then
  # FP8 (issue 38): the kernels and cuBLASLt's FP8 GEMMs against the CPU emulation, FP8 training
  # against the CPU's, then the 1.3B step without and with FP8 on the same GPU (predicted 1.34x,
  # docs/performance.md "FP8 GEMMs").
  # cuBLASLt's own errors (why it refuses a GEMM) in $OUT/cublaslt-PID.log.
  export CUBLASLT_LOG_LEVEL=1 CUBLASLT_LOG_FILE="$out/cublaslt-%i.log"
  "$root/bin/test_cuda_ops" --gtest_brief=1 --gtest_filter='*Fp8*' 2>&1 | tee "$out/test_cuda_ops-fp8.log" | grep -vE '^\[20[0-9]{2}-' | tail -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  "$root/bin/test_cuda_train" --gtest_brief=1 --gtest_filter='*Fp8*' 2>&1 | tee "$out/test_cuda_train-fp8.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  for f in "" --fp8=hybrid --fp8=hybrid:tensorwise; do
    "$root/bin/bench_gpu_train" 1.3b 10 0 0 bf16 $f 2>&1 | tee -a "$out/bench-fp8.log" | grep -vE '^\[20[0-9]{2}-' | tail -3
  done
  # Pass by pass at the 1.3B shapes: the bf16 and FP8 GEMMs, the amaxes, the quantizations.
  "$root/bin/bench_fp8" 20 2>&1 | tee "$out/bench-fp8-passes.log" | grep -vE '^\[20[0-9]{2}-' || status=1
  unset CUBLASLT_LOG_LEVEL CUBLASLT_LOG_FILE
  for f in "$out"/cublaslt-*.log; do [ -s "$f" ] && { echo "$f:"; head -5 "$f"; }; done
fi
if step train; then
  # GPT-2, and the Llama family (issue 15: RoPE, RMSNorm, SwiGLU, grouped-query attention).
  for model in gpt2-tiny llama-tiny; do
    echo "== tessera-train --device cuda vs --device cpu ($model, 10 iterations) =="
    for d in cpu cuda; do
      "$root/bin/tessera-train" --config "$root/configs/$model.ini" --device "$d" --train-iters 10 \
        --log-interval 1 --metrics-file "$out/train-$model-$d.jsonl" > "$out/train-$model-$d.log" 2>&1 ||
        { echo "tessera-train $model --device $d failed:"; tail -5 "$out/train-$model-$d.log"; status=1; }
    done
    if [ -s "$out/train-$model-cpu.jsonl" ] && [ -s "$out/train-$model-cuda.jsonl" ]; then
      scripts/compare-losses "$out/train-$model-cpu.jsonl" "$out/train-$model-cuda.jsonl" 1e-4 cpu cuda || status=1
    fi
  done
fi
if [ $bench -eq 1 ] && [ $memory -eq 1 ]; then
  for mode in "" --recompute=selective --recompute=full "--recompute=full --distributed-optimizer"; do
    echo "== bench_gpu_train 1.3b 5 16 0 bf16 $mode =="
    "$root/bin/bench_gpu_train" 1.3b 5 16 0 bf16 $mode 2>&1 | tee -a "$out/bench-memory-modes.log" || status=1
  done
  for mode in "" --recompute=full; do
    echo "== bench_gpu_train 1.3b --max-micro-batch $mode =="
    "$root/bin/bench_gpu_train" 1.3b 0 0 0 bf16 --max-micro-batch $mode 2>&1 | tee -a "$out/bench-memory-max.log" || status=1
  done
fi
if step rerun; then
  echo "== result validation's cost: GPT-2 124M bf16, micro-batch 16 (bench/bench_rerun.sh) =="
  ITERS=30 WARMUP=5 REPEATS=2 bash bench/bench_rerun.sh "$root" --config "$root/configs/gpt2-124m.ini" \
    --device cuda --bf16 --micro-batch-size 16 --global-batch-size 16 2>&1 | tee "$out/rerun-cost.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  "$root/bin/tessera-train" --config "$root/configs/gpt2-124m.ini" --device cuda --bf16 --mock-data \
    --micro-batch-size 16 --global-batch-size 16 --train-iters 10 --log-interval 5 \
    --rerun-mode report_stats > "$out/rerun-report-stats.log" 2>&1 || status=1
  grep "report_stats" "$out/rerun-report-stats.log" | sed 's/^.*\] //'
fi
if step save; then
  # --async-save on the GPU (issue 37 point 3): GPT-2 124M (SAVE_MODEL=gpt2-1.3b for the 1.3B,
  # with SAVE_MB, SAVE_GBS, SAVE_INTERVAL), bf16, mock data, --deterministic-mode (cuDNN's
  # backward without atomics: bitwise reruns), two intervals with a checkpoint at the end of each,
  # saved synchronously and then in the background: the loop's blocked time (staging) against
  # the synchronous save's, and a resume from the background save's first checkpoint that must
  # give the second interval's losses bitwise.
  model=${SAVE_MODEL:-gpt2-124m}
  every=${SAVE_INTERVAL:-20}
  ck=/tmp/tessera-save
  # One GPU: TP and PP 1 whatever the config says (gpt2-1.3b.ini is written for TP 2).
  common=(--config "$root/configs/$model.ini" --device cuda --bf16 --deterministic-mode
          --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
          --micro-batch-size "${SAVE_MB:-16}" --global-batch-size "${SAVE_GBS:-64}"
          --lr-warmup-iters 2 --train-iters $((2 * every)) --log-interval 1 --save-interval "$every")
  for mode in sync async; do
    rm -rf "$ck-$mode" "$out/save-$model-$mode.jsonl"
    extra=(); [ $mode = async ] && extra=(--async-save)
    echo "== tessera-train $model --save ($mode) =="
    "$root/bin/tessera-train" "${common[@]}" --save "$ck-$mode" "${extra[@]}" \
      --metrics-file "$out/save-$model-$mode.jsonl" > "$out/save-$model-$mode.log" 2>&1 ||
      { echo "tessera-train --save ($mode) failed:"; tail -5 "$out/save-$model-$mode.log"; status=1; }
    grep -E 'checkpoint|saved' "$out/save-$model-$mode.log" | grep -v '^$' | sed 's/^.*\] //' | head -8
  done
  rm -rf "$out/save-$model-resume.jsonl"
  echo "== resume from the background save's iteration $every =="
  rm -rf "$ck-async/iter_$(printf %07d $((2 * every)))"
  echo "$every" > "$ck-async/latest_checkpointed_iteration.txt"
  "$root/bin/tessera-train" "${common[@]}" --load "$ck-async" \
    --metrics-file "$out/save-$model-resume.jsonl" > "$out/save-$model-resume.log" 2>&1 ||
    { echo "tessera-train --load failed:"; tail -5 "$out/save-$model-resume.log"; status=1; }
  python3 - "$every" "$out/save-$model-async.jsonl" "$out/save-$model-resume.jsonl" "$out/save-$model-sync.jsonl" <<'PY' || status=1
import json, sys
def losses(p):
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(p)) if "lm_loss" in r}
every = int(sys.argv[1])
a, r, s = (losses(p) for p in sys.argv[2:])
later = range(every + 1, 2 * every + 1)
same = all(a.get(i) is not None and a.get(i) == r.get(i) for i in later)
print(f"resume from iteration {every} (async save):", "bitwise" if same else "DIFFERS",
      {i: (a.get(i), r.get(i)) for i in later if a.get(i) != r.get(i)})
print("async vs sync save losses:", "bitwise" if a == s else "DIFFER")
sys.exit(0 if same and a == s else 1)
PY
  rm -rf "$ck-sync" "$ck-async"
fi
if step attention; then
  echo "== bench_attention (Tessera) and bench/attention_peer.py (PyTorch SDPA, same GPU) =="
  "$root/bin/bench_attention" --dropout 0.1 --packed 256 2>&1 | tee "$out/bench-attention.log" || status=1
  python3 bench/attention_peer.py 2>&1 | tee "$out/bench-attention-peer.log"
fi
if step bench; then
  echo "== bench_gpu_train ${bench_args[*]:-all 10} =="
  "$root/bin/bench_gpu_train" "${bench_args[@]:-all}" 2>&1 | tee -a "$out/bench.log" || status=1
fi
if step generate; then
  echo "== bench_generate gpu bf16 (issue 16: decode, context, prefill; transformers beside) =="
  "$root/bin/bench_generate" gpu bf16 2>&1 | tee "$out/bench-generate.log" || status=1
fi
if step decode-profile; then
  # Where a batch-1 decode step's time goes (issue 37: 1,645 tokens/s, 0.61 ms a token, against
  # 2,000): every kernel of ~3 decode steps (graph nodes one by one) timed by ncu, without clock
  # control, well after the graph's capture; their sum per step against the step's wall time.
  ncu=$(command -v ncu || true)
  for c in /usr/local/cuda/bin/ncu /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
    [ -z "$ncu" ] && [ -x "$c" ] && ncu=$c
  done
  [ -n "$ncu" ] || ncu=$(find / -name ncu -type f -perm -u+x -not -path '/proc/*' 2>/dev/null | head -1)
  if [ -z "$ncu" ]; then
    echo "gpu-run.sh: ncu not found"; status=1
  else
    "$root/bin/bench_generate" gpu bf16 batch1 2>&1 | tee "$out/decode-batch1.log" | tail -1
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --launch-skip 3000 \
      --launch-count 450 --csv --print-units base "$root/bin/bench_generate" gpu bf16 batch1 \
      > "$out/ncu-decode.csv" 2> "$out/ncu-decode.err" || status=1
    python3 - "$out/ncu-decode.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if not rows:
    print("ncu: no rows (see ncu-decode.err)"); sys.exit(0)
head = rows[0]; k = head.index("Kernel Name"); v = head.index("Metric Value")
t = collections.defaultdict(float); n = collections.Counter()
for r in rows[1:]:
    t[r[k][:60]] += float(r[v].replace(",", "")); n[r[k][:60]] += 1
total = sum(t.values())
print(f"ncu: {sum(n.values())} kernels, {total/1e3:.1f} us in all")
for name, ns in sorted(t.items(), key=lambda x: -x[1])[:15]:
    print(f"  {ns/1e3:9.1f} us  {n[name]:4d} x  {name}")
PY
  fi
fi
if step llama1b; then  # issue 15: Llama 3.2 1B's architecture, sequence 2048
  echo "== bench_gpu_train llama1b 10 =="
  "$root/bin/bench_gpu_train" llama1b 10 2>&1 | tee -a "$out/bench.log" || status=1
fi
exit $status
