#!/usr/bin/env bash
# demo.sh: the main job end to end on this machine's CPU: install and build; turn real English
# text (Debian's fortunes) into GPT-2-tokenized HDF5 shards; train gpt2-tiny on it on one rank and
# on 4 MPI ranks (TP 2 x PP 2), showing that both layouts give the same losses; checkpoint the
# 4-rank run, reshard the checkpoint to one rank, evaluate it and generate text from it.
# Output goes to runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only the programs it runs are built (the tests and benchmarks are scripts/test.sh's).
scripts/setup.sh --targets "tessera-preprocess tessera-train tessera-reshard tessera-eval tessera-generate"
scripts/prepare-corpus.sh data/corpus
out=runs/demo
mkdir -p "$out"
rm -rf "$out"/metrics*.jsonl "$out/ckpt" "$out/ckpt-tp1"
iters=${DEMO_ITERS:-60}
common=(--config configs/gpt2-tiny.ini --data-path data/corpus/fortunes --split 949,50,1
        --train-iters "$iters" --lr-warmup-iters 5 --log-interval 10)
echo "== train gpt2-tiny on the fortunes corpus, 1 rank =="
build/bin/tessera-train "${common[@]}" --metrics-file "$out/metrics.jsonl" --log-file "$out/train.log"
echo "== the same run on 4 ranks: TP 2 x PP 2 (same losses as one rank, DESIGN.md invariant 2) =="
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun --oversubscribe --bind-to none -np 4 build/bin/tessera-train "${common[@]}" \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --metrics-file "$out/metrics-tp2pp2.jsonl" --save "$out/ckpt"
echo "== reshard the TP 2 x PP 2 checkpoint to one rank =="
build/bin/tessera-reshard --load "$out/ckpt" --save "$out/ckpt-tp1" \
  --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1
echo "== evaluate the resharded checkpoint on the validation split =="
build/bin/tessera-eval --load "$out/ckpt-tp1" --data-path data/corpus/fortunes --split 949,50,1
echo "== generate from it =="
build/bin/tessera-generate --load "$out/ckpt-tp1" --prompt "Q: What is the meaning of life?" \
  --max-new-tokens 32 --temperature 0.8 --top-k 40 --top-p 0.9 --seed 2
scripts/plot-metrics "$out/loss.png" "$out/metrics.jsonl" "$out/metrics-tp2pp2.jsonl"
loss() { sed 's/.*"lm_loss": \([^,]*\).*/\1/' "$1"; }
echo "== done: loss $(loss "$out/metrics.jsonl" | head -1) (first logged) -> $(loss "$out/metrics.jsonl" | tail -1) on 1 rank, $(loss "$out/metrics-tp2pp2.jsonl" | tail -1) on TP2 x PP2; logs, metrics, loss.png and checkpoints in $out/ =="
