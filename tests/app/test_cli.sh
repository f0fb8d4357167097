#!/usr/bin/env bash
# test_cli.sh: tessera-train's command-line contract: bad input exits 2 with one "error:" line
# naming the option; --help documents the Megatron option names; --dry-run exits 0.
set -u
bin=$1
configs=$2
fail=0
expect() {  # expect CODE PATTERN -- ARGS...
  local code=$1 pattern=$2
  shift 3
  local out rc
  out=$("$bin" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne "$code" ] || ! grep -qE -- "$pattern" <<<"$out"; then
    echo "FAIL: tessera-train $* -> rc=$rc (want $code), output: $out"
    fail=1
  elif [ "$code" -eq 2 ] && [ "$(grep -c 'error:' <<<"$out")" -ne 1 ]; then
    echo "FAIL: tessera-train $* -> want exactly one error line, got: $out"
    fail=1
  else
    echo "ok: $* -> $rc"
  fi
}
expect 2 "unrecognised option '--no-such-option'" -- --no-such-option
# Issue 58: no abbreviations (Megatron's allow_abbrev=False), options of a feature the model lacks,
# skips and injections beyond the run.
expect 2 "unrecognised option '--train-iter': options are not abbreviated .*did you mean --train-iters\?" -- --train-iter 3
expect 2 "unrecognised option '--first-last': .*did you mean --first-last-layers-bf16\?" -- --train-iters 3 --first-last
expect 2 "--q-lora-rank has no effect without --multi-latent-attention" -- --train-iters 3 --q-lora-rank 4
expect 2 "--kv-lora-rank has no effect without --multi-latent-attention" -- --train-iters 3 --kv-lora-rank 4
expect 2 "--moe-router-topk has no effect without --num-experts" -- --train-iters 3 --moe-router-topk 1
expect 2 "--moe-router-num-groups has no effect without --num-experts" -- --train-iters 3 --moe-router-num-groups 2
expect 2 "--iterations-to-skip 99 is beyond the run \(3 iterations\)" -- --train-iters 3 --iterations-to-skip 99
expect 2 "--error-injection-at 10:0 is beyond the run \(3 iterations\)" -- --train-iters 3 --rerun-mode validate_results --error-injection-at 10
# OMP_NUM_THREADS is the thread count when --threads is not given (issue 58).
out=$(OMP_NUM_THREADS=3 "$bin" --config "$configs/gpt2-tiny.ini" --mock-data --train-iters 1 --device cpu 2>&1)
if grep -q ", 3 threads per rank" <<<"$out"; then echo "ok: OMP_NUM_THREADS=3 -> 3 threads"; else
  echo "FAIL: OMP_NUM_THREADS=3 not taken: $(grep 'threads per rank' <<<"$out")"; fail=1; fi
out=$(OMP_NUM_THREADS=3 "$bin" --config "$configs/gpt2-tiny.ini" --mock-data --train-iters 1 --device cpu --threads 1 2>&1)
if grep -q ", 1 threads per rank" <<<"$out"; then echo "ok: --threads 1 over OMP_NUM_THREADS"; else
  echo "FAIL: --threads 1 not taken: $(grep 'threads per rank' <<<"$out")"; fail=1; fi
expect 2 "num-attention-heads=5 must divide --hidden-size=64" -- --hidden-size 64 --num-attention-heads 5
expect 2 "seq-length=256 exceeds --max-position-embeddings=128" -- --seq-length 256 --max-position-embeddings 128
expect 2 "micro-batch-size=0" -- --micro-batch-size 0
expect 2 "/does/not/exist.ini" -- --config /does/not/exist.ini
expect 2 "lr-decay-style" -- --lr-decay-style sometimes
expect 2 "--device=tpu is not a device" -- --device tpu
expect 2 "--bf16 and --fp16 both given" -- --bf16 --fp16
expect 2 "--fp16 loss scaling" -- --fp16 --loss-scale-window 0
expect 0 "loss scale: .* number of skipped iterations" -- --config "$configs/gpt2-tiny.ini" --device cpu --fp16 --train-iters 2 --log-interval 1
if ! nvidia-smi -L >/dev/null 2>&1; then  # no GPU here: --device cuda must say so, not crash
  expect 2 "--device=cuda: (no CUDA device is visible|this build has no CUDA)" -- --device cuda
fi
expect 2 "profile-step-start=5 / --profile-step-end=5 capture nothing" -- --profile --profile-step-start 5 --profile-step-end 5
expect 2 "--profile-ranks=0,x is not a list of ranks" -- --profile-ranks 0,x
expect 0 "profiling iterations 2 to 3" -- --config "$configs/gpt2-tiny.ini" --device cpu --train-iters 4 --log-interval 1 --profile --profile-step-start 1 --profile-step-end 3
expect 2 "--recompute-method=block needs --recompute-granularity full" -- --recompute-method block
expect 2 "--recompute-method=uniform needs --recompute-granularity full" -- --recompute-granularity selective --recompute-method uniform
expect 2 "--recompute-num-layers=3 does not fit a pipeline stage of 2 layers" -- --num-layers 2 --train-iters 1 --recompute-granularity full --recompute-num-layers 3
expect 2 "--recompute-granularity=some is not a granularity" -- --recompute-granularity some
# Megatron's schedules and dropout (issue 14): one clear line each.
expect 2 "--sequence-parallel needs --tensor-model-parallel-size > 1" -- --config "$configs/gpt2-tiny.ini" --sequence-parallel
expect 2 "--seq-length=30 is not divisible by --tensor-model-parallel-size=4 as --sequence-parallel needs" -- --config "$configs/gpt2-tiny.ini" --seq-length 30 --max-position-embeddings 32 --tensor-model-parallel-size 4 --sequence-parallel --dry-run
expect 2 "--num-layers=2 is not divisible by --pipeline-model-parallel-size=2 x --num-layers-per-virtual-pipeline-stage=2" -- --config "$configs/gpt2-tiny.ini" --num-layers 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --dry-run
expect 2 "--num-layers=6 is not divisible by --pipeline-model-parallel-size=2 x virtual stages 2" -- --config "$configs/gpt2-tiny.ini" --num-layers 6 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 --dry-run
expect 2 "needs the number of micro-batches per step, 3 .* to be a multiple of --pipeline-model-parallel-size=2" -- --config "$configs/gpt2-tiny.ini" --num-layers 4 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 --global-batch-size 6 --micro-batch-size 2 --dry-run
expect 2 "--recompute-num-layers=2 does not fit a model chunk \\(virtual pipeline stage\\) of 1 layer" -- --config "$configs/gpt2-tiny.ini" --num-layers 4 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 --recompute-granularity full --recompute-num-layers 2 --dry-run
expect 2 "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1" -- --config "$configs/gpt2-tiny.ini" --virtual-pipeline-model-parallel-size 2
expect 2 "--virtual-pipeline-model-parallel-size=3 and --num-layers-per-virtual-pipeline-stage=1 disagree" -- --config "$configs/gpt2-tiny.ini" --num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --virtual-pipeline-model-parallel-size 3 --dry-run
expect 2 "--hidden-dropout=1 is out of range \(allowed: 0 <= p < 1\)" -- --hidden-dropout 1
expect 2 "--attention-dropout=-0.1 is out of range" -- --attention-dropout -0.1
expect 0 "sequence parallelism: on" -- --config "$configs/gpt2-tiny.ini" --tensor-model-parallel-size 2 --sequence-parallel --dry-run
expect 0 "stage 0 \(layers 0, 2, embedding\)" -- --config "$configs/gpt2-tiny.ini" --num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --dry-run
expect 2 "--checkpoint-num-layers=2 needs --checkpoint-activations" -- --checkpoint-num-layers 2
expect 2 "--checkpoint-num-layers=-2 is out of range" -- --checkpoint-activations --checkpoint-num-layers=-2
expect 2 "--checkpoint-num-layers=3 does not fit a pipeline stage of 2 layers" -- --num-layers 2 --train-iters 1 --checkpoint-activations --checkpoint-num-layers 3
expect 0 "activation recomputation: full \\(uniform, 2 layers per chunk\\)" -- --config "$configs/gpt2-tiny.ini" --num-layers 4 --checkpoint-activations --checkpoint-num-layers 2 --dry-run
expect 0 "activation recomputation: selective" -- --config "$configs/gpt2-tiny.ini" --recompute-granularity selective --dry-run
expect 2 "--overlap-param-gather needs --use-distributed-optimizer" -- --overlap-param-gather
expect 0 "optimizer: distributed" -- --config "$configs/gpt2-tiny.ini" --use-distributed-optimizer --overlap-param-gather --dry-run
expect 0 "--tensor-model-parallel-size|--num-layers" -- --help
expect 0 "stage 0 .*memory per rank" -- --config "$configs/gpt2-tiny.ini" --dry-run
for c in gpt2-124m gpt2-345m gpt2-1.3b; do  # the shipped configurations are valid
  expect 0 "stage 0 .*memory per rank" -- --config "$configs/$c.ini" --vocab-size 50257 --dry-run
done
# The Llama family (issue 15): bad values get one line naming the option; the shipped configs run.
expect 2 "--num-query-groups=3 does not divide --num-attention-heads=4" -- --group-query-attention --num-query-groups 3
expect 2 "--num-query-groups=4 equals --num-attention-heads: that is multi-head attention" -- --group-query-attention --num-query-groups 4
expect 2 "--rotary-percent=1.5 is out of range \(allowed: 0 < p <= 1\)" -- --position-embedding-type rope --rotary-percent 1.5
expect 2 "--rotary-percent=0 is out of range" -- --position-embedding-type rope --rotary-percent 0
expect 2 "--position-embedding-type=sinusoidal is not known \(allowed: learned_absolute, rope, alibi, none\)" -- --position-embedding-type sinusoidal
expect 0 "architecture: ALiBi, LayerNorm, GELU" -- --config "$configs/gpt2-tiny.ini" --position-embedding-type alibi --dry-run
expect 0 "architecture: no position embedding, LayerNorm, GELU" -- --config "$configs/gpt2-tiny.ini" --position-embedding-type none --dry-run
expect 2 "--normalization=BatchNorm is not known \(allowed: LayerNorm, RMSNorm\)" -- --normalization BatchNorm
expect 2 "--num-query-groups=2 is not divisible by --tensor-model-parallel-size=4" -- --config "$configs/gpt2-tiny.ini" --group-query-attention --num-query-groups 2 --tensor-model-parallel-size 4 --dry-run
expect 2 "--norm-epsilon=1e-06 and --layernorm-epsilon=1e-05 disagree" -- --norm-epsilon 1e-6 --layernorm-epsilon 1e-5
expect 0 "architecture: RoPE \(base 10000, 8 of 8 features\), RMSNorm, SwiGLU, grouped-query attention \(2 key/value heads for 8\), untied output layer, no linear biases" -- --config "$configs/llama-tiny.ini" --dry-run
expect 0 "parameters: 1235814400 \(model, tied head counted once\)" -- --config "$configs/llama3-1b.ini" --dry-run
expect 0 "iteration +4/ +4 .*lm loss" -- --config "$configs/llama-tiny.ini" --device cpu --train-iters 4 --log-interval 1
# Megatron launch lines and hostile input (issue 27): one line each, naming the option.
tiny=(--config "$configs/gpt2-tiny.ini")
expect 2 "unexpected argument 'yes' after --bf16, a switch: leave the value out \(on\), or give true or false" -- "${tiny[@]}" --bf16 yes
expect 2 "unexpected argument 'hello' \(not an option's value" -- hello "${tiny[@]}"
expect 2 "^rank 0 .*: error: --data-path '/nonexistent/a' names no shards" -- "${tiny[@]}" --data-path 0.5 /nonexistent/a 0.5 /nonexistent/b
expect 2 "--data-path 0.5 a 0.5: 3 words; a blend is pairs of a weight and a prefix" -- "${tiny[@]}" --data-path 0.5 a 0.5
expect 2 "--data-path 0 corpus: the weight 0 of 'corpus' must be positive" -- "${tiny[@]}" --data-path 0 corpus
for opt in save load tensorboard-dir data-path log-file metrics-file; do
  expect 2 "error: --$opt is empty; give it a value or leave the option out" -- "${tiny[@]}" --$opt ""
done
printf 'train-iters = 5\nsave =\n' > "${TMPDIR:-/tmp}/empty-save.$$.ini"
expect 2 "--save is empty in config file '.*empty-save.*'" -- --config "${TMPDIR:-/tmp}/empty-save.$$.ini"
rm -f "${TMPDIR:-/tmp}/empty-save.$$.ini"
expect 2 "--config '$configs' is a directory; give an INI file" -- --config "$configs"
expect 2 "give the length of the run: --train-iters N or --train-samples N" -- --num-layers 2
expect 2 "--async-save needs --save" -- "${tiny[@]}" --async-save
expect 2 "--num-query-groups=2 needs --group-query-attention" -- --num-query-groups 2
expect 0 "--num-layers-per-virtual-pipeline-stage=2 makes one model chunk per pipeline rank \(4 layers / PP 2\): the plain 1F1B schedule runs" -- "${tiny[@]}" --num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --dry-run
# The command line replaces the config file's alternatives; a conflict left names the config file.
expect 0 "--train-samples on the command line replaces train-iters = 200 of config file '.*gpt2-tiny.ini'" -- "${tiny[@]}" --train-samples 64 --dry-run
expect 0 "--lr-warmup-fraction on the command line replaces lr-warmup-iters = 10 of config file" -- "${tiny[@]}" --lr-warmup-fraction 0.1 --dry-run
expect 0 "iteration +4/ +4 .*lm loss" -- "${tiny[@]}" --device cpu --train-samples 64 --lr-warmup-fraction 0.1 --log-interval 1
expect 0 "iteration +3/ +3 .*lm loss" -- "${tiny[@]}" --device cpu --rampup-batch-size 8 8 8 --train-samples 40 --lr-warmup-samples 8 --log-interval 1
expect 2 "count iterations, whose size changes under --rampup-batch-size 8 8 8.* \(--lr-warmup-iters is set in config file '.*gpt2-tiny.ini'\)" -- "${tiny[@]}" --rampup-batch-size 8 8 8 --train-samples 40
# --attention-backend: the CPU runs its reference (the start-up line says so); cuDNN or the flash
# kernels asked for on the CPU, or a name that is not a choice, are one line each.
expect 0 "attention: the CPU reference" -- "${tiny[@]}" --device cpu --attention-backend local --train-iters 1
expect 0 "attention: --attention-backend auto, --deterministic-mode" -- "${tiny[@]}" --deterministic-mode --dry-run
expect 2 "--attention-backend fused needs --device cuda" -- "${tiny[@]}" --device cpu --attention-backend fused
expect 2 "--attention-backend=cudnn is not one of auto, fused \(cuDNN\)" -- "${tiny[@]}" --attention-backend cudnn
# FP8 (docs/training.md): the run says what it quantizes; every bad combination is one line.
expect 0 "fp8: hybrid \(E4M3 inputs and weights, E5M2 output gradients\), tensorwise scaling; 2 of 2 layers in FP8" -- "${tiny[@]}" --device cpu --fp8-format hybrid --fp8-recipe tensorwise --train-iters 2 --log-interval 1
expect 0 "fp8: e4m3, delayed scaling \(amax history 16, max, margin 1\); 1 of 3 layers" -- "${tiny[@]}" --num-layers 3 --fp8-format e4m3 --fp8-amax-history-len 16 --fp8-amax-compute-algo max --fp8-margin 1 --first-last-layers-bf16 --num-layers-at-end-in-bf16 1 --num-layers-at-start-in-bf16 1 --dry-run
expect 2 "--fp8-format fp4 is not a choice \(allowed: e4m3, hybrid\)" -- "${tiny[@]}" --fp8-format fp4
expect 2 "--fp8-recipe mxfp8: not yet" -- "${tiny[@]}" --fp8-format hybrid --fp8-recipe mxfp8
expect 2 "--fp8-recipe rowwise is not a choice" -- "${tiny[@]}" --fp8-format hybrid --fp8-recipe rowwise
expect 2 "--fp8-margin -1: must be >= 0" -- "${tiny[@]}" --fp8-format hybrid --fp8-margin -1
expect 2 "the argument \('1.5'\) for option '--fp8-margin' is invalid: it takes a whole number" -- "${tiny[@]}" --fp8-format hybrid --fp8-margin 1.5
expect 2 "the argument \('x'\) for option '--lr' is invalid: it takes a number" -- "${tiny[@]}" --lr x
expect 2 "--fp8-amax-history-len 0: must be >= 1" -- "${tiny[@]}" --fp8-format hybrid --fp8-amax-history-len 0
expect 2 "--fp8-amax-compute-algo is delayed scaling's" -- "${tiny[@]}" --fp8-format hybrid --fp8-recipe tensorwise --fp8-amax-compute-algo max
expect 2 "--fp8-amax-compute-algo sometimes is not a choice" -- "${tiny[@]}" --fp8-format hybrid --fp8-amax-compute-algo sometimes
expect 2 "an --fp8-\* option \(or --first-last-layers-bf16\) without --fp8-format" -- "${tiny[@]}" --fp8-recipe tensorwise
expect 2 "--fp8-format: --hidden-size is 72, but FP8 GEMMs need multiples of 16" -- "${tiny[@]}" --fp8-format hybrid --hidden-size 72
expect 2 "--fp8-format: --ffn-hidden-size / TP is 40" -- "${tiny[@]}" --fp8-format hybrid --ffn-hidden-size 40
expect 2 "leave none of the 2 layers in FP8" -- "${tiny[@]}" --fp8-format hybrid --first-last-layers-bf16
expect 2 "--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 need --first-last-layers-bf16" -- "${tiny[@]}" --fp8-format hybrid --num-layers-at-start-in-bf16 2
# Issue 39's new-user cases (one line each, exit 2; or a line where the run goes on).
expect 2 "--lr=inf is not a finite number" -- "${tiny[@]}" --lr inf --train-iters 2
expect 2 "--weight-decay=inf is not a finite number" -- "${tiny[@]}" --weight-decay inf --train-iters 2
expect 2 "--lr-warmup-iters=10 is not shorter than --lr-decay-iters=5: the warm-up must end before the decay does" -- "${tiny[@]}" --lr-decay-iters 5 --lr-warmup-iters 10 --train-iters 3
expect 0 "the learning-rate warm-up \(10 iterations\) lasts the whole run \(3 iterations\)" -- "${tiny[@]}" --lr-warmup-iters 10 --train-iters 3 --log-interval 1
expect 2 "--train-samples=-3 is out of range \(allowed: >= 1\)" -- "${tiny[@]}" --train-samples -3
expect 2 "--moe-layer-freq=\[0,0\] leaves none of the 2 layers a MoE layer" -- "${tiny[@]}" --num-experts 4 --moe-layer-freq "[0,0]" --train-iters 2
# A size no rank of this machine holds: refused at once from the memory estimate, not by the OOM
# killer; --dry-run prints the estimate at once whatever the expert count.
start=$(date +%s)
expect 2 "error: the run does not fit: one rank of pipeline stage 0 needs about [0-9.]+ [TP]iB by the estimate \(.* parameters.*\) and has the host's [0-9.]+ GiB; .*--dry-run prints the estimate per rank" -- --config "$configs/mixtral-tiny.ini" --device cpu --mock-data --num-experts 100000000 --train-iters 1
expect 0 "expert" -- --config "$configs/mixtral-tiny.ini" --mock-data --num-experts 100000000 --dry-run
[ $(($(date +%s) - start)) -le 30 ] && echo "ok: --num-experts 100000000 answered in $(($(date +%s) - start)) s" ||
  { echo "FAIL: --num-experts 100000000 took $(($(date +%s) - start)) s"; fail=1; }
out=$("$bin" --lr abc 2>&1)
if grep -q "config file ''" <<<"$out" || ! grep -q "'--lr' is invalid" <<<"$out"; then
  echo "FAIL: a malformed number without --config names a config file: $out"; fail=1
else
  echo "ok: --lr abc without --config: $out"
fi
expect 2 "--fp8-format: --moe-ffn-hidden-size / TP is 40" -- "${tiny[@]}" --fp8-format hybrid --num-experts 4 --moe-ffn-hidden-size 40
expect 0 "fp8: the experts' GEMMs of FP8 layers run one block \(sender, expert\) at a time" -- "${tiny[@]}" --fp8-format hybrid --num-experts 4 --moe-ffn-hidden-size 32 --moe-grouped-gemm --disable-bias-linear --train-iters 1 --log-interval 1
if nvidia-smi -L >/dev/null 2>&1; then  # the device check comes first where there is no GPU
  expect 2 "--fp8-format on --device cuda needs --bf16" -- "${tiny[@]}" --fp8-format hybrid --device cuda
fi
# Megatron options that mean nothing here: accepted with one line each; a bad choice still refused.
expect 0 "--use-flash-attn: accepted without effect: attention is always fused" -- "${tiny[@]}" --use-flash-attn --DDP-impl local --no-async-tensor-model-parallel-allreduce --exit-signal-handler --distributed-backend nccl --dry-run
expect 0 "--DDP-impl local: accepted without effect" -- "${tiny[@]}" --DDP-impl local --dry-run
expect 2 "--DDP-impl fancy is not a choice \(allowed: local,torch\)" -- "${tiny[@]}" --DDP-impl fancy
expect 2 "--num-workers two: not a whole number" -- "${tiny[@]}" --num-workers two
# Issue 57/58: the shipped DeepSeek-V3 config fits the hardware it names (64 dgx-h100 nodes), and
# --dry-run says so; dropless it does not, and the verdict names the change that fits; a plan's
# --world-size; --cluster and --world-size only with --dry-run; an unknown kind lists the kinds.
expect 0 "memory verdict: fits dgx-h100's NVIDIA H100 SXM5 80GB \(79.7 GiB\): the fullest rank \(stage 0\) needs 46.3 GiB \+ 2.0 GiB runtime reserve" -- --config "$configs/deepseek-v3.ini" --dry-run --cluster dgx-h100
dropless=$(mktemp --suffix=.ini)
grep -v '^moe-expert-capacity-factor' "$configs/deepseek-v3.ini" > "$dropless"
expect 0 "memory verdict: does not fit dgx-h100's .*needs 104.9 GiB .*; --moe-expert-capacity-factor 1.0 would fit \(46.3 GiB\)" -- --config "$dropless" --dry-run --cluster dgx-h100
rm -f "$dropless"
# ... and --moe-expert-capacity-factor none over the file's factor is dropless again (issue 71).
expect 0 "memory verdict: does not fit dgx-h100's .*needs 104.9 GiB" -- --config "$configs/deepseek-v3.ini" --dry-run --cluster dgx-h100 --moe-expert-capacity-factor none
expect 0 "memory verdict: fits dgx-h200's .* needs 105.0 GiB" -- --config "$configs/deepseek-v3.ini" --dry-run --cluster dgx-h200 --recompute-granularity selective
expect 0 "layout: world 16 = TP 2 x PP 2 x DP 4;" -- --config "$configs/gpt2-tiny.ini" --num-layers 4 --dry-run --world-size 16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
expect 0 "memory verdict: (none: no GPU on this host|fits this host's)" -- --config "$configs/gpt2-tiny.ini" --dry-run --device cuda
expect 2 "--world-size plans a run: it needs --dry-run" -- --config "$configs/gpt2-tiny.ini" --train-iters 1 --world-size 8
expect 2 "--cluster dgx-b300: no such cluster kind in .*configs/clusters \(there: dgx-a100, dgx-h100, dgx-h200\)" -- --config "$configs/gpt2-tiny.ini" --dry-run --cluster dgx-b300
expect 2 "--world-size=0 is out of range" -- --config "$configs/gpt2-tiny.ini" --dry-run --world-size 0
# Issue 59: --optimizer and Muon's options.
expect 2 "--optimizer sgd is not a choice \(allowed: adam, muon, dist_muon\)" -- "${tiny[@]}" --optimizer sgd
expect 2 "--muon-momentum is a Muon option: it needs --optimizer muon" -- "${tiny[@]}" --muon-momentum 0.95
expect 2 "--muon-tp-mode rowwise is not a choice \(allowed: blockwise, duplicated, distributed\)" -- "${tiny[@]}" --optimizer muon --muon-tp-mode rowwise
expect 2 "--muon-num-ns-steps=0 is out of range" -- "${tiny[@]}" --optimizer muon --muon-num-ns-steps 0
expect 0 "optimizer: Muon .*, layer-wise over the distributed optimizer\) for the matrices; AdamW for the word embedding, the output layer" -- "${tiny[@]}" --optimizer dist_muon --dry-run
# Issue 71 point 8: Megatron's assertion; Megatron-FSDP's recommended options taken, each saying why.
expect 2 "--overlap-param-gather needs --overlap-grad-reduce \(on by default" -- "${tiny[@]}" --dry-run --world-size 2 --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce false
for opt in "--ckpt-format fsdp_dtensor" --grad-reduce-in-bf16 --use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration --init-model-with-meta-device; do
  # shellcheck disable=SC2086
  expect 0 "tessera-train: ${opt%% *}( fsdp_dtensor)?: accepted without effect: " -- "${tiny[@]}" --dry-run --world-size 2 --use-megatron-fsdp $opt
done
expect 2 "--ckpt-format torch_dist is not a choice \(allowed: fsdp_dtensor\)" -- "${tiny[@]}" --dry-run --ckpt-format torch_dist
# Issue 71 point 4: --ranks-per-gpu ranks share the GPU (each with its reserve); under FSDP
# no_shard the cure is the next strategy, not the distributed optimizer it just ignored.
# Issue 72: the published-style DeepSeek-V3 pipeline the config states (PP16 x VP2 layout string,
# EP 64, 1,024 GPUs) fits; its fullest rank is the MTP stage.
expect 0 "memory verdict: fits dgx-h100's NVIDIA H100 SXM5 80GB \(79.7 GiB\): the fullest rank \(stage 14\) needs 47.9 GiB \+ 2.0 GiB runtime reserve" -- --config "$configs/deepseek-v3.ini" --dry-run --cluster dgx-h100 --world-size 1024 --tensor-model-parallel-size 1 --no-sequence-parallel --pipeline-model-parallel-size 16 --pipeline-model-parallel-layout "Et*3|(tt|)*29,m|L" --expert-model-parallel-size 64
expect 0 "memory verdict: does not fit dgx-h100's NVIDIA H100 SXM5 80GB \(79.7 GiB, shared by --ranks-per-gpu 2 ranks\): the fullest rank \(stage 0\) needs 46.3 GiB, 2 ranks 92.6 GiB \+ 4.0 GiB runtime reserve" -- --config "$configs/deepseek-v3.ini" --dry-run --cluster dgx-h100 --ranks-per-gpu 2
out=$("$bin" --config "$configs/qwen3-8b.ini" --dry-run --cluster dgx-h100 --world-size 8 --use-megatron-fsdp --data-parallel-sharding-strategy no_shard --micro-batch-size 8 --recompute-granularity full 2>&1)
if grep -q "memory verdict: does not fit .*--data-parallel-sharding-strategy optim would fit (48.3 GiB)" <<<"$out" \
   && ! grep "memory verdict" <<<"$out" | grep -q -- "--use-distributed-optimizer"; then
  echo "ok: FSDP no_shard's verdict suggests --data-parallel-sharding-strategy optim"
else
  echo "FAIL: FSDP no_shard's verdict: $(grep 'memory verdict' <<<"$out")"; fail=1
fi
# Issue 71 point 7: dist_muon says it is deprecated; the scalar optimizer is Megatron's adam.
expect 0 "--optimizer dist_muon is deprecated \(as in Megatron-LM\): it runs --optimizer muon --use-distributed-optimizer" -- "${tiny[@]}" --optimizer dist_muon --dry-run
expect 0 "optimizer: Muon" -- "${tiny[@]}" --optimizer muon --muon-scalar-optimizer adam --dry-run
expect 2 "--muon-scalar-optimizer lion is not a choice \(allowed: adam" -- "${tiny[@]}" --optimizer muon --muon-scalar-optimizer lion
expect 2 "--muon-scalar-optimizer is a Muon option: it needs --optimizer muon" -- "${tiny[@]}" --muon-scalar-optimizer adam
# --collective-plan: only with --dry-run; an unwritable prefix names the file; multi-token
# prediction is planned (issue 69: the plan is the recorded step).
expect 2 "--collective-plan plans a run: it needs --dry-run" -- --config "$configs/gpt2-tiny.ini" --train-iters 1 --collective-plan /tmp/p
expect 2 "--collective-plan: cannot write /nonexistent-dir/p.rank0 \(check that its folder exists and is writable\)" -- --config "$configs/gpt2-tiny.ini" --dry-run --collective-plan /nonexistent-dir/p
expect 0 "collective plan: 2 files /tmp/tessera-cli-plan.rank0...1" -- --config "$configs/llama-tiny.ini" --dry-run --mtp-num-layers 1 --world-size 2 --tensor-model-parallel-size 2 --collective-plan /tmp/tessera-cli-plan
# Issue 71 point 2: a config file's switch turned off on the command line, in Megatron's spellings
# (--no-X, --X=false, --X false; the last spelling wins); a bad value names the spellings; the
# refusal of a switch the file set says how to turn it off; --no-X of a true/false option.
spfile=$(mktemp --suffix=.ini)
grep -v '^sequence-parallel' "$configs/gpt2-tiny.ini" > "$spfile"
echo "sequence-parallel = true" >> "$spfile"
expect 2 "--sequence-parallel needs --tensor-model-parallel-size > 1 .*set in config file '$spfile'; --no-sequence-parallel on the command line turns it off\)" -- --config "$spfile" --dry-run
for off in "--no-sequence-parallel" "--sequence-parallel=false" "--sequence-parallel false" "--sequence-parallel=0" "--sequence-parallel --no-sequence-parallel"; do
  # shellcheck disable=SC2086
  expect 0 "sequence parallelism: off" -- --config "$spfile" --dry-run $off
done
expect 2 "--sequence-parallel needs --tensor-model-parallel-size > 1" -- --config "$spfile" --dry-run --no-sequence-parallel --sequence-parallel=true
expect 0 "sequence parallelism: on" -- --config "$spfile" --dry-run --world-size 2 --tensor-model-parallel-size 2
expect 2 "--sequence-parallel=maybe: a switch is given alone \(on\), as --no-sequence-parallel \(off\), or with true or false" -- --config "$spfile" --dry-run --sequence-parallel=maybe
expect 2 "--no-such-switch" -- --config "$spfile" --dry-run --no-such-switch
rm -f "$spfile"
# --no-overlap-grad-reduce is --overlap-grad-reduce false: the buckets' all-reduces move after the
# backward in the collective plan (TP2 x DP2, small buckets).
planned() {  # planned PREFIX OPTIONS...: rank 0's planned calls
  "$bin" "${tiny[@]}" --num-layers 4 --dry-run --world-size 4 --tensor-model-parallel-size 2 \
    --ddp-bucket-size 3000 --collective-plan "$1" "${@:2}" > /dev/null 2>&1 && cat "$1.rank0"
}
p_on=$(planned /tmp/tessera-cli-ov1)
p_no=$(planned /tmp/tessera-cli-ov2 --no-overlap-grad-reduce)
p_false=$(planned /tmp/tessera-cli-ov3 --overlap-grad-reduce false)
p_disable=$(planned /tmp/tessera-cli-ov4 --disable-overlap-grad-reduce)
rm -f /tmp/tessera-cli-ov*
if [ -n "$p_no" ] && [ "$p_no" = "$p_false" ] && [ "$p_no" = "$p_disable" ] && [ "$p_no" != "$p_on" ] \
   && [ "$(sort <<<"$p_no")" = "$(sort <<<"$p_on")" ]; then
  echo "ok: --no-overlap-grad-reduce and --disable-overlap-grad-reduce plan as --overlap-grad-reduce false (the same calls, reordered)"
else
  echo "FAIL: --no-overlap-grad-reduce: $(wc -l <<<"$p_no") calls, not --overlap-grad-reduce false's or not reordered"
  fail=1
fi
for opt in num-layers hidden-size num-attention-heads seq-length max-position-embeddings \
           micro-batch-size global-batch-size train-iters lr min-lr lr-decay-style \
           lr-warmup-iters weight-decay clip-grad adam-beta1 adam-beta2 adam-eps seed \
           make-vocab-size-divisible-by log-interval recompute-granularity recompute-method \
           recompute-num-layers checkpoint-activations checkpoint-num-layers \
           use-distributed-optimizer overlap-grad-reduce overlap-param-gather sequence-parallel \
           num-layers-per-virtual-pipeline-stage virtual-pipeline-model-parallel-size \
           attention-dropout hidden-dropout position-embedding-type rotary-base rotary-percent \
           normalization norm-epsilon swiglu group-query-attention num-query-groups \
           untie-embeddings-and-output-weights disable-bias-linear; do
  "$bin" --help | grep -q -- "--$opt" || { echo "FAIL: --help does not document --$opt"; fail=1; }
done
[ $fail -eq 0 ] && echo "app.cli_errors: all passed"
exit $fail
