#!/usr/bin/env bash
# test_check_structure.sh: scripts/check-structure catches what it is for (issue 69): on a copy of
# lib/ with a file of plan/ including train/ (a folder above it), a "../" include and a folder
# missing from the folder order, it exits 1 naming each; on the copy as it is, it passes.
# Usage: test_check_structure.sh REPO_ROOT
set -u
root=$1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$root/lib" "$tmp/lib"
if out=$(python3 "$root/scripts/check-structure" "$tmp" 2>&1); then
  ok "the copy of lib/ passes"
else
  bad "the unchanged copy fails: $out"
fi
sed -i '1i #include "train/trainer.hpp"\n#include "../core/error.hpp"' "$tmp/lib/plan/predict.cpp"
mkdir -p "$tmp/lib/newfolder" && echo '#include "core/error.hpp"' > "$tmp/lib/newfolder/x.cpp"
out=$(python3 "$root/scripts/check-structure" "$tmp" 2>&1)
rc=$?
[ $rc -eq 1 ] && ok "exit 1 on the broken copy" || bad "exit $rc on the broken copy"
grep -q 'lib/plan/predict.cpp:1: includes train/trainer.hpp: lib/plan/ may include only folders below it' <<<"$out" &&
  ok "names the upward include" || bad "no upward include in: $out"
grep -q 'lib/plan/predict.cpp:2: includes "../core/error.hpp"' <<<"$out" &&
  ok "names the ../ include" || bad "no ../ include in: $out"
grep -q 'lib/newfolder/x.cpp: lib/newfolder/ is not in the folder order' <<<"$out" &&
  ok "names the folder outside the order" || bad "no unknown folder in: $out"
[ $fail -eq 0 ] && echo "structure.catches_violations: all passed"
exit $fail
