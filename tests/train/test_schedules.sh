#!/usr/bin/env bash
# test_schedules.sh: Megatron-LM's learning-rate and weight-decay schedules through tessera-train:
# every iteration's logged learning rate (and scheduled weight decay) equals the formula, written
# here independently in Python, to 1e-6 (the log line) and 1e-12 (the metrics file), for WSD in
# each annealing style with --lr-warmup-init, inverse-square-root, a sample-based WSD under a
# batch-size ramp, and a run stopped at iteration 6 and resumed, which logs what the uninterrupted
# run logs (and the same losses). Bad options: one error line, exit 2.
# Usage: test_schedules.sh BIN_DIR CONFIG_DIR
set -u
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
train() {
  "$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --mock-data --vocab-size 500 --threads 1 \
    --device cpu --log-interval 1 "$@"
}

# check LOG METRICS SPEC: every iteration line of LOG and every line of METRICS against the formula.
# SPEC: python dict literal with lr, min_lr, init, warmup, decay, style, wsd, wsd_style, unit
# ("iter" or "samples"), wd (None, or (start, end, style, total)).
check() {
  python3 - "$1" "$2" "$3" <<'EOF'
import json, math, re, sys
log, metrics, spec = sys.argv[1], sys.argv[2], eval(sys.argv[3])

def lr_at(n):  # Megatron's get_lr at num_steps n (iterations, or samples under a ramp)
    mx, mn, init, W, D = spec["lr"], spec["min_lr"], spec.get("init", 0.0), spec["warmup"], spec["decay"]
    g = spec.get("samples_per_step", 1)
    if W > 0 and n <= W:
        return init + (mx - init) * n / W
    if spec["style"] == "constant":
        return mx
    if n > D:
        return mn
    if spec["style"] == "inverse-square-root":
        return max(mn, mx * math.sqrt(max(W * g, 1)) / math.sqrt(max(n * g, 1)))
    if spec["style"] == "WSD":
        S = spec["wsd"]
        if n <= D - S:
            return mx
        r = (n - (D - S)) / S
        c = {"linear": 1 - r, "cosine": (1 + math.cos(math.pi * r)) / 2,
             "exponential": 2 * 0.5 ** r - 1, "minus_sqrt": 1 - r ** 0.5}[spec["wsd_style"]]
        return mn + c * (mx - mn)
    r = (n - W) / (D - W)
    c = 1 - r if spec["style"] == "linear" else (1 + math.cos(math.pi * r)) / 2
    return mn + c * (mx - mn)

def wd_at(n):  # Megatron's get_wd
    start, end, style, total = spec["wd"]
    if n > total:
        return end
    r = n / total
    return start + (end - start) * (r if style == "linear" else (1 - math.cos(math.pi * r)) / 2)

def step_of(it, consumed):
    return consumed if spec.get("unit") == "samples" else it

errors, rows = [], 0
for line in open(log):
    m = re.search(r"iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) .*learning rate: ([0-9.E+-]+)", line)
    if not m:
        continue
    rows += 1
    it, consumed, lr = int(m.group(1)), int(m.group(2)), float(m.group(3))
    want = lr_at(step_of(it, consumed))
    if abs(lr - want) > 1e-6 * want:
        errors.append(f"log iteration {it}: lr {lr} want {want}")
    w = re.search(r"weight decay: ([0-9.E+-]+)", line)
    if spec.get("wd") and (not w or abs(float(w.group(1)) - wd_at(step_of(it, consumed))) > 1e-6 * wd_at(step_of(it, consumed))):
        errors.append(f"log iteration {it}: weight decay {w and w.group(1)} want {wd_at(step_of(it, consumed))}")
    if not spec.get("wd") and w:
        errors.append(f"log iteration {it}: a constant weight decay is logged")
for line in open(metrics):
    j = json.loads(line)
    if "lr" not in j:
        continue
    n = step_of(j["iteration"], j["consumed_samples"])
    if abs(j["lr"] - lr_at(n)) > 1e-12 * lr_at(n):
        errors.append(f"metrics iteration {j['iteration']}: lr {j['lr']!r} want {lr_at(n)!r}")
    if spec.get("wd") and abs(j.get("weight_decay", -1) - wd_at(n)) > 1e-12 * max(wd_at(n), 1e-300):
        errors.append(f"metrics iteration {j['iteration']}: weight_decay {j.get('weight_decay')!r} want {wd_at(n)!r}")
if rows != spec["rows"]:
    errors.append(f"{rows} iteration lines, want {spec['rows']}")
print("\n".join(errors[:8]) if errors else f"{rows} iterations match")
sys.exit(1 if errors else 0)
EOF
}

# 1. WSD in each annealing style, warm-up from --lr-warmup-init, the weight decay rising: 24
#    iterations, warm-up 4, decay over all 24, the last 10 annealing (from iteration 14).
for style in exponential linear cosine minus_sqrt; do
  wdstyle=$([ "$style" = cosine ] && echo linear || echo cosine)
  train --train-iters 24 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 4 --lr-warmup-init 1e-5 \
    --lr-decay-style WSD --lr-wsd-decay-style $style --lr-wsd-decay-iters 10 \
    --weight-decay-incr-style $wdstyle --start-weight-decay 0.01 --end-weight-decay 0.1 \
    --metrics-file "$work/wsd-$style.jsonl" > "$work/wsd-$style.log" 2>&1 \
    || bad "WSD $style run: $(tail -3 "$work/wsd-$style.log")"
  res=$(check "$work/wsd-$style.log" "$work/wsd-$style.jsonl" "dict(lr=6e-4, min_lr=6e-5, init=1e-5, warmup=4, decay=24, style='WSD', wsd=10, wsd_style='$style', wd=(0.01, 0.1, '$wdstyle', 24), rows=24)")
  [ $? -eq 0 ] && ok "WSD $style, weight decay $wdstyle: $res" || bad "WSD $style: $res"
done

# 2. inverse-square-root (Megatron counts samples: the global batch of 16 cancels with warm-up),
#    the decay ending at iteration 12 (min-lr after it), the default constant weight decay (not
#    logged).
train --train-iters 16 --lr 6e-4 --min-lr 1e-4 --lr-warmup-iters 3 --lr-decay-style inverse-square-root \
  --lr-decay-iters 12 --metrics-file "$work/isr.jsonl" > "$work/isr.log" 2>&1 || bad "inverse-square-root run: $(tail -3 "$work/isr.log")"
res=$(check "$work/isr.log" "$work/isr.jsonl" "dict(lr=6e-4, min_lr=1e-4, warmup=3, decay=12, style='inverse-square-root', samples_per_step=16, rows=16)")
[ $? -eq 0 ] && ok "inverse-square-root: $res" || bad "inverse-square-root: $res"
train --train-iters 6 --lr 6e-4 --min-lr 0 --lr-warmup-iters 0 --lr-decay-style inverse-square-root \
  --metrics-file "$work/isr0.jsonl" > "$work/isr0.log" 2>&1 || bad "inverse-square-root without warm-up: $(tail -3 "$work/isr0.log")"
res=$(check "$work/isr0.log" "$work/isr0.jsonl" "dict(lr=6e-4, min_lr=0, warmup=0, decay=6, style='inverse-square-root', samples_per_step=16, rows=6)")
[ $? -eq 0 ] && ok "inverse-square-root without warm-up (max_lr / sqrt(samples)): $res" || bad "inverse-square-root without warm-up: $res"

# 3. Sample-based: a batch-size ramp (8, then 16 after 16 samples) counts the schedule in samples.
train --rampup-batch-size 8 8 16 --train-samples 320 --lr 6e-4 --min-lr 6e-5 --lr-warmup-samples 32 \
  --lr-decay-samples 288 --lr-decay-style WSD --lr-wsd-decay-samples 128 --lr-wsd-decay-style linear \
  --weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.2 \
  --metrics-file "$work/ramp.jsonl" > "$work/ramp.log" 2>&1 || bad "ramp run: $(tail -3 "$work/ramp.log")"
rows=$(grep -c "iteration .*learning rate" "$work/ramp.log")
res=$(check "$work/ramp.log" "$work/ramp.jsonl" "dict(lr=6e-4, min_lr=6e-5, warmup=32, decay=288, style='WSD', wsd=128, wsd_style='linear', unit='samples', wd=(0.0, 0.2, 'linear', 320), rows=$rows)")
[ $? -eq 0 ] && [ "$rows" -ge 19 ] && ok "WSD in samples under a ramp ($rows iterations): $res" || bad "ramp: $res"

# 4. Resume: stopped after iteration 6 (--exit-interval saves first), resumed to 12; every line of
#    both parts equals the uninterrupted run's lr, weight decay and loss.
S=(--train-iters 12 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 3 --lr-warmup-init 1e-5 --lr-decay-style WSD
   --lr-wsd-decay-style exponential --lr-wsd-decay-iters 5 --weight-decay-incr-style cosine
   --start-weight-decay 0.02 --end-weight-decay 0.2)
fields() { grep -o "iteration .*" "$1" | grep "learning rate" | sed -E 's/elapsed time per iteration \(ms\): [0-9.]+ \| //; s/ \| tokens\/s.*(\| weight decay)/ \1/'; }
train "${S[@]}" > "$work/full.log" 2>&1 || bad "uninterrupted run: $(tail -3 "$work/full.log")"
train "${S[@]}" --exit-interval 6 --save "$work/ck" > "$work/part1.log" 2>&1 || bad "part 1: $(tail -3 "$work/part1.log")"
train "${S[@]}" --load "$work/ck" --save "$work/ck" > "$work/part2.log" 2>&1 || bad "part 2: $(tail -3 "$work/part2.log")"
fields "$work/full.log" > "$work/full.txt"
cat <(fields "$work/part1.log") <(fields "$work/part2.log") > "$work/resumed.txt"
if [ "$(wc -l < "$work/full.txt")" -eq 12 ] && grep -q "weight decay" "$work/full.txt" && cmp -s "$work/full.txt" "$work/resumed.txt" \
   && ! grep -q "schedule differs" "$work/part2.log"; then
  ok "resumed at 6 == uninterrupted: $(sed -n 7p "$work/full.txt")"
else
  bad "resume differs: $(diff "$work/full.txt" "$work/resumed.txt" | head -6)"
fi
res=$(check "$work/part2.log" /dev/null "dict(lr=6e-4, min_lr=6e-5, init=1e-5, warmup=3, decay=12, style='WSD', wsd=5, wsd_style='exponential', wd=(0.02, 0.2, 'cosine', 12), rows=6)")
[ $? -eq 0 ] && ok "the resumed part against the formula: $res" || bad "resumed part: $res"

# A resume with another schedule takes it, says so in one warning line; Megatron's
# --override-opt_param-scheduler is accepted (it is what Tessera does).
out=$(train "${S[@]}" --train-iters 14 --lr 5e-4 --load "$work/ck" --override-opt_param-scheduler 2>&1)
grep -qE "warning.*schedule differs from checkpoint .*\(lr 0.0006 -> 0.0005, train-iters 12 -> 14\); this run's options are used from iteration 13" <<<"$out" \
  && grep -q "override-opt_param-scheduler: accepted without effect" <<<"$out" \
  && grep -qE "iteration +13/ +14 .*learning rate: " <<<"$out" \
  && ok "a changed schedule at resume: one warning line naming the changes" || bad "changed schedule at resume: $out"

# 5. Bad options: one error line naming the option, exit 2 (the config's run is 200 iterations).
expect2() {  # PATTERN ARGS...
  local pattern=$1 out rc
  shift
  out=$(train "$@" 2>&1)
  rc=$?
  if [ $rc -eq 2 ] && grep -qE -- "$pattern" <<<"$out" && [ "$(grep -c 'error:' <<<"$out")" -eq 1 ]; then
    ok "$* -> exit 2"
  else
    bad "$* -> rc=$rc, want 2 and one line matching '$pattern': $out"
  fi
}
expect2 "--lr-wsd-decay-iters=17 \(17 iterations\) is longer than the decay phase after the warm-up: 20 .* - 4 warm-up = 16 iterations" \
  --lr-warmup-iters 4 --lr-decay-iters 20 --lr-decay-style WSD --lr-wsd-decay-iters 17
expect2 "--lr-wsd-decay-style=steep is not a style \(allowed: exponential, linear, cosine, minus_sqrt\)" \
  --lr-decay-style WSD --lr-wsd-decay-iters 5 --lr-wsd-decay-style steep
expect2 "--lr-decay-style=wsd is not a style \(allowed: constant, linear, cosine, inverse-square-root, WSD\)" \
  --lr-decay-style wsd
expect2 "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples" --lr-decay-style WSD
expect2 "--lr-wsd-decay-iters applies only to --lr-decay-style WSD \(the style is cosine\)" --lr-wsd-decay-iters 5
expect2 "--lr-wsd-decay-style applies only to --lr-decay-style WSD" --lr-wsd-decay-style linear
expect2 "--lr-wsd-decay-samples=8 is less than one global batch \(16 samples\)" --lr-decay-style WSD --lr-wsd-decay-samples 8
expect2 "--lr-wsd-decay-iters=-3 is out of range \\(allowed: >= 1\\)" --lr-decay-style WSD --lr-wsd-decay-iters=-3
expect2 "--lr-warmup-init=0.01 is out of range \(allowed: 0 <= init <= --lr=0.003\)" --lr-warmup-init 0.01
expect2 "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay" \
  --weight-decay-incr-style linear --start-weight-decay 0.01
expect2 "--start-weight-decay needs --weight-decay-incr-style linear or cosine" --start-weight-decay 0.01
expect2 "--start-weight-decay=-0.1 / --end-weight-decay=0.1 are out of range" \
  --weight-decay-incr-style cosine --start-weight-decay=-0.1 --end-weight-decay 0.1
expect2 "--weight-decay-incr-style=step is not a style \(allowed: constant, linear, cosine\)" --weight-decay-incr-style step
expect2 "--lr-wsd-decay-iters=5 counts iterations, whose size changes under --rampup-batch-size 8 8 16" \
  --train-samples 320 --rampup-batch-size 8 8 16 --lr-warmup-samples 32 --lr-decay-style WSD --lr-wsd-decay-iters 5
"$bin/tessera-train" --help | grep -q -- "--lr-wsd-decay-style" && "$bin/tessera-train" --help | grep -q -- "--weight-decay-incr-style" \
  && ok "--help documents the schedule options" || bad "--help lacks the schedule options"

[ $fail -eq 0 ] && echo "train.schedules: all passed"
exit $fail
