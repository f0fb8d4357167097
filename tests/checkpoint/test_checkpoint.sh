#!/usr/bin/env bash
# test_checkpoint.sh: checkpoints as a user meets them: save/load per layout, exact resume (bitwise
# on CPU) at 1 rank and TP2 x PP2 x DP2, resharding TP2xPP2 -> TP1 -> TP4 -> TP2xPP2 with equal
# evaluation losses and identical tensors, HF export/import, damaged checkpoints, a save that fails
# half-way, bad --load input, tessera-checkpoint verify (every copy of every tensor), and the
# offline writers' output directories (parents created; a directory holding a checkpoint refused).
# Usage: test_checkpoint.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# vocab 600: padded to 640 at TP1, 768 at TP2, 1024 at TP4, so resharding re-pads.
common=(--config "$configs/gpt2-tiny.ini" --num-layers 4 --hidden-size 32 --num-attention-heads 4
        --seq-length 32 --max-position-embeddings 32 --vocab-size 600 --global-batch-size 8
        --micro-batch-size 2 --log-interval 1 --lr-warmup-iters 2 --threads 1)
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
train() {  # train NP TP PP ARGS...
  local np=$1 tp=$2 pp=$3
  shift 3
  local cmd=("$bin/tessera-train" "${common[@]}" --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" "$@")
  if [ "$np" -gt 1 ]; then timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}"
  else timeout 300 "${cmd[@]}"; fi
}
# records_untimed FILE: each record up to its timings (iteration, samples, loss, lr, grad norm).
records_untimed() { sed 's/"ms_per_iter.*//' "$1"; }
evalloss() { grep -o 'lm loss value: [0-9.E+-]*' | awk '{print $4}'; }
close() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-6 * a) }'; }

# ---- exact resume, bitwise, at 1 rank and at TP2 x PP2 x DP2 ----
for layout in "1 1 1" "8 2 2"; do
  set -- $layout
  np=$1 tp=$2 pp=$3
  d=$work/resume-$np
  train "$np" "$tp" "$pp" --train-iters 12 --metrics-file "$d-full.jsonl" > "$d-full.log" 2>&1 || bad "full run np $np"
  train "$np" "$tp" "$pp" --train-iters 12 --exit-interval 6 --save "$d" > "$d-a.log" 2>&1 || bad "first half np $np"
  train "$np" "$tp" "$pp" --train-iters 12 --load "$d" --save "$d" --metrics-file "$d-res.jsonl" > "$d-b.log" 2>&1 || bad "resumed half np $np"
  if diff <(records_untimed "$d-full.jsonl" | tail -6) <(records_untimed "$d-res.jsonl") > /dev/null && [ "$(wc -l < "$d-res.jsonl")" -eq 6 ]; then
    ok "exact resume at np $np (TP $tp PP $pp): iterations 7-12 bitwise equal to the uninterrupted run"
  else
    bad "resume at np $np differs:"; diff <(records_untimed "$d-full.jsonl" | tail -6) <(records_untimed "$d-res.jsonl") | head -4
  fi
done
[ "$(cat "$work/resume-1/latest_checkpointed_iteration.txt")" = "12" ] && ok "latest points at the end-of-training save (12)" || bad "latest file: $(cat "$work/resume-1/latest_checkpointed_iteration.txt")"

# ---- virtual pipeline stages (interleaved 1F1B) with dropout: exact resume in the same layout,
# resume at 1 rank, and the checkpoint resharded like any other ----
vp=(--num-layers-per-virtual-pipeline-stage 1 --attention-dropout 0.1 --hidden-dropout 0.1)
d=$work/vp
train 2 1 2 "${vp[@]}" --train-iters 12 --metrics-file "$d-full.jsonl" > "$d-full.log" 2>&1 || bad "full run with virtual stages: $(tail -2 "$d-full.log")"
train 2 1 2 "${vp[@]}" --train-iters 12 --exit-interval 6 --save "$d" > "$d-a.log" 2>&1 || bad "first half with virtual stages"
train 2 1 2 "${vp[@]}" --train-iters 12 --load "$d" --metrics-file "$d-res.jsonl" > "$d-b.log" 2>&1 || bad "resumed half with virtual stages"
if diff <(records_untimed "$d-full.jsonl" | tail -6) <(records_untimed "$d-res.jsonl") > /dev/null && [ "$(wc -l < "$d-res.jsonl")" -eq 6 ]; then
  ok "exact resume at PP2 with 2 virtual stages and dropout: iterations 7-12 bitwise equal"
else
  bad "resume with virtual stages differs:"; diff <(records_untimed "$d-full.jsonl" | tail -6) <(records_untimed "$d-res.jsonl") | head -4
fi
train 1 1 1 --attention-dropout 0.1 --hidden-dropout 0.1 --train-iters 12 --load "$d" --metrics-file "$d-one.jsonl" > "$d-c.log" 2>&1 || bad "virtual-stage checkpoint resumed at 1 rank"
worst=$(paste <(sed 's/.*"lm_loss": \([^,]*\),.*/\1/' "$d-full.jsonl" | tail -6) <(sed 's/.*"lm_loss": \([^,]*\),.*/\1/' "$d-one.jsonl") | awk '{ x = $1 - $2; if (x < 0) x = -x; if (x / $1 > w) w = x / $1; n++ } END { print (n == 6 ? w : "missing") }')
awk -v w="$worst" 'BEGIN { exit !(w != "missing" && w <= 1e-5) }' && ok "the virtual-stage checkpoint resumes at 1 rank: iterations 7-12 within $worst" || bad "1-rank resume of the virtual-stage checkpoint: $worst"
"$bin/tessera-reshard" --load "$d" --save "$work/vp-tp2" --target-tensor-model-parallel-size 2 > "$work/rvp.log" 2>&1 || bad "reshard of the virtual-stage checkpoint: $(cat "$work/rvp.log")"
ref=$(train 2 1 2 --num-layers-per-virtual-pipeline-stage 1 --load "$d" --skip-train --eval-iters 2 2>&1 | evalloss)
got=$(train 2 2 1 --load "$work/vp-tp2" --skip-train --eval-iters 2 2>&1 | evalloss)
close "$ref" "$got" && ok "virtual-stage checkpoint resharded to TP2: eval loss $got (original $ref)" || bad "resharded virtual-stage checkpoint: '$got' vs '$ref'"

# ---- the Llama family (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head, no biases):
# exact resume at TP2 x PP2, resharding to TP1 and back with equal evaluation losses and
# identical tensors, and the model options checked on load ----
llama=(--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
       --ffn-hidden-size 88 --group-query-attention --num-query-groups 2
       --untie-embeddings-and-output-weights --disable-bias-linear)
d=$work/llama
train 4 2 2 "${llama[@]}" --train-iters 10 --metrics-file "$d-full.jsonl" > "$d-full.log" 2>&1 || bad "Llama full run: $(tail -2 "$d-full.log")"
train 4 2 2 "${llama[@]}" --train-iters 10 --exit-interval 5 --save "$d" > "$d-a.log" 2>&1 || bad "Llama first half"
train 4 2 2 "${llama[@]}" --train-iters 10 --load "$d" --metrics-file "$d-res.jsonl" > "$d-b.log" 2>&1 || bad "Llama resumed half"
if diff <(records_untimed "$d-full.jsonl" | tail -5) <(records_untimed "$d-res.jsonl") > /dev/null && [ "$(wc -l < "$d-res.jsonl")" -eq 5 ]; then
  ok "exact resume of the Llama-style model at TP2 x PP2: iterations 6-10 bitwise equal"
else
  bad "Llama resume differs:"; diff <(records_untimed "$d-full.jsonl" | tail -5) <(records_untimed "$d-res.jsonl") | head -4
fi
"$bin/tessera-reshard" --load "$d" --save "$d-tp1" --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1 > "$d-r1.log" 2>&1 || bad "Llama reshard to TP1: $(cat "$d-r1.log")"
"$bin/tessera-reshard" --load "$d-tp1" --save "$d-back" --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 > "$d-r2.log" 2>&1 || bad "Llama reshard back"
ref=$(train 4 2 2 "${llama[@]}" --load "$d" --skip-train --eval-iters 2 2>&1 | evalloss)
got=$(train 1 1 1 "${llama[@]}" --load "$d-tp1" --skip-train --eval-iters 2 2>&1 | evalloss)
close "$ref" "$got" && ok "Llama checkpoint resharded to one rank: eval loss $got (TP2xPP2: $ref)" || bad "Llama resharded eval loss '$got' vs '$ref'"
got=$(train 2 2 1 "${llama[@]}" --load "$d" --skip-train --eval-iters 2 2>&1 | evalloss)
close "$ref" "$got" && ok "Llama checkpoint resharded on load to TP2 x PP1: eval loss $got" || bad "Llama reshard-on-load eval loss '$got' vs '$ref'"
same=1
for f in "$d"/iter_0000005/*.h5; do
  h5diff -q "$f" "$d-back/iter_0000005/$(basename "$f")" /model /model > /dev/null 2>&1 || same=0
  h5diff -q "$f" "$d-back/iter_0000005/$(basename "$f")" /optimizer /optimizer > /dev/null 2>&1 || same=0
done
[ $same -eq 1 ] && ok "Llama TP2xPP2 -> TP1 -> TP2xPP2 gives bitwise identical tensors" || bad "Llama round trip changed tensors"
out=$(train 1 1 1 "${llama[@]/RMSNorm/LayerNorm}" --load "$d" --skip-train --eval-iters 1 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "has --normalization=RMSNorm but this run has LayerNorm" <<<"$out" && ok "loading with another normalization: one clear line" || bad "normalization mismatch on load: rc $rc: $out"
no_swiglu=()
for a in "${llama[@]}"; do [ "$a" = --swiglu ] || no_swiglu+=("$a"); done
out=$(train 1 1 1 "${no_swiglu[@]}" --load "$d" --skip-train --eval-iters 1 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "was trained with --swiglu (gate and up weights in mlp.fc1) but this run does not" <<<"$out" && ok "loading without --swiglu: one clear line" || bad "swiglu mismatch on load: rc $rc: $out"

# ---- save/load per layout and resharding ----
src=$work/tp2pp2
train 4 2 2 --train-iters 8 --save "$src" > "$work/src.log" 2>&1 || bad "training at TP2 x PP2"
"$bin/tessera-reshard" --load "$src" --save "$work/tp1" --target-tensor-model-parallel-size 1 > "$work/r1.log" 2>&1 || bad "reshard to TP1: $(cat "$work/r1.log")"
"$bin/tessera-reshard" --load "$work/tp1" --save "$work/tp4" --target-tensor-model-parallel-size 4 > "$work/r4.log" 2>&1 || bad "reshard to TP4"
"$bin/tessera-reshard" --load "$work/tp4" --save "$work/back" --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 > "$work/rb.log" 2>&1 || bad "reshard back to TP2 x PP2"
grep -q "padded to 1024" "$work/r4.log" && ok "TP4 re-pads the vocabulary (600 -> 1024)" || bad "no re-padding in: $(head -1 "$work/r4.log")"
ref=$(train 4 2 2 --load "$src" --skip-train --eval-iters 2 2>&1 | evalloss)
for case in "tp1 1 1 1" "tp4 4 4 1" "back 4 2 2" "tp1 2 1 2" "tp2pp2 2 2 1"; do
  set -- $case
  name=$1 np=$2 tp=$3 pp=$4
  got=$(train "$np" "$tp" "$pp" --load "$work/$name" --skip-train --eval-iters 2 2>&1 | evalloss)
  close "$ref" "$got" && ok "eval loss of $name loaded at TP $tp x PP $pp: $got (TP2xPP2 original: $ref)" \
                      || bad "eval loss of $name at TP $tp x PP $pp: '$got' vs '$ref'"
done
same=1
for f in "$src"/iter_0000008/*.h5; do
  h5diff -q "$f" "$work/back/iter_0000008/$(basename "$f")" /model /model > /dev/null 2>&1 || same=0
  h5diff -q "$f" "$work/back/iter_0000008/$(basename "$f")" /optimizer /optimizer > /dev/null 2>&1 || same=0
done
[ $same -eq 1 ] && ok "TP2xPP2 -> TP1 -> TP4 -> TP2xPP2 gives bitwise identical model and optimizer tensors" || bad "round trip changed tensors"
out=$(train 1 1 1 --swiglu --load "$src" --skip-train --eval-iters 1 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "was trained without --swiglu (no gate weights in mlp.fc1) but this run gives it" <<<"$out" && ok "--swiglu with a checkpoint without gate weights: one clear line" || bad "--swiglu on a GPT-2 checkpoint: rc $rc: $out"
# Training continues at another layout from the resharded checkpoint.
train 1 1 1 --train-iters 10 --load "$work/tp1" > "$work/cont.log" 2>&1 && grep -q "iteration       10/" "$work/cont.log" \
  && ok "training continues on 1 rank from the TP1 checkpoint" || bad "continue from tp1: $(tail -2 "$work/cont.log")"

# ---- Hugging Face export and import ----
"$bin/tessera-convert" --to-hf --load "$src" --save "$work/hf" > /dev/null 2>&1 || bad "export to HF"
"$bin/tessera-convert" --from-hf "$work/hf" --save "$work/fromhf" --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 > /dev/null 2>&1 || bad "import from HF"
same=1
for f in "$src"/iter_0000008/*.h5; do
  h5diff -q "$f" "$work/fromhf/iter_0000000/$(basename "$f")" /model /model > /dev/null 2>&1 || same=0
done
[ $same -eq 1 ] && ok "HF export then import at TP2 x PP2 gives identical tensors" || bad "HF round trip changed tensors"
grep -q '"n_embd": 32' "$work/hf/config.json" && grep -q '"vocab_size": 600' "$work/hf/config.json" && ok "config.json" || bad "config.json: $(cat "$work/hf/config.json")"

# ---- the offline writers' outputs: parents created; a run is never moved back; bad input rc 2 ----
"$bin/tessera-convert" --to-hf --load "$src" --save "$work/new/a/hf" > /dev/null 2>&1 && [ -f "$work/new/a/hf/model.safetensors" ] \
  && "$bin/tessera-convert" --from-hf "$work/hf" --save "$work/new/b/ckpt" > /dev/null 2>&1 && [ -f "$work/new/b/ckpt/iter_0000000/mp_rank_00_000.h5" ] \
  && "$bin/tessera-reshard" --load "$src" --save "$work/new/c/ckpt" > /dev/null 2>&1 && [ -f "$work/new/c/ckpt/iter_0000008/mp_rank_00_000.h5" ] \
  && ok "--to-hf, --from-hf and tessera-reshard create the parents of --save" || bad "output parents: $(ls -R "$work/new" | head -5)"
out=$("$bin/tessera-convert" --from-hf "$work/hf" --save "$src" 2>&1); rc=$?
if [ $rc -eq 2 ] && grep -q "error: --save '$src' already holds a checkpoint (latest iteration 8); writing iteration 0 there would make it the latest" <<<"$out" \
   && [ "$(cat "$src/latest_checkpointed_iteration.txt")" = 8 ] && [ ! -e "$src/iter_0000000" ]; then
  ok "--from-hf into the run at iteration 8 refused, rc 2, latest still 8: $out"
else
  bad "--from-hf into a run: rc $rc, latest $(cat "$src/latest_checkpointed_iteration.txt"), $(ls "$src"): $out"
fi
out=$("$bin/tessera-reshard" --load "$src" --save "$src/iter_0000008/tp1" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "is or contains the checkpoint being read" <<<"$out" && [ ! -e "$src/iter_0000008/tp1" ] \
  && ok "tessera-reshard --save inside the source: rc 2, nothing written" || bad "reshard into its source: rc $rc: $out"

# ---- tessera-checkpoint verify: every tensor of every file, replicated copies included ----
figures=$(for f in "$src"/iter_0000008/*.h5; do h5ls -r "$f"; done | awk '/ Dataset / { s = $0; sub(/.* Dataset \{/, "", s); sub(/\}.*/, "", s)
  n = split(s, d, ", "); p = 1; for (i = 1; i <= n; i++) p *= d[i]; t++; b += 4 * p } END { print t " tensors, " b " bytes" }')
out=$("$bin/tessera-checkpoint" verify "$src" 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q "verified $src/iter_0000008 (iteration 8, TP 2 x PP 2): 4 files, $figures checked in .*: clean$" <<<"$out" \
  && ok "verify of the TP2 x PP2 checkpoint: clean, 4 files, $figures (h5ls)" || bad "verify of a clean checkpoint: rc $rc, h5ls: $figures: $out"
cp -r "$src" "$work/bit"
"$bin/test_checkpoint_tool" flip-bit "$work/bit/iter_0000008/mp_rank_01_000.h5" /model/layers.0.ln1.weight > /dev/null || bad "could not flip a bit"
out=$("$bin/tessera-checkpoint" verify "$work/bit" 2>&1); rc=$?
[ $rc -eq 1 ] && [ "$(grep -c "^$work/bit/iter_0000008/mp_rank_01_000.h5: /model/layers.0.ln1.weight: checksum mismatch" <<<"$out")" = 1 ] \
  && grep -q "4 files, $figures checked in .*: 1 problem (damaged)$" <<<"$out" \
  && ok "verify finds one flipped bit in TP rank 1's copy of a replicated LayerNorm weight, rc 1" || bad "verify of a flipped bit: rc $rc: $out"
out=$("$bin/tessera-checkpoint" verify "$work/no-such-dir" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "error: '$work/no-such-dir' is not a directory" <<<"$out" && ok "verify of a missing directory: rc 2" || bad "verify of a missing directory: rc $rc: $out"

# ---- damaged checkpoints: one clear line naming the file, exit 2, nothing overwritten ----
expect_error() {  # expect_error DESCRIPTION PATTERN CKPT
  local out rc
  out=$(train 1 1 1 --load "$3" --skip-train --eval-iters 1 2>&1)
  rc=$?
  if [ $rc -ne 0 ] && grep -qE -- "$2" <<<"$out"; then ok "$1 -> rc $rc: $(grep -m1 'error:' <<<"$out")"
  else bad "$1: rc $rc, output: $(tail -3 <<<"$out")"; fi
}
cp -r "$work/tp1" "$work/trunc"
f=$work/trunc/iter_0000008/mp_rank_00_000.h5
truncate -s $(( $(stat -c %s "$f") / 2 )) "$f"
expect_error "truncated file" "mp_rank_00_000.h5" "$work/trunc"
cp -r "$work/tp1" "$work/flip"
f=$work/flip/iter_0000008/mp_rank_00_000.h5
"$bin/test_checkpoint_tool" flip-byte "$f" /model/layers.1.mlp.fc1.weight > /dev/null || bad "could not flip a byte"
expect_error "flipped byte" "checksum|corrupt" "$work/flip"
cp -r "$work/tp1" "$work/ver"
# Rewrite the format_version attribute with the small helper built for this test.
"$bin/test_checkpoint_tool" set-version "$work/ver/iter_0000008/mp_rank_00_000.h5" 99 || bad "could not edit the version"
expect_error "wrong format version" "format_version 99" "$work/ver"
# A split offset at the top of int64 (found by fuzz_checkpoint: offset + extent overflowed).
cp -r "$src" "$work/offset"
"$bin/test_checkpoint_tool" set-attr "$work/offset/iter_0000008/mp_rank_00_000.h5" \
  /model/layers.0.mlp.fc1.weight split_offset 9223372036854775807 || bad "could not edit split_offset"
expect_error "split offset 2^63-1" "layers.0.mlp.fc1.weight stores .* at offset 9223372036854775807 .* do not fit together" "$work/offset"
# A damaged iteration attribute in the first file is blamed on that file (loading and verify).
cp -r "$src" "$work/iterattr"
"$bin/test_checkpoint_tool" set-attr "$work/iterattr/iter_0000008/mp_rank_00_000.h5" / iteration 5 || bad "could not edit the iteration"
expect_error "iteration attribute of mp_rank_00_000.h5 damaged" "file '$work/iterattr/iter_0000008/mp_rank_00_000.h5' has iteration 5 but lies in iter_0000008" "$work/iterattr"
out=$("$bin/tessera-checkpoint" verify "$work/iterattr" 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "^$work/iterattr/iter_0000008/mp_rank_00_000.h5: attribute iteration is 5, but its directory is iter_0000008$" <<<"$out" \
  && ok "verify names the damaged iteration attribute, rc 1" || bad "verify of the iteration attribute: rc $rc: $out"
# Every file recording TP 1 while TP rank 1's files are there: refused, not loaded half-zero.
cp -r "$src" "$work/tpattr"
for f in "$work/tpattr"/iter_0000008/*.h5; do "$bin/test_checkpoint_tool" set-attr "$f" / tensor_model_parallel_size 1 || bad "could not edit the TP size"; done
expect_error "layout attributes of every file damaged alike" "holds mp_rank_01_000.h5, outside the layout TP 1 x PP 2 its files record" "$work/tpattr"
cp -r "$src" "$work/missing"
rm "$work/missing/iter_0000008/mp_rank_01_001.h5"
expect_error "missing shard" "missing shard file .*mp_rank_01_001.h5" "$work/missing"
# An empty directory is a first run's (it starts fresh: tests/app/test_megatron_script.sh); an
# iteration directory without the latest file is a damaged checkpoint.
mkdir -p "$work/nolatest/iter_0000008"
expect_error "no latest file" "no latest_checkpointed_iteration.txt" "$work/nolatest"
out=$("$bin/tessera-train" --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
      --max-position-embeddings 32 --vocab-size 600 --load "$src" --skip-train 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "hidden-size=32 but this run has 64" <<<"$out" && ok "another model shape -> rc 2" || bad "shape mismatch: rc $rc $out"

# ---- a save that fails half-way on one rank leaves the previous checkpoint loadable ----
d=$work/faulty
out=$(TESSERA_FAULT_SAVE_RANK=1:10 train 2 2 1 --train-iters 12 --save "$d" --save-interval 5 2>&1); rc=$?
if [ $rc -ne 0 ] && [ "$(cat "$d/latest_checkpointed_iteration.txt")" = "5" ] && [ ! -e "$d/iter_0000010" ] && [ ! -e "$d/iter_0000010.tmp" ]; then
  ok "save failing on rank 1 at iteration 10: job exits $rc, latest stays 5, no partial iter_0000010"
else
  bad "faulty save: rc $rc, latest $(cat "$d/latest_checkpointed_iteration.txt" 2>/dev/null), $(ls "$d")"
fi
train 2 2 1 --train-iters 6 --load "$d" > "$work/after.log" 2>&1 && grep -q "loaded checkpoint.*iteration 5" "$work/after.log" \
  && ok "the previous checkpoint (5) loads after the failed save" || bad "load after failed save: $(tail -2 "$work/after.log")"

[ $fail -eq 0 ] && echo "checkpoints: all passed"
exit $fail
