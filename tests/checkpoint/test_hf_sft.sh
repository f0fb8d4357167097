#!/usr/bin/env bash
# test_hf_sft.sh: fine-tuning a Hugging Face model on chat data end to end (issue 40 point 7), as
# a user runs it: a tiny LlamaForCausalLM with Llama 3's 128,256-token vocabulary (written by the
# independent hf_llama_tool.py) is converted, fine-tuned with --finetune --sft on conversations
# preprocessed with its tokenizer's chat template, exported back to Hugging Face and imported
# again; greedy generation from the export equals the fine-tuned checkpoint's, and tessera-generate
# --chat-template answers from it with the prompt Jinja2 + Tokenizers.js give.
# Usage: test_hf_sft.sh BIN_DIR SOURCE_DIR
set -u
bin=$1
src=$2
hf=$src/data/hf-tokenizers/llama3_1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3
"$py" -c "import jinja2" || { echo "FAIL: python3-jinja2 is needed (scripts/setup.sh installs it)"; exit 1; }
run() {  # run NAME CMD...: the command's output in $work/NAME.log, a failure reported
  local name=$1
  shift
  timeout 300 "$@" > "$work/$name.log" 2>&1 || { bad "$name: $(tail -3 "$work/$name.log")"; return 1; }
}

"$py" - "$work/chats.jsonl" <<'PY'
import json, random, sys
random.seed(5)
with open(sys.argv[1], "w") as f:
    for i in range(200):
        a, b = random.randint(1, 9), random.randint(1, 9)
        f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}?"},
                                         {"role": "assistant", "content": str(a + b)}]}) + "\n")
PY
run make python3 "$src/tests/checkpoint/hf_llama_tool.py" make "$work/hf" --vocab 128256 --positions 64 \
  --dtype bf16 --groups 2 --seed 4 || exit 1
run pre "$bin/tessera-preprocess" --input "$work/chats.jsonl" --output-prefix "$work/chat" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf" --chat-template auto \
  --eod-token '<|end_of_text|>' --workers 1 || exit 1
run import "$bin/tessera-convert" --from-hf "$work/hf" --save "$work/ck" || exit 1
if run sft "$bin/tessera-train" --load "$work/ck" --finetune --use-checkpoint-args --data-path "$work/chat" \
     --sft --seq-length 64 --split 100,0,0 --eval-interval 0 --global-batch-size 8 --micro-batch-size 4 \
     --train-iters 30 --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --threads 1 --device cpu \
     --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf" --metrics-file "$work/sft.jsonl" \
     --save "$work/sft-ck"; then
  first=$(head -1 "$work/sft.jsonl" | sed 's/.*"lm_loss": \([^,]*\),.*/\1/')
  last=$(tail -1 "$work/sft.jsonl" | sed 's/.*"lm_loss": \([^,]*\),.*/\1/')
  its=$(sed 's/.*"iteration": \([0-9]*\),.*/\1/' "$work/sft.jsonl" | tr '\n' ' ')
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 2) }' && [ "${its%% *}" = 1 ] \
    && grep -q "packed (--sft)" "$work/sft.log" \
    && ok "--finetune --sft from the HF import: iterations from 1, loss $first -> $last over 30 iterations" \
    || bad "fine-tuning: iterations '$its', loss $first -> $last"
fi
run export "$bin/tessera-convert" --load "$work/sft-ck" --to-hf --save "$work/hf-out" \
  && run reimport "$bin/tessera-convert" --from-hf "$work/hf-out" --save "$work/ck2" \
  && grep -q '"LlamaForCausalLM"' "$work/hf-out/config.json" && grep -q '"vocab_size": 128256' "$work/hf-out/config.json" \
  && ok "exported to Hugging Face (LlamaForCausalLM, 128256 tokens) and imported again" \
  || bad "export: $(cat "$work/hf-out/config.json" 2>/dev/null | head -c 300)"
P="128000 128006 882 128007 271 18 10 19 30 128009 128006 78191 128007 271"
G=(--threads 1 --device cpu --greedy --max-new-tokens 5)
a=$("$bin/tessera-generate" --load "$work/sft-ck" "${G[@]}" --prompt-ids "$P" 2>/dev/null)
b=$("$bin/tessera-generate" --load "$work/ck2" "${G[@]}" --prompt-ids "$P" 2>/dev/null)
[ -n "$a" ] && [ "$a" = "$b" ] && ok "greedy from the HF round trip equals the fine-tuned checkpoint: ${a#*| }" \
  || bad "round trip generation: '$a' vs '$b'"

# The chat template on the exported model: its prompt is the ids of the conversation rendered by
# Jinja2 from the tokenizer's chat_template, encoded by Tokenizers.js; the answer is --prompt-ids'.
"$py" - "$hf" "$work/gp.jsonl" <<'PY'
import json, sys
from jinja2.sandbox import ImmutableSandboxedEnvironment
cfg = json.load(open(sys.argv[1] + "/tokenizer_config.json"))
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
text = env.from_string(cfg["chat_template"]).render(messages=[{"role": "user", "content": "3+4?"}],
    bos_token=cfg["bos_token"], eos_token=cfg["eos_token"], add_generation_prompt=True)
open(sys.argv[2], "w").write(json.dumps({"text": text}) + "\n")
PY
ref=$(node "$src/tests/data/hf_reference.mjs" "$hf" jsonl "$work/gp.jsonl" text)
ans=$("$bin/tessera-generate" --load "$work/ck2" "${G[@]}" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "$hf" --chat-template auto --prompt "3+4?" 2>"$work/gen.err")
ids=$("$bin/tessera-generate" --load "$work/ck2" "${G[@]}" --prompt-ids "$ref" 2>/dev/null | sed 's/.*| //')
want=$(awk '{ for (i = 1; i <= NF && $i != 128009; i++) printf "%s%s", (i > 1 ? " " : ""), $i }' <<<"$ids")
text=""
[ -n "$want" ] && text=$(node "$src/tests/data/hf_reference.mjs" "$hf" decode "$want")
n=$(wc -w <<<"$ref")
grep -q "^tessera-generate: $n prompt tokens prefilled" "$work/gen.err" && [ "$ans" = "3+4?$text" ] \
  && ok "tessera-generate --chat-template auto on the export: the template's $n prompt ids, answer '${ans#3+4?}'" \
  || bad "chat generation: '$ans' vs '3+4?$text' ($(cat "$work/gen.err"))"
exit $fail
