#!/usr/bin/env bash
# demo.sh: the main job end to end on this machine's CPU: install and build, then train the
# gpt2-tiny configuration and show its loss curve. Output goes to runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out=runs/demo
mkdir -p "$out"
rm -f "$out/metrics.jsonl"
echo "== train gpt2-tiny on one rank (synthetic Markov-chain data) =="
build/bin/tessera-train --config configs/gpt2-tiny.ini --train-iters 200 \
  --metrics-file "$out/metrics.jsonl" --log-file "$out/train.log"
first=$(head -1 "$out/metrics.jsonl" | sed 's/.*"lm_loss": \([^,]*\).*/\1/')
last=$(tail -1 "$out/metrics.jsonl" | sed 's/.*"lm_loss": \([^,]*\).*/\1/')
echo "== done: loss ${first} (first logged) -> ${last} (last); log and metrics in $out/ =="
