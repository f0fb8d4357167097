#!/usr/bin/env bash
# test_sbatch_rerun.sh: slurm/train.sbatch's answer to result validation's exit codes (issue 39),
# with srun and scontrol replaced by recorders (no Slurm needed): exit 16 requeues the job without
# the host the tracker file names as suspect, at most RERUN_REQUEUES times at one checkpoint (then
# it stops, naming the host); exit 17 stops without a requeue; a signal stop still requeues.
# Usage: test_sbatch_rerun.sh SOURCE_DIR
set -u
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
mkdir -p "$work/fake" "$work/tessera/build/bin" "$work/ckpt"
cp "$src/configs/gpt2-tiny.ini" "$work/tessera/tiny.ini"
printf '#!/bin/sh\nexit 0\n' > "$work/tessera/build/bin/tessera-train"
# srun: exits with the code in $work/rc (what tessera-train would have returned)
printf '#!/bin/sh\necho "srun $*" >> "%s/calls"\nexit $(cat "%s/rc")\n' "$work" "$work" > "$work/fake/srun"
# scontrol: records its calls; "show job" reports the exclusion list last set
cat > "$work/fake/scontrol" <<FAKE
#!/bin/sh
echo "scontrol \$*" >> "$work/calls"
if [ "\$1" = show ]; then echo "JobId=42 ExcNodeList=\$(cat "$work/excluded" 2>/dev/null || echo '(null)')"; fi
case "\$2" in ExcNodeList=*) echo "\${2#ExcNodeList=}" > "$work/excluded";; esac
case "\$3" in ExcNodeList=*) echo "\${3#ExcNodeList=}" > "$work/excluded";; esac
exit 0
FAKE
chmod +x "$work/fake/srun" "$work/fake/scontrol" "$work/tessera/build/bin/tessera-train"
echo 4 > "$work/ckpt/latest_checkpointed_iteration.txt"
echo "ts=1 node=gpu-node-7 device=3 jobID=42 rank=5 iteration=5 status=FIRST_RERUN_REPRODUCIBLE result=nan message='x'" \
  > "$work/ckpt/result_rejected_tracker.txt"
launch() {  # launch RC: one run of the batch script whose tessera-train exits RC
  echo "$1" > "$work/rc"
  : > "$work/calls"
  PATH=$work/fake:$PATH SLURM_JOB_ID=42 SLURM_JOB_NAME=t SLURM_JOB_NUM_NODES=2 SLURM_NTASKS=16 \
    SLURM_JOB_NODELIST=gpu-node-[1-8] TESSERA_DIR=$work/tessera CONFIG=tiny.ini CKPT_DIR=$work/ckpt \
    TRAIN_ITERS=10 RERUN_REQUEUES=2 bash "$src/slurm/train.sbatch" > "$work/out" 2>&1
}

launch 16
rc=$?
[ $rc -eq 16 ] && ok "exit 16 passed on" || bad "exit 16: script exited $rc"
grep -q "scontrol update JobId=42 ExcNodeList=gpu-node-7" "$work/calls" && ok "exit 16: the suspect host excluded" ||
  { bad "exit 16: no exclusion"; cat "$work/calls"; }
grep -q "scontrol requeue 42" "$work/calls" && ok "exit 16: requeued" || bad "exit 16: not requeued"
grep -q -- "--load $work/ckpt" "$work/calls" && ok "exit 16: the launch resumes from CKPT_DIR" || bad "no --load"

launch 16
grep -q "ExcNodeList=gpu-node-7$" "$work/calls" && grep -q "scontrol requeue 42" "$work/calls" &&
  ok "exit 16 again: requeued once more, the host listed once" || { bad "second exit 16"; cat "$work/calls"; }
launch 16
rc=$?
if [ $rc -eq 16 ] && ! grep -q "scontrol requeue" "$work/calls" &&
  grep -q "exit 16 again at checkpoint 4 (3 times; RERUN_REQUEUES=2): not requeueing; resubmit with other nodes (sbatch --exclude=gpu-node-7)" "$work/out"; then
  ok "a third exit 16 at the same checkpoint: no restart loop"
else bad "third exit 16: rc $rc"; cat "$work/out" "$work/calls"; fi
echo 6 > "$work/ckpt/latest_checkpointed_iteration.txt"
launch 16
grep -q "scontrol requeue 42" "$work/calls" && ok "exit 16 at a newer checkpoint: the count starts again" ||
  bad "newer checkpoint not requeued"

launch 17
rc=$?
[ $rc -eq 17 ] && ! grep -q "scontrol requeue" "$work/calls" && grep -q "exit 17 (result validation failed): not requeueing" "$work/out" &&
  ok "exit 17: stops" || { bad "exit 17: rc $rc"; cat "$work/out"; }
launch 0
grep -q "scontrol requeue 42" "$work/calls" && ok "a signal stop before the end: requeued" || bad "exit 0 not requeued"
exit $fail
