#!/usr/bin/env bash
# test_megatron_script.sh: a launch script in the shape of Megatron-LM's examples/pretrain_gpt.sh
# (GPT_ARGS / DATA_ARGS / OUTPUT_ARGS, --load = --save from the first run, the tokenizer options,
# a blend of one, the implementation switches) runs unchanged under mpirun; it is killed with -9
# after its first checkpoint and requeued with the same line, and the requeued run ends with the
# uninterrupted run's losses, bit for bit. Also: the tokenizer options are checked against the
# shards; a damaged checkpoint in --load stays an error while an empty directory starts fresh.
# Usage: test_megatron_script.sh BIN_DIR VOCAB_DIR
set -u
bin=$1
vocab=$2
work=$(mktemp -d)
cleanup() {
  pkill -9 -f "tessera-train.*$work" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric

# A corpus of 600 short English-like documents, preprocessed as Megatron's
# tools/preprocess_data.py would be called (the output directory does not exist yet).
python3 - "$work/corpus.jsonl" <<'EOF'
import json, random, sys
random.seed(27)
words = "the a model trains on text of many kinds and learns which word comes next in each line".split()
with open(sys.argv[1], "w") as f:
    for i in range(600):
        f.write(json.dumps({"text": " ".join(random.choice(words) for _ in range(90))}) + "\n")
EOF
"$bin/tessera-preprocess" --input "$work/corpus.jsonl" --output-prefix "$work/data/my-gpt2_text_document" \
  --vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe" --append-eod true --workers 1 \
  > "$work/preprocess.log" 2>&1 || { bad "preprocess: $(tail -2 "$work/preprocess.log")"; exit 1; }

# Bad input to the preprocessor is exit 2 with one line, like every app's (a bad line in a jsonl
# file was exit 1 before).
printf '{"text": "fine"}\n{"text": 5}\n' > "$work/bad.jsonl"
out=$("$bin/tessera-preprocess" --input "$work/bad.jsonl" --output-prefix "$work/bad/x" --workers 1 \
      --vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe" 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "error: .*bad.jsonl:2: expected a string" <<<"$out" && [ ! -e "$work/bad/x_00000.h5" ] \
  && ok "preprocess: a bad jsonl line -> exit 2, one line, no shard" || bad "preprocess bad line: rc $rc: $out"

DATA_PATH=$work/data/my-gpt2_text_document
VOCAB_FILE=$vocab/encoder.json
MERGE_FILE=$vocab/vocab.bpe
GPT_ARGS="
    --num-layers 2
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --micro-batch-size 2
    --global-batch-size 8
    --lr 0.00015
    --train-iters 24
    --lr-decay-iters 20
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --use-flash-attn
    --attention-softmax-in-fp32
"
DATA_ARGS="
    --data-path 1.0 $DATA_PATH
    --tokenizer-type GPT2BPETokenizer
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
"
OUTPUT_ARGS="
    --log-interval 4
    --save-interval 8
    --eval-interval 8
    --eval-iters 2
"
DISTRIBUTED_ARGS="--DDP-impl local --no-async-tensor-model-parallel-allreduce --distributed-backend nccl"

# train CHECKPOINT_PATH LOG [EXTRA...]: the launch line, as a requeued Slurm job runs it each time.
train() {
  local ck=$1 log=$2
  shift 2
  # shellcheck disable=SC2086
  mpirun --oversubscribe --bind-to none -np 2 "$bin/tessera-train" $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS \
    $DISTRIBUTED_ARGS --exit-signal-handler --save "$ck" --load "$ck" \
    --metrics-file "$work/logs/$(basename "$log" .log).jsonl" "$@" > "$log" 2>&1
}
loss_at() {  # METRICS ITERATION: the lm_loss the metrics file logged at that iteration
  python3 -c 'import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get("iteration") == int(sys.argv[2]) and "lm_loss" in d: print(repr(d["lm_loss"]))' "$1" "$2" | tail -1
}

# 1. The uninterrupted run: --load names a directory that does not exist yet.
train "$work/ref" "$work/ref.log"
rc=$?
if [ $rc -eq 0 ] && grep -q "training finished after 24 iterations" "$work/ref.log"; then
  ok "the Megatron-style line trains under mpirun -np 2 (24 iterations)"
else
  bad "reference run: rc $rc: $(tail -3 "$work/ref.log")"
fi
grep -q "holds no checkpoint yet (it does not exist yet): training starts from iteration 0" "$work/ref.log" \
  && ok "--load on an absent directory: one line, a fresh start" || bad "no fresh-start line: $(grep -i load "$work/ref.log" | head -3)"
n=$(grep -c "accepted without effect" "$work/ref.log")
[ "$n" -eq 6 ] && ok "6 implementation options accepted, one line each" || bad "accepted lines: $n ($(grep 'accepted without' "$work/ref.log"))"
grep -q "a blend of one dataset" "$work/ref.log" && ok "--data-path 1.0 PREFIX: a blend of one" || bad "no blend-of-one line"
grep -q "validation loss at iteration 8" "$work/ref.log" && ok "evaluations run" || bad "no evaluation line"

# 2. Killed (-9) after its first checkpoint, then requeued with the same line.
train "$work/run" "$work/run1.log" &
job=$!
for _ in $(seq 1 1200); do
  [ -f "$work/run/latest_checkpointed_iteration.txt" ] && break
  kill -0 $job 2>/dev/null || break
  sleep 0.1
done
pkill -9 -f "tessera-train.*$work/run" 2>/dev/null
wait $job 2>/dev/null
saved=$(cat "$work/run/latest_checkpointed_iteration.txt" 2>/dev/null)
if [ -n "$saved" ] && [ "$saved" -lt 24 ]; then
  ok "killed with -9 after the checkpoint of iteration $saved"
else
  bad "the first run was not killed mid-way (latest: '$saved'): $(tail -2 "$work/run1.log")"
fi
train "$work/run" "$work/run2.log"
rc=$?
[ $rc -eq 0 ] && grep -q "training finished after 24 iterations" "$work/run2.log" \
  && ok "requeued with the same line: resumed and finished" || bad "requeue: rc $rc: $(tail -3 "$work/run2.log")"
grep -q "holds no checkpoint yet" "$work/run2.log" && bad "the requeue started fresh instead of loading"
for it in 12 16 20 24; do
  a=$(loss_at "$work/logs/ref.jsonl" $it)
  b=$(loss_at "$work/logs/run2.jsonl" $it)
  [ -n "$a" ] && [ "$a" = "$b" ] && ok "iteration $it: requeued loss == uninterrupted loss ($a)" \
    || bad "iteration $it: requeued '$b' vs uninterrupted '$a'"
done

# 3. The tokenizer options are checked against the shards' tokenizer.
python3 -c 'import json, sys
d = json.load(open(sys.argv[1])); d["<|extra|>"] = len(d); json.dump(d, open(sys.argv[2], "w"))' \
  "$vocab/encoder.json" "$work/encoder-extra.json"
one() {  # WANT_RC PATTERN ARGS...: one process, a short run
  local want=$1 pattern=$2 out rc
  shift 2
  out=$("$bin/tessera-train" --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --max-position-embeddings 64 --train-iters 2 --threads 1 "$@" 2>&1)
  rc=$?
  if [ $rc -eq "$want" ] && grep -qE -- "$pattern" <<<"$out"; then ok "$pattern"; else bad "$* -> rc $rc: $out"; fi
}
one 2 "error: the tokenizer of --vocab-file '.*encoder-extra.json' / --merge-file '.*' \\('gpt2-bpe', 50258 tokens\\) is not the one the shards of --data-path '.*' were made with \\('gpt2-bpe', 50257 tokens\\)" \
  --data-path "$DATA_PATH" --vocab-file "$work/encoder-extra.json" --merge-file "$MERGE_FILE"
one 2 "error: --tokenizer-type HuggingFaceTokenizer is not the tokenizer the shards of --data-path '.*' were made with \\(GPT2BPETokenizer, 'gpt2-bpe'\\)" \
  --data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer
one 0 "vocab 50257" --data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
one 0 "mock data over the 50257 tokens of the tokenizer options" --mock-data --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"

# 4. --load: an empty directory starts fresh; a damaged checkpoint there stays an error.
mkdir -p "$work/empty"
one 0 "--load '.*empty' holds no checkpoint yet \\(it is empty\\)" --mock-data --load "$work/empty"
mkdir -p "$work/damaged/iter_0000008"
one 2 "error: --load '.*damaged' has no latest_checkpointed_iteration.txt" --mock-data --load "$work/damaged"
mkdir -p "$work/badlatest" && echo "eight" > "$work/badlatest/latest_checkpointed_iteration.txt"
one 2 "error: '.*badlatest/latest_checkpointed_iteration.txt' does not hold an iteration number" --mock-data --load "$work/badlatest"

[ $fail -eq 0 ] && echo "megatron script: all passed"
exit $fail
