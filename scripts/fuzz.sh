#!/usr/bin/env bash
# fuzz.sh: builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan) into build-fuzz/
# and runs each for SECONDS (default 60) from its seed corpus in tests/fuzz/corpus/<target>/,
# two at a time. New inputs go to build-fuzz/corpus/<target>/ (the seeds stay as they are); a
# crash leaves build-fuzz/crash-<target>-* and makes the script exit 1: add that input to
# tests/fuzz/regressions/<target>/ once fixed (they run first, every time).
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]   (targets: bpe json safetensors config shard checkpoint)
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(bpe json safetensors config shard checkpoint)
case "$seconds" in ''|*[!0-9]*) echo "fuzz.sh: error: SECONDS must be a whole number, got '$seconds'" >&2; exit 2 ;; esac
for t in "${targets[@]}"; do
  [ -f "tests/fuzz/fuzz_$t.cpp" ] || { echo "fuzz.sh: error: no target '$t' (allowed: bpe json safetensors config shard checkpoint)" >&2; exit 2; }
done
for p in clang-14 libfuzzer-14-dev; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends clang-14 libfuzzer-14-dev || exit 1
    break
  fi
done
mkdir -p build-fuzz
cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo > build-fuzz/build.log 2>&1 \
  && cmake --build build-fuzz -j 2 >> build-fuzz/build.log 2>&1 || { echo "fuzz.sh: error: the build failed; see build-fuzz/build.log" >&2; tail -20 build-fuzz/build.log >&2; exit 1; }
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
# Each fuzzing process writes its inputs under a scratch directory of its own; they all go here and
# are removed at the end (fork mode starts many processes).
export TMPDIR=$PWD/build-fuzz/tmp
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
# A crash is upstream when a libhdf5 frame comes before the first Tessera frame of its stack.
upstream() {  # LOG
  awk '/^ +#[0-9]+ / { if ($0 ~ /tessera::|\/lib\/(core|data|checkpoint|model)\//) { print "no"; exit }
                       if ($0 ~ /libhdf5/) { print "yes"; exit } } END { }' "$1"
}
run() {  # TARGET: regressions first, then SECONDS of fuzzing
  local t=$1
  local dir=build-fuzz/corpus/$t log=build-fuzz/$t.log
  [ -n "$(ls -A "tests/fuzz/corpus/$t" 2>/dev/null)" ] || { echo "FAIL: fuzz_$t: its seed corpus tests/fuzz/corpus/$t is missing or empty"; return 1; }
  mkdir -p "$dir"
  : > "$log"
  if [ -d "tests/fuzz/regressions/$t" ] && [ -n "$(ls -A "tests/fuzz/regressions/$t")" ]; then
    build-fuzz/fuzz_$t tests/fuzz/regressions/$t/* >> "$log" 2>&1 || { echo "FAIL: fuzz_$t: a regression input fails again ($log)"; return 1; }
  fi
  local asan=$ASAN_OPTIONS extra=()
  if [ "$t" = shard ] || [ "$t" = checkpoint ]; then
    # HDF5 files. Debian's libhdf5 has memory errors of its own on malformed files (upstream
    # bugs: hdf5.supp silences those its memcpy makes); a huge size read from a damaged file gets
    # a failed allocation, which HDF5 reports, instead of ending the run; and the run goes on
    # after a crash (fork mode), so each crash can be told apart below: inside libhdf5 or ours.
    asan="$asan:suppressions=$PWD/tests/fuzz/hdf5.supp:allocator_may_return_null=1:max_allocation_size_mb=2048"
    extra=(-malloc_limit_mb=1000000 -fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1)
  fi
  # Inputs as long as libFuzzer's default (the largest seed, at least 4 KB), except for the JSON
  # readers: nesting past their 512-level limit, and far past it, needs longer ones.
  local len=()
  case "$t" in json | safetensors) len=(-max_len=200000) ;; esac
  rm -f build-fuzz/crash-$t-* build-fuzz/timeout-$t-* build-fuzz/oom-$t-*
  rm -rf build-fuzz/unreproduced/crash-$t-*
  ASAN_OPTIONS=$asan build-fuzz/fuzz_$t -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=30 \
    -print_final_stats=1 -artifact_prefix="build-fuzz/crash-$t-" "${len[@]}" "${extra[@]}" "$dir" "tests/fuzz/corpus/$t" >> "$log" 2>&1
  local rc=$?
  local ours=0 theirs=0 unrepro=0 a
  for a in build-fuzz/crash-$t-*; do
    [ -e "$a" ] || continue
    case "$a" in *.log) continue ;; *slow-unit-*) rm -f "$a"; continue ;; esac  # slow, not wrong
    ASAN_OPTIONS=$asan timeout 120 build-fuzz/fuzz_$t -timeout=20 "${extra[0]:+-malloc_limit_mb=1000000}" "$a" > "$a.log" 2>&1
    local arc=$?
    if [ $arc -eq 0 ] && [ ${#extra[@]} -gt 0 ]; then
      # Fork mode names the input a child was running when it stopped; one that runs cleanly on
      # its own is kept for a look (libhdf5's state after its own suppressed errors, or the
      # child's time running out) but is not a finding.
      unrepro=$((unrepro + 1)); mkdir -p build-fuzz/unreproduced; mv "$a" "$a.log" build-fuzz/unreproduced/
    elif [ "$(upstream "$a.log")" = yes ]; then
      theirs=$((theirs + 1)); mkdir -p build-fuzz/hdf5-upstream; mv "$a" "$a.log" build-fuzz/hdf5-upstream/
    else
      ours=$((ours + 1))
    fi
  done
  local runs
  runs=$(grep -oE '(stat::number_of_executed_units: *|#)[0-9]+' "$log" | grep -oE '[0-9]+$' | sort -n | tail -1)
  if [ -z "$runs" ] || [ "$runs" -eq 0 ]; then  # it never fuzzed (a missing seed corpus, say)
    echo "FAIL: fuzz_$t: no input ran: $(grep -m1 -vE '^INFO' "$log") (log $log)"
    return 1
  fi
  if [ $ours -eq 0 ] && { [ $rc -eq 0 ] || [ ${#extra[@]} -gt 0 ]; }; then
    echo "ok: fuzz_$t: ${runs:-?} runs in ${seconds} s, $(ls "$dir" | wc -l) inputs in its corpus, no crash in Tessera's code$([ $theirs -gt 0 ] && echo "; $theirs inside libhdf5 (upstream; build-fuzz/hdf5-upstream/)")$([ $unrepro -gt 0 ] && echo "; $unrepro stopped child input(s) ran cleanly alone (build-fuzz/unreproduced/)")"
  else
    echo "FAIL: fuzz_$t: $(grep -m1 -hE 'ERROR|runtime error|deadly signal' "$log" build-fuzz/crash-$t-*.log 2>/dev/null | head -1) (inputs: $(ls build-fuzz/crash-$t-* 2>/dev/null | grep -v '\.log$' | head -3 | tr '\n' ' ')log $log)"
    return 1
  fi
}
fail=0
for ((i = 0; i < ${#targets[@]}; i += 2)); do  # two at a time (CI has 2 cores)
  run "${targets[i]}" & a=$!
  b=""
  if [ $((i + 1)) -lt ${#targets[@]} ]; then run "${targets[i + 1]}" & b=$!; fi
  wait $a || fail=1
  [ -z "$b" ] || wait $b || fail=1
done
[ $fail -eq 0 ] && echo "fuzz: all targets ran ${seconds} s without a crash"
exit $fail
