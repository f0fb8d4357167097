#!/usr/bin/env bash
# test_loss_mask.sh: loss masks in the shards (issue 40 point 2). Shards written the h5py way
# with /loss_mask (prompt tokens 0, answer tokens and EOD 1) train with the same losses at 1 rank,
# TP2 + SP, PP2 interleaved, DP2 with the distributed optimizer and CP2; a blend mixes masked and
# unmasked shards; --calculate-per-token-loss does not depend on the micro-batch size while
# Megatron's default mean per micro-batch does; a micro-batch without a counted token is said once
# and trains on (no NaN); a mask of another length or a value other than 0/1 is one line, exit 2.
# --sft packs whole conversations (the same losses at TP2 + SP, PP2, DP2, CP2, CP4, TP2 x CP2;
# resumed bit for bit; long documents cut and counted, or refused with --sft-no-truncate).
# Usage: test_loss_mask.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3
"$py" -c "import h5py, numpy" || { echo "FAIL: python3-h5py and python3-numpy are needed (scripts/setup.sh installs them)"; exit 1; }

# write.py OUT [mask=yes|no|short|two] [silent=N]: 500 documents over a 200-token vocabulary (eod
# 199), each a "prompt" of 3-12 tokens (mask 0) and an "answer" of 3-12 tokens counting up from
# the prompt's last token (mask 1), then EOD (mask 1). silent=N: every N-th document is a
# 90-token prompt with no answer (a whole sample without a counted token). mask=short drops the
# last mask entry; mask=two writes a 2 into document 7.
cat > "$work/write.py" <<'PY'
import sys
import h5py
import numpy as np
out = sys.argv[1]
opts = dict(a.split("=", 1) for a in sys.argv[2:])
rng = np.random.default_rng(int(opts.get("seed", 2)))
silent = int(opts.get("silent", 0))
toks, mask, offsets = [], [], [0]
for d in range(500):
    if silent and d % silent == 0:
        p = list(rng.integers(0, 199, 90)); a = []
    else:
        p = list(rng.integers(0, 199, int(rng.integers(3, 13))))
        a = [(p[-1] + 1 + i) % 199 for i in range(int(rng.integers(3, 13)))]
    toks += p + a + [199]
    mask += [0] * len(p) + [1] * (len(a) + 1)
    offsets.append(len(toks))
m = np.array(mask, dtype=np.uint8)
if opts.get("mask") == "short":
    m = m[:-1]
if opts.get("mask") == "two":
    m[offsets[7] + 1] = 2
with h5py.File(out, "w") as f:
    f.create_dataset("tokens", data=np.array(toks, dtype=np.int64), chunks=(4096,), compression="gzip")
    f.create_dataset("doc_offsets", data=np.array(offsets, dtype=np.int64))
    if opts.get("mask", "yes") != "no":
        f.create_dataset("loss_mask", data=m)
    for k, v in {"vocab_size": 200, "eod_id": 199, "tokenizer": "synthetic", "format_version": 1}.items():
        f.attrs[k] = v
PY
"$py" "$work/write.py" "$work/chat_00000.h5" || exit 1
"$py" "$work/write.py" "$work/plain_00000.h5" mask=no seed=3 || exit 1
"$py" "$work/write.py" "$work/silent_00000.h5" silent=2 || exit 1
"$py" "$work/write.py" "$work/short_00000.h5" mask=short || exit 1
"$py" "$work/write.py" "$work/two_00000.h5" mask=two || exit 1

common=(--config "$configs/gpt2-tiny.ini" --num-layers 4 --hidden-size 32 --num-attention-heads 4
        --seq-length 32 --max-position-embeddings 32 --vocab-size 0 --global-batch-size 8
        --train-iters 20 --log-interval 1 --lr-warmup-iters 2 --threads 1 --device cpu
        --split 100,0,0 --eval-interval 0 --position-embedding-type rope)
# shellcheck source=layout_runs.sh
source "$(dirname "$0")/layout_runs.sh"  # run, worst, within
differ() {  # differ A B DESCRIPTION: some loss differs by more than 1e-4 relative
  local w
  w=$(worst "$1" "$2")
  [ "$w" != missing ] && awk -v w="$w" 'BEGIN { exit !(w > 1e-4) }' && ok "$3 (up to $w relative)" \
    || bad "$3: worst difference only $w"
}

D=(--data-path "$work/chat")
run plain 1 --data-path "$work/plain" --micro-batch-size 2 || exit 1
run base 1 "${D[@]}" --micro-batch-size 2 || exit 1
# The prompts are random, the answers count up: with only the answers counted the loss falls far
# below the plain corpus's (all tokens counted, half of them random).
first=$(losses "$work/base.jsonl" | head -1); last=$(losses "$work/base.jsonl" | tail -1)
plast=$(losses "$work/plain.jsonl" | tail -1)
awk -v a="$first" -v b="$last" -v p="$plast" 'BEGIN { exit !(b < a - 0.4 && b < p - 0.2) }' \
  && ok "masked answers: loss $first -> $last (the unmasked corpus: $plast)" \
  || bad "masked training: $first -> $last, unmasked $plast"
run tp2-sp 2 "${D[@]}" --micro-batch-size 2 --tensor-model-parallel-size 2 --sequence-parallel \
  && within base tp2-sp "TP2 + sequence parallelism"
run pp2-vp 2 "${D[@]}" --micro-batch-size 2 --pipeline-model-parallel-size 2 \
  --num-layers-per-virtual-pipeline-stage 1 && within base pp2-vp "PP2, interleaved"
run dp2-distopt 2 "${D[@]}" --micro-batch-size 2 --use-distributed-optimizer \
  && within base dp2-distopt "DP2, distributed optimizer"
run cp2 2 "${D[@]}" --micro-batch-size 2 --context-parallel-size 2 && within base cp2 "CP2"
run docs 1 "${D[@]}" --micro-batch-size 2 --reset-position-ids --reset-attention-mask --eod-mask-loss \
  && run docs-tp2 2 "${D[@]}" --micro-batch-size 2 --reset-position-ids --reset-attention-mask \
       --eod-mask-loss --tensor-model-parallel-size 2 --sequence-parallel \
  && within docs docs-tp2 "masks with the three document options, TP2 + SP"

# Megatron's default objective depends on how the global batch is cut into micro-batches when the
# counts differ; the per-token loss does not.
run mbs1 1 "${D[@]}" --micro-batch-size 1 && differ base mbs1 "the default mean per micro-batch: micro-batch 1 vs 2 differ"
run tok2 1 "${D[@]}" --micro-batch-size 2 --calculate-per-token-loss \
  && run tok1 1 "${D[@]}" --micro-batch-size 1 --calculate-per-token-loss \
  && within tok2 tok1 "--calculate-per-token-loss, micro-batch 1 vs 2" && differ base tok2 "per token vs per micro-batch"

# A blend of masked and unmasked shards (the unmasked one counts every token).
run blend 1 --data-path 0.5 "$work/chat" 0.5 "$work/plain" --micro-batch-size 2 \
  && run blend-dp2 2 --data-path 0.5 "$work/chat" 0.5 "$work/plain" --micro-batch-size 2 \
  && within blend blend-dp2 "a blend of masked and unmasked shards, DP2"

# Samples inside 90-token prompts: micro-batches without a counted token.
if run silent 1 --data-path "$work/silent" --micro-batch-size 1; then
  n=$(grep -c "has no token whose loss counts" "$work/silent.log")
  [ "$n" = 1 ] && ! grep -qi "nan" "$work/silent.jsonl" && [ "$(wc -l < "$work/silent.jsonl")" = 20 ] \
    && ok "a micro-batch without a counted token: said once, 20 finite losses" \
    || bad "micro-batch without a counted token: said $n times, $(grep -ci nan "$work/silent.jsonl") NaN lines"
fi
# The same at TP2: every rank of the grid skips alike: each warning once, not once per rank
# (issue 71 point 9).
if run silent-tp2 2 --data-path "$work/silent" --micro-batch-size 1 --tensor-model-parallel-size 2; then
  n=$(grep -c "has no token whose loss counts" "$work/silent-tp2.log")
  skips=$(grep -c "counts toward the loss" "$work/silent-tp2.log")
  iters=$(grep -o "iteration [0-9]*: no token of its global batch" "$work/silent-tp2.log" | sort -u | wc -l)
  [ "$n" = 1 ] && [ "$skips" = "$iters" ] \
    && ok "TP2: the empty micro-batch said once, $skips skipped iteration(s) each said once" \
    || bad "TP2: the empty micro-batch said $n times, skips said $skips times for $iters iterations"
fi

# --sft: whole conversations packed first-fit, positions and attention reset per document (the
# shards' boundaries), the same losses at every layout, resumed exactly.
S=("${D[@]}" --sft --micro-batch-size 2)
if run sft 1 "${S[@]}" --save "$work/sft-ckpt" --save-interval 10; then
  grep -q "packed (--sft): [0-9.]*% of the samples' tokens are document tokens" "$work/sft.log" \
    && ok "--sft logs its packing: $(grep -o 'packed (--sft): [0-9.]*%' "$work/sft.log")" \
    || bad "--sft: no packing line in the log"
  differ base sft "--sft trains other samples than the windows"
  run sft-tp2 2 "${S[@]}" --tensor-model-parallel-size 2 --sequence-parallel && within sft sft-tp2 "--sft, TP2 + SP"
  run sft-pp2 2 "${S[@]}" --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
    && within sft sft-pp2 "--sft, PP2 interleaved"
  run sft-dp2 2 "${S[@]}" --use-distributed-optimizer && within sft sft-dp2 "--sft, DP2 distributed optimizer"
  run sft-cp2 2 "${S[@]}" --context-parallel-size 2 && within sft sft-cp2 "--sft, CP2"
  run sft-cp4 4 "${S[@]}" --context-parallel-size 4 && within sft sft-cp4 "--sft, CP4"
  run sft-tp2cp2 4 "${S[@]}" --tensor-model-parallel-size 2 --context-parallel-size 2 \
    --sequence-parallel && within sft sft-tp2cp2 "--sft, TP2 x CP2 + SP"
  if run sft-resume 1 "${S[@]}" --load "$work/sft-ckpt/iter_0000010" --train-iters 20; then
    got=$(losses "$work/sft-resume.jsonl" | tr '\n' ' '); want=$(losses "$work/sft.jsonl" | tail -10 | tr '\n' ' ')
    [ "$got" = "$want" ] && ok "--sft resumed at iteration 10: iterations 11-20 bit for bit" \
      || bad "--sft resume: $got vs $want"
  fi
fi
# Evaluation packs too: tessera-eval --sft equals tessera-train --skip-train --sft.
e_sft=$("$bin/tessera-eval" --load "$work/sft-ckpt" --data-path "$work/chat" --split 50,50,0 --eval-iters 3 \
  --global-batch-size 8 --micro-batch-size 2 --threads 1 --device cpu --sft 2>&1 | grep -o 'loss [0-9.]*' | awk '{print $2}')
t_sft=$("$bin/tessera-train" "${common[@]}" "${D[@]}" --sft --micro-batch-size 2 --split 50,50,0 --load "$work/sft-ckpt" \
  --skip-train --eval-iters 3 2>&1 | grep -o 'lm loss value: [0-9.E+-]*' | awk '{printf "%.9f", $4}')
[ -n "$e_sft" ] && [ "$e_sft" = "$t_sft" ] && ok "tessera-eval --sft: $e_sft == tessera-train --skip-train --sft" \
  || bad "evaluation with --sft: tessera-eval '$e_sft', --skip-train '$t_sft'"
if run sft-cut 1 --data-path "$work/silent" --sft --micro-batch-size 2 --train-iters 2; then
  grep -q "250 document(s) cut to fit" "$work/sft-cut.log" && ok "--sft cuts the 90-token documents and says so" \
    || bad "--sft cut: $(grep -o 'packed.*' "$work/sft-cut.log")"
fi

refuse() {  # refuse WHAT PATTERN ARGS...: exit 2 and one error line naming the shard, the last
  local what=$1 pattern=$2 out rc
  shift 2
  out=$("$bin/tessera-train" "${common[@]}" --train-iters 2 --micro-batch-size 2 "$@" 2>&1); rc=$?
  if [ $rc -eq 2 ] && [ "$(grep -c 'error' <<<"$out")" = 1 ] && tail -1 <<<"$out" | grep -q -- "$pattern"; then
    ok "refused: $what"
  else bad "$what: rc $rc: $(tail -3 <<<"$out")"; fi
}
refuse "a loss mask of another length" "short_00000.h5': /loss_mask has .* entries for the .* tokens of /tokens" \
  --data-path "$work/short"
refuse "a mask value of 2" "two_00000.h5': /loss_mask of document 7 (token 1 of the document.* is 2" \
  --data-path "$work/two" --train-iters 60
refuse "--sft-no-truncate with a longer document" "--sft-no-truncate: document 0 of '$work/silent' has 91 tokens, more than a sample's --seq-length+1 = 33" \
  --data-path "$work/silent" --sft --sft-no-truncate
"$py" - "$work/one_00000.h5" <<'PY'
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "w") as f:
    f.create_dataset("tokens", data=np.arange(1, 200, dtype=np.int32)); f.create_dataset("doc_offsets", data=np.array([0, 199]))
    for k, v in {"vocab_size": 200, "eod_id": 199, "tokenizer": "synthetic", "format_version": 1}.items(): f.attrs[k] = v
PY
refuse "--sft on data of one document" "--sft packs whole documents, but the shards of '$work/one' hold one document" \
  --data-path "$work/one" --sft
refuse "--sft at CP2 with a sequence length its chunks cannot split" \
  "--seq-length=30 is not divisible by 2 x --context-parallel-size=2 = 4 (each context-parallel rank holds two of the sequence's 2 x CP chunks, and --sft's packed samples are cut the same way" \
  "${D[@]}" --sft --context-parallel-size 2 --seq-length 30 --dry-run
exit $fail
