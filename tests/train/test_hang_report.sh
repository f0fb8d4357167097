#!/usr/bin/env bash
# test_hang_report.sh: issue 39 point 4 through tessera-train under mpirun, as a user meets it.
# (1) The hang watchdog names the collective that is stuck, its group, the ranks that did not
# arrive and where they are: one rank made slower than --distributed-timeout-minutes (DP 2: the
# other waits in the data-parallel all_reduce; PP 2: the other waits in a point-to-point call
# with it). (2) --disable-straggler-on-startup starts the straggler report off, a connection to
# --straggler-ctrlr-port turns it on (the reply says so) and the reports follow; (3) bad values.
# Usage: test_hang_report.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
run() {  # run LOG ARGS...: two ranks of the tiny model; the exit code
  local log=$1
  shift
  mpirun --oversubscribe --bind-to none -np 2 "$bin/tessera-train" --config "$configs/gpt2-tiny.ini" \
    --mock-data --vocab-size 500 --threads 1 --device cpu --log-interval 1 \
    --global-batch-size 8 --micro-batch-size 2 "$@" >"$log" 2>&1
}
expect_log() {  # expect_log WHAT LOG PATTERN
  if grep -qE -- "$3" "$2"; then ok "$1"; else bad "$1: no /$3/ in $2"; tail -5 "$2"; fi
}

# --- (1) the watchdog names the stuck collective ---
# Rank 1 sleeps 60 s before its forward from iteration 1 on; the timeout is 3 s.
run "$work/dp.log" --train-iters 4 --distributed-timeout-minutes 0.05 --straggler-injection 1:60
rc=$?
[ $rc -eq 3 ] && ok "DP 2 hang: exit 3" || { bad "DP 2 hang: exit $rc, expected 3"; tail -5 "$work/dp.log"; }
expect_log "DP 2 hang: rank 0 names the all_reduce on the data-parallel group and rank 1, computing" \
  "$work/dp.log" \
  "rank 0 .*no progress .*every rank still answers.*: all_reduce #[0-9]+ on the data-parallel group \(ranks 0,1\) is stuck: rank\(s\) 0 wait in it; rank\(s\) 1 did not arrive \(rank 1: not in a collective \(computing after iteration 0\)\)"
[ "$(grep -c 'error: no progress' "$work/dp.log")" -ge 1 ] && ok "DP 2 hang: one line per rank at most" ||
  bad "DP 2 hang: no error line"

run "$work/pp.log" --train-iters 4 --pipeline-model-parallel-size 2 --distributed-timeout-minutes 0.05 \
  --straggler-injection 1:60
rc=$?
[ $rc -eq 3 ] && ok "PP 2 hang: exit 3" || { bad "PP 2 hang: exit $rc, expected 3"; tail -5 "$work/pp.log"; }
expect_log "PP 2 hang: rank 0 waits in a point-to-point call with rank 1 on the pipeline group, in a named pass" \
  "$work/pp.log" \
  "rank 0 .*no progress .*rank 0 waits in (send|recv|send_recv) with rank 1 on the pipeline (gradient )?group in the (forward|backward) of micro-batch [0-9]+ \(rank 1: not in a collective \(computing after iteration 0\)\)"

# --- (2) the straggler report toggled at run time ---
port=$((20000 + $$ % 20000))
run "$work/toggle.log" --train-iters 400 --log-straggler --disable-straggler-on-startup \
  --straggler-ctrlr-port "$port" --straggler-injection 1:0.02 &
job=$!
for _ in $(seq 1 300); do grep -q 'toggles it' "$work/toggle.log" && break; sleep 0.1; done
expect_log "the controller says where it listens" "$work/toggle.log" \
  "straggler report off; a connection to [^ ]+:$port toggles it \(--straggler-ctrlr-port\)"
for _ in $(seq 1 300); do grep -q 'iteration *5/' "$work/toggle.log" && break; sleep 0.1; done
favicon=$(exec 3<>"/dev/tcp/127.0.0.1/$port" && printf 'GET /favicon.ico HTTP/1.0\r\n\r\n' >&3 && cat <&3)
echo "$favicon" | grep -q '404 Not Found' && ok "another path is answered 404 and toggles nothing" ||
  bad "the favicon request's reply: $favicon"
before=$(grep -c 'straggler report, iterations' "$work/toggle.log")
reply=$(exec 3<>"/dev/tcp/127.0.0.1/$port" && printf 'GET / HTTP/1.0\r\n\r\n' >&3 && cat <&3)
echo "$reply" | grep -q 'straggler report on' && ok "the toggle answers: $(echo "$reply" | tail -1)" ||
  bad "the toggle's reply: $reply"
for _ in $(seq 1 300); do
  [ "$(grep -c 'straggler report, iterations' "$work/toggle.log")" -ge 2 ] && break
  sleep 0.1
done
after=$(grep -c 'straggler report, iterations' "$work/toggle.log")
[ "$before" -eq 0 ] && [ "$after" -ge 2 ] && ok "no report while off, $after after the toggle" ||
  bad "reports: $before before the toggle, $after after"
expect_log "the log says it was turned on" "$work/toggle.log" "straggler report turned on"
expect_log "the report names rank 1 as the slowest" "$work/toggle.log" \
  "straggler report, iterations [0-9]+ to [0-9]+ .*slowest rank 1 on "
kill "$job" 2>/dev/null
wait "$job" 2>/dev/null

# --- (3) bad values: one line, exit 2 ---
for args in "--straggler-ctrlr-port 70000" "--disable-straggler-on-startup"; do
  # shellcheck disable=SC2086
  run "$work/bad.log" --train-iters 1 $args
  rc=$?
  lines=$(grep -c 'error' "$work/bad.log")
  [ $rc -eq 2 ] && [ "$lines" -eq 1 ] && ok "$args: exit 2, $(grep error "$work/bad.log")" ||
    { bad "$args: exit $rc, $lines error lines"; cat "$work/bad.log"; }
done
[ $fail -eq 0 ] && echo "hang report: all passed"
exit $fail
