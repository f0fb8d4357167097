#!/usr/bin/env bash
# test_plan_lines.sh (issue 71 point 1): the srun lines tessera-plan prints run the layout it
# ranked. For each case, each printed line's tessera-train options, given to tessera-train
# --dry-run with the same --world-size and --cluster, start and give the row's prediction (the
# `predicted:` line, exactly) and its memory (the verdict's fullest rank, to the table's 0.1
# GiB); -N times --ntasks-per-node is the world size. The cases: the README's example
# (llama3-1b.ini sets sequence parallelism, the distributed optimizer and selective
# recomputation, which rows turn off), a MoE config that sets EP 8 and the distributed optimizer
# (qwen3-30b-a3b.ini), and 12 GPUs of 8-GPU nodes with the planner's own precision and vocabulary.
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
[ $fail -eq 0 ] && echo "plan.printed_lines: all passed"
exit $fail
