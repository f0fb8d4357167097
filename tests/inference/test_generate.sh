#!/usr/bin/env bash
# test_generate.sh: tessera-generate and tessera-eval as a user runs them: the KV cache gives the
# same greedy tokens as recomputation; TP2, PP2 and TP2xPP2 give the same tokens as TP1; a seed
# reproduces sampling in any layout; top-k 1 is greedy; batched prompts of different lengths match
# the prompts run alone; tessera-eval gives the same loss at every micro-batch size and layout;
# bad input is refused with a clear message.
# Usage: test_generate.sh BIN_DIR CONFIG_DIR VOCAB_DIR
set -u
bin=$1
configs=$2
vocab=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
mpi() { local np=$1; shift; timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "$@"; }
"$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --num-layers 4 --train-iters 40 --threads 1 \
  --save "$work/ck" > "$work/train.log" 2>&1 || { bad "training the model: $(tail -2 "$work/train.log")"; exit 1; }
gen() { "$bin/tessera-generate" --load "$work/ck" --threads 1 "$@" 2>/dev/null; }
P=(--prompt-ids "5 17 42" --max-new-tokens 24)
greedy=$(gen "${P[@]}" --greedy)
[ "$(wc -w <<<"$greedy")" -eq 28 ] && ok "greedy: $greedy" || bad "greedy output: '$greedy'"
[ "$(gen "${P[@]}" --greedy --no-kv-cache)" = "$greedy" ] && ok "KV cache == full recompute (greedy, 24 tokens)" || bad "cache differs from recompute"
# bf16 / fp16: weights, activations and KV cache in the compute dtype (CPU: through f32 copies;
# the ids may differ from f32's where two logits are within bf16's rounding, so only their count is
# checked here: test_inference checks the logits against f32's).
for dt in bf16 fp16; do
  out=$(gen "${P[@]}" --greedy --$dt)
  [ "$(wc -w <<<"$out")" -eq 28 ] && ok "--$dt greedy: $out" || bad "--$dt greedy output: '$out'"
done
err=$("$bin/tessera-generate" --load "$work/ck" --threads 1 "${P[@]}" --bf16 --fp16 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && grep -q -- "--bf16 and --fp16 exclude each other" <<<"$err" && ok "--bf16 --fp16 refused" || bad "--bf16 --fp16: rc $rc '$err'"
for l in "2 2 1" "2 1 2" "4 2 2"; do
  set -- $l
  out=$(mpi "$1" "$bin/tessera-generate" --load "$work/ck" --threads 1 "${P[@]}" --greedy \
        --tensor-model-parallel-size "$2" --pipeline-model-parallel-size "$3" 2>/dev/null)
  [ "$out" = "$greedy" ] && ok "TP $2 x PP $3 greedy == TP1" || bad "TP $2 x PP $3 greedy: '$out' vs '$greedy'"
done
S=("${P[@]}" --temperature 0.9 --top-k 50 --top-p 0.95 --seed 7)
s1=$(gen "${S[@]}"); s2=$(gen "${S[@]}")
[ -n "$s1" ] && [ "$s1" = "$s2" ] && ok "seeded sampling is reproducible: $s1" || bad "sampling not reproducible: '$s1' vs '$s2'"
s3=$(mpi 2 "$bin/tessera-generate" --load "$work/ck" --threads 1 "${S[@]}" --tensor-model-parallel-size 2 2>/dev/null)
[ "$s3" = "$s1" ] && ok "seeded sampling at TP2 == TP1" || bad "sampling at TP2: '$s3' vs '$s1'"
[ "$(gen "${P[@]}" --temperature 0.9 --seed 8)" != "$s1" ] && ok "another seed, other tokens" || bad "seed has no effect"
[ "$(gen "${P[@]}" --top-k 1 --seed 99)" = "$greedy" ] && ok "top-k 1 == greedy" || bad "top-k 1 differs from greedy"
batch=$(gen --prompt-ids "5 17 42" --prompt-ids "300" --prompt-ids "9 9 9 9 9 9" --max-new-tokens 24 --greedy)
one=$(gen --prompt-ids "300" --max-new-tokens 24 --greedy)
three=$(gen --prompt-ids "9 9 9 9 9 9" --max-new-tokens 24 --greedy)
if [ "$(sed -n 1p <<<"$batch")" = "[1] $greedy" ] && [ "$(sed -n 2p <<<"$batch")" = "[2] $one" ] && [ "$(sed -n 3p <<<"$batch")" = "[3] $three" ]; then
  ok "a batch of prompts of lengths 3, 1, 6 == each prompt alone"
else
  bad "batched generation differs: $batch / $one / $three"
fi
# The Llama family (configs/llama-tiny.ini: RoPE at the cached positions, grouped-query KV caches of
# 2 key/value heads, RMSNorm, SwiGLU, untied head): cache == recompute, and every layout the same.
"$bin/tessera-train" --config "$configs/llama-tiny.ini" --train-iters 30 --threads 1 \
  --save "$work/llama" > "$work/llama.log" 2>&1 || bad "training llama-tiny: $(tail -2 "$work/llama.log")"
lgen() { "$bin/tessera-generate" --load "$work/llama" --threads 1 "$@" 2>/dev/null; }
lg=$(lgen "${P[@]}" --greedy)
[ "$(wc -w <<<"$lg")" -eq 28 ] && [ "$(lgen "${P[@]}" --greedy --no-kv-cache)" = "$lg" ] \
  && ok "Llama-style model: KV cache == full recompute (greedy): $lg" || bad "Llama cache vs recompute: '$lg'"
for l in "2 2 1" "4 2 2"; do
  set -- $l
  out=$(mpi "$1" "$bin/tessera-generate" --load "$work/llama" --threads 1 "${P[@]}" --greedy \
        --tensor-model-parallel-size "$2" --pipeline-model-parallel-size "$3" 2>/dev/null)
  [ "$out" = "$lg" ] && ok "Llama-style model at TP $2 x PP $3: greedy == TP1" || bad "Llama TP $2 x PP $3 greedy: '$out' vs '$lg'"
done
ls1=$(lgen "${S[@]}")
ls2=$(mpi 2 "$bin/tessera-generate" --load "$work/llama" --threads 1 "${S[@]}" --tensor-model-parallel-size 2 2>/dev/null)
[ -n "$ls1" ] && [ "$ls1" = "$ls2" ] && ok "Llama-style model: seeded sampling at TP2 == TP1" || bad "Llama sampling at TP2: '$ls2' vs '$ls1'"
lbatch=$(lgen --prompt-ids "5 17 42" --prompt-ids "9 9 9 9 9 9" --max-new-tokens 24 --greedy)
[ "$(sed -n 1p <<<"$lbatch")" = "[1] $lg" ] && [ "$(sed -n 2p <<<"$lbatch")" = "[2] $(lgen --prompt-ids "9 9 9 9 9 9" --max-new-tokens 24 --greedy)" ] \
  && ok "Llama-style model: batched prompts (RoPE per sequence position) == each alone" || bad "Llama batched generation: $lbatch"

# Qwen2's options (configs/qwen2-tiny.ini: q/k/v biases, tied head) with --kv-channels 24 (KV
# caches of 24-channel heads in a 64-wide model), interleaved rotary pairs and RMSNorm as 1 + w;
# and GPT-2 with squared ReLU: cache == recompute, and TP2, TP2 x PP2 the same as TP1.
for m in "qwen|--config $configs/qwen2-tiny.ini --kv-channels 24 --rotary-interleaved --apply-layernorm-1p" \
         "relu2|--config $configs/gpt2-tiny.ini --squared-relu --apply-layernorm-1p"; do
  IFS='|' read -r name opts <<<"$m"
  "$bin/tessera-train" $opts --train-iters 30 --threads 1 --save "$work/$name" > "$work/$name.log" 2>&1 \
    || { bad "training $name: $(tail -2 "$work/$name.log")"; continue; }
  qg=$("$bin/tessera-generate" --load "$work/$name" --threads 1 "${P[@]}" --greedy 2>/dev/null)
  [ "$(wc -w <<<"$qg")" -eq 28 ] && [ "$("$bin/tessera-generate" --load "$work/$name" --threads 1 "${P[@]}" --greedy --no-kv-cache 2>/dev/null)" = "$qg" ] \
    && ok "$name: KV cache == full recompute (greedy): $qg" || bad "$name cache vs recompute: '$qg'"
  for l in "2 2 1" "4 2 2"; do
    set -- $l
    out=$(mpi "$1" "$bin/tessera-generate" --load "$work/$name" --threads 1 "${P[@]}" --greedy \
          --tensor-model-parallel-size "$2" --pipeline-model-parallel-size "$3" 2>/dev/null)
    [ "$out" = "$qg" ] && ok "$name at TP $2 x PP $3: greedy == TP1" || bad "$name TP $2 x PP $3 greedy: '$out' vs '$qg'"
  done
done
# The options are in the checkpoint: resuming without one of them is one line naming it.
out=$("$bin/tessera-train" --config "$configs/qwen2-tiny.ini" --kv-channels 24 --rotary-interleaved \
      --train-iters 31 --threads 1 --load "$work/qwen" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "was trained with --apply-layernorm-1p (norm weights applied as 1 + w) but this run does not" <<<"$out" \
  && ok "qwen checkpoint without --apply-layernorm-1p: refused" || bad "qwen resume without --apply-layernorm-1p: rc $rc: $(tail -2 <<<"$out")"
out=$("$bin/tessera-train" --config "$configs/qwen2-tiny.ini" --rotary-interleaved --apply-layernorm-1p \
      --train-iters 31 --threads 1 --load "$work/qwen" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "has --kv-channels=24 but this run has 16" <<<"$out" \
  && ok "qwen checkpoint without --kv-channels 24: refused" || bad "qwen resume without --kv-channels: rc $rc: $(tail -2 <<<"$out")"
"$bin/tessera-train" --config "$configs/qwen2-tiny.ini" --kv-channels 24 --rotary-interleaved --apply-layernorm-1p \
  --train-iters 31 --threads 1 --load "$work/qwen" > "$work/qwen-resume.log" 2>&1 \
  && ok "qwen checkpoint resumes with its options" || bad "qwen resume: $(tail -2 "$work/qwen-resume.log")"

# ALiBi (the bias at the cached positions, each TP rank its heads' slopes).
"$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --position-embedding-type alibi --train-iters 30 \
  --threads 1 --save "$work/alibi" > "$work/alibi.log" 2>&1 || bad "training with ALiBi: $(tail -2 "$work/alibi.log")"
ag=$("$bin/tessera-generate" --load "$work/alibi" --threads 1 "${P[@]}" --greedy 2>/dev/null)
[ "$(wc -w <<<"$ag")" -eq 28 ] && [ "$("$bin/tessera-generate" --load "$work/alibi" --threads 1 "${P[@]}" --greedy --no-kv-cache 2>/dev/null)" = "$ag" ] \
  && ok "ALiBi: KV cache == full recompute (greedy): $ag" || bad "ALiBi cache vs recompute: '$ag'"
out=$(mpi 2 "$bin/tessera-generate" --load "$work/alibi" --threads 1 "${P[@]}" --greedy --tensor-model-parallel-size 2 2>/dev/null)
[ "$out" = "$ag" ] && ok "ALiBi at TP2: greedy == TP1" || bad "ALiBi TP2 greedy: '$out' vs '$ag'"

# Bad input.
long=$(seq -s ' ' 1 64)
out=$("$bin/tessera-generate" --load "$work/ck" --prompt-ids "$long" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "prompt 1 has 64 tokens; the context holds 64 positions" <<<"$out" && ok "prompt longer than the context -> rc 2" || bad "long prompt: rc $rc $out"
out=$("$bin/tessera-generate" --load "$work/ck" --prompt-ids "99999999 5" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "prompt 1: token id 99999999 (position 1) is outside the vocabulary of 512 tokens (ids 0 to 511)" <<<"$out" \
  && ok "prompt id outside the vocabulary -> rc 2" || bad "prompt id 99999999: rc $rc $out"
# Beam search and the other generation controls from the command line.
[ "$(gen "${P[@]}" --beam-size 1)" = "$greedy" ] && ok "--beam-size 1 == greedy" || bad "--beam-size 1 differs from greedy"
b4=$(gen "${P[@]}" --beam-size 4 --return-log-probs)
b4tp=$(mpi 4 "$bin/tessera-generate" --load "$work/ck" --threads 1 "${P[@]}" --beam-size 4 --return-log-probs \
       --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 2>/dev/null)
[ "$(sed -n 1p <<<"$b4")" = "$(sed -n 1p <<<"$b4tp")" ] && [ "$(grep -o 'log-probs: [^|]*' <<<"$b4" | wc -w)" -eq 25 ] \
  && ok "--beam-size 4: TP2 x PP2 == 1 rank; 24 log-probs and the beam score: $(grep -o 'beam score.*' <<<"$b4")" \
  || bad "beam search: '$b4' vs TP2 x PP2 '$b4tp'"
d1=$(gen "${P[@]}" --temperature 1.2 --top-p 0.9 --top-p-decay 0.5 --top-p-bound 0.05 --seed 3)
d2=$(gen "${P[@]}" --temperature 1.2 --top-p 0.9 --seed 3)
[ -n "$d1" ] && [ "$d1" != "$d2" ] && ok "--top-p-decay narrows the nucleus: $d1" || bad "top-p decay had no effect: '$d1'"
out=$("$bin/tessera-generate" --load "$work/ck" --prompt-ids "1 2" --top-p 0.5 --top-p-bound 0.7 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q -- "--top-p-bound=0.7 is out of range" <<<"$out" && ok "--top-p-bound above --top-p -> rc 2" || bad "top-p-bound: rc $rc $out"
out=$("$bin/tessera-generate" --load "$work/ck" --prompt-ids "1 2" --top-p 1.5 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q -- "--top-p=1.5 is out of range" <<<"$out" && ok "--top-p 1.5 -> rc 2" || bad "top-p: rc $rc $out"
cp -r "$work/ck" "$work/noweights"
"$bin/test_checkpoint_tool" drop-model "$work/noweights/iter_0000040/mp_rank_00_000.h5"
out=$("$bin/tessera-generate" --load "$work/noweights" --prompt-ids "1 2" 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "has no /model group" <<<"$out" && ok "checkpoint without model weights -> rc $rc" || bad "no weights: rc $rc $out"
out=$("$bin/tessera-generate" --load "$work/ck" --prompt "hello" --vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "vocabulary has 512 tokens, the tokenizer" <<<"$out" && ok "tokenizer/model vocabulary mismatch -> rc 2" || bad "vocab mismatch: rc $rc $out"
out=$("$bin/tessera-generate" --load "$work/ck" --prompt "hello" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "the checkpoint's model has a vocabulary of 512 tokens, not GPT-2's (the default tokenizer): give the tokenizer it was trained with" <<<"$out" &&
  ok "the default tokenizer on a 512-token model -> rc 2, no download advice" || bad "default tokenizer: rc $rc $out"
out=$("$bin/tessera-generate" --load "$work/ck" --prompt-ids "1 2 3" --max-new-tokens 50000 --greedy --threads 1 2>&1 >/dev/null); rc=$?
[ $rc -eq 0 ] && grep -q "warning: --max-new-tokens 50000: the longest prompt (3 tokens) leaves room for" <<<"$out" &&
  ok "--max-new-tokens beyond the context: generated, with a warning" || bad "max-new-tokens cap: rc $rc $out"

# tessera-eval: a small real corpus, every sample of the valid split exactly once.
for i in $(seq 1 400); do echo "{\"text\": \"Line $i: the cat sat on the mat number $((i * 7 % 13)), and the dog ran.\"}"; done > "$work/c.jsonl"
"$bin/tessera-preprocess" --input "$work/c.jsonl" --vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe" \
  --output-prefix "$work/c" --workers 2 > /dev/null || bad "preprocess"
"$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --num-layers 2 --seq-length 32 --max-position-embeddings 32 \
  --data-path "$work/c" --split 80,20,0 --train-iters 5 --threads 1 --save "$work/cc" > "$work/t2.log" 2>&1 || bad "training on the corpus: $(tail -2 "$work/t2.log")"
ev() { grep -o 'loss [0-9.]*' | awk '{print $2}'; }
e1=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --threads 1 2>&1)
l1=$(ev <<<"$e1")
l2=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --micro-batch-size 7 --threads 1 2>&1 | ev)
l3=$(mpi 2 "$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --tensor-model-parallel-size 2 --threads 1 2>/dev/null | ev)
l4=$(mpi 2 "$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --micro-batch-size 3 --threads 1 2>/dev/null | ev)
l5=$(mpi 2 "$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --context-parallel-size 2 --threads 1 2>/dev/null | ev)
close() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-6 * a) }'; }
if close "$l1" "$l2" && close "$l1" "$l3" && close "$l1" "$l4" && close "$l1" "$l5"; then
  ok "tessera-eval: same loss at micro-batch 4, 7, TP2, DP2 x micro-batch 3 and CP2: $l1 ($(grep -o '[0-9]* samples, [0-9]* tokens' <<<"$e1"))"
else
  bad "tessera-eval losses differ: $l1 $l2 $l3 $l4 $l5"
fi
samples=$(grep -o '[0-9]* samples' <<<"$e1" | awk '{print $1}')
tokens=$(grep -o '[0-9]* tokens evaluated' <<<"$e1" | awk '{print $1}')
[ -n "$samples" ] && [ "$tokens" = "$((samples * 32))" ] && ok "every valid sample once: $samples samples x 32 = $tokens tokens" || bad "counts: $e1"
# --seq-length: evaluation at another context than training (at most the model's positions).
e16=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --threads 1 --seq-length 16 2>&1)
s16=$(grep -o '[0-9]* samples' <<<"$e16" | awk '{print $1}')
t16=$(grep -o '[0-9]* tokens evaluated' <<<"$e16" | awk '{print $1}')
l16=$(ev <<<"$e16")
[ -n "$s16" ] && [ "$s16" -gt "$samples" ] && [ "$t16" = "$((s16 * 16))" ] && ! close "$l16" "$l1" \
  && ok "--seq-length 16: $s16 samples x 16 = $t16 tokens, loss $l16 (32: $l1)" || bad "eval --seq-length 16: $e16"
out=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --seq-length 64 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q -- "--seq-length=64 is out of range: the model of '.*' has 32 positions" <<<"$out" \
  && ok "eval --seq-length above the positions -> rc 2" || bad "eval --seq-length 64: rc $rc $out"
short=$(gen "${P[@]}" --greedy --seq-length 8)
[ "$(wc -w <<<"$short")" -eq 9 ] && [ "${greedy#"$short"}" != "$greedy" ] \
  && ok "generate --seq-length 8: 5 new tokens, the greedy run's first ones: $short" || bad "generate --seq-length 8: '$short' vs '$greedy'"
out=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 100,0,0 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "valid split" <<<"$out" && ok "empty valid split -> rc 2" || bad "empty split: rc $rc $out"
# The --data-path forms training takes: `1.0 PREFIX`, a blend (two copies of the corpus, equal
# weights: each gives its valid split once, so the loss is the same over twice the samples), the
# split's own --valid-data-path; --eval-iters N: the samples training's evaluation draws.
for f in "$work"/c_*.h5; do cp "$f" "$work/c2${f#"$work"/c}"; done
lw=$("$bin/tessera-eval" --load "$work/cc" --data-path 1.0 "$work/c" --split 80,20,0 --threads 1 2>&1 | ev)
eb=$("$bin/tessera-eval" --load "$work/cc" --data-path 0.5 "$work/c" 0.5 "$work/c2" --split 80,20,0 --threads 1 2>&1)
lb=$(ev <<<"$eb")
sb=$(grep -o '[0-9]* samples' <<<"$eb" | awk '{print $1}')
close "$l1" "$lw" && close "$l1" "$lb" && [ "$sb" = "$((2 * samples))" ] \
  && ok "eval --data-path '1.0 PREFIX' and a blend of two copies: loss $lw / $lb over $samples / $sb samples" \
  || bad "eval data-path forms: $l1 vs '$lw' / '$lb' ($eb)"
lv=$("$bin/tessera-eval" --load "$work/cc" --valid-data-path "$work/c" --threads 1 2>&1 | ev)
lvs=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 0,100,0 --threads 1 2>&1 | ev)
[ -n "$lv" ] && [ "$lv" = "$lvs" ] && ok "eval --valid-data-path PREFIX == --split 0,100,0: $lv" || bad "eval --valid-data-path: '$lv' vs '$lvs'"
ei=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --threads 1 --eval-iters 3 \
  --global-batch-size 8 --micro-batch-size 4 2>&1)
li=$(ev <<<"$ei")
lt=$("$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --num-layers 2 --seq-length 32 --max-position-embeddings 32 \
  --data-path "$work/c" --split 80,20,0 --threads 1 --load "$work/cc" --skip-train --eval-iters 3 \
  --global-batch-size 8 --micro-batch-size 4 2>&1 | grep -o 'lm loss value: [0-9.E+-]*' | awk '{printf "%.9f", $4}')
grep -q "24 samples, 768 tokens evaluated (3 batches of 8)" <<<"$ei" && close "$li" "$lt" \
  && ok "eval --eval-iters 3: 24 samples, loss $li == tessera-train --skip-train --eval-iters 3: $lt" \
  || bad "eval --eval-iters: '$ei' vs training's '$lt'"
out=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --valid-data-path "$work/c" 2>&1); rc=$?
[ $rc -eq 2 ] && [ "$(wc -l <<<"$out")" -eq 1 ] && grep -q "give either --data-path or the per-split paths" <<<"$out" \
  && ok "eval --data-path with --valid-data-path -> rc 2" || bad "eval both paths: rc $rc $out"
# --eval-iters beyond the split: said (its samples repeat), and the loss still that of the samples.
en=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --split 80,20,0 --threads 1 \
  --eval-iters $((samples + 1)) --global-batch-size 4 --micro-batch-size 4 2>&1)
grep -q "note: --eval-iters $((samples + 1)) x 4 samples = $((4 * samples + 4)) samples, the valid split holds $samples: its samples repeat" <<<"$en" \
  && [ -n "$(ev <<<"$en")" ] && ok "eval --eval-iters beyond the split: a note, and a loss ($(ev <<<"$en"))" || bad "eval beyond the split: $en"
out=$("$bin/tessera-eval" --load "$work/cc" --data-path "$work/c" --eval-iters -1 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q -- "--eval-iters -1 is negative" <<<"$out" && ok "eval --eval-iters -1 -> rc 2" || bad "eval --eval-iters -1: rc $rc $out"
[ $fail -eq 0 ] && echo "generation and evaluation: all passed"
exit $fail
