#!/usr/bin/env bash
# test_logging.sh: what Megatron-LM users read in a run's log, as tessera-train prints it: the
# timers at every --timing-log-level and --timing-log-option (TP2 x PP2, min <= max over ranks),
# params norm and zeros in the gradient (the same at 1 rank and TP2 x PP2), the memory report
# against the --dry-run estimate, TensorBoard event files read by an independent reader (same
# losses as the metrics file), a repeated option taking its last value, Megatron's schedule options
# (--train-samples, --rampup-batch-size across layouts and a resume), and the bad inputs.
# Usage: test_logging.sh BIN_DIR CONFIG_DIR SOURCE_DIR
set -u
bin=$1
configs=$2
src=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
train() {  # NP ARGS...
  local np=$1
  shift
  if [ "$np" = 1 ]; then
    "$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --vocab-size 500 --threads 1 "$@"
  else
    timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "$bin/tessera-train" \
      --config "$configs/gpt2-tiny.ini" --vocab-size 500 --threads 1 "$@"
  fi
}
L=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2)

# 1. Timers: level 2 at TP2 x PP2 lists every phase with min <= max; the options change the format.
out=$(train 4 "${L[@]}" --train-iters 4 --log-interval 2 --timing-log-level 2 --save "$work/ck" 2>&1)
missing=""
for t in forward-backward forward-compute backward-compute batch-generator forward-recv forward-send \
         backward-recv backward-send grads-all-reduce embedding-grads-all-reduce optimizer save-checkpoint; do
  grep -qE "^ +$t \.+: \([0-9.]+, [0-9.]+\)$" <<<"$out" || missing="$missing $t"
done
minmax_ok=$(grep -E '^ +[a-z-]+ \.+: \(' <<<"$out" | sed 's/.*(\(.*\), \(.*\))/\1 \2/' | awk '$1 > $2 { bad = 1 } END { print bad ? "no" : "yes" }')
[ -z "$missing" ] && [ "$minmax_ok" = yes ] && [ "$(grep -c '^(min, max) time across ranks (ms):' <<<"$out")" -eq 3 ] \
  && ok "--timing-log-level 2 at TP2 x PP2: every timer, min <= max, after each log line and the save" \
  || bad "timers (missing:$missing; min<=max: $minmax_ok): $out"
out=$(train 4 "${L[@]}" --train-iters 2 --log-interval 2 --timing-log-level 1 --timing-log-option max 2>&1)
grep -q "^max time across ranks (ms):" <<<"$out" && grep -qE "^ +forward-backward \.+: [0-9.]+$" <<<"$out" \
  && ! grep -q "forward-compute" <<<"$out" && ok "level 1, option max: forward-backward, not forward-compute" \
  || bad "level 1 max: $out"
out=$(train 4 "${L[@]}" --train-iters 2 --log-interval 2 --timing-log-level 1 --timing-log-option all 2>&1)
grep -q "^times across ranks (ms):" <<<"$out" && [ "$(grep -cE '^ +rank +[0-3]: [0-9.]+$' <<<"$out")" -ge 16 ] \
  && ok "option all: every rank's time per timer" || bad "option all: $out"
out=$(train 1 --train-iters 2 --log-interval 1 2>&1)
! grep -q "time across ranks" <<<"$out" && ok "level 0 (the default): no timers without a save" || bad "level 0 printed timers: $out"

# 2. Params norm and zeros in the gradient: the same model, the same figures in every layout (the
#    12 padded vocabulary rows of wte get zero gradient: 12 x 64 = 768 zeros).
one=$(train 1 --train-iters 3 --log-interval 3 --log-params-norm --log-num-zeros-in-grad 2>&1 | grep -o 'params norm: [0-9.]* | num zeros: [0-9]*')
four=$(train 4 "${L[@]}" --train-iters 3 --log-interval 3 --log-params-norm --log-num-zeros-in-grad 2>&1 | grep -o 'params norm: [0-9.]* | num zeros: [0-9]*')
dist=$(train 4 --tensor-model-parallel-size 2 --use-distributed-optimizer --bf16 --train-iters 3 --log-interval 3 --log-params-norm 2>&1 | grep -o 'params norm: [0-9.]*')
[ -n "$one" ] && [ "$one" = "$four" ] && grep -q "num zeros: 768" <<<"$one" && [ -n "$dist" ] \
  && ok "1 rank == TP2 x PP2: $one; distributed optimizer (bf16 master weights): $dist" || bad "params norm / zeros: '$one' vs '$four', dist '$dist'"

# 3. The memory report after the first iteration: every rank, allocated within 5% of the estimate.
out=$(train 4 "${L[@]}" --train-iters 2 --memory-report-interval 2 2>&1)
rows=$(grep -E '^\[Rank [0-3]\] \(after [12] iterations\) memory \(MB\) \| allocated: ' <<<"$out")
close=$(awk -F'|' '{ split($2, a, ": "); split($5, e, ": "); d = a[2] - e[2]; if (d < 0) d = -d; if (d > 0.05 * e[2]) bad = 1 } END { print bad ? "no" : "yes" }' <<<"$rows")
[ "$(wc -l <<<"$rows")" -eq 8 ] && [ "$close" = yes ] && ok "memory report: 4 ranks after iterations 1 and 2, allocated within 5% of the estimate ($(head -1 <<<"$rows"))" \
  || bad "memory report: $out"

# 4. TensorBoard: the last rank writes; the independent reader finds every iteration's loss equal to
#    the metrics file's (as float32), the timers, the validation perplexity.
train 4 "${L[@]}" --train-iters 4 --log-interval 2 --timing-log-level 1 --log-timers-to-tensorboard \
  --eval-interval 2 --eval-iters 1 --log-validation-ppl-to-tensorboard --tensorboard-dir "$work/tb" \
  --metrics-file "$work/m.jsonl" > "$work/tb.log" 2>&1 || bad "training with TensorBoard: $(tail -3 "$work/tb.log")"
files=$(ls "$work"/tb/events.out.tfevents.* 2>/dev/null | wc -l)
if [ "$files" -eq 1 ] && python3 "$src/tests/core/read_tfevents.py" "$work"/tb/events.out.tfevents.* > "$work/tb.txt"; then
  check=$(python3 - "$work/tb.txt" "$work/m.jsonl" <<'EOF'
import json, math, sys
tb = {}
for line in open(sys.argv[1]):
    if line.startswith("file_version"):
        continue
    step, rest = line.split(" ", 1)
    tag, value = rest.rsplit(" ", 1)
    tb[(tag, int(step))] = float(value)
problems = []
for line in open(sys.argv[2]):
    d = json.loads(line)
    if "valid_lm_loss" in d:
        it = d["iteration"]
        if abs(tb.get(("lm loss validation", it), 0) - d["valid_lm_loss"]) > 1e-5 * d["valid_lm_loss"]:
            problems.append("validation loss %d" % it)
        if abs(tb.get(("lm loss validation ppl", it), 0) - math.exp(d["valid_lm_loss"])) > 1e-4 * math.exp(d["valid_lm_loss"]):
            problems.append("ppl %d" % it)
for it in range(1, 5):
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "iteration-time"):
        if (tag, it) not in tb:
            problems.append("%s at %d" % (tag, it))
for it in (2, 4):
    for tag in ("forward-backward-time", "optimizer-time"):
        if (tag, it) not in tb:
            problems.append("%s at %d" % (tag, it))
if tb.get(("batch-size", 1)) != 16.0:
    problems.append("batch size")
# The metrics file logs the mean loss of each interval of 2: TensorBoard's per-iteration losses
# average to it.
logged = [json.loads(l) for l in open(sys.argv[2])]
logged = [d for d in logged if "lm_loss" in d]
for d in logged:
    it = d["iteration"]
    mean = (tb[("lm loss", it - 1)] + tb[("lm loss", it)]) / 2
    if abs(mean - d["lm_loss"]) > 1e-6 * d["lm_loss"]:
        problems.append("mean loss at %d: %r vs %r" % (it, mean, d["lm_loss"]))
if len(logged) != 2:
    problems.append("%d logged iterations" % len(logged))
print("ok" if not problems else " ".join(problems))
EOF
)
  [ "$check" = ok ] && ok "TensorBoard: $(wc -l < "$work/tb.txt") records read back; losses == the metrics file; timers; validation ppl" \
    || bad "TensorBoard contents: $check: $(head -20 "$work/tb.txt")"
else
  bad "TensorBoard: $files event files, reader: $(python3 "$src/tests/core/read_tfevents.py" "$work"/tb/events.out.tfevents.* 2>&1 | tail -2)"
fi

# 5. A repeated option takes its last value (launch scripts append overrides).
out=$(train 1 --train-iters 7 --log-interval 1 --train-iters 2 2>&1)
grep -q "iteration *2/ *2 " <<<"$out" && ! grep -q "iteration *3/" <<<"$out" && ok "--train-iters 7 ... --train-iters 2 trains 2" \
  || bad "repeated option: $out"

# 6. Schedule and loading options of Megatron-LM's launch scripts.
lrs() { grep -o 'learning rate: [0-9.E+-]*' | awk '{print $3}' | tr '\n' ' '; }
[ "$(train 1 --train-iters 0 --train-samples 40 --log-interval 1 2>&1 | grep -c ' iteration ')" -eq 2 ] \
  && ok "--train-samples 40 at global batch 16: 2 iterations" || bad "--train-samples"
w=$(train 1 --train-iters 4 --lr 0.002 --lr-warmup-iters 0 --lr-warmup-fraction 0.5 --log-interval 1 2>&1 | lrs)
[ "$w" = "1.000000E-03 2.000000E-03 $(train 1 --train-iters 4 --lr 0.002 --lr-warmup-iters 2 --log-interval 1 2>&1 | lrs | cut -d' ' -f3-)" ] \
  && ok "--lr-warmup-fraction 0.5 of 4 iterations == --lr-warmup-iters 2: $w" || bad "--lr-warmup-fraction: $w"
a=$(train 1 --train-iters 6 --lr-warmup-iters 1 --lr-decay-samples 64 --log-interval 1 2>&1 | lrs)
b=$(train 1 --train-iters 6 --lr-warmup-iters 1 --lr-decay-iters 4 --log-interval 1 2>&1 | lrs)
[ -n "$a" ] && [ "$a" = "$b" ] && ok "--lr-decay-samples 64 == --lr-decay-iters 4 at global batch 16" || bad "--lr-decay-samples: '$a' vs '$b'"
train 1 --train-iters 2 --save "$work/full" > /dev/null 2>&1
train 1 --train-iters 2 --save "$work/lean" --no-save-optim > /dev/null 2>&1
fs=$(stat -c %s "$work"/full/iter_0000002/*.h5); ls=$(stat -c %s "$work"/lean/iter_0000002/*.h5)
[ -n "$ls" ] && [ "$ls" -lt $((fs / 2)) ] && ok "--no-save-optim: $ls bytes instead of $fs" || bad "--no-save-optim: $ls vs $fs"
out=$(train 1 --train-iters 4 --load "$work/full" --no-load-optim --no-load-rng --log-interval 1 2>&1)
grep -q -- "--no-load-optim: the optimizer and its step count start fresh" <<<"$out" && grep -q "iteration *3/ *4" <<<"$out" \
  && ! grep -q "iteration *1/" <<<"$out" && ok "--no-load-optim --no-load-rng: resumes at iteration 3 with a fresh optimizer" || bad "--no-load-optim: $out"
out=$(train 1 --train-iters 3 --load "$work/full" --num-layers 3 --hidden-size 96 --num-attention-heads 6 --use-checkpoint-args --log-interval 1 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q "2 layers, hidden 64, 4 heads" <<<"$out" && grep -q "iteration *3/ *3" <<<"$out" \
  && ok "--use-checkpoint-args: the checkpoint's 2 x 64 model over the command line's 3 x 96" || bad "--use-checkpoint-args: rc $rc $out"
out=$(train 1 --train-iters 3 --load "$work/full" --num-layers 3 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "has --num-layers=2 but this run has 3" <<<"$out" && ok "without --use-checkpoint-args the shapes must agree" || bad "shape check: rc $rc"

# --rampup-batch-size 8 8 48 to 16 over --train-samples 160 (Megatron's counts): 6 steps of 8 while
# fewer than 48 samples are consumed, one of 16 at 48, then (160 - 64) / 16 = 6: 13 iterations.
# The same losses at 1 rank, DP2 and TP2 x PP2; a resume in the middle of the ramp is exact.
R=(--train-iters 0 --lr-warmup-iters 0 --train-samples 160 --rampup-batch-size 8 8 48 --lr-warmup-samples 32 --log-interval 1)
field() { sed "s/.*\"$2\": \([^,]*\),.*/\1/" "$1" | tr '\n' ' '; }
train 1 "${R[@]}" --metrics-file "$work/r1.jsonl" > "$work/r1.log" 2>&1
train 2 "${R[@]}" --metrics-file "$work/r2.jsonl" > "$work/r2.log" 2>&1
train 4 "${L[@]}" "${R[@]}" --metrics-file "$work/r4.jsonl" > "$work/r4.log" 2>&1
sizes=$(field "$work/r1.jsonl" global_batch_size)
[ "$sizes" = "8 8 8 8 8 8 16 16 16 16 16 16 16 " ] && [ "$(field "$work/r1.jsonl" consumed_samples | awk '{print $NF}')" = 160 ] \
  && grep -q "at first (--rampup-batch-size: +8 in equal parts of the first 48 samples, up to 16; 13 iterations)" "$work/r1.log" \
  && ok "--rampup-batch-size 8 8 48: global batches $sizes(160 samples)" || bad "ramp sizes '$sizes': $(tail -3 "$work/r1.log")"
worst=$(paste <(field "$work/r1.jsonl" lm_loss | tr ' ' '\n') <(field "$work/r2.jsonl" lm_loss | tr ' ' '\n') <(field "$work/r4.jsonl" lm_loss | tr ' ' '\n') \
  | awk 'NF == 3 { for (i = 2; i <= 3; i++) { d = ($i - $1) / $1; if (d < 0) d = -d; if (d > w) w = d }; n++ } END { printf "%d %.3g", n, w }')
awk -v w="${worst#* }" -v n="${worst% *}" 'BEGIN { exit !(n == 13 && w < 1e-5) }' \
  && ok "ramp: 1 rank == DP2 == TP2 x PP2 (13 iterations, worst relative difference ${worst#* })" || bad "ramp layouts: $worst"
train 1 "${R[@]}" --save "$work/ramp" --save-interval 4 --exit-interval 4 > /dev/null 2>&1
train 1 "${R[@]}" --load "$work/ramp" --metrics-file "$work/rr.jsonl" > "$work/rr.log" 2>&1
a=$(tail -n 9 "$work/r1.jsonl" | sed 's/"ms_per_iter.*//'); b=$(sed 's/"ms_per_iter.*//' "$work/rr.jsonl")
[ -n "$b" ] && [ "$a" = "$b" ] && ok "ramp: resumed at iteration 4 (batch 8), iterations 5-13 bitwise equal (batch, lr, loss)" \
  || bad "ramp resume: $(diff <(echo "$a") <(echo "$b") | head -4)"

# Evaluation: each one continues through the validation split; at the end of training Megatron's
# "validation loss at the end of training" for the val and test data.
out=$(train 1 --train-iters 4 --log-interval 2 --eval-interval 2 --eval-iters 2 2>&1)
v2=$(grep -o 'validation loss at iteration 2 | lm loss value: [0-9.E+-]*' <<<"$out" | awk '{print $NF}')
v4=$(grep -o 'validation loss at iteration 4 | lm loss value: [0-9.E+-]*' <<<"$out" | awk '{print $NF}')
[ -n "$v2" ] && [ -n "$v4" ] && [ "$v2" != "$v4" ] && grep -q "^ validation loss at the end of training for val data | lm loss value: " <<<"$out" \
  && grep -q "^ validation loss at the end of training for test data | lm loss value: " <<<"$out" \
  && ok "evaluations move through the split ($v2, $v4); val and test loss at the end of training" || bad "evaluation: $out"
for i in $(seq 1 300); do echo "{\"text\": \"Line $i: the cat sat on the mat number $((i * 7 % 13)), and the dog ran.\"}"; done > "$work/c.jsonl"
"$bin/tessera-preprocess" --input "$work/c.jsonl" --vocab-file "$src/data/gpt2/encoder.json" \
  --merge-file "$src/data/gpt2/vocab.bpe" --output-prefix "$work/c" --workers 1 > /dev/null
C=(--vocab-size 0 --data-path "$work/c" --seq-length 32 --max-position-embeddings 32 --split 80,20,0 --train-iters 2 --eval-interval 2 --eval-iters 1)
full=$("$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --threads 1 "${C[@]}" --full-validation 2>&1)
part=$("$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --threads 1 "${C[@]}" 2>&1)
f=$(grep -o 'validation loss at iteration 2 | lm loss value: [0-9.E+-]*' <<<"$full" | awk '{print $NF}')
p=$(grep -o 'validation loss at iteration 2 | lm loss value: [0-9.E+-]*' <<<"$part" | awk '{print $NF}')
[ -n "$f" ] && [ -n "$p" ] && [ "$f" != "$p" ] && ! grep -q "for test data" <<<"$full" \
  && ok "--full-validation: the whole split ($f; one batch: $p); no test split, no test loss" || bad "--full-validation: $full"

# 7. Bad input: one line, exit 2.
refused() {  # WHAT PATTERN ARGS...
  local what=$1 pattern=$2 out rc
  shift 2
  out=$(train 1 --train-iters 1 "$@" 2>&1); rc=$?
  [ $rc -eq 2 ] && [ "$(grep -c 'error:' <<<"$out")" -eq 1 ] && grep -qF -- "$pattern" <<<"$out" \
    && ok "$what -> rc 2" || bad "$what: rc $rc: $out"
}
touch "$work/file"
refused "an unwritable --tensorboard-dir" "--tensorboard-dir '$work/file/tb': cannot create '$work/file/tb': Not a directory" --tensorboard-dir "$work/file/tb"
refused "--timing-log-level 3" "--timing-log-level=3 is out of range (allowed: 0, 1, 2)" --timing-log-level 3
refused "--timing-log-option median" "--timing-log-option 'median' is not an option (allowed: minmax, max, all)" --timing-log-option median
refused "--tensorboard-log-interval 0" "--tensorboard-log-interval=0 is out of range (allowed: >= 1)" --tensorboard-log-interval 0
refused "warm-up fraction and iterations" "--lr-warmup-fraction and --lr-warmup-iters (or --lr-warmup-samples) both given; choose one" --lr-warmup-fraction 0.1 --lr-warmup-iters 3
refused "--lr-warmup-fraction 1.5" "--lr-warmup-fraction=1.5 is out of range (allowed: 0 < f <= 1)" --lr-warmup-iters 0 --lr-warmup-fraction 1.5
refused "--train-samples with --train-iters" "--train-samples and --train-iters both given; choose one" --train-samples 64
refused "--train-samples below a batch" "--train-samples=8 is less than one global batch (16 samples)" --train-iters 0 --train-samples 8
RB=(--train-iters 0 --lr-warmup-iters 0 --train-samples 64)
refused "a ramp that misses the global batch" "--rampup-batch-size 4 5 32 does not reach --global-batch-size=16 in whole steps: 16 - START 4 = 12 is not a multiple of INCR 5" "${RB[@]}" --rampup-batch-size 4 5 32
refused "a ramp batch that does not split" "--rampup-batch-size 6 5 32: the ramp's global batch 6 is not divisible by --micro-batch-size=4 x data-parallel size 1 = 4" "${RB[@]}" --micro-batch-size 4 --global-batch-size 16 --rampup-batch-size 6 5 32
refused "a ramp of two numbers" "--rampup-batch-size 4 4: give three numbers, START INCR SAMPLES" "${RB[@]}" --rampup-batch-size 4 4
refused "a ramp without --train-samples" "--rampup-batch-size 4 4 32 needs --train-samples" --lr-warmup-iters 0 --rampup-batch-size 4 4 32
refused "a ramp with --lr-warmup-iters" "count iterations, whose size changes under --rampup-batch-size 4 4 32" --train-iters 0 --train-samples 64 --rampup-batch-size 4 4 32
refused "--use-checkpoint-args without --load" "--use-checkpoint-args needs --load" --use-checkpoint-args
refused "--no-load-optim without --load" "--no-load-optim needs --load" --no-load-optim
refused "--full-validation on mock data" "--full-validation needs --data-path (mock data has no end)" --full-validation

[ $fail -eq 0 ] && echo "logging: all passed"
exit $fail
