#!/usr/bin/env bash
# test_model_families.sh: the model families of issue 41 train alike at every layout. Qwen3
# (--qk-layernorm: each query and key head RMS-normalized before RoPE, --kv-channels wider than
# hidden / heads, no biases) gives the single-rank losses to 1e-5 over 20 iterations at TP2 with
# sequence parallelism (the norms' weights see a share of the heads on each TP rank: their
# gradients are summed over TP), PP2, DP2 with the distributed optimizer, CP2, TP2 x PP2 and
# with selective and full recomputation; the q/k norms as LayerNorm applied as 1 + w at TP2;
# Qwen3-MoE (a dense first layer, then 4 experts, top 2 renormalized or not) at EP2, TP2 x EP2 with
# sequence parallelism and PP2. The option changes the losses (a run without it differs), and
# configs/qwen3-tiny.ini trains as it is. DeepSeek-V3's router (sigmoid, group-limited, the
# aux-loss-free expert bias updating every step) at EP2, TP2 x EP2 + SP, PP2, DP2 with the
# distributed optimizer, CP2 and TP2 x EP2 x PP2; its bias resumes bitwise from a checkpoint and
# through tessera-reshard; --moe-per-layer-logging's lines and figures. DeepSeek-V3's attention
# (multi-latent, YaRN) with that router at TP2+SP, TP4, PP2, DP2 with the distributed optimizer,
# CP2, EP2, TP2 x EP2 x PP2 and with recomputation, and its generation at TP1 and TP2;
# multi-token prediction at TP2+SP, PP2 (with the distributed optimizer too), EP2, CP2 (its
# shifted tokens cut from the whole samples), CP2 x TP2 + SP and TP2 x EP2 x PP2 (LM and MTP
# losses).
# Usage: test_model_families.sh BIN_DIR CONFIG_DIR
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
common=(--config "$configs/gpt2-tiny.ini" --num-layers 4 --hidden-size 32 --num-attention-heads 4
        --seq-length 32 --max-position-embeddings 32 --vocab-size 200 --mock-data
        --global-batch-size 8 --train-iters 20 --log-interval 1 --lr-warmup-iters 2 --threads 1
        --device cpu --eval-interval 0 --seed 1)
# Qwen3's options (configs/qwen3-tiny.ini's, smaller). --seed 1: with the default seed one
# embedding element's first gradients are ~1e-9 by coincidence, so Adam's first steps move it by
# +-lr on the sign of rounding noise, and every layout that sums in another order (even another
# micro-batch size on one rank) drifts to ~1e-5 (measured; not a layout effect).
q3=(--position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-6
    --swiglu --ffn-hidden-size 88 --group-query-attention --num-query-groups 2 --kv-channels 12
    --disable-bias-linear --untie-embeddings-and-output-weights)
# shellcheck source=layout_runs.sh
source "$(dirname "$0")/layout_runs.sh"  # run, worst, within

# Qwen3 (dense).
run q3 1 --micro-batch-size 2 "${q3[@]}" --qk-layernorm || exit 1
run q3-off 1 --micro-batch-size 2 "${q3[@]}" || exit 1
w=$(worst q3 q3-off)
if [ "$w" != missing ] && awk -v w="$w" 'BEGIN { exit !(w > 1e-3) }'; then
  ok "--qk-layernorm changes the losses (worst relative difference $w without it)"
else
  bad "--qk-layernorm changed the losses by $w only"
fi
for layout in "q3-tp2sp 2 --tensor-model-parallel-size 2 --sequence-parallel" \
              "q3-pp2 2 --pipeline-model-parallel-size 2" \
              "q3-dp2 2 --use-distributed-optimizer" \
              "q3-cp2 2 --context-parallel-size 2" \
              "q3-tp2pp2 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" \
              "q3-selective 1 --recompute-granularity selective" \
              "q3-full 1 --recompute-granularity full --recompute-method uniform"; do
  set -- $layout
  name=$1 np=$2
  shift 2
  run "$name" "$np" --micro-batch-size 2 "${q3[@]}" --qk-layernorm "$@" &&
    within q3 "$name" "Qwen3 $*"
done
# The q/k norms as LayerNorm (weights and biases) applied as 1 + w, with all linear biases.
ln=(--position-embedding-type rope --normalization LayerNorm --apply-layernorm-1p --kv-channels 12
    --qk-layernorm)
run q3ln 1 --micro-batch-size 2 "${ln[@]}" &&
  run q3ln-tp2 2 --micro-batch-size 2 "${ln[@]}" --tensor-model-parallel-size 2 &&
  within q3ln q3ln-tp2 "LayerNorm (1 + w) q/k norms, TP2"

# Qwen3-MoE: layer 0 dense, then 4 experts of width 16, the top 2.
moe=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-layer-freq "[0,1,1,1]"
     --moe-aux-loss-coeff 0.01)
for topk in renorm pre-softmax; do
  extra=()
  [ $topk = pre-softmax ] && extra=(--moe-router-pre-softmax)
  run "qm-$topk" 1 --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${moe[@]}" "${extra[@]}" ||
    continue
  for layout in "ep2 2 --expert-model-parallel-size 2" \
                "tp2ep2sp 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel" \
                "pp2 2 --pipeline-model-parallel-size 2"; do
    set -- $layout
    name=qm-$topk-$1 np=$2
    shift 2
    run "$name" "$np" --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${moe[@]}" "${extra[@]}" "$@" &&
      within "qm-$topk" "$name" "Qwen3-MoE ($topk) $*"
  done
done
w=$(worst qm-renorm qm-pre-softmax)
if [ "$w" != missing ] && awk -v w="$w" 'BEGIN { exit !(w > 1e-4) }'; then
  ok "norm_topk_prob matters: the renormalized and plain top-2 runs differ by $w"
else
  bad "the renormalized and plain top-2 runs differ by $w only"
fi
# DeepSeek-V3's router on the Qwen3 attention: sigmoid scores over 8 experts in 4 groups, each
# token's top 2 within its best 2 groups (a group's score: its top 2), the aux-loss-free expert
# bias updating every step (rate 0.01, so it moves the choice within 20 steps), routing weights
# scaled by 2.5, a shared expert, layer 0 dense, the sequence-wise aux loss at DeepSeek's 1e-4.
ds=(--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-layer-freq "[0,1,1,1]"
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 0.01 --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-group-score-experts 2 --moe-router-topk-scaling-factor 2.5
    --moe-shared-expert-intermediate-size 32 --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4 --moe-per-layer-logging)
run ds 1 --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${ds[@]}" || exit 1
# The same run stopped after iteration 10 with a checkpoint (resumed below).
run ds-half 1 --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${ds[@]}" --save "$work/ds-ck" \
  --save-interval 10 --exit-interval 10 || exit 1
for layout in "ds-ep2 2 --expert-model-parallel-size 2" \
              "ds-tp2ep2sp 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel" \
              "ds-pp2 2 --pipeline-model-parallel-size 2" \
              "ds-dp2 2 --use-distributed-optimizer" \
              "ds-cp2 2 --context-parallel-size 2" \
              "ds-tp2ep2pp2 8 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2"; do
  set -- $layout
  name=$1 np=$2
  shift 2
  run "$name" "$np" --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${ds[@]}" "$@" &&
    within ds "$name" "DeepSeek-V3 router, bias updating: $*"
done
# The bias moved (its range in the per-layer lines), the same at every layout: the last interval's
# lines of one rank and eight agree to the digit.
bias_lines() { grep -E "^.* MoE layer [0-9]+ \| .*expert bias" "$work/$1.log" | tail -3 | sed 's/.*MoE layer/MoE layer/'; }
b1=$(bias_lines ds) b8=$(bias_lines ds-tp2ep2pp2)
if [ -n "$b1" ] && [ "$b1" = "$b8" ] && ! grep -q "expert bias: \[0, 0\]" <<<"$b1"; then
  ok "the expert biases moved and agree at 1 rank and TP2 x EP2 x PP2: $(head -1 <<<"$b1")"
else
  bad "expert bias lines: one rank '$b1', eight '$b8'"
fi
grep -q '"moe_layer_1_tokens_cv": ' "$work/ds.jsonl" && grep -q '"moe_layer_3_bias_max": ' "$work/ds.jsonl" \
  && ok "--moe-per-layer-logging writes each layer's figures to the metrics file" \
  || bad "no per-layer MoE figures in the metrics file: $(head -c 300 "$work/ds.jsonl")"
# Resume: the bias is in the checkpoint, so iterations 11-20 from it are the uninterrupted run's,
# bit for bit; and through tessera-reshard to TP2 at TP2 x EP2 within 1e-5.
resume_same() {  # resume_same NAME: iterations 11-20 of NAME equal ds's
  paste <(losses "$work/ds.jsonl" | tail -10) <(losses "$work/$1.jsonl") | awk -v bit="$2" '
    { n++; if (bit) { if ($1 != $2) bad++ } else { d = $1 - $2; if (d < 0) d = -d; if (d / $1 > 1e-5) bad++ } }
    END { exit !(n == 10 && bad == 0) }'
}
run ds-resume 1 --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${ds[@]}" --load "$work/ds-ck" &&
  { resume_same ds-resume 1 && ok "resumed at iteration 10: iterations 11-20 bitwise the uninterrupted run's (the expert bias restored)" \
    || bad "the resumed run's losses differ: $(losses "$work/ds-resume.jsonl" | head -2 | tr '\n' ' ')"; }
if "$bin/tessera-reshard" --load "$work/ds-ck" --save "$work/ds-tp2" --target-tensor-model-parallel-size 2 > "$work/reshard.log" 2>&1 &&
   run ds-resume-tp2 4 --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${ds[@]}" --load "$work/ds-tp2" \
     --tensor-model-parallel-size 2 --expert-model-parallel-size 2; then
  resume_same ds-resume-tp2 "" && ok "resharded to TP2, resumed at TP2 x EP2: iterations 11-20 within 1e-5" \
    || bad "the resharded run's losses differ: $(losses "$work/ds-resume-tp2.jsonl" | head -2 | tr '\n' ' ')"
else
  bad "reshard or resume at TP2: $(tail -2 "$work/reshard.log")"
fi
# The option is model state: loading without it is one line.
nobias=()
for a in "${ds[@]}"; do [ "$a" = --moe-router-enable-expert-bias ] || nobias+=("$a"); done
"$bin/tessera-train" "${common[@]}" --micro-batch-size 2 "${q3[@]}" --qk-layernorm "${nobias[@]}" \
  --load "$work/ds-ck" --metrics-file "$work/x.jsonl" > "$work/nobias.log" 2>&1
rc=$?
[ $rc -eq 2 ] && grep -q "was trained with --moe-router-enable-expert-bias" "$work/nobias.log" \
  && ok "loading a checkpoint with expert biases without the option -> rc 2, one line" \
  || bad "load without --moe-router-enable-expert-bias: rc $rc: $(tail -1 "$work/nobias.log")"

# DeepSeek-V3 (configs/deepseek-tiny.ini): multi-latent attention with YaRN and latent norms,
# DeepSeek's router with the bias updating, a shared expert, layer 0 dense. Every layout gives
# the one-rank losses; the heads split over TP, the latents replicated (their gradients summed).
common=(--config "$configs/deepseek-tiny.ini" --mock-data --vocab-size 200 --seq-length 32
        --global-batch-size 8 --micro-batch-size 2 --train-iters 20 --log-interval 1
        --lr-warmup-iters 2 --threads 1 --device cpu --eval-interval 0 --seed 1)
run dsv3 1 --save "$work/dsv3-ck" --save-interval 20 || exit 1
for layout in "dsv3-tp2sp 2 --tensor-model-parallel-size 2 --sequence-parallel" \
              "dsv3-tp4 4 --tensor-model-parallel-size 4" \
              "dsv3-pp2 2 --pipeline-model-parallel-size 2" \
              "dsv3-dp2 2 --use-distributed-optimizer" \
              "dsv3-cp2 2 --context-parallel-size 2" \
              "dsv3-ep2 2 --expert-model-parallel-size 2" \
              "dsv3-tp2ep2pp2 8 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2" \
              "dsv3-selective 1 --recompute-granularity selective" \
              "dsv3-full 1 --recompute-granularity full --recompute-method uniform"; do
  set -- $layout
  name=$1 np=$2
  shift 2
  run "$name" "$np" "$@" && within dsv3 "$name" "DeepSeek-V3 (MLA, YaRN, router): $*"
done
# Multi-token prediction (one depth, on the last stage; its embedding copy there summed with the
# first stage's): the LM and mtp_1 losses of every layout are the one-rank run's, and it moves
# the LM losses (its loss joins the gradient).
mtp_within() {  # mtp_within BASE NAME DESCRIPTION: both losses within 1e-5 relative
  local w
  w=$(paste <(sed 's/.*"lm_loss": \([^,]*\),.*"mtp_1_loss": \([^,]*\),.*/\1 \2/' "$work/$1.jsonl") \
            <(sed 's/.*"lm_loss": \([^,]*\),.*"mtp_1_loss": \([^,]*\),.*/\1 \2/' "$work/$2.jsonl") | awk '
    NF == 4 { for (i = 1; i <= 2; i++) { d = $i - $(i + 2); if (d < 0) d = -d; r = d / $i; if (r > w) w = r } n++ }
    END { if (n != 20) print "missing"; else printf "%.3g", w }')
  if [ "$w" = missing ] || awk -v w="$w" 'BEGIN { exit !(w > 1e-5) }'; then
    bad "$2 ($3): worst relative LM / mtp_1 loss difference $w against $1"
  else
    ok "$2 ($3): LM and mtp_1 losses within $w over 20 iterations"
  fi
}
run mtp 1 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 || exit 1
w=$(worst dsv3 mtp)
[ "$w" != missing ] && awk -v w="$w" 'BEGIN { exit !(w > 1e-4) }' && grep -q " | mtp_1 loss: " "$work/mtp.log" \
  && ok "--mtp-num-layers 1 logs mtp_1 loss and moves the LM losses (by $w)" \
  || bad "MTP: LM losses moved by $w; line: $(grep -m1 'iteration  ' "$work/mtp.log")"
for layout in "mtp-tp2sp 2 --tensor-model-parallel-size 2 --sequence-parallel" \
              "mtp-pp2 2 --pipeline-model-parallel-size 2" \
              "mtp-pp2-dist 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer" \
              "mtp-ep2 2 --expert-model-parallel-size 2" \
              "mtp-cp2 2 --context-parallel-size 2" \
              "mtp-cp2tp2 4 --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel" \
              "mtp-tp2ep2pp2 8 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2"; do
  set -- $layout
  name=$1 np=$2
  shift 2
  run "$name" "$np" --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 "$@" &&
    mtp_within mtp "$name" "DeepSeek-V3 with MTP: $*"
done
# Generation through the KV cache (the expanded keys and values): greedy ids at TP1 and TP2 agree.
gen() {  # gen NP [options]
  local np=$1
  shift
  local cmd=("$bin/tessera-generate" --load "$work/dsv3-ck" --threads 1 --prompt-ids "3 14 15 92 65"
             --max-new-tokens 8 --greedy "$@")
  if [ "$np" -gt 1 ]; then timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}" 2>/dev/null
  else timeout 300 "${cmd[@]}" 2>/dev/null; fi
}
g1=$(gen 1) g2=$(gen 2 --tensor-model-parallel-size 2)
[ -n "$g1" ] && [ "$g1" = "$g2" ] && ok "DeepSeek-V3 generation at TP1 and TP2: $g1" \
  || bad "DeepSeek-V3 generation: TP1 '$g1', TP2 '$g2'"

# Bad input: one line naming the option, exit 2.
expect() {  # expect WHAT PATTERN [options]
  local what=$1 pattern=$2 out rc
  shift 2
  out=$("$bin/tessera-train" --config "$configs/deepseek-tiny.ini" --mock-data --vocab-size 200 \
        --train-iters 1 --threads 1 --device cpu "$@" 2>&1); rc=$?
  if [ $rc -eq 2 ] && grep -qE -- "$pattern" <<<"$out" && [ "$(grep -c 'error:' <<<"$out")" -eq 1 ]; then
    ok "$what -> rc 2"
  else
    bad "$what: rc $rc: $(tail -2 <<<"$out")"
  fi
}
expect "MLA without its key/value rank" "--kv-lora-rank=0 is out of range with --multi-latent-attention \(allowed: >= 1\)" --kv-lora-rank 0
expect "an odd --qk-pos-emb-head-dim" "--qk-pos-emb-head-dim=7 must be even" --qk-pos-emb-head-dim 7
expect "values wider than the heads" "--v-head-dim=40 exceeds --qk-head-dim \+ --qk-pos-emb-head-dim = 24" --v-head-dim 40
expect "--moe-router-group-topk above the groups" "--moe-router-group-topk=5 is out of range for --moe-router-num-groups=4 \(allowed: 1 to 4\)" --moe-router-group-topk 5
expect "groups not dividing the experts" "--moe-router-num-groups=3 does not divide --num-experts=8" --moe-router-num-groups 3
expect "the top k beyond the kept groups' experts" "--moe-router-topk=5 exceeds the 4 experts of the 2 groups" --moe-router-topk 5
expect "a group score of more experts than a group has" "a group's score sums 3 experts' scores \(--moe-router-group-score-experts\), but a group has 2" --moe-router-group-score-experts 3
expect "the expert bias without sigmoid scores" "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid" --moe-router-score-function softmax
expect "YaRN's mscale apart from mscale-all-dim" "--mscale=1 differs from --mscale-all-dim=0.707" --mscale 1
out=$("$bin/tessera-train" --config "$configs/qwen3-tiny.ini" --mock-data --vocab-size 200 --train-iters 1 \
      --threads 1 --device cpu --rope-type yarn 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q -- "--rope-type yarn needs --multi-latent-attention" <<<"$out" \
  && ok "YaRN without MLA -> rc 2" || bad "YaRN without MLA: rc $rc: $(tail -1 <<<"$out")"
out=$("$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --mock-data --vocab-size 200 --train-iters 1 \
      --threads 1 --device cpu --mtp-num-layers 1 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q -- "--mtp-num-layers with --position-embedding-type learned_absolute" <<<"$out" \
  && ok "MTP with learned positions -> rc 2" || bad "MTP with learned positions: rc $rc: $(tail -1 <<<"$out")"
expect "MTP in FP8" "--fp8-format with --mtp-num-layers" --mtp-num-layers 1 --fp8-format hybrid
expect "MLA with grouped-query attention" "--multi-latent-attention with --group-query-attention" --group-query-attention --num-query-groups 2

common=(--config "$configs/qwen3-tiny.ini" --mock-data --vocab-size 200 --train-iters 20
        --log-interval 10 --threads 1 --device cpu)
run tiny 1 && awk -F'"lm_loss": ' 'NR == 1 { split($2, a, ","); first = a[1] }
  END { split($2, a, ","); exit !(a[1] < first - 0.3) }' "$work/tiny.jsonl" \
  && ok "configs/qwen3-tiny.ini trains (the loss falls by more than 0.3 in 20 iterations)" \
  || bad "configs/qwen3-tiny.ini: $(head -1 "$work/tiny.jsonl")"
[ $fail -eq 0 ] && echo "model families: all passed"
exit $fail
