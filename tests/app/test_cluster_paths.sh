#!/usr/bin/env bash
# test_cluster_paths.sh (issue 71 point 3): a shipped cluster kind (--cluster dgx-h100) from any
# working directory: the build tree's copy beside bin/ (a program moved with it), an install
# (cmake --install: PREFIX/share/tessera/configs); a copied cluster file's relative `rates` path
# resolves beside the file, from any directory; a cluster file whose rates cannot be found is one
# line naming it.
# Usage: test_cluster_paths.sh BUILD_DIR CONFIG_DIR
set -u
build=$(cd "$1" && pwd)
configs=$(cd "$2" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad
model=(--config "$configs/gpt2-tiny.ini" --world-size 8 --global-batch-size 8 --top 1)
plan() {  # plan DIR PROGRAM ARGS...: the machine-readable line of tessera-plan's first row
  local dir=$1 program=$2
  shift 2
  (cd "$dir" && "$program" "${model[@]}" "$@" 2>&1) | grep -E '^predicted: ' | head -1
}
want=$(plan "$configs/.." "$build/bin/tessera-plan" --cluster dgx-h100)
[ -n "$want" ] || bad "tessera-plan --cluster dgx-h100 in the repository predicts nothing"
[ -f "$build/configs/clusters/dgx-h100.ini" ] && [ -f "$build/configs/rates/h200.ini" ] \
  && ok "the build tree holds configs/clusters and configs/rates beside bin/" \
  || bad "no configs/clusters or configs/rates in $build"
# The build tree's layout moved away from the sources: bin/ and configs/ side by side.
mkdir -p "$work/moved/bin"
cp "$build/bin/tessera-plan" "$work/moved/bin/"
cp -r "$build/configs" "$work/moved/"
got=$(plan / "$work/moved/bin/tessera-plan" --cluster dgx-h100)
[ -n "$got" ] && [ "$got" = "$want" ] && ok "from /, the copy beside bin/: $got" \
  || bad "from /, the copy beside bin/: '$got' (want '$want')"
# An install.
if cmake --install "$build" --prefix "$work/inst" > "$work/install.log" 2>&1; then
  got=$(plan / "$work/inst/bin/tessera-plan" --cluster dgx-h100)
  [ "$got" = "$want" ] && ok "from /, an install (share/tessera/configs): $got" \
    || bad "from /, the installed tessera-plan: '$got' (want '$want')"
else
  bad "cmake --install failed: $(tail -2 "$work/install.log")"
fi
# A copied cluster file naming its rates relative to itself, used from another directory and
# from its own (given as a bare file name).
mkdir -p "$work/site/rates" "$work/elsewhere"
cp "$configs/rates/h200.ini" "$work/site/rates/mine.ini"
sed -e 's/^name *=.*/name = mine/' "$configs/clusters/dgx-h200.ini" > "$work/site/mine.ini"
grep -q '^rates' "$work/site/mine.ini" && sed -i 's#^rates.*#rates = rates/mine.ini#' "$work/site/mine.ini" \
  || sed -i 's#^\[gpu\]#[gpu]\nrates = rates/mine.ini#' "$work/site/mine.ini"
a=$(plan "$work/elsewhere" "$build/bin/tessera-plan" --cluster "$work/site/mine.ini")
b=$(plan "$work/site" "$build/bin/tessera-plan" --cluster mine.ini)
[ -n "$a" ] && [ "$a" = "$b" ] && ok "a copied cluster file's rates beside it: $a" \
  || bad "a copied cluster file's rates: from elsewhere '$a', from its folder '$b'"
# Its rates missing: one line naming the rates file.
rm "$work/site/rates/mine.ini"
out=$(cd "$work/elsewhere" && "$build/bin/tessera-plan" "${model[@]}" --cluster "$work/site/mine.ini" 2>&1)
rc=$?
[ $rc -eq 2 ] && grep -q "rates file '$work/site/rates/mine.ini' cannot be read" <<<"$out" \
  && [ "$(grep -c 'error' <<<"$out")" -eq 1 ] && ok "missing rates: $(grep error <<<"$out")" \
  || bad "missing rates: rc $rc, $out"
[ $fail -eq 0 ] && echo "app.cluster_paths: all passed"
exit $fail
