#!/usr/bin/env bash
# test_foreign_shards.sh: shards written by other tools (issue 18). A shard written the plain
# h5py way (variable-length UTF-8 string attribute, int32/uint8 integer attributes, chunked and
# gzip-compressed int64 /tokens) trains; token ids outside the vocabulary stop the run, at 1 rank
# and at DP2 where only one rank reads the bad sample, with the shard, document and position named
# (one line, exit 2, every rank stops); missing or inconsistent vocab_size/eod_id are refused by
# name; tessera-preprocess refuses what its tokenizer could not have written.
# Usage: test_foreign_shards.sh BIN_DIR CONFIG_DIR
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
# Debian's python3-h5py lives in the system interpreter (a python3 earlier on PATH may lack it).
py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3
"$py" -c "import h5py, numpy" || { echo "FAIL: python3-h5py and python3-numpy are needed (scripts/setup.sh installs them)"; exit 1; }

# write.py OUT [bad=DOCS:POS:ID] [drop=ATTR] [eod=N] [vocab=N]: 200 documents of random lengths
# over ids 0..vocab-2 of a 1000-token vocabulary, eod vocab-1, written as h5py does by default
# (Python str -> variable-length UTF-8; numpy scalars keep their width; int64 /tokens, chunked,
# gzip). bad=190-199:5:60000 puts id 60000 at position 5 of documents 190 to 199.
cat > "$work/write.py" <<'PY'
import sys
import h5py
import numpy as np
out = sys.argv[1]
opts = dict(a.split("=", 1) for a in sys.argv[2:])
vocab = int(opts.get("vocab", 1000))
rng = np.random.default_rng(7)
docs = []
for d in range(200):
    n = int(rng.integers(20, 120))
    docs.append(np.append(rng.integers(0, vocab - 1, n - 1), vocab - 1))
if "bad" in opts:
    span, p, v = opts["bad"].split(":")
    lo, hi = (int(x) for x in span.split("-"))
    for d in range(lo, hi + 1):
        docs[d][int(p)] = int(v)
tokens = np.concatenate(docs).astype(np.int64)
offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
with h5py.File(out, "w") as f:
    f.create_dataset("tokens", data=tokens, chunks=(4096,), compression="gzip", compression_opts=4)
    f.create_dataset("doc_offsets", data=offsets)
    attrs = {"vocab_size": np.int32(vocab), "eod_id": np.uint16(opts.get("eod", vocab - 1)),
             "tokenizer": "gpt2", "format_version": 1}
    for k, v in attrs.items():
        if k != opts.get("drop"):
            f.attrs[k] = v
print(len(tokens))
PY
"$py" "$work/write.py" "$work/plain_00000.h5"
"$py" - "$work/plain_00000.h5" <<'PY' > "$work/kinds"
import sys, h5py
f = h5py.File(sys.argv[1], "r")
print(h5py.check_string_dtype(f.attrs.get_id("tokenizer").dtype), f["tokens"].compression, f["tokens"].dtype)
PY
T=(--config "$configs/gpt2-tiny.ini" --vocab-size 0 --seq-length 32 --max-position-embeddings 32 --threads 1 --log-interval 1)
out=$("$bin/tessera-train" "${T[@]}" --data-path "$work/plain" --train-iters 3 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q "iteration *3/ *3" <<<"$out" && grep -q "utf-8" "$work/kinds" && grep -q gzip "$work/kinds" \
  && ok "an h5py-default shard ($(cat "$work/kinds")) trains: $(grep -o 'lm loss: [0-9.E+-]*' <<<"$out" | tail -1)" \
  || bad "h5py shard: rc $rc $(cat "$work/kinds") $out"

# Ids outside the vocabulary stop the run before a step uses them. Every sample over documents
# 0-199 of 32+1 tokens: an epoch (about 440 windows) within 40 iterations of 16 samples.
stops() {  # WHAT PATTERN NP ARGS...
  local what=$1 pattern=$2 np=$3 rc
  shift 3
  if [ "$np" = 1 ]; then out=$("$bin/tessera-train" "${T[@]}" "$@" 2>&1); rc=$?
  else out=$(timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "$bin/tessera-train" "${T[@]}" "$@" 2>&1); rc=$?; fi
  [ $rc -eq 2 ] && [ "$(grep -c 'error:' <<<"$out")" -eq 1 ] && grep -qE -- "$pattern" <<<"$out" \
    && ok "$what -> rc 2: $(grep 'error:' <<<"$out" | cut -c1-200)" || bad "$what: rc $rc: $out"
}
"$py" "$work/write.py" "$work/big_00000.h5" bad=0-199:5:60000
stops "id 60000 with vocab 1000" "data shard '$work/big_00000.h5': document [0-9]+ \(token 5 of the document, [0-9]+ of the shard\) has id 60000, outside the vocabulary of 1000 tokens" 1 --data-path "$work/big" --train-iters 40
! grep -q "lm loss" <<<"$out" && ok "no step ran on it" || bad "a step ran on bad data: $out"
d=$(grep -o "document [0-9]* (token 5 of the document, [0-9]* of the shard)" <<<"$out" | tr -d '(),' | awk '{print $2, $8}')
"$py" -c "import h5py, sys; o = h5py.File('$work/big_00000.h5')['doc_offsets']; d, at = map(int, '$d'.split()); sys.exit(0 if o[d] + 5 == at else 1)" \
  && ok "the named document and shard position agree ($d)" || bad "document/position '$d'"
"$py" "$work/write.py" "$work/neg_00000.h5" bad=0-199:2:-7
stops "a negative id" "document [0-9]+ \(token 2 of the document, [0-9]+ of the shard\) has id -7," 1 --data-path "$work/neg" --train-iters 40
# One bad token in the whole corpus, at DP2 (each rank reads half of a step's samples): whichever
# rank reads it, every rank stops with its words (no hang), in the first epoch.
"$py" "$work/write.py" "$work/one_00000.h5" bad=100-100:7:5000
stops "one bad id at DP2" "document 100 \(token 7 of the document, [0-9]+ of the shard\) has id 5000" 2 --data-path "$work/one" --train-iters 40
# In evaluation (documents 190-199 are the validation split; training reads clean ones), at TP2.
"$py" "$work/write.py" "$work/val_00000.h5" bad=190-199:5:60000
stops "id 60000 in evaluation at TP2" "has id 60000, outside the vocabulary of 1000 tokens" 2 --tensor-model-parallel-size 2 --data-path "$work/val" --split 95,5,0 --train-iters 2 --eval-interval 1 --eval-iters 5
grep -q "iteration *1/" <<<"$out" && ok "training ran on the clean split first" || bad "evaluation case: $out"
# Attributes.
"$py" "$work/write.py" "$work/noeod_00000.h5" drop=eod_id
stops "a shard without eod_id" "data shard '$work/noeod_00000.h5': lacks the eod_id attribute" 1 --data-path "$work/noeod" --train-iters 1
"$py" "$work/write.py" "$work/novocab_00000.h5" drop=vocab_size
stops "a shard without vocab_size" "data shard '$work/novocab_00000.h5': lacks the vocab_size attribute" 1 --data-path "$work/novocab" --train-iters 1
"$py" "$work/write.py" "$work/badeod_00000.h5" eod=60000
stops "eod_id past vocab_size" "has eod_id 60000, outside its vocab_size 1000 \\(inconsistent attributes\\)" 1 --data-path "$work/badeod" --train-iters 1

[ $fail -eq 0 ] && echo "foreign shards: all passed"
exit $fail
