#!/usr/bin/env bash
# test_blend.sh: Megatron's data blends end to end (issue 28). Three corpora preprocessed with
# GPT-2's BPE; tessera-inspect's dataset of each of 4,000 samples equals an independent
# transcription of build_blending_indices, its text names the corpus it came from, and its tokens
# equal the shard's own; tessera-train on the blend gives the same losses at 1 rank, DP2 and TP2,
# and a resumed run the uninterrupted run's losses bit for bit; per-split paths train and
# evaluate; bad blends are one line, exit 2.
# Usage: test_blend.sh BIN_DIR CONFIG_DIR VOCAB_DIR HF_TOKENIZERS_DIR
set -u
bin=$1
configs=$2
vocab=$3
hf=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric

# Three corpora whose every document starts with its corpus's name in capitals.
python3 - "$work" <<'EOF'
import json, random, sys
random.seed(28)
corpora = {"web": ("the page has links and ads for many people", 300),
           "code": ("def int return for while if else value item", 200),
           "books": ("once upon a time there lived a king and queen", 100)}
for name, (words, n) in corpora.items():
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for i in range(n):
            body = " ".join(random.choice(words.split()) for _ in range(40 + i % 50))
            f.write(json.dumps({"text": f"{name.upper()} {body}"}) + "\n")
EOF
for c in web code books; do
  "$bin/tessera-preprocess" --input "$work/$c.jsonl" --output-prefix "$work/data/$c" \
    --vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe" --append-eod true \
    --workers 1 > "$work/pre.log" 2>&1 || { bad "preprocess $c: $(tail -2 "$work/pre.log")"; exit 1; }
done
# The same web text with another tokenizer (Llama 3's).
"$bin/tessera-preprocess" --input "$work/web.jsonl" --output-prefix "$work/data/web-llama" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/llama3" --append-eod true \
  --workers 1 > "$work/pre.log" 2>&1 || { bad "preprocess llama: $(tail -2 "$work/pre.log")"; exit 1; }

D=$work/data
blend=(0.6 "$D/web" 0.3 "$D/code" 0.1 "$D/books")
model=(--config "$configs/gpt2-tiny.ini" --num-layers 2 --hidden-size 32 --num-attention-heads 4
       --seq-length 32 --max-position-embeddings 32 --lr-warmup-iters 2 --threads 1
       --log-interval 1 --device cpu)

# 1. tessera-inspect: 4,000 samples against the formula, written here again from the issue.
"$bin/tessera-inspect" "${model[@]}" --data-path "${blend[@]}" --global-batch-size 16 \
  --train-iters 250 --samples 0:4000 --json > "$work/inspect.jsonl" 2> "$work/inspect.err"
rc=$?
check=$(python3 - "$work/inspect.jsonl" "$D" <<'EOF'
import json, sys
w = [0.6, 0.3, 0.1]
s = sum(w); w = [x / s for x in w]
count = [0, 0, 0]
names = ["web", "code", "books"]
rows = [json.loads(l) for l in open(sys.argv[1])]
bad = []
if len(rows) != 4000: bad.append(f"{len(rows)} rows")
for i, r in enumerate(rows):
    x = max(i, 1)
    errors = [w[d] * x - count[d] for d in range(3)]
    d = max(range(3), key=lambda k: (errors[k], -k))
    want = {"sample": i, "iteration": i // 16 + 1, "dataset": d,
            "prefix": f"{sys.argv[2]}/{names[d]}", "dataset_sample": count[d]}
    got = {k: r[k] for k in want}
    if got != want: bad.append(f"sample {i}: {got} != {want}"); break
    if len(r["tokens"]) != 33 or not r["documents"]: bad.append(f"sample {i}: {len(r['tokens'])} tokens"); break
    count[d] += 1
print("; ".join(bad[:3]) if bad else f"ok {count}")
EOF
)
[ $rc -eq 0 ] && [[ $check == ok* ]] && ok "inspect --json: 4000 samples in Megatron's blending order (${check#ok })" \
  || bad "inspect --json: rc $rc: $check $(head -c 300 "$work/inspect.err")"

# Text of one iteration: 16 samples, each decoded text from the corpus its header names.
"$bin/tessera-inspect" "${model[@]}" --data-path "${blend[@]}" --global-batch-size 16 \
  --train-iters 250 --iteration 41 > "$work/it41.txt" 2>&1
rc=$?
headers=$(grep -c '^=== sample' "$work/it41.txt")
first=$(grep -m1 '^=== sample' "$work/it41.txt")
mismatch=$(python3 - "$work/it41.txt" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
parts = re.split(r"^=== (.*)$", text, flags=re.M)[1:]
bad, named = 0, 0
for head, body in zip(parts[0::2], parts[1::2]):
    name = re.search(r"dataset \d '[^']*/(\w+)'", head).group(1).upper()
    words = re.findall(r"[A-Z]{3,}", body)
    bad += any(w != name for w in words)
    named += bool(words)
print(bad if named >= 4 else f"only {named} samples hold a corpus name")
EOF
)
[ $rc -eq 0 ] && [ "$headers" = 16 ] && [[ $first == "=== sample 640 | iteration 41 | dataset "* ]] && [ "$mismatch" = 0 ] \
  && ok "inspect --iteration 41: 16 samples from sample 640, each text from the corpus it names" \
  || bad "inspect --iteration: rc $rc, $headers headers, first '$first', $mismatch mismatched: $(head -c 300 "$work/it41.txt")"

# 2. Training on the blend: 1 rank, DP2, TP2 give the same losses; the start-up log has a line
# per dataset.
train() {  # train NAME NP [options]: metrics in $work/NAME.jsonl
  local name=$1 np=$2
  shift 2
  local cmd=("$bin/tessera-train" "${model[@]}" --data-path "${blend[@]}" --global-batch-size 8
             --micro-batch-size 2 --train-iters 12 --metrics-file "$work/$name.jsonl" "$@")
  if [ "$np" -gt 1 ]; then
    timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}" > "$work/$name.log" 2>&1
  else
    timeout 300 "${cmd[@]}" > "$work/$name.log" 2>&1
  fi
}
train one 1; rc1=$?
lines=$(grep -c "^data: dataset [0-2] '$D/[a-z]*', weight 0\.[0-9]*: train split, documents 0-[0-9]* of [0-9]*, [0-9]* tokens, [0-9]* samples of 33 tokens per epoch; [0-9]* drawn over the run" "$work/one.log")
[ $rc1 -eq 0 ] && [ "$lines" = 3 ] && grep -q "^data: a blend of 3 datasets" "$work/one.log" \
  && ok "training on the blend logs one line per dataset" || bad "1-rank run: rc $rc1, $lines lines: $(grep -m4 '^data' "$work/one.log")"
for layout in "dp2 2" "tp2 2 --tensor-model-parallel-size 2"; do
  set -- $layout
  name=$1
  shift
  train "$name" "$@"
  rc=$?
  worst=$(paste <(losses "$work/one.jsonl") <(losses "$work/$name.jsonl") | awk '
    { d = $1 - $2; if (d < 0) d = -d; r = d / $1; if (r > w) w = r; n++ }
    END { if (n != 12) print "missing"; else printf "%.3g", w }')
  [ $rc -eq 0 ] && awk -v w="$worst" 'BEGIN { exit !(w != "missing" && w + 0 <= 1e-5) }' \
    && ok "blend at $name: the 1-rank losses (worst relative difference $worst)" \
    || bad "blend at $name: rc $rc, worst $worst: $(tail -3 "$work/$name.log")"
done

# Resume: stopped after saving at iteration 6, resumed to 12 at DP2: the uninterrupted losses, bit for bit.
train save 1 --save "$work/ckpt" --save-interval 6 --exit-interval 6 && \
  train resumed 1 --load "$work/ckpt" --save "$work/ckpt"
rc=$?
if [ $rc -eq 0 ] && diff <(losses "$work/one.jsonl" | tail -6) <(losses "$work/resumed.jsonl") > /dev/null; then
  ok "a blend run stopped at iteration 6 and resumed has the uninterrupted losses bitwise"
else
  bad "resume: rc $rc: $(losses "$work/one.jsonl" | tail -6 | tr '\n' ' ') vs $(losses "$work/resumed.jsonl" | tr '\n' ' ')"
fi

# 3. Per-split paths: training on a blend, validating on another.
timeout 300 "$bin/tessera-train" "${model[@]}" --train-data-path 0.5 "$D/web" 0.5 "$D/code" \
  --valid-data-path "$D/books" --test-data-path 1 "$D/books" --global-batch-size 8 --micro-batch-size 4 \
  --train-iters 4 --eval-interval 2 --eval-iters 1 > "$work/split.log" 2>&1
rc=$?
[ $rc -eq 0 ] && grep -q "validation loss at iteration 4" "$work/split.log" \
  && grep -q "^data: dataset 1 '$D/code', weight 0.5: train split, documents 0-200 of 200" "$work/split.log" \
  && ok "--train-data-path blend with --valid-data-path and --test-data-path" \
  || bad "per-split paths: rc $rc: $(grep -m3 'data:\|error\|validation' "$work/split.log")"

# 4. Bad input: one line, exit 2.
refuse() {  # refuse DESCRIPTION PATTERN PROGRAM ARGS...
  local what=$1 pattern=$2
  shift 2
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  [ $rc -eq 2 ] && [ "$(wc -l <<<"$out")" -eq 1 ] && grep -q -- "$pattern" <<<"$out" \
    && ok "$what -> exit 2, one line" || bad "$what: rc $rc: $out"
}
T=("$bin/tessera-train" "${model[@]}" --train-iters 2)
I=("$bin/tessera-inspect" "${model[@]}" --global-batch-size 16 --train-iters 250)
refuse "odd number of blend words" "3 words; a blend is pairs of a weight and a prefix" "${T[@]}" --data-path 0.6 "$D/web" 0.4
refuse "negative weight" "the weight -0.4 of '$D/code' must be positive" "${T[@]}" --data-path 0.6 "$D/web" -0.4 "$D/code"
refuse "zero weight" "the weight 0 of '$D/code' must be positive" "${T[@]}" --data-path 0.6 "$D/web" 0 "$D/code"
# A prefix with a space (issue 39): one quoted argument on the command line, and a quoted value in a
# config file's blend; the same losses as the prefix without the space.
mkdir -p "$D/my data" && cp "$D"/web_*.h5 "$D/my data/"
printf 'data-path = 0.5 "%s" 0.5 %s\n' "$D/my data/web" "$D/code" > "$work/space.ini"
"$bin/tessera-train" "${model[@]}" --train-iters 2 --data-path "$D/web" --metrics-file "$work/nospace.jsonl" > /dev/null 2>&1
"$bin/tessera-train" "${model[@]}" --train-iters 2 --data-path "$D/my data/web" --metrics-file "$work/space.jsonl" > "$work/space.log" 2>&1
rc=$?
"$bin/tessera-train" --config "$work/space.ini" "${model[@]:2}" --train-iters 2 > "$work/space-ini.log" 2>&1
rc2=$?
if [ $rc -eq 0 ] && [ $rc2 -eq 0 ] && [ -s "$work/space.jsonl" ] &&
   [ "$(grep -o '"lm_loss": [^,]*' "$work/space.jsonl")" = "$(grep -o '"lm_loss": [^,]*' "$work/nospace.jsonl")" ]; then
  ok "a prefix with a space: as a quoted argument (the same losses) and quoted in a config file's blend"
else
  bad "a prefix with a space: rc $rc / $rc2: $(tail -n 1 "$work/space.log") $(tail -n 1 "$work/space-ini.log")"
fi
refuse "an unclosed quote in a blend" "a quote is not closed" "${T[@]}" --data-path '0.5 "a b 0.5 c'
refuse "the same prefix spelled twice" "the prefix '$D/./web' is given twice (as '$D/web' before)" \
  "${T[@]}" --data-path 0.6 "$D/web" 0.4 "$D/./web"
refuse "a prefix that does not exist" "'$D/nope' names no shards" "${T[@]}" --data-path 0.6 "$D/web" 0.4 "$D/nope"
refuse "two tokenizers in one blend" "the shards of '$D/web-llama' were made with another tokenizer than those of '$D/web'" \
  "${T[@]}" --data-path 0.6 "$D/web" 0.4 "$D/web-llama"
refuse "--valid-data-path of another tokenizer" "the shards of '$D/web-llama' were made with another tokenizer" \
  "${T[@]}" --train-data-path "$D/web" --valid-data-path "$D/web-llama" --eval-interval 1
refuse "--data-path with --train-data-path" "--data-path and --train-data-path both given" \
  "${T[@]}" --data-path "$D/web" --train-data-path "$D/code"
refuse "--split with per-split paths" "with --train-data-path each path is a whole split" \
  "${T[@]}" --train-data-path "$D/web" --split 90,10,0
refuse "inspect: --iteration beyond the run" "--iteration 251 is beyond the run: --train-iters 250" \
  "${I[@]}" --data-path "${blend[@]}" --iteration 251
refuse "inspect: --samples beyond the run" "goes beyond the run's 4000 samples" \
  "${I[@]}" --data-path "${blend[@]}" --samples 3990:4001
refuse "inspect: --iteration and --samples" "give one of --iteration N and --samples A:B" \
  "${I[@]}" --data-path "${blend[@]}" --iteration 2 --samples 0:4
refuse "inspect: --iteration 0" "--iteration 0 is not an iteration (iterations count from 1)" \
  "${I[@]}" --data-path "${blend[@]}" --iteration 0
# A learning-rate option inspect does not use leaves a ramp-up run readable.
if out=$("$bin/tessera-inspect" "${model[@]}" --global-batch-size 16 --rampup-batch-size 4 4 200 \
           --train-samples 4000 --lr-warmup-iters 5 --data-path "${blend[@]}" --iteration 3 2>&1) &&
   grep -q "iteration 3" <<<"$out"; then
  ok "inspect: a ramp-up run with --lr-warmup-iters -> its iteration 3"
else
  bad "inspect with a ramp and --lr-warmup-iters: $(tail -n 2 <<<"$out")"
fi
refuse "inspect: a bad range" "--samples '9:3' is not a range" "${I[@]}" --data-path "${blend[@]}" --samples 9:3
refuse "inspect: no data" "give --data-path" "${I[@]}" --iteration 2
exit $fail
