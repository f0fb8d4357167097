#!/usr/bin/env bash
# test_doc_examples.sh (issue 71 point 10): the documented example commands still print what the
# documents show. A code block after the line `<!-- example: checked by app.doc_examples -->` in a
# markdown file holds commands (lines starting `build/bin/` or `$ tessera-...`) each followed by
# lines of its output: every such line must match a line the command prints, `...` standing for
# any text (elided figures, the seconds a run took). Commands run from the repository root with
# the build's programs.
# Usage: test_doc_examples.sh BIN_DIR SOURCE_DIR
set -u
bin=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
cd "$src" || exit 1
python3 - "$bin" README.md docs/*.md <<'PY'
import re, shlex, subprocess, sys
bin_dir, files = sys.argv[1], sys.argv[2:]
marker = "<!-- example: checked by app.doc_examples -->"
failed = checked = 0
for path in files:
    lines = open(path).read().splitlines()
    for i, l in enumerate(lines):
        if l.strip() != marker:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        k = j + 1
        block = []
        while k < len(lines) and not lines[k].startswith("```"):
            block.append(lines[k]); k += 1
        runs = []  # (command, expected lines)
        for b in block:
            if b.startswith("build/bin/") or b.startswith("$ "):
                runs.append((b, []))
            elif runs and b.strip() and b.strip() != "...":
                runs[-1][1].append(b.strip())
        for cmd, expected in runs:
            words = shlex.split(cmd[2:] if cmd.startswith("$ ") else cmd)
            prog = words[0].split("/")[-1]
            out = subprocess.run([bin_dir + "/" + prog] + words[1:], capture_output=True,
                                 text=True, timeout=600)
            printed = [x.strip() for x in (out.stdout + out.stderr).splitlines()]
            for e in expected:
                pattern = ".*".join(re.escape(p) for p in e.split("..."))
                checked += 1
                if not any(re.fullmatch(pattern, p) for p in printed):
                    failed += 1
                    print(f"FAIL: {path}:{i + 1}: `{cmd}` printed no line like:\n  {e}")
            if not expected and out.returncode != 0:
                failed += 1
                print(f"FAIL: {path}:{i + 1}: `{cmd}` exited {out.returncode}: {printed[-1:]}")
        print(f"ok: {path}:{i + 1}: {len(runs)} command(s)")
if checked == 0:
    print("FAIL: no documented example line checked"); failed += 1
print("app.doc_examples: all passed" if failed == 0 else f"app.doc_examples: {failed} failed")
sys.exit(1 if failed else 0)
PY
