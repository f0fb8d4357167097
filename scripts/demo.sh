#!/usr/bin/env bash
# demo.sh: the main job end to end on this machine's CPU: install and build; turn real English
# text (Debian's fortunes) into GPT-2-tokenized HDF5 shards; train gpt2-tiny on it on one rank and
# on 4 MPI ranks (TP 2 x PP 2), showing that both layouts give the same losses.
# Output goes to runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/prepare-corpus.sh data/corpus
out=runs/demo
mkdir -p "$out"
rm -f "$out"/metrics*.jsonl
iters=${DEMO_ITERS:-60}
common=(--config configs/gpt2-tiny.ini --data-path data/corpus/fortunes --split 949,50,1
        --train-iters "$iters" --lr-warmup-iters 5 --log-interval 10)
echo "== train gpt2-tiny on the fortunes corpus, 1 rank =="
build/bin/tessera-train "${common[@]}" --metrics-file "$out/metrics.jsonl" --log-file "$out/train.log"
echo "== the same run on 4 ranks: TP 2 x PP 2 (same losses as one rank, DESIGN.md invariant 2) =="
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun --oversubscribe --bind-to none -np 4 build/bin/tessera-train "${common[@]}" \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --metrics-file "$out/metrics-tp2pp2.jsonl"
loss() { sed 's/.*"lm_loss": \([^,]*\).*/\1/' "$1"; }
echo "== done: loss $(loss "$out/metrics.jsonl" | head -1) (first logged) -> $(loss "$out/metrics.jsonl" | tail -1) on 1 rank, $(loss "$out/metrics-tp2pp2.jsonl" | tail -1) on TP2 x PP2; logs and metrics in $out/ =="
