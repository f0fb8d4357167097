#!/usr/bin/env bash
# test_documents.sh: documents inside a sample (issue 40 point 1): Megatron's --reset-position-ids,
# --reset-attention-mask and --eod-mask-loss on shards of short documents (several end-of-document
# tokens per 33-token sample). They change the losses; the losses with them are the single-rank
# ones to 1e-5 at TP2 with sequence parallelism, PP2 with virtual stages, DP2 with the distributed
# optimizer, CP2, CP4 and TP2 x CP2 (documents spanning the ring's chunks), TP2 x PP2 and CP2 with
# RoPE and with ALiBi, with dropout and selective recomputation at CP2 and TP2 x PP2, MoE at EP2
# and EP2 x CP2 (--eod-mask-loss alone also at CP2); one cross-document attention left
# (a mutation) must show at CP2; what cannot run is refused in one line.
# Usage: test_documents.sh BIN_DIR CONFIG_DIR
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

# 600 documents of 3 to 24 tokens over a 200-token vocabulary (eod 199), each token most often
# its predecessor + 1 (something to learn across a document, nothing across its end).
"$py" - "$work/docs_00000.h5" <<'PY'
import sys
import h5py
import numpy as np
rng = np.random.default_rng(40)
docs = []
for d in range(600):
    n = int(rng.integers(3, 25))
    t = [int(rng.integers(0, 199))]
    for _ in range(n - 2):
        t.append((t[-1] + 1) % 199 if rng.random() < 0.8 else int(rng.integers(0, 199)))
    docs.append(np.array(t + [199]))
tokens = np.concatenate(docs).astype(np.int32)
offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
with h5py.File(sys.argv[1], "w") as f:
    f.create_dataset("tokens", data=tokens)
    f.create_dataset("doc_offsets", data=offsets)
    for k, v in {"vocab_size": 200, "eod_id": 199, "tokenizer": "synthetic",
                 "format_version": 1}.items():
        f.attrs[k] = v
PY
common=(--config "$configs/gpt2-tiny.ini" --num-layers 4 --hidden-size 32 --num-attention-heads 4
        --seq-length 32 --max-position-embeddings 32 --vocab-size 0 --global-batch-size 8
        --train-iters 20 --log-interval 1 --lr-warmup-iters 2 --threads 1 --device cpu
        --data-path "$work/docs" --split 100,0,0 --eval-interval 0)
docs=(--reset-position-ids --reset-attention-mask --eod-mask-loss)
# shellcheck source=layout_runs.sh
source "$(dirname "$0")/layout_runs.sh"  # run, worst, within

run plain 1 --micro-batch-size 2 || exit 1
run base 1 --micro-batch-size 2 "${docs[@]}" --save "$work/ckpt" --save-interval 20 || exit 1
# Evaluation takes the options too: tessera-eval equals tessera-train --skip-train with them, and
# differs without them.
evl() { "$bin/tessera-eval" --load "$work/ckpt" --data-path "$work/docs" --split 50,50,0 \
  --eval-iters 3 --global-batch-size 8 --micro-batch-size 2 --threads 1 --device cpu "$@" 2>&1 \
  | grep -o 'loss [0-9.]*' | awk '{print $2}'; }
e_docs=$(evl "${docs[@]}"); e_plain=$(evl)
t_docs=$("$bin/tessera-train" "${common[@]}" --micro-batch-size 2 --split 50,50,0 "${docs[@]}" \
  --load "$work/ckpt" --skip-train --eval-iters 3 2>&1 | grep -o 'lm loss value: [0-9.E+-]*' \
  | awk '{printf "%.9f", $4}')
awk -v a="$e_docs" -v b="$t_docs" -v c="$e_plain" 'BEGIN { d = a - b; if (d < 0) d = -d; e = a - c;
  if (e < 0) e = -e; exit !(a != "" && b != "" && c != "" && d <= 1e-6 * a && e > 1e-3) }' \
  && ok "tessera-eval with the options: $e_docs == tessera-train --skip-train: $t_docs (without them: $e_plain)" \
  || bad "evaluation with the options: tessera-eval '$e_docs', --skip-train '$t_docs', plain '$e_plain'"
for opt in --reset-position-ids --reset-attention-mask --eod-mask-loss; do
  run "only$opt" 1 --micro-batch-size 2 "$opt" || continue
  w=$(worst plain "only$opt")
  awk -v w="$w" 'BEGIN { exit !(w > 1e-4) }' && ok "$opt alone changes the losses (up to $w relative)" \
    || bad "$opt alone changed no loss (worst difference $w)"
done
first=$(losses "$work/base.jsonl" | head -1); last=$(losses "$work/base.jsonl" | tail -1)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.3) }' \
  && ok "with the three options the loss falls from $first to $last" || bad "the loss did not fall: $first -> $last"

run tp2-sp 2 --micro-batch-size 2 "${docs[@]}" --tensor-model-parallel-size 2 --sequence-parallel \
  && within base tp2-sp "TP2 + sequence parallelism"
run pp2-vp 2 --micro-batch-size 2 "${docs[@]}" --pipeline-model-parallel-size 2 \
  --num-layers-per-virtual-pipeline-stage 1 && within base pp2-vp "PP2, interleaved"
run dp2-distopt 2 --micro-batch-size 2 "${docs[@]}" --use-distributed-optimizer \
  && within base dp2-distopt "DP2, distributed optimizer"
run eod-only 1 --micro-batch-size 2 --eod-mask-loss --position-embedding-type rope \
  && run eod-cp2 2 --micro-batch-size 2 --eod-mask-loss --position-embedding-type rope \
       --context-parallel-size 2 && within eod-only eod-cp2 "--eod-mask-loss alone, CP2"
# Context parallelism: documents span the chunks and ranks (8 chunks of 4 tokens at CP4).
run cp2 2 --micro-batch-size 2 "${docs[@]}" --context-parallel-size 2 \
  && within base cp2 "CP2, learned positions"
run cp4 4 --micro-batch-size 2 "${docs[@]}" --context-parallel-size 4 \
  && within base cp4 "CP4, learned positions"
run tp2-cp2 4 --micro-batch-size 2 "${docs[@]}" --tensor-model-parallel-size 2 \
  --context-parallel-size 2 --sequence-parallel && within base tp2-cp2 "TP2 x CP2 + sequence parallelism"
# Dropout (keyed by global sample and position) and selective recomputation compose with them.
R=(--attention-dropout 0.1 --hidden-dropout 0.1 --recompute-granularity selective)
run drop 1 --micro-batch-size 2 "${docs[@]}" "${R[@]}" && {
  run drop-cp2 2 --micro-batch-size 2 "${docs[@]}" "${R[@]}" --context-parallel-size 2 \
    && within drop drop-cp2 "dropout 0.1 + selective recomputation, CP2"
  run drop-tp2pp2 4 --micro-batch-size 2 "${docs[@]}" "${R[@]}" --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 --sequence-parallel \
    && within drop drop-tp2pp2 "dropout 0.1 + selective recomputation, TP2 x PP2 + SP"
}
# Mixture of experts with expert parallelism (the documents touch only the attention).
M=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.01)
run moe 1 --micro-batch-size 2 "${docs[@]}" "${M[@]}" && {
  run moe-ep2 2 --micro-batch-size 2 "${docs[@]}" "${M[@]}" --expert-model-parallel-size 2 \
    && within moe moe-ep2 "MoE, EP2"
  run moe-ep2-cp2 4 --micro-batch-size 2 "${docs[@]}" "${M[@]}" --expert-model-parallel-size 2 \
    --context-parallel-size 2 && within moe moe-ep2-cp2 "MoE, EP2 x CP2"
}
# The mutation: one cross-document attention left in each micro-batch's tables must show at CP2.
TESSERA_FAULT_DOC_MASK=leak run cp2-leak 2 --micro-batch-size 2 "${docs[@]}" \
  --context-parallel-size 2 && {
  w=$(worst base cp2-leak)
  awk -v w="$w" 'BEGIN { exit !(w > 1e-5) }' \
    && ok "one cross-document attention left (TESSERA_FAULT_DOC_MASK=leak) at CP2 moves the losses by $w" \
    || bad "the leaked attention at CP2 went unnoticed (worst difference $w)"
}
for pe in rope alibi; do
  run "$pe" 1 --micro-batch-size 2 "${docs[@]}" --position-embedding-type "$pe" || continue
  run "$pe-tp2pp2" 4 --micro-batch-size 2 "${docs[@]}" --position-embedding-type "$pe" \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    && within "$pe" "$pe-tp2pp2" "$pe, TP2 x PP2 + sequence parallelism"
  run "$pe-cp2" 2 --micro-batch-size 2 "${docs[@]}" --position-embedding-type "$pe" \
    --context-parallel-size 2 && within "$pe" "$pe-cp2" "$pe, CP2"
done

refuse() {  # refuse WHAT PATTERN ARGS...: exit 2 and one line naming the option
  local what=$1 pattern=$2 out rc
  shift 2
  out=$("$bin/tessera-train" "${common[@]}" --train-iters 1 "$@" 2>&1); rc=$?
  if [ $rc -eq 2 ] && grep -q -- "$pattern" <<<"$out"; then ok "refused: $what"
  else bad "$what: rc $rc: $(tail -2 <<<"$out")"; fi
}
out=$("$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --train-iters 1 --mock-data \
  --reset-attention-mask 2>&1); rc=$?
[ $rc -eq 2 ] && [ "$(wc -l <<<"$out")" -eq 1 ] \
  && grep -q -- "--reset-attention-mask needs --data-path: mock data has no end-of-document" <<<"$out" \
  && ok "refused: documents on mock data" || bad "documents on mock data: rc $rc: $out"
refuse "CP with a sequence length its chunks cannot split" \
  "--seq-length=30 is not divisible by 2 x --context-parallel-size=2 = 4" \
  "${docs[@]}" --seq-length 30 --context-parallel-size 2 --dry-run
exit $fail
