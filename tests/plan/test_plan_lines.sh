#!/usr/bin/env bash
# test_plan_lines.sh (issue 71 point 1): the srun lines tessera-plan prints run the layout it
# ranked. For each case, each printed line's tessera-train options, given to tessera-train
# --dry-run with the same --world-size and --cluster, start and give the row's prediction (the
# `predicted:` line, exactly) and its memory (the verdict's fullest rank, to the table's 0.1
# GiB); -N times --ntasks-per-node is the world size. The cases: the README's example
# (llama3-1b.ini sets sequence parallelism, the distributed optimizer and selective
# recomputation, which rows turn off), a MoE config that sets EP 8 and the distributed optimizer
# (qwen3-30b-a3b.ini), and 12 GPUs of 8-GPU nodes with the planner's own precision and vocabulary;
# stage splits and the pipeline schedule searched and given (issue 72).
# Usage: test_plan_lines.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad
check() {  # check NAME WORLD CLUSTER PLAN-OPTIONS...
  local name=$1 world=$2 cluster=$3
  shift 3
  if ! "$bin/tessera-plan" "$@" --world-size "$world" --cluster "$cluster" > "$work/$name.plan" 2>&1; then
    bad "$name: tessera-plan failed: $(tail -2 "$work/$name.plan")"; return
  fi
  python3 - "$work/$name.plan" "$work/$name" <<'PY' || { bad "$name: cannot read the plan"; return; }
import re, sys
text = open(sys.argv[1]).read().splitlines()
rows = [l for l in text if re.match(r"^ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ ", l)]
preds = [l for l in text if l.startswith("predicted: ")]
lines = [l.strip() for l in text if l.strip().startswith("srun ")]
assert rows and len(rows) == len(preds) == len(lines), (len(rows), len(preds), len(lines))
with open(sys.argv[2] + ".rows", "w") as f:
    for r, p, s in zip(rows, preds, lines):
        m = re.match(r"srun -N (\d+) --ntasks-per-node (\d+) tessera-train (.*)$", s)
        f.write("%s %s %s\t%s\t%s\n" % (m.group(1), m.group(2), r.split()[10], p, m.group(3)))
PY
  local n=0 nodes per mem pred args out got need
  while IFS=$'\t' read -r head pred args; do
    read -r nodes per mem <<<"$head"
    n=$((n + 1))
    [ $((nodes * per)) -eq "$world" ] || bad "$name row $n: -N $nodes x --ntasks-per-node $per is not $world"
    # shellcheck disable=SC2086
    out=$(eval "\"$bin/tessera-train\" $args --dry-run --world-size $world --cluster $cluster" 2>&1)
    got=$(grep '^predicted: ' <<<"$out")
    need=$(grep -oE 'the fullest rank \(stage [0-9]+\) needs [0-9.]+ GiB' <<<"$out" | grep -oE '[0-9.]+ GiB' | cut -d' ' -f1)
    if [ "$got" = "$pred" ] && [ -n "$need" ] && awk -v a="$need" -v b="$mem" 'BEGIN { exit !(a - b < 0.051 && b - a < 0.051) }'; then
      ok "$name row $n: -N $nodes x $per; the line predicts the row's step and needs $need GiB"
    else
      bad "$name row $n: tessera-train $args -> '$got' needs '$need' (the row: '$pred', $mem GiB): $(grep error <<<"$out")"
    fi
  done < "$work/$name.rows"
  [ "$n" -gt 0 ] || bad "$name: no line printed"
}
check readme 8 dgx-h100 --config "$configs/llama3-1b.ini" --global-batch-size 128 --top 3
check qwen3-moe 16 dgx-h100 --config "$configs/qwen3-30b-a3b.ini" --global-batch-size 64 --top 3
check twelve 12 dgx-h100 --config "$configs/gpt2-1.3b.ini" --global-batch-size 96 --bf16 \
  --vocab-size 50257 --seq-length 1024 --top 2
# Issue 72: stage splits searched and layout options restricting the search. 15 layers at PP 4
# (given: every row at PP 4) can only split unevenly; a given layout string holds in every row
# (the MTP layer on a stage of its own), and its lines run it (the '|' quoted).
check uneven 8 dgx-h100 --config "$configs/llama3-1b.ini" --num-layers 15 --global-batch-size 64 \
  --pipeline-model-parallel-size 4 --top 3
check mtp-layout 8 dgx-h100 --config "$configs/deepseek-tiny.ini" --mtp-num-layers 1 \
  --hidden-size 4096 --seq-length 4096 --max-position-embeddings 4096 --vocab-size 50257 \
  --global-batch-size 64 --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout "Et|ttt|m|L" --top 2
for name in uneven mtp-layout; do
  pps=$(grep -E '^ +[0-9]+ +[0-9]+ +[0-9]+ ' "$work/$name.plan" | awk '{ print $3 }' | sort -u | tr '\n' ' ')
  splits=$(grep -E '^ +[0-9]+ +[0-9]+ +[0-9]+ ' "$work/$name.plan" | awk '{ print $NF }' | sort -u | tr '\n' ' ')
  if [ "$pps" = "4 " ] && ! grep -qw even <<<"$splits"; then
    ok "$name: every row at the given PP 4, splits: $splits"
  else
    bad "$name: rows at PP $pps with splits $splits"
  fi
done
# The pipeline schedule (issue 72): searched (a wide 16-layer model at PP 4 without virtual stages,
# 8 micro-batches: zero-bubble saves more idle time than its copies cost: the fastest row, 1F1B
# next;
# their lines run them and predict the same), and given without a PP (every row pipelined and
# zero-bubble).
check schedule 16 dgx-h100 --config "$configs/gpt2-1.3b.ini" --num-layers 16 --hidden-size 8192 \
  --num-attention-heads 64 --seq-length 4096 --max-position-embeddings 4096 --global-batch-size 8 \
  --bf16 --vocab-size 50257 --pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 1 \
  --top 2
check zero-bubble 16 dgx-h100 --config "$configs/gpt2-1.3b.ini" --global-batch-size 64 --bf16 \
  --vocab-size 50257 --seq-length 1024 --pipeline-schedule zero-bubble --top 2
sched() { grep -E '^ +[0-9]+ +[0-9]+ +[0-9]+ ' "$work/$1.plan" | awk '{ print $(NF - 1) }' | sort -u | tr '\n' ' '; }
first_two=$(grep -E '^ +[0-9]+ +[0-9]+ +[0-9]+ ' "$work/schedule.plan" | awk '{ print $(NF - 1) }' | head -2 | tr '\n' ' ')
[ "$first_two" = "zb 1f1b " ] && grep -q -- "--pipeline-schedule zero-bubble" "$work/schedule.plan" &&
  ok "schedule: searched, zero-bubble first and 1F1B second" ||
  bad "schedule: rows $first_two"
pps=$(grep -E '^ +[0-9]+ +[0-9]+ +[0-9]+ ' "$work/zero-bubble.plan" | awk '$3 < 2 { print "PP " $3 }' | head -1)
[ "$(sched zero-bubble)" = "zb " ] && [ -z "$pps" ] &&
  ok "zero-bubble given without a PP: every row pipelined and zero-bubble" ||
  bad "zero-bubble given: rows $(sched zero-bubble) $pps"
grep -q "pipeline-model-parallel-layout 'Et|ttt|m|L'" "$work/mtp-layout.plan" &&
  ok "mtp-layout: the srun line quotes the layout" || bad "mtp-layout: no quoted layout in $(grep srun "$work/mtp-layout.plan" | head -1)"
# --hf-config (issue 71 point 5): the sequence from rope_scaling's original length, else
# --seq-length required naming the file's max_position_embeddings; the dtype from torch_dtype; the
# assumptions printed.
hfcfgs=$(dirname "$0")/../checkpoint/hf_configs
mkdir -p "$work/qwen3" "$work/dsv3"
cp "$hfcfgs/qwen3-8b.json" "$work/qwen3/config.json"
python3 - "$hfcfgs/deepseek-v3.json" "$work/dsv3/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.pop("quantization_config", None)  # as dequantized weights' config.json
json.dump(c, open(sys.argv[2], "w"))
PY
out=$("$bin/tessera-plan" --hf-config "$work/qwen3" --world-size 8 --cluster dgx-h100 --global-batch-size 64 --top 1 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "give --seq-length (.*config.json has no rope_scaling.original_max_position_embeddings; its max_position_embeddings 40960 is the longest the model takes" <<<"$out" \
  && ok "--hf-config without a training length: --seq-length asked for" || bad "--hf-config qwen3-8b: rc $rc, $out"
out=$("$bin/tessera-plan" --hf-config "$work/qwen3" --world-size 8 --cluster dgx-h100 --global-batch-size 64 --seq-length 4096 --top 1 2>&1)
grep -q "the plan rests on: the sequence length of --seq-length; bfloat16 (config.json's torch_dtype)" <<<"$out" \
  && grep -q "global batch 64 x 4096 tokens" <<<"$out" && grep -q -- "--bf16" <<<"$(grep srun <<<"$out")" \
  && ok "--hf-config qwen3-8b plans in bf16 at --seq-length 4096" || bad "--hf-config qwen3-8b: $out"
out=$("$bin/tessera-plan" --hf-config "$work/dsv3" --world-size 8 --cluster dgx-h100 --global-batch-size 64 --top 1 2>&1)
grep -q "the plan rests on: sequence 4096 (rope_scaling.original_max_position_embeddings" <<<"$out" \
  && grep -q "global batch 64 x 4096 tokens" <<<"$out" \
  && ok "--hf-config deepseek-v3: sequence 4096 from rope_scaling" || bad "--hf-config deepseek-v3: $out"
[ $fail -eq 0 ] && echo "plan.printed_lines: all passed"
exit $fail
