#!/usr/bin/env bash
# test_mpi_cli.sh: multi-rank behaviour of tessera-train as a user meets it under mpirun:
# an impossible layout is reported once by rank 0 and every rank exits; the layout table is
# printed; the start-up line names an interleaved schedule's bubble and sequence parallelism;
# 4 unbound ranks on this machine's cores get their share of threads; a rank killed
# mid-run ends the whole job non-zero within seconds instead of hanging.
set -u
bin=$1
configs=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
mpirun=(mpirun --oversubscribe --bind-to none)
fail=0
check() {  # check NAME CONDITION-RESULT MESSAGE
  if [ "$2" -eq 0 ]; then echo "ok: $1"; else echo "FAIL: $1: $3"; fail=1; fi
}

out=$(timeout 60 "${mpirun[@]}" -np 6 "$bin" --config "$configs/gpt2-tiny.ini" --tensor-model-parallel-size 4 2>&1)
rc=$?
n=$(grep -c 'error: world size 6 is not divisible by --tensor-model-parallel-size=4' <<<"$out")
check "impossible layout (6 ranks, TP 4)" $([ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$n" -eq 1 ]; echo $?) "rc=$rc, $n error lines: $out"

out=$(timeout 60 "${mpirun[@]}" -np 2 "$bin" --config "$configs/gpt2-tiny.ini" --num-attention-heads 4 --tensor-model-parallel-size 2 --global-batch-size 6 --micro-batch-size 4 2>&1)
rc=$?
n=$(grep -c 'error: .*--global-batch-size' <<<"$out")
check "global batch not divisible" $([ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$n" -eq 1 ]; echo $?) "rc=$rc: $out"

out=$(timeout 120 "${mpirun[@]}" -np 4 "$bin" --config "$configs/gpt2-tiny.ini" --tensor-model-parallel-size 2 --train-iters 2 2>&1)
rc=$?
check "layout table and thread share" $([ $rc -eq 0 ] && grep -q 'TP 2 x PP 1 x DP 2' <<<"$out" && grep -qE '^ +3 +1 +0 +1 +3 ' <<<"$out" && grep -q ' 1 threads per rank' <<<"$out"; echo $?) "rc=$rc: $out"

# The start-up line names the schedule (interleaved: its bubble (P-1)/V / (m + (P-1)/V) =
# 0.5 / 4.5 with P 2, V 2, m 4) and sequence parallelism; --log-file creates its directory.
logdir=$(mktemp -d)
out=$(timeout 120 "${mpirun[@]}" -np 4 "$bin" --config "$configs/gpt2-tiny.ini" --tensor-model-parallel-size 2 \
      --pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1 \
      --sequence-parallel --train-iters 2 --log-file "$logdir/new/dir/train.log" 2>&1)
rc=$?
check "interleaved schedule and SP named" $([ $rc -eq 0 ] && grep -q 'interleaved 1F1B pipeline (2 model chunks per rank) bubble (theoretical) 0.1111.*; sequence parallelism on' <<<"$out" && grep -q 'interleaved 1F1B' "$logdir/new/dir/train.log"; echo $?) "rc=$rc: $out"
rm -rf "$logdir"

# Kill rank 2 with SIGKILL while the job trains; the job must end, non-zero, within 30 s.
log=$(mktemp)
"${mpirun[@]}" -np 4 "$bin" --config "$configs/gpt2-tiny.ini" --train-iters 100000 --log-interval 1 > "$log" 2>&1 &
job=$!
for _ in $(seq 1 100); do grep -q 'iteration' "$log" && break; sleep 0.2; done
victim=$(pgrep -P "$job" -f tessera-train | sed -n 3p)
start=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
for _ in $(seq 1 300); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$job" 2>/dev/null; then
  check "killed rank ends the job" 1 "mpirun still running 30 s after a rank was killed"
  kill -9 "$job"
else
  wait "$job"
  rc=$?
  check "killed rank ends the job (rc $rc after $(( $(date +%s) - start )) s)" $([ -n "$victim" ] && [ $rc -ne 0 ]; echo $?) "victim '$victim', rc=$rc"
fi
rm -f "$log"

# SIGUSR1 (Slurm's time-limit warning): every rank saves at the next step and the job exits 0.
ck=$(mktemp -d)
log=$(mktemp)
"${mpirun[@]}" -np 2 "$bin" --config "$configs/gpt2-tiny.ini" --train-iters 100000 --log-interval 5 \
  --tensor-model-parallel-size 2 --save "$ck" > "$log" 2>&1 &
job=$!
for _ in $(seq 1 100); do grep -q 'iteration' "$log" && break; sleep 0.2; done
pkill -USR1 -P "$job" -f tessera-train
for _ in $(seq 1 300); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
wait "$job"
rc=$?
check "SIGUSR1 saves and exits 0 (rc $rc, checkpoint $(cat "$ck/latest_checkpointed_iteration.txt" 2>/dev/null))" \
  $([ $rc -eq 0 ] && grep -q 'received signal 10 (SIGUSR1)' "$log" && [ -s "$ck/latest_checkpointed_iteration.txt" ]; echo $?) "$(tail -3 "$log")"
rm -rf "$ck" "$log"

# A rank that stops answering (SIGSTOP): the watchdog ends the job and rank 0 names it.
log=$(mktemp)
"${mpirun[@]}" -np 4 "$bin" --config "$configs/gpt2-tiny.ini" --train-iters 100000 --log-interval 5 \
  --distributed-timeout-minutes 0.1 > "$log" 2>&1 &
job=$!
for _ in $(seq 1 100); do grep -q 'iteration' "$log" && break; sleep 0.2; done
victim=$(pgrep -P "$job" -f tessera-train | sed -n 3p)
[ -n "$victim" ] && kill -STOP "$victim"
for _ in $(seq 1 400); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$job" 2>/dev/null; then
  check "hung rank ends the job" 1 "still running 40 s after a rank was stopped"
  kill -CONT "$victim" 2>/dev/null
  kill -9 "$job"
else
  wait "$job"
  rc=$?
  check "hung rank ends the job (rc $rc): $(grep -m1 'stopped answering' "$log")" \
    $([ -n "$victim" ] && [ $rc -ne 0 ] && grep -q 'rank(s) [0-9]* stopped answering' "$log"; echo $?) "$(tail -5 "$log")"
fi
[ -n "$victim" ] && kill -9 "$victim" 2>/dev/null
rm -f "$log"
[ $fail -eq 0 ] && echo "mpi cli: all passed"
exit $fail
