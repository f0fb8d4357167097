#!/usr/bin/env bash
# prepare-corpus.sh: the demo corpus: real English text from Debian's `fortunes` package (the
# fortune-mod databases), one document per fortune, written as jsonl (key "text"), then tokenized
# into HDF5 shards with tessera-preprocess. Usage: scripts/prepare-corpus.sh [OUT_DIR=data/corpus]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-data/corpus}
src=/usr/share/games/fortunes
if [ ! -d "$src" ]; then
  echo "prepare-corpus.sh: installing Debian's fortunes package"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends fortunes
fi
scripts/get-gpt2-vocab.sh
mkdir -p "$out"
jsonl="$out/fortunes.jsonl"
# Every file of the package that has an index (.dat) is a fortune database: entries split by "%".
files=()
for dat in "$src"/*.dat; do files+=("${dat%.dat}"); done
LC_ALL=C awk '
  function flush() {
    if (doc != "") {
      gsub(/\\/, "\\\\&", doc); gsub(/"/, "\\\\&", doc); gsub(/\t/, "\\t", doc)
      gsub(/\r/, "", doc); gsub(/[\001-\010\013\014\016-\037]/, "", doc)
      gsub(/\n/, "\\n", doc)
      printf "{\"text\": \"%s\", \"source\": \"%s\"}\n", doc, FILENAME
    }
    doc = ""
  }
  FNR == 1 { flush() }
  /^%$/ { flush(); next }
  { doc = (doc == "" ? $0 : doc "\n" $0) }
  END { flush() }' "${files[@]}" > "$jsonl.tmp"
mv "$jsonl.tmp" "$jsonl"
echo "prepare-corpus.sh: $(wc -l < "$jsonl") fortunes from ${#files[@]} databases in $jsonl"
build/bin/tessera-preprocess --input "$jsonl" --json-key text \
  --vocab-file data/gpt2/encoder.json --merge-file data/gpt2/vocab.bpe \
  --output-prefix "$out/fortunes" --shard-size 200K --workers 2
