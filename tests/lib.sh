# lib.sh: the helpers every shell test sources (`source "$(dirname "$0")/../lib.sh"`). The test
# sets fail=0 first and exits with it at the end.
#   ok MESSAGE / bad MESSAGE      one line each ("ok: ...", "FAIL: ..."); bad sets fail=1
#   losses FILE                   the lm_loss of each record of a metrics file, one per line
#   iteration_losses FILE         "iteration lm_loss" of each record
#   run_losses RUN                iteration_losses of the test's $work/RUN.jsonl
#   metric FILE FIELD             the value of FIELD in each record that has it
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fail=1; }
losses() { sed 's/.*"lm_loss": \([^,]*\),.*/\1/' "$1"; }
iteration_losses() { sed -n 's/.*"iteration": \([0-9]*\),.*"lm_loss": \([^,]*\),.*/\1 \2/p' "$1"; }
run_losses() { iteration_losses "$work/$1.jsonl"; }
metric() { sed -n "s/.*\"$2\": \([^,}]*\).*/\1/p" "$1"; }
