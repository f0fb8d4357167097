#!/usr/bin/env bash
# gpu-lease.sh: one call of the device tool (issue 70). It runs the next lease's steps of
# scripts/gpu-manifest (through scripts/gpu-plan: in the manifest's order, the steps not yet in
# scripts/gpu-manifest.passed whose budgets fit the deadline; correctness first: the short CUDA
# tests, the NCCL smoke test, the NCCL layouts, then the rates, the CUDA tests, the benchmarks
# beside their peers, the sanitizers), each under `timeout` against one deadline, so that a slow
# step costs the steps after it and never the logs. The device tool returns at most 8 files from
# $OUT, and a command killed at its limit returns what it left: after every step its output is
# appended to $OUT/lease.log, $OUT/logs.tar.gz (every step's files) and $OUT/summary.txt
# ("step|rc|seconds" lines, the card and the bundle's commit; scripts/gpu-plan record reads it
# here) are written again. At the end: a one-screen summary (ran, passed, failed, skipped for
# time) and issue 37's table of figures beside the peer's of the same run (scripts/gpu-figures.py).
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-lease.sh [SECONDS=540]
#   GPU_LEASE_STEPS="STEP ..." runs those manifest steps instead (in the manifest's order);
#   GPU_LEASE_ALL=1 runs the steps that passed before too.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
budget=${1:-540}
start=$(date +%s)
deadline=$((start + budget))
final=${OUT:-/tmp/tessera-gpu-out}
logs=$(mktemp -d)/logs
mkdir -p "$logs" "$final"
plan_args=(--deadline "$budget")
[ -n "${GPU_LEASE_STEPS:-}" ] && plan_args+=(--only "$GPU_LEASE_STEPS")
[ "${GPU_LEASE_ALL:-0}" = 1 ] && plan_args+=(--all)
mapfile -t plan < <(python3 scripts/gpu-plan steps "${plan_args[@]}") ||
  { echo "gpu-lease.sh: error: scripts/gpu-plan could not read scripts/gpu-manifest" >&2; exit 2; }
[ ${#plan[@]} -gt 0 ] || { echo "gpu-lease.sh: no step to run: the steps asked for have passed (GPU_LEASE_ALL=1 runs them again) or none fits ${budget} s (scripts/gpu-manifest's budgets)"; exit 0; }
commit=$(cat .gpu/commit.txt 2>/dev/null || echo unknown)
ran=0 passed=0 failed=0 skipped=0
lines=()
write_summary() {
  { echo "device: $(cat "$final/device.txt" 2>/dev/null || echo unknown)"
    echo "commit: $commit"
    printf '%s\n' "${lines[@]}"; } > "$final/summary.txt"
}
first=1
for entry in "${plan[@]}"; do
  IFS='|' read -r name longest cmd <<< "$entry"
  left=$((deadline - $(date +%s) - 10))
  if [ $left -lt 20 ]; then
    skipped=$((skipped + 1))
    echo "gpu-lease: $name skipped (the deadline)" >> "$final/lease.log"
    continue
  fi
  t=$((longest < left ? longest : left))
  echo "=== gpu-lease: $name (at most ${t}s) ===" | tee -a "$final/lease.log"
  s=$(date +%s)
  # The first step unpacks the archive; the others reuse it. No file-name expansion of the
  # command's words (gtest filters).
  set -f
  # shellcheck disable=SC2086
  GPU_LEASE_STEP=$name GPU_RUN_REUSE=$((1 - first)) OUT="$logs/$name" timeout -k 5 "$t" $cmd 2>&1 |
    tee "$logs/$name.out" >> "$final/lease.log"
  rc=${PIPESTATUS[0]}
  set +f
  first=0
  took=$(( $(date +%s) - s ))
  ran=$((ran + 1))
  if [ "$rc" = 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  lines+=("$name|$rc|$took")
  echo "=== gpu-lease: $name rc $rc in ${took}s$([ "$rc" = 124 ] && echo ' (timed out)') ===" |
    tee -a "$final/lease.log"
  f=$(find "$logs" -name device.txt | head -1)
  [ -n "$f" ] && cp "$f" "$final/device.txt"
  write_summary
  tar -C "$(dirname "$logs")" -czf "$final/logs.tar.gz" logs
done
write_summary
echo "=== gpu-lease summary ($(cat "$final/device.txt" 2>/dev/null), commit $commit): ran $ran, passed $passed, failed $failed, skipped for time $skipped ==="
printf '%s\n' "${lines[@]}" | awk -F'|' '{ printf "  %-20s rc %-4s %5s s%s\n", $1, $2, $3, ($2 == 124 ? " (timed out)" : "") }'
# Issue 37's table of figures against the peer of the same run (point 4), last.
python3 scripts/gpu-figures.py "$logs" | tee "$final/figures.txt"
