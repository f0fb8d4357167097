#!/usr/bin/env bash
# test_megatron_import.sh: tessera-preprocess --input-format megatron on Megatron-LM indexed
# datasets written by an independent writer (Python's struct, from the published layout): the
# shards hold the same tokens and documents (read back with h5dump), training runs on them, and
# bad files are refused with one line naming the file, exit 2.
# Usage: test_megatron_import.sh BIN_DIR CONFIG_DIR VOCAB_DIR
set -u
bin=$1
configs=$2
vocab=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
tokenizer=(--vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe")

# The writer: MMapIndexedDataset index version 1 (megatron/core/datasets/indexed_dataset.py's
# layout): magic, version, dtype code, sequence count, document-index count, lengths (int32),
# byte pointers (int64), document index (int64). Documents are 1 to 3 sequences of random tokens,
# the last one ending with <|endoftext|> (50256), as Megatron's preprocess_data.py --append-eod
# writes them. Also writes the expected tokens and document offsets as raw little-endian arrays.
cat > "$work/write.py" <<'EOF'
import random, struct, sys
prefix, code, docs, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fmt = {1: "B", 4: "i", 5: "q", 8: "H", 7: "f"}[code]
size = struct.calcsize(fmt)
rng = random.Random(seed)
lengths, pointers, doc_index, tokens, offsets = [], [], [0], [], [0]
with open(prefix + ".bin", "wb") as b:
    for d in range(docs):
        doc = []
        for s in range(rng.randint(1, 3)):
            seq = [rng.randrange(0, 50256 if code != 1 else 256) for _ in range(rng.randint(1, 40))]
            if s == 0 and d % 7 == 3:
                seq = []  # an empty sequence now and then
            pointers.append(b.tell())
            lengths.append(len(seq))
            b.write(struct.pack("<%d%s" % (len(seq), fmt), *seq))
            doc += seq
        doc_index.append(len(lengths))
        tokens += doc
        offsets.append(len(tokens))
with open(prefix + ".idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00")
    f.write(struct.pack("<Q", 1))
    f.write(struct.pack("<B", code))
    f.write(struct.pack("<Q", len(lengths)))
    f.write(struct.pack("<Q", len(doc_index)))
    f.write(struct.pack("<%di" % len(lengths), *lengths))
    f.write(struct.pack("<%dq" % len(pointers), *pointers))
    f.write(struct.pack("<%dq" % len(doc_index), *doc_index))
with open(prefix + ".want_tokens", "wb") as f:
    f.write(struct.pack("<%dH" % len(tokens), *tokens))
with open(prefix + ".want_offsets", "wb") as f:
    f.write(struct.pack("<%dQ" % len(offsets), *offsets))
print(len(tokens), docs)
EOF

pre() { "$bin/tessera-preprocess" "${tokenizer[@]}" --input-format megatron "$@"; }
# h5dump writes a dataset's raw values; they must equal what the writer put in the .bin.
same_as_written() {  # SHARD PREFIX
  h5dump -d /tokens -b LE -o "$work/got_tokens" "$1" > /dev/null &&
    h5dump -d /doc_offsets -b LE -o "$work/got_offsets" "$1" > /dev/null &&
    cmp -s "$work/got_tokens" "$2.want_tokens" && cmp -s "$work/got_offsets" "$2.want_offsets"
}
for code in 8 4 5; do  # uint16 (Megatron's choice for GPT-2), int32, int64
  read -r ntok ndoc < <(python3 "$work/write.py" "$work/m$code" "$code" 300 "$code")
  out=$(pre --input "$work/m$code" --output-prefix "$work/s$code" 2>&1); rc=$?
  if [ $rc -eq 0 ] && grep -q "$ndoc documents, $ntok tokens from the Megatron-LM dataset" <<<"$out" &&
     same_as_written "$work/s${code}_00000.h5" "$work/m$code"; then
    ok "dtype code $code: $ndoc documents, $ntok tokens, identical tokens and document offsets"
  else
    bad "dtype code $code: rc $rc: $out"
  fi
done
# Shards cut by --shard-size keep whole documents; training reads them.
out=$(pre --input "$work/m8" --output-prefix "$work/cut" --shard-size 1K 2>&1) && [ -f "$work/cut_00002.h5" ] \
  && ok "--shard-size 1K: $(grep -o '[0-9]* shard(s)' <<<"$out")" || bad "shard size: $out"
"$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --data-path "$work/s8" --seq-length 32 \
  --max-position-embeddings 32 --split 90,10,0 --train-iters 3 --log-interval 1 --threads 1 > "$work/train.log" 2>&1 \
  && grep -q "iteration *3/ *3" "$work/train.log" && ok "training reads the imported shards" \
  || bad "training on the import: $(tail -3 "$work/train.log")"

# Bad input: one line naming the file, exit 2.
refused() {  # WHAT PATTERN ARGS...
  local what=$1 pattern=$2
  shift 2
  local out rc
  out=$(pre "$@" 2>&1); rc=$?
  if [ $rc -eq 2 ] && [ "$(wc -l <<<"$out")" -eq 1 ] && grep -qF -- "$pattern" <<<"$out"; then
    ok "$what -> rc 2: $out"
  else
    bad "$what: rc $rc: $out"
  fi
}
cp "$work/m8.idx" "$work/magic.idx"; cp "$work/m8.bin" "$work/magic.bin"
printf 'XXXXXXX' | dd of="$work/magic.idx" conv=notrunc status=none
refused "bad magic" "'$work/magic.idx' is not a Megatron-LM indexed dataset index" --input "$work/magic" --output-prefix "$work/o"
cp "$work/m8.idx" "$work/v2.idx"; cp "$work/m8.bin" "$work/v2.bin"
printf '\x02' | dd of="$work/v2.idx" bs=1 seek=9 conv=notrunc status=none
refused "index version 2" "'$work/v2.idx' has index version 2; only version 1 (MMapIndexedDataset) is supported" --input "$work/v2" --output-prefix "$work/o"
cp "$work/m8.idx" "$work/short.idx"; head -c 1000 "$work/m8.bin" > "$work/short.bin"
refused "a .bin shorter than its index says" "'$work/short.bin' has 1000 bytes; its index '$work/short.idx' says sequence" --input "$work/short" --output-prefix "$work/o"
python3 "$work/write.py" "$work/f32" 7 5 1 > /dev/null
refused "float32 values" "holds float32 values, not token ids" --input "$work/f32" --output-prefix "$work/o"
cp "$work/m4.idx" "$work/big.idx"; cp "$work/m4.bin" "$work/big.bin"
printf '\x60\xea\x00\x00' | dd of="$work/big.bin" bs=1 seek=0 conv=notrunc status=none  # 60000
refused "a token outside the vocabulary" "'$work/big.bin': document 0 (sequence 0, token 0) has id 60000, outside the vocabulary of 50257 tokens" --input "$work/big" --output-prefix "$work/o"
refused "a missing dataset" "'$work/none.idx' cannot be opened" --input "$work/none" --output-prefix "$work/o"
refused "two inputs" "--input-format megatron takes one --input PREFIX (got 2)" --input "$work/m8" "$work/m4" --output-prefix "$work/o"
if ls "$work"/o_* > /dev/null 2>&1; then bad "a refused import left $(ls "$work"/o_*)"; else ok "a refused import leaves no shard"; fi

[ $fail -eq 0 ] && echo "Megatron-LM dataset import: all passed"
exit $fail
