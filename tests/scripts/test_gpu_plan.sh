#!/usr/bin/env bash
# test_gpu_plan.sh (issue 70): the GPU lease's manifest through scripts/gpu-plan. The static check
# on this build (every step's programs bundled and its runner step known, the leases within their
# deadline with the first one correctness first, each lease's bundle and the tracked tree under
# the 64 MiB carry limit); then, on a copy, a lease's returned summary recorded: the step that
# passed is written with the commit, the card and its seconds, the failed one is not, and the next
# lease starts at the failed step; a summary naming a step the manifest lacks is refused.
# Usage: test_gpu_plan.sh BIN_DIR
set -u
bin=$1
here=$(cd "$(dirname "$0")/../../scripts" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad
if out=$(python3 "$here/gpu-plan" check "$bin" 2>&1); then
  ok "check: $(echo "$out" | tail -1); $(echo "$out" | grep -m1 '^lease 1 bundle' | grep -oE '[0-9.]+ MiB of 64' || echo 'sizes not measured')"
else
  bad "check: $(echo "$out" | grep problem | head -3)"
fi
first=$(python3 "$here/gpu-plan" steps --all | cut -d'|' -f1 | head -3 | tr '\n' ' ')
[ "$first" = "cuda-short nccl-smoke nccl2 " ] && ok "the first lease starts: $first" || bad "the first lease starts: $first"
mkdir -p "$work/scripts"
cp "$here/gpu-plan" "$here/gpu-manifest" "$here/gpu-manifest.passed" "$here/gpu-bundle.sh" "$here/gpu-run.sh" "$work/scripts/"
printf 'device: NVIDIA H100 80GB HBM3, 81559 MiB, 580.1\ncommit: abc1234\ncuda-short|0|41\nnccl-smoke|1|30\n' > "$work/summary.txt"
python3 "$work/scripts/gpu-plan" record "$work/summary.txt" > "$work/record.log" 2>&1
line=$(grep -v '^#' "$work/scripts/gpu-manifest.passed")
[ "$line" = "cuda-short | abc1234 | NVIDIA H100 80GB HBM3, 81559 MiB, 580.1 | 41 | $(date +%F)" ] &&
  ok "record: $line" || bad "record wrote: $line"
next=$(python3 "$work/scripts/gpu-plan" steps | cut -d'|' -f1 | head -1)
[ "$next" = nccl-smoke ] && ok "the next lease starts at the failed step: $next" || bad "the next lease starts at $next"
printf 'commit: abc1234\nno-such-step|0|1\n' > "$work/bad.txt"
if python3 "$work/scripts/gpu-plan" record "$work/bad.txt" > "$work/bad.log" 2>&1; then
  bad "record took a step the manifest lacks"
else
  ok "refused: $(cat "$work/bad.log")"
fi
[ $fail -eq 0 ] && echo "gpu plan: all passed"
exit $fail
