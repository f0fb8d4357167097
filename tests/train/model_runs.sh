# model_runs.sh: helpers the scripts that train one model at many layouts source (test_fsdp.sh,
# test_muon.sh). They read $bin and $work, take the model's options from a named array, and call
# ok / bad / iteration_losses (tests/lib.sh, which the script sources first).
train() {  # train NAME NP MODEL [options]: metrics in $work/NAME.jsonl, log in $work/NAME.log
  local name=$1 np=$2 rc
  local -n model=$3
  shift 3
  local cmd=("$bin/tessera-train" "${model[@]}" --metrics-file "$work/$name.jsonl" "$@")
  if [ "$np" -gt 1 ]; then
    timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}" > "$work/$name.log" 2>&1
  else
    timeout 300 "${cmd[@]}" > "$work/$name.log" 2>&1
  fi
  rc=$?
  [ $rc -eq 0 ] || { bad "$name exited $rc: $(grep -v '^\[' "$work/$name.log" | tail -3)"; return 1; }
}
worst() {  # worst BASE NAME...: the worst relative loss difference and the iterations compared
  # (the NAMEs' iterations together: a run and its resumption)
  join <(iteration_losses "$work/$1.jsonl" | sort -k1,1) \
       <(shift; for n in "$@"; do iteration_losses "$work/$n.jsonl"; done | sort -k1,1) | awk '
    { d = $2 - $3; if (d < 0) d = -d; r = d / $2; if (r > w) w = r; n++ }
    END { if (n == 0) print "missing"; else printf "%.3g %d", w, n }'
}
