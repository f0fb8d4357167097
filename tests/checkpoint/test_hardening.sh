#!/usr/bin/env bash
# test_hardening.sh: checkpoints under faults and read-only use (issue 18).
#  1. Reading a checkpoint never writes it: with the checkpoint directory read-only (and, as
#     root, the tools run as user nobody so the permissions bite), tessera-eval, tessera-generate,
#     tessera-convert --to-hf, tessera-reshard, tessera-checkpoint verify and a resume into another
#     --save all succeed, an export into the read-only directory is bad input (exit 2), and every
#     file of the checkpoint is byte-identical with the same mtime afterwards.
#  2. --async-save at TP2 x PP2: training is unchanged, a resume from a background-written
#     checkpoint is exact; a failing write is reported at the next iteration with the previous
#     checkpoint kept; a full disk (a small tmpfs) during a background save keeps the previous
#     checkpoint loadable; SIGTERM during a background save waits for it, saves and exits 0.
#  3. kill -9 of one rank at 10 random moments while TP2 x PP2 saves (slowed down with
#     TESSERA_SLOW_SAVE_MS so the kill lands inside saves), synchronous and --async-save: every
#     time the latest checkpoint loads and the next iteration's loss equals the uninterrupted
#     run's, bitwise.
# Usage: test_hardening.sh BIN_DIR CONFIG_DIR VOCAB_DIR [main|kills]   (default: both; ctest runs
# them as two tests, and the sanitizer pass leaves out the timing-driven kills)
set -u
bin=$1
configs=$2
vocab=$3
part=${4:-all}
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
chmod 755 "$work"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
mpi() { local np=$1; shift; timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "$@"; }
# As root, permissions do not stop writes: run the readers as user nobody.
as_reader() {
  if [ "$(id -u)" = 0 ]; then setpriv --reuid=65534 --regid=65534 --clear-groups "$@"; else "$@"; fi
}

for i in $(seq 1 300); do echo "{\"text\": \"Line $i: the cat sat on the mat number $((i * 7 % 13)), and the dog ran.\"}"; done > "$work/c.jsonl"
"$bin/tessera-preprocess" --input "$work/c.jsonl" --vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe" \
  --output-prefix "$work/c" --workers 1 > /dev/null || bad "preprocess"
T=(--config "$configs/gpt2-tiny.ini" --vocab-size 0 --seq-length 32 --max-position-embeddings 32 --data-path "$work/c" --split 80,20,0 --threads 1)

A=(--config "$configs/gpt2-tiny.ini" --vocab-size 500 --threads 1 --tensor-model-parallel-size 2
   --pipeline-model-parallel-size 2 --log-interval 1 --lr-decay-iters 60)
strip() { sed 's/, "ms_per_iter.*//' "$@"; }  # the metrics without the timings
mpi 4 "$bin/tessera-train" "${A[@]}" --train-iters 60 --metrics-file "$work/ref.jsonl" > "$work/ref.log" 2>&1 || bad "reference run: $(tail -3 "$work/ref.log")"

if [ "$part" != kills ]; then
# 1. Read-only checkpoints.
mpi 4 "$bin/tessera-train" "${T[@]}" --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --train-iters 4 --save "$work/ro" > "$work/ro.log" 2>&1 || bad "training the checkpoint: $(tail -3 "$work/ro.log")"
snapshot() { (cd "$work/ro" && find . -printf '%p %s %T@ %m\n' | sort && find . -type f -exec sha256sum {} + | sort); }
chmod -R a-w "$work/ro"
before=$(snapshot)
as_reader touch "$work/ro/probe" 2> /dev/null && bad "the read-only set-up does not stop writes" || ok "set-up: a reader cannot write into the checkpoint"
mkdir -m 777 "$work/out"
ro() {  # WHAT CMD...: runs as a reader; ok when it exits 0
  local what=$1 out rc
  shift
  out=$(as_reader "$@" 2>&1); rc=$?
  [ $rc -eq 0 ] && ok "read-only checkpoint: $what" || bad "read-only checkpoint: $what: rc $rc: $(tail -3 <<<"$out")"
}
ro "tessera-eval" "$bin/tessera-eval" --load "$work/ro" --data-path "$work/c" --split 80,20,0 --threads 1
ro "tessera-generate" "$bin/tessera-generate" --load "$work/ro" --prompt-ids "5 17 42" --max-new-tokens 8 --greedy --threads 1
ro "tessera-convert --to-hf" "$bin/tessera-convert" --to-hf --load "$work/ro" --save "$work/out/hf"
ro "tessera-reshard to TP1 x PP1" "$bin/tessera-reshard" --load "$work/ro" --save "$work/out/tp1" \
  --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1
ro "a resume into another --save" "$bin/tessera-train" "${T[@]}" --train-iters 6 --load "$work/ro" --save "$work/out/cont"
ro "tessera-checkpoint verify" "$bin/tessera-checkpoint" verify "$work/ro"
out=$(as_reader "$bin/tessera-convert" --to-hf --load "$work/ro" --save "$work/ro" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "error: --save '$work/ro' is not writable" <<<"$out" \
  && ok "tessera-convert --to-hf into a directory it cannot write: rc 2 (bad input), one line" || bad "--to-hf into a read-only directory: rc $rc: $out"
after=$(snapshot)
[ -n "$before" ] && [ "$before" = "$after" ] && ok "the checkpoint is unchanged: $(grep -c ' ' <<<"$before") entries, same bytes, sizes, mtimes and modes" \
  || bad "the checkpoint changed: $(diff <(echo "$before") <(echo "$after") | head -5)"

# 2. --async-save.
mpi 4 "$bin/tessera-train" "${A[@]}" --train-iters 8 --save "$work/as" --save-interval 4 --async-save \
  --metrics-file "$work/as.jsonl" > "$work/as.log" 2>&1 || bad "async run: $(tail -3 "$work/as.log")"
[ "$(strip "$work/as.jsonl")" = "$(strip "$work/ref.jsonl" | head -8)" ] && [ "$(cat "$work/as/latest_checkpointed_iteration.txt")" = 8 ] \
  && grep -q "saved checkpoint $work/as/iter_0000004 in .* in the background (--async-save; the loop was blocked" "$work/as.log" \
  && ok "--async-save: 8 iterations as without it; iterations 4 and 8 committed in the background" || bad "async run: $(tail -3 "$work/as.log")"
mpi 4 "$bin/tessera-train" "${A[@]}" --train-iters 8 --load "$work/as/iter_0000004" --metrics-file "$work/as-res.jsonl" > "$work/as-res.log" 2>&1
[ "$(strip "$work/as-res.jsonl")" = "$(strip "$work/ref.jsonl" | sed -n 5,8p)" ] \
  && ok "a resume from the background-written iteration 4 gives iterations 5-8 bitwise" || bad "async resume: $(tail -3 "$work/as-res.log")"
out=$(TESSERA_FAULT_SAVE_RANK=1:8 mpi 4 "$bin/tessera-train" "${A[@]}" --train-iters 12 --save "$work/af" --save-interval 4 --async-save 2>&1); rc=$?
if [ $rc -ne 0 ] && [ "$(cat "$work/af/latest_checkpointed_iteration.txt")" = 4 ] && [ ! -e "$work/af/iter_0000008" ] && [ ! -e "$work/af/iter_0000008.tmp" ] \
   && grep -q "saving the checkpoint of iteration 8 to '$work/af' failed.*the previous checkpoint is intact" <<<"$out" && grep -q "iteration *9/" <<<"$out"; then
  ok "a background write failing on rank 1: reported after iteration 9, exit $rc, latest stays 4, no partial iteration 8"
else
  bad "failing async save: rc $rc, latest $(cat "$work/af/latest_checkpointed_iteration.txt" 2>/dev/null): $(grep -i error <<<"$out" | head -3)"
fi
# A full disk: a tmpfs with room for one checkpoint and a half.
need=$(du -sb "$work/as/iter_0000004" | cut -f1)
mkdir -p "$work/tfs"
if mount -t tmpfs -o size=$((need * 3 / 2)) tmpfs "$work/tfs" 2> /dev/null; then
  out=$(mpi 4 "$bin/tessera-train" "${A[@]}" --train-iters 12 --save "$work/tfs/ck" --save-interval 4 --async-save 2>&1); rc=$?
  latest=$(cat "$work/tfs/ck/latest_checkpointed_iteration.txt" 2>/dev/null)
  if [ $rc -ne 0 ] && [ "$latest" = 4 ] && grep -q "the previous checkpoint is intact" <<<"$out" && [ ! -e "$work/tfs/ck/iter_0000008" ]; then
    ok "a full disk during a background save: exit $rc, latest stays 4 ($(grep -o 'failed: [^;]*' <<<"$out" | head -1 | cut -c1-120))"
  else
    bad "full disk: rc $rc latest '$latest': $(grep -i error <<<"$out" | head -3)"
  fi
  cp -r "$work/tfs/ck" "$work/full-ck"
  umount "$work/tfs"
  mpi 4 "$bin/tessera-train" "${A[@]}" --train-iters 5 --load "$work/full-ck" --metrics-file "$work/full-res.jsonl" > /dev/null 2>&1
  [ "$(strip "$work/full-res.jsonl")" = "$(strip "$work/ref.jsonl" | sed -n 5p)" ] && ok "the checkpoint kept on the full disk resumes exactly" || bad "resume after a full disk"
else
  echo "skip: a full disk needs a tmpfs mount (not permitted here)"
fi
# SIGTERM while a background save is writing (slowed): the run waits for it, saves and exits 0.
TESSERA_SLOW_SAVE_MS=40 mpirun --oversubscribe --bind-to none -np 4 "$bin/tessera-train" "${A[@]}" --train-iters 200 \
  --save "$work/st" --save-interval 3 --async-save > "$work/st.log" 2>&1 &
mp=$!
for _ in $(seq 1 300); do grep -q "writing $work/st/iter_0000003 in the background" "$work/st.log" && break; sleep 0.1; done
kill -TERM $(pgrep -P $mp -x tessera-train | head -1) 2> /dev/null
wait $mp; rc=$?
latest=$(cat "$work/st/latest_checkpointed_iteration.txt" 2>/dev/null)
if [ $rc -eq 0 ] && [ -n "$latest" ] && [ "$latest" -gt 3 ] && [ -d "$work/st/iter_0000003" ] && grep -q "received signal 15" "$work/st.log" \
   && ! ls -d "$work"/st/*.tmp > /dev/null 2>&1; then
  ok "SIGTERM during the background save of iteration 3: it finished, iteration $latest saved, exit 0"
else
  bad "SIGTERM during an async save: rc $rc latest '$latest': $(tail -3 "$work/st.log")"
fi

fi

# Ctrl-C (issue 39): the first SIGINT saves and stops as SIGTERM does; a second exits at once.
# The second is sent once the first was taken (logged), while the (slowed) save writes: two
# signals sent back to back may reach the process as one (the kernel merges a pending signal).
[ "$part" != kills ] && for n in 1 2; do
  slow=0
  [ $n -eq 2 ] && slow=100
  TESSERA_SLOW_SAVE_MS=$slow "$bin/tessera-train" "${T[@]}" --train-iters 100000 --log-interval 1 \
    --save "$work/int$n" --save-interval 100000 > "$work/int$n.log" 2>&1 &
  p=$!
  for _ in $(seq 1 300); do grep -q " iteration        2/" "$work/int$n.log" && break; sleep 0.1; done
  kill -INT $p
  if [ $n -eq 2 ]; then
    for _ in $(seq 1 300); do grep -q "received signal 2" "$work/int$n.log" && break; sleep 0.02; done
    kill -INT $p
  fi
  wait $p; rc=$?
  latest=$(cat "$work/int$n/latest_checkpointed_iteration.txt" 2>/dev/null)
  if [ $n -eq 1 ] && [ $rc -eq 0 ] && [ -n "$latest" ] && grep -q "received signal 2 (SIGINT)" "$work/int1.log"; then
    ok "one Ctrl-C: iteration $latest saved, exit 0"
  elif [ $n -eq 2 ] && [ $rc -eq 130 ] && grep -q "second SIGINT: exiting at once" "$work/int2.log"; then
    ok "two Ctrl-C: exit 130 at once"
  else
    bad "Ctrl-C x $n: rc $rc latest '$latest': $(tail -n 3 "$work/int$n.log")"
  fi
done

# 3. kill -9 of one rank at 10 random moments during saves, in one checkpoint directory.
kills() {  # NAME [--async-save]
  local name=$1 d=$work/kill-$1 trial loaded=0 midsave=0 latest rank mp
  shift
  RANDOM=7
  for trial in $(seq 1 10); do
    local load=()
    [ -f "$d/latest_checkpointed_iteration.txt" ] && load=(--load "$d")
    TESSERA_SLOW_SAVE_MS=10 mpirun --oversubscribe --bind-to none -np 4 "$bin/tessera-train" "${A[@]}" --train-iters 1000 \
      --save "$d" --save-interval 1 --keep-checkpoints 2 "${load[@]}" "$@" > "$work/k.log" 2>&1 &
    mp=$!
    # Once this run has saved (start-up takes longer on a busy machine), a random moment.
    for _ in $(seq 1 1200); do grep -qE "^saved checkpoint|in the background \(--async-save\)$" "$work/k.log" && break; sleep 0.1; done
    sleep "$((RANDOM % 3)).$((RANDOM % 10))"
    rank=$((RANDOM % 4))
    kill -9 "$(pgrep -P $mp -x tessera-train | sed -n "$((rank + 1))p")" 2> /dev/null
    wait $mp 2> /dev/null
    latest=$(cat "$d/latest_checkpointed_iteration.txt" 2>/dev/null)
    # Mid-save: this run left the directory of a later iteration unfinished.
    for t in "$d"/iter_*.tmp; do
      [ -e "$t" ] && [ -n "$latest" ] && [ "$((10#$(basename "$t" .tmp | sed 's/iter_//')))" -gt "$latest" ] && { midsave=$((midsave + 1)); break; }
    done
    [ -n "$latest" ] || { bad "$name kill $trial: no checkpoint yet ($(tail -2 "$work/k.log"))"; continue; }
    rm -f "$work/k.jsonl"
    mpi 4 "$bin/tessera-train" "${A[@]}" --train-iters $((latest + 1)) --load "$d" --metrics-file "$work/k.jsonl" > "$work/kr.log" 2>&1
    if [ "$(strip "$work/k.jsonl")" = "$(strip "$work/ref.jsonl" | sed -n "$((latest + 1))p")" ]; then
      loaded=$((loaded + 1))
    else
      bad "$name kill $trial (rank $rank): iteration $latest did not resume exactly: $(tail -2 "$work/kr.log")"
    fi
  done
  [ $loaded -eq 10 ] && [ $midsave -ge 1 ] && ok "kill -9 $name: 10/10 loaded and resumed exactly ($midsave of the kills left a partial save behind; last iteration $latest)" \
    || bad "kill -9 $name: $loaded/10 loaded, $midsave mid-save"
}
if [ "$part" != main ]; then
  kills sync
  kills async --async-save
fi

[ $fail -eq 0 ] && echo "hardening: all passed"
exit $fail
