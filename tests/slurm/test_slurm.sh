#!/usr/bin/env bash
# test_slurm.sh: the shipped Slurm scripts on a real single-node Slurm (Debian's slurm-wlm and
# munge, installed here when missing, started on this host with a generated slurm.conf, stopped at
# the end): sbatch of slurm/train.sbatch completes and writes its checkpoint and log; a resubmit
# continues from that checkpoint; scancel --signal=USR1 saves a checkpoint, exits cleanly and the
# script requeues the job, which then finishes; a rank killed with SIGKILL ends the job non-zero
# with the previous checkpoint intact; the script refuses to run outside Slurm.
# Usage: test_slurm.sh SOURCE_DIR
set -u
src=$1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then echo "FAIL: slurm-wlm and munge are not installed and this is not root"; exit 1; fi
  echo "installing slurm-wlm and munge"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge > /dev/null \
    || { echo "FAIL: cannot install slurm-wlm and munge"; exit 1; }
fi
work=$(mktemp -d /tmp/tessera_slurm_XXXXXX)
host=$(hostname)
port=$(( 20000 + RANDOM % 20000 ))
# The machine's cores (nproc alone honours OMP_NUM_THREADS: a test run with OMP_NUM_THREADS=1
# would declare one CPU, and jobs of two tasks would pend forever).
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
export SLURM_CONF=$work/slurm.conf
cat > "$SLURM_CONF" <<CONF
ClusterName=tessera-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
SlurmctldPort=$port
SlurmdPort=$(( port + 1 ))
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=10
MinJobAge=600
NodeName=$host CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
mkdir -p "$work/state" "$work/spool"
started_munge=0
if ! munge -n 2>/dev/null | unmunge > /dev/null 2>&1; then
  [ -f /etc/munge/munge.key ] || mungekey --create > /dev/null 2>&1 || /usr/sbin/create-munge-key -f > /dev/null 2>&1
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null
  munged --force > /dev/null 2>&1 || munged > /dev/null 2>&1
  started_munge=1
  sleep 1
fi
cleanup() {
  scancel --user=root > /dev/null 2>&1
  sleep 1
  [ -f "$work/slurmd.pid" ] && kill "$(cat "$work/slurmd.pid")" 2>/dev/null
  [ -f "$work/slurmctld.pid" ] && kill "$(cat "$work/slurmctld.pid")" 2>/dev/null
  pkill -f "slurmstepd.*$work" 2>/dev/null
  [ $started_munge -eq 1 ] && pkill -x munged 2>/dev/null
  sleep 1
  rm -rf "$work"
}
trap cleanup EXIT
slurmctld -f "$SLURM_CONF" && slurmd -f "$SLURM_CONF" || { echo "FAIL: cannot start slurmctld/slurmd"; cat "$work"/*.log 2>/dev/null | tail -20; exit 1; }
for _ in $(seq 1 30); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo -h -o %T | grep -q idle || { echo "FAIL: the Slurm node did not become idle"; tail -20 "$work"/*.log; exit 1; }
ok "single-node Slurm up on $host (ports $port/$((port + 1)))"

# Outside Slurm the script refuses to run.
out=$(env -u SLURM_JOB_ID bash "$src/slurm/train.sbatch" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "submit it with: sbatch" <<<"$out" && ok "train.sbatch outside Slurm -> rc 2" || bad "outside Slurm: rc $rc $out"

ck=$work/ckpt
submit() {  # submit TRAIN_ITERS EXTRA REQUEUE -> job id
  (cd "$work" && sbatch --parsable --gpus-per-node=0 --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 \
     --time=20 --job-name=tiny \
     --export=ALL,TESSERA_DIR="$src",CONFIG=configs/gpt2-tiny.ini,CKPT_DIR="$ck",TRAIN_ITERS="$1",REQUEUE="$3",EXTRA_ARGS="--tensor-model-parallel-size 2 --log-interval 10 --threads 1 $2" \
     "$src/slurm/train.sbatch")
}
wait_done() {  # wait_done JOB SECONDS: until the job is gone from squeue
  for _ in $(seq 1 "$2"); do
    squeue -h -j "$1" 2>/dev/null | grep -q . || return 0
    sleep 1
  done
  return 1
}
state_of() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
exit_of() { scontrol show job "$1" 2>/dev/null | grep -o ' ExitCode=[0-9:]*' | cut -d= -f2; }

# 1. A job runs to the end and writes its checkpoint and log.
j=$(submit 20 "--save-interval 10" 1)
wait_done "$j" 240 || bad "job $j did not finish in 240 s"
log=$work/tiny-$j.out
if [ "$(state_of "$j")" = COMPLETED ] && grep -q "training finished after 20 iterations" "$log" && [ "$(cat "$ck/latest_checkpointed_iteration.txt")" = 20 ]; then
  ok "sbatch train.sbatch: job $j COMPLETED, 20 iterations, checkpoint iteration 20, log $(basename "$log")"
else
  bad "first job $j: state $(state_of "$j"), latest $(cat "$ck/latest_checkpointed_iteration.txt" 2>/dev/null); $(tail -5 "$log" "$work/tiny-$j.err" 2>/dev/null)"
fi
grep -q "rank = tp + TP" "$log" && grep -qE "^ +1 +1 +0 +0 +1 +$host" "$log" && ok "layout table under srun --mpi=pmix (rank, local rank, host)" || bad "no layout table in $log"

# 2. A resubmitted job continues from that checkpoint.
j=$(submit 30 "" 1)
wait_done "$j" 240 || bad "job $j did not finish"
log=$work/tiny-$j.out
grep -q "resuming from $ck (iteration 20)" "$log" && grep -q "loaded checkpoint.*iteration 20" "$log" && grep -q "training finished after 30 iterations" "$log" \
  && ok "resubmitted job $j continued from iteration 20 to 30" || bad "resubmit: $(tail -5 "$log")"

# 3. scancel --signal=USR1: checkpoint, clean exit, requeue, and the requeued job finishes.
j=$(submit 3000 "" 1)
log=$work/tiny-$j.out
for _ in $(seq 1 120); do grep -q "iteration       40/" "$log" 2>/dev/null && break; sleep 1; done
scancel --signal=USR1 "$j"
for _ in $(seq 1 120); do grep -q "requeueing job" "$log" 2>/dev/null && break; sleep 1; done
if grep -q "received signal 10 (SIGUSR1)" "$log" && grep -q "tessera-train exited 0" "$log" && grep -q "requeueing job $j" "$log"; then
  stopped=$(grep -o "stopping after iteration [0-9]*" "$log" | head -1 | awk '{print $4}')
  ok "scancel --signal=USR1: saved at iteration $stopped, exited 0, job requeued"
  # Slurm holds a requeued job for about two minutes (EligibleTime = requeue + 121 s); the test
  # makes it eligible now (what an administrator's `scontrol update StartTime=now` does), so the
  # wait is the resume itself.
  for _ in $(seq 1 30); do [ "$(state_of "$j")" = PENDING ] && break; sleep 1; done
  scontrol update JobId="$j" StartTime=now > /dev/null 2>&1 || bad "scontrol update StartTime=now of the requeued job $j"
  # Let the requeued job resume, then stop it for good (USR1 again with REQUEUE still 1 would loop:
  # cancel it once it has resumed from the saved iteration).
  for _ in $(seq 1 180); do grep -q "resuming from $ck (iteration $stopped)" "$log" && break; sleep 1; done
  grep -q "resuming from $ck (iteration $stopped)" "$log" && ok "the requeued job resumed from iteration $stopped" || bad "requeued job did not resume: $(tail -5 "$log")"
  for _ in $(seq 1 60); do [ "$(grep -c 'loaded checkpoint' "$log")" -ge 2 ] && break; sleep 1; done
  scancel "$j"
  wait_done "$j" 60
else
  bad "USR1: $(tail -8 "$log")"
  scancel "$j"
fi

# 4. A rank killed with SIGKILL ends the job non-zero; the previous checkpoint stays loadable.
before=$(cat "$ck/latest_checkpointed_iteration.txt")
j=$(submit 100000 "--save-interval 1000000 --distributed-timeout-minutes 1" 0)
log=$work/tiny-$j.out
for _ in $(seq 1 120); do grep -q "iteration  *[0-9]*/  100000" "$log" 2>/dev/null && break; sleep 1; done
victim=$(pgrep -f "tessera-train --config configs/gpt2-tiny.ini.*--train-iters 100000" | tail -1)
t0=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
wait_done "$j" 120
t1=$(date +%s)
after=$(cat "$ck/latest_checkpointed_iteration.txt")
if [ -n "$victim" ] && [ "$(state_of "$j")" != COMPLETED ] && [ "$after" = "$before" ] && [ $((t1 - t0)) -le 90 ]; then
  ok "SIGKILL of a rank: job $j $(state_of "$j") (exit $(exit_of "$j")) after $((t1 - t0)) s; latest still $after"
else
  bad "SIGKILL: victim '$victim', state $(state_of "$j"), $((t1 - t0)) s, latest $before -> $after; $(tail -3 "$log")"
fi
out=$("$src/build/bin/tessera-train" --config "$src/configs/gpt2-tiny.ini" --load "$ck" --skip-train --eval-iters 1 --threads 1 2>&1)
grep -q "validation loss at iteration $after" <<<"$out" && ok "checkpoint $after loads after the crash" || bad "load after crash: $out"

[ $fail -eq 0 ] && echo "slurm: all passed"
exit $fail
