#!/usr/bin/env bash
# test_rerun.sh: result validation and reruns (issue 39) through tessera-train under mpirun, as a
# user (or Slurm) relaunches a job: each injected error type ends with the exit code and the log
# lines Megatron's state machine gives (transient: 17; persistent: 16, 16 again on the same host, 17
# on another naming the first, 17 at once back on it, then training on; correct result: 16, 17, then
# the iteration skipped), the tracker file's lines, --rerun-mode report_stats training bitwise the
# plain run's model with a spread of 0, --iterations-to-skip, a real NaN reproduced on two ranks
# (not skipped: the next launch stops at once), --rerun-mode disabled, and bad options. Another host
# is a UTS namespace (unshare -u) with its own host name; skipped with a note where that is not
# allowed. Losses are compared exactly with the clean run's metrics file.
# Usage: test_rerun.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
host=$(hostname)
# run LOG [--host NAME] ARGS...: two ranks (DP 2) of the tiny model, 8 iterations; the exit code.
run() {
  local log=$1 other=""
  shift
  if [ "${1:-}" = "--host" ]; then other=$2; shift 2; fi
  local cmd=(mpirun --oversubscribe --bind-to none -np 2 "$bin/tessera-train" --config
    "$configs/gpt2-tiny.ini" --mock-data --vocab-size 500 --threads 1 --device cpu
    --log-interval 1 --train-iters "${ITERS:-8}" --global-batch-size 8 --micro-batch-size 2 "$@")
  if [ -n "$other" ]; then
    unshare -u sh -c 'hostname "$0" && exec "$@"' "$other" "${cmd[@]}" >"$log" 2>&1
  else
    "${cmd[@]}" >"$log" 2>&1
  fi
}
# loss_records FILE: "iteration loss" (Python's repr) per line of a metrics file.
loss_records() { python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "lm_loss" in d: print(d["iteration"], repr(d["lm_loss"]))' "$1"; }
# same_losses A B FIRST LAST: iterations FIRST..LAST of metrics files A and B are equal.
same_losses() {
  diff <(loss_records "$1" | awk -v a="$3" -v b="$4" '$1 >= a && $1 <= b') \
    <(loss_records "$2" | awk -v a="$3" -v b="$4" '$1 >= a && $1 <= b') >/dev/null &&
    [ "$(loss_records "$1" | awk -v a="$3" -v b="$4" '$1 >= a && $1 <= b' | wc -l)" -eq $(($4 - $3 + 1)) ]
}
expect_rc() {  # expect_rc WHAT RC WANT LOG
  if [ "$2" -eq "$3" ]; then ok "$1: exit $2"; else bad "$1: exit $2, expected $3"; tail -5 "$4"; fi
}
expect_log() {  # expect_log WHAT LOG PATTERN
  if grep -qE -- "$3" "$2"; then ok "$1"; else bad "$1: no /$3/ in $2"; tail -5 "$2"; fi
}
can_unshare=1
unshare -u sh -c 'hostname tessera-other' 2>/dev/null || can_unshare=0

run "$work/clean.log" --metrics-file "$work/clean.jsonl" --save "$work/clean"
expect_rc "clean run" $? 0 "$work/clean.log"
[ "$(loss_records "$work/clean.jsonl" | wc -l)" -eq 8 ] && ok "clean run: 8 losses" || bad "clean run: losses"
expect_log "the tracker file defaults beside --save" "$work/clean.log" \
  "result validation: validate_results .*; tracker file $work/clean/result_rejected_tracker.txt"
[ ! -s "$work/clean/result_rejected_tracker.txt" ] && ok "clean run: the tracker file is empty" ||
  bad "clean run wrote tracker lines"

# --- report_stats: every iteration twice, the same model, a spread of 0 ---
run "$work/stats.log" --rerun-mode report_stats --metrics-file "$work/stats.jsonl" --save "$work/stats"
expect_rc "report_stats" $? 0 "$work/stats.log"
same_losses "$work/clean.jsonl" "$work/stats.jsonl" 1 8 && ok "report_stats: losses equal the plain run's" ||
  bad "report_stats: losses differ from the plain run's"
expect_log "report_stats: spread 0" "$work/stats.log" \
  "iterations 1 to 1: 4 results rerun, 4 identical, largest relative difference 0"
n=$(grep -c "results rerun" "$work/stats.log")
[ "$n" -eq 8 ] && ok "report_stats: a report every log interval" || bad "report_stats: $n reports"
# the models after iteration 8 are the same: two more (plain) iterations from each give the same losses
ITERS=10 run "$work/clean10.log" --load "$work/clean" --metrics-file "$work/clean10.jsonl"
ITERS=10 run "$work/stats10.log" --load "$work/stats" --metrics-file "$work/stats10.jsonl"
same_losses "$work/clean10.jsonl" "$work/stats10.jsonl" 9 10 &&
  ok "report_stats: the model and optimizer after it equal the plain run's" ||
  bad "report_stats: the resumed losses differ"

# --- transient error: exit 17, nothing saved; the relaunch trains the clean run's losses ---
d=$work/transient
run "$d.1.log" --save "$d" --save-interval 2 --error-injection-at 5:1 \
  --error-injection-type transient_error --metrics-file "$d.jsonl"
expect_rc "transient error" $? 17 "$d.1.log"
expect_log "transient: the host named" "$d.1.log" "transient error: .*rank 1 \\(host $host, CPU\\)"
expect_log "transient: rerun in place" "$d.1.log" "iteration 5: a result was rejected on 1 rank\\(s\\); rerunning"
[ "$(cat "$d/latest_checkpointed_iteration.txt")" = 4 ] && ok "transient: nothing saved at 5" ||
  bad "transient: latest is $(cat "$d/latest_checkpointed_iteration.txt")"
t=$d/result_rejected_tracker.txt
grep -q "rank=1 iteration=5 status=INITIAL_RUN result=nan injected=transient_error" "$t" &&
  grep -q "rank=1 iteration=5 status=FIRST_RERUN_NOT_REPRODUCIBLE" "$t" &&
  ok "transient: tracker lines" || { bad "transient: tracker lines"; cat "$t"; }
run "$d.2.log" --save "$d" --save-interval 2 --load "$d" --error-injection-at 5:1 \
  --error-injection-type transient_error --metrics-file "$d.jsonl"
expect_rc "transient: the relaunch (same command line)" $? 0 "$d.2.log"
same_losses "$work/clean.jsonl" "$d.jsonl" 5 8 && ok "transient: iterations 5-8 equal the clean run's" ||
  bad "transient: losses differ"

# --- persistent error: 16, 16 on the same host, 17 elsewhere naming it, 17 back on it, then on ---
d=$work/persistent
args=(--save "$d" --save-interval 2 --error-injection-at 5:1 --error-injection-type persistent_error
  --metrics-file "$d.jsonl")
run "$d.1.log" "${args[@]}"
expect_rc "persistent error" $? 16 "$d.1.log"
expect_log "persistent: 16 says why" "$d.1.log" "reproduced the rejected result of rank 1 \\(host $host, CPU\\); exit 16"
[ "$(cat "$d/latest_checkpointed_iteration.txt")" = 4 ] && ok "persistent: checkpoint of iteration 4" ||
  bad "persistent: latest is $(cat "$d/latest_checkpointed_iteration.txt")"
# Relaunched with --rerun-mode disabled (no --save: the checkpoint stays): the pending rerun is
# dropped with a warning, not silently (issue 58).
run "$d.disabled.log" --load "$d" --rerun-mode disabled
expect_rc "persistent: relaunched with --rerun-mode disabled" $? 0 "$d.disabled.log"
expect_log "persistent: the dropped diagnosis said" "$d.disabled.log" "warning: result validation: the checkpoint holds a pending rerun of iteration 5 .*--rerun-mode disabled does not run it"
run "$d.2.log" "${args[@]}" --load "$d"
expect_rc "persistent: requeued on the same host" $? 16 "$d.2.log"
expect_log "persistent: same hardware said" "$d.2.log" "rescheduled on the hardware whose result is to be checked"
if [ $can_unshare = 1 ]; then
  run "$d.3.log" --host tessera-other "${args[@]}" --load "$d"
  expect_rc "persistent: on another host" $? 17 "$d.3.log"
  expect_log "persistent: first host named" "$d.3.log" "persistent error: .*rank 1 \\(host $host, CPU\\)"
  grep -q "node=tessera-other .*rank=1 iteration=5 status=SECOND_RERUN_NOT_REPRODUCIBLE" "$d/result_rejected_tracker.txt" &&
    ok "persistent: tracker line" || bad "persistent: tracker line"
  run "$d.4.log" "${args[@]}" --load "$d"
  expect_rc "persistent: back on the faulty host" $? 17 "$d.4.log"
  expect_log "persistent: exclude it" "$d.4.log" "host $host was found faulty .*exclude it"
  grep -q "^.*iteration 5" "$d.4.log" && ! grep -q "iteration 5 .*lm loss" "$d.4.log" &&
    ok "persistent: stopped at once" || bad "persistent: trained before stopping"
  run "$d.5.log" --host tessera-other "${args[@]}" --load "$d"
  expect_rc "persistent: elsewhere, training on" $? 0 "$d.5.log"
  same_losses "$work/clean.jsonl" "$d.jsonl" 5 8 && ok "persistent: iterations 5-8 equal the clean run's" ||
    bad "persistent: losses differ"
fi

# --- correct result: 16, 17 elsewhere, then the tracker skips iteration 5 ---
if [ $can_unshare = 1 ]; then
  d=$work/correct
  args=(--save "$d" --save-interval 2 --error-injection-at 5:1 --error-injection-type correct_result
    --metrics-file "$d.jsonl")
  run "$d.1.log" "${args[@]}"
  expect_rc "correct result" $? 16 "$d.1.log"
  run "$d.2.log" --host tessera-other "${args[@]}" --load "$d"
  expect_rc "correct result: on another host" $? 17 "$d.2.log"
  expect_log "correct result: said" "$d.2.log" "correct result: other hardware reproduces .*next launch skips the iteration"
  run "$d.3.log" "${args[@]}" --load "$d"
  expect_rc "correct result: the next launch" $? 0 "$d.3.log"
  expect_log "correct result: skip from the tracker" "$d.3.log" "skipping iteration\\(s\\) 5 \\(reproduced twice on a rank"
  expect_log "correct result: iteration 5 skipped" "$d.3.log" "iteration 5 skipped .*its 8 samples consumed"
  same_losses "$work/clean.jsonl" "$d.jsonl" 1 4 && ok "correct result: iterations 1-4 equal the clean run's" ||
    bad "correct result: losses differ"
  python3 - "$d.jsonl" <<'EOF' && ok "correct result: 7 updates, 64 samples" || bad "correct result: consumed samples"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "lm_loss" in json.loads(l)]
last = [r for r in rows if r["iteration"] == 8][-1]
assert last["consumed_samples"] == 64, last
EOF
fi

# --- --iterations-to-skip: samples consumed, no update ---
run "$work/skip.log" --iterations-to-skip 3 --metrics-file "$work/skip.jsonl"
expect_rc "--iterations-to-skip 3" $? 0 "$work/skip.log"
expect_log "--iterations-to-skip: said" "$work/skip.log" "iteration 3 skipped"
same_losses "$work/clean.jsonl" "$work/skip.jsonl" 1 2 && ok "skip: iterations 1-2 equal the clean run's" ||
  bad "skip: losses differ"
python3 - "$work/clean.jsonl" "$work/skip.jsonl" <<'EOF' && ok "skip: iteration 4 reads iteration 4's batch with 3 updates" || bad "skip: iteration 4"
import json, sys
clean = {json.loads(l)["iteration"]: json.loads(l) for l in open(sys.argv[1])}
skip = {json.loads(l)["iteration"]: json.loads(l) for l in open(sys.argv[2])}
assert skip[4]["consumed_samples"] == clean[4]["consumed_samples"] == 32
assert skip[4]["lr"] == clean[3]["lr"], (skip[4]["lr"], clean[3]["lr"])  # the schedule did not advance
assert skip[4]["lm_loss"] != clean[4]["lm_loss"]
# Megatron's record of a skipped iteration: no loss line; the next line counts it.
assert 3 not in skip, skip.get(3)
assert skip[4]["skipped_iterations"] == 1 and skip[4]["skipped_samples"] == 8, skip[4]
assert "skipped_iterations" not in skip[2] and "skipped_iterations" not in skip[5]
EOF
grep -q "iteration        3/" "$work/skip.log" && bad "skip: iteration 3 has a log line: $(grep 'iteration        3/' "$work/skip.log")" ||
  ok "skip: no log line for iteration 3"
grep -q "iteration        4/.*| skipped iterations: 1 | skipped samples: 8" "$work/skip.log" &&
  ok "skip: iteration 4's line counts the skipped one" || bad "skip: iteration 4's line: $(grep 'iteration        4/' "$work/skip.log")"
# The last iteration skipped: no later line, so its own says the count, without a loss.
run "$work/skip-last.log" --iterations-to-skip 8 --metrics-file "$work/skip-last.jsonl"
expect_rc "--iterations-to-skip 8 (the last)" $? 0 "$work/skip-last.log"
grep -qE "iteration 8/8 \| consumed samples: 64 \| skipped iterations: 1 \| skipped samples: 8" "$work/skip-last.log" &&
  tail -1 "$work/skip-last.jsonl" | grep -q '"iteration": 8, "consumed_samples": 64, "skipped_iterations": 1, "skipped_samples": 8}' &&
  ! tail -1 "$work/skip-last.jsonl" | grep -q lm_loss &&
  ok "skip of the last iteration: its line and record say it, without a loss" || bad "skip of the last iteration: $(tail -2 "$work/skip-last.log")"

# --- a real NaN on both ranks: 16, 17 elsewhere, and the next launch stops at once ---
if [ $can_unshare = 1 ]; then
  d=$work/nan
  args=(--save "$d" --save-interval 1 --lr 1e30 --lr-warmup-iters 0 --clip-grad 0)
  run "$d.1.log" "${args[@]}"
  rc=$?
  expect_rc "a real NaN" $rc 16 "$d.1.log"
  it=$(grep -oE "iteration ([0-9]+): the rerun in place reproduced" "$d.1.log" | head -1 | grep -oE "[0-9]+")
  run "$d.2.log" --host tessera-other "${args[@]}" --load "$d"
  expect_rc "a real NaN: on another host" $? 17 "$d.2.log"
  expect_log "a real NaN: correct result" "$d.2.log" "iteration $it: correct result"
  run "$d.3.log" "${args[@]}" --load "$d"
  expect_rc "a real NaN: the next launch stops at once" $? 17 "$d.3.log"
  expect_log "a real NaN: not skipped, said" "$d.3.log" "iteration $it: other hardware already reproduced the result of rank\\(s\\) 0,1.*would only repeat it: skip it with --iterations-to-skip $it"
fi

# --- --rerun-mode disabled: a NaN stops the run with one line; RERUN_DISABLED in the tracker ---
d=$work/disabled
run "$d.log" --rerun-mode disabled --lr 1e30 --lr-warmup-iters 0 --clip-grad 0 --save "$d"
expect_rc "--rerun-mode disabled" $? 1 "$d.log"
expect_log "disabled: the line" "$d.log" "training stopped \\(--rerun-mode disabled"
grep -q "status=RERUN_DISABLED" "$d/result_rejected_tracker.txt" && ok "disabled: tracker line" ||
  bad "disabled: tracker line"

# --- a damaged newest checkpoint: one line naming the file and the newest that verifies; --load-fallback ---
d=$work/damaged
ITERS=6 run "$d.1.log" --save "$d" --save-interval 2
"$bin/test_checkpoint_tool" flip-byte "$d/iter_0000006/mp_rank_00_000.h5" /model/layers.1.mlp.fc1.weight >/dev/null ||
  bad "could not damage the checkpoint"
run "$d.2.log" --save "$d" --save-interval 2 --load "$d" --metrics-file "$d.jsonl"
rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c error "$d.2.log")" -eq 1 ] &&
  grep -qE "iter_0000006/mp_rank_00_000.h5.*layers.1.mlp.fc1.weight.*checksum.*the newest checkpoint that verifies is iteration 4 .*--load-fallback" "$d.2.log"; then
  ok "damaged checkpoint: one line naming the file and iteration 4"
else bad "damaged checkpoint: exit $rc"; cat "$d.2.log"; fi
run "$d.3.log" --save "$d" --save-interval 2 --load "$d" --load-fallback --metrics-file "$d.jsonl"
expect_rc "--load-fallback" $? 0 "$d.3.log"
expect_log "--load-fallback: said" "$d.3.log" "--load-fallback: loading iteration 4 instead"
expect_log "--load-fallback: the checksum cost printed" "$d.3.log" "checksums of what it read verified in [0-9.e-]+ s \([0-9]+ % of the load\)"
grep -q "iteration=4 status=LOAD_FALLBACK" "$d/result_rejected_tracker.txt" && ok "--load-fallback: tracker line" ||
  bad "--load-fallback: no tracker line"
same_losses "$work/clean.jsonl" "$d.jsonl" 5 8 && ok "--load-fallback: iterations 5-8 equal the clean run's" ||
  bad "--load-fallback: losses differ"
# Every damage verify finds falls back the same way (issue 58): a truncated, empty or missing
# shard, `latest` naming a missing iteration; the error names the iterations present.
for kind in truncated empty missing latest; do
  d=$work/damage-$kind
  ITERS=6 run "$d.1.log" --save "$d" --save-interval 2
  f=$d/iter_0000006/mp_rank_00_000.h5
  want=4
  case $kind in
    truncated) truncate -s $(($(stat -c %s "$f") / 2)) "$f" ;;
    empty) : > "$f" ;;
    missing) rm "$f" ;;
    latest) echo 8 > "$d/latest_checkpointed_iteration.txt"; want=6 ;;
  esac
  run "$d.2.log" --load "$d"
  rc=$?
  if [ $rc -eq 2 ] && [ "$(grep -c error "$d.2.log")" -eq 1 ] &&
    grep -qE "the newest checkpoint that verifies is iteration $want \(.*iterations present: 2, 4, 6\): resume from it with --load-fallback" "$d.2.log"; then
    ok "$kind newest checkpoint: one line naming iteration $want and those present"
  else bad "$kind newest checkpoint: exit $rc"; cat "$d.2.log"; fi
  run "$d.3.log" --load "$d" --load-fallback
  expect_rc "$kind: --load-fallback" $? 0 "$d.3.log"
  expect_log "$kind: --load-fallback loads iteration $want" "$d.3.log" "--load-fallback: loading iteration $want instead"
done

# --- --log-straggler names the rank made slow (each way round) ---
for slow in 0 1; do
  run "$work/straggler$slow.log" --log-straggler --log-interval 4 --straggler-injection "$slow:0.05"
  expect_rc "--straggler-injection $slow:0.05" $? 0 "$work/straggler$slow.log"
  n=$(grep -cE "straggler report, iterations [15] to [48] .*slowest rank $slow on $host \\(compute [0-9.]+ ms, waiting [0-9.]+ ms\\) \\| fastest rank $((1 - slow)) on $host" "$work/straggler$slow.log")
  [ "$n" -eq 2 ] && ok "--log-straggler names rank $slow as the slowest, twice" ||
    { bad "--log-straggler: $n reports naming rank $slow"; grep straggler "$work/straggler$slow.log"; }
done

# --- bad options: one line, exit 2 ---
for a in "--rerun-mode sometimes" "--error-injection-at 0" "--error-injection-at 5:x" \
  "--error-injection-at 5:2" "--iterations-to-skip abc" "--iterations-to-skip 0" \
  "--error-injection-type sometimes --error-injection-rate 3" "--error-injection-type correct_result" \
  "--rerun-mode disabled --error-injection-rate 5" "--rerun-mode report_stats --check-for-spiky-loss" \
  "--result-rejected-tracker-filename /proc/nope/tracker.txt" "--straggler-injection 1" \
  "--straggler-injection x:1" "--straggler-injection 1:-2" "--straggler-minmax-count 0"; do
  # shellcheck disable=SC2086
  run "$work/bad.log" $a
  rc=$?
  lines=$(grep -c "error" "$work/bad.log")
  if [ $rc -eq 2 ] && [ "$lines" -eq 1 ]; then ok "$a: exit 2, one line"; else
    bad "$a: exit $rc, $lines error lines"; cat "$work/bad.log"; fi
done

exit $fail
