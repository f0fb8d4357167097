# layout_runs.sh: helpers the layout-comparison scripts source (test_documents.sh,
# test_loss_mask.sh). They read $bin, $work and the array `common` (tessera-train's options of
# every run), and call ok / bad / losses (tests/lib.sh, which the script sources first).
run() {  # run NAME NP [options]: tessera-train on NP ranks, metrics in $work/NAME.jsonl
  local name=$1 np=$2 rc
  shift 2
  local cmd=("$bin/tessera-train" "${common[@]}" --metrics-file "$work/$name.jsonl" "$@")
  if [ "$np" -gt 1 ]; then
    timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}" > "$work/$name.log" 2>&1
  else
    timeout 300 "${cmd[@]}" > "$work/$name.log" 2>&1
  fi
  rc=$?
  [ $rc -eq 0 ] || { bad "$name exited $rc: $(grep -v '^\[' "$work/$name.log" | tail -3)"; return 1; }
}
worst() {  # the worst relative loss difference of two runs over 20 iterations
  paste <(losses "$work/$1.jsonl") <(losses "$work/$2.jsonl") | awk '
    { d = $1 - $2; if (d < 0) d = -d; r = d / $1; if (r > w) w = r; n++ }
    END { if (n != 20) print "missing"; else printf "%.3g", w }'
}
within() {  # within BASE NAME DESCRIPTION [TOLERANCE]: every loss within 1e-5 (or TOLERANCE)
  local w t=${4:-1e-5}
  w=$(worst "$1" "$2")
  if [ "$w" = missing ] || awk -v w="$w" -v t="$t" 'BEGIN { exit !(w > t) }'; then
    bad "$2 ($3): worst relative loss difference $w against $1 (bound $t)"
  else
    ok "$2 ($3): worst relative difference $w over 20 iterations"
  fi
}
