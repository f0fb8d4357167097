#!/usr/bin/env bash
# test_chat.sh: chat data (issue 40 point 3). tessera-preprocess --chat-template auto renders
# conversations with the template tokenizer_config.json names (Llama 3.1's, Mistral NeMo's); the
# tokens equal Tokenizers.js's encoding of the same conversations rendered by Jinja2 from the
# chat_template itself (HF's apply_chat_template settings), and exactly the assistant contents and
# their end-of-turn tokens are targets. A conversation without an assistant turn is reported and
# left out; tessera-inspect brackets the targets and --json carries loss_mask and position_ids;
# bad conversations and templates are one line, exit 2.
# Usage: test_chat.sh BIN_DIR SOURCE_DIR
set -u
bin=$1
src=$2
hf=$src/data/hf-tokenizers
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3
"$py" -c "import h5py, numpy, jinja2" || { echo "FAIL: python3-h5py, python3-numpy and python3-jinja2 are needed (scripts/setup.sh installs them)"; exit 1; }

"$py" - "$work/chats.jsonl" <<'PY'
import json, sys
convs = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": " Hello! How can I help? "},
     {"role": "user", "content": "Say goodbye in French."}, {"role": "assistant", "content": "Au revoir, à bientôt."}],
    [{"role": "user", "content": "Write code"}, {"role": "assistant", "content": "def f(x):\n    return x * 2\n"}],
    [{"role": "user", "content": "Only a question, no answer"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Colour of the sky?"},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"},
     {"role": "assistant", "content": "Green."}],
]
with open(sys.argv[1], "w") as f:
    for c in convs:
        f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
PY

# check.py SHARD TOKDIR CHATS: the reference rendering and encoding against the shard.
cat > "$work/check.py" <<'PY'
import json, subprocess, sys
import h5py, numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols
shard, tokdir, chats, ref = sys.argv[1:5]
cfg = json.load(open(tokdir + "/tokenizer_config.json"))
def raise_exception(m):
    raise RuntimeError(m)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.globals["raise_exception"] = raise_exception
tmpl = env.from_string(cfg["chat_template"])
convs = [json.loads(l)["messages"] for l in open(chats) if l.strip()]
convs = [c for c in convs if any(m["role"] == "assistant" for m in c)]
llama = "<|eot_id|>" in cfg["chat_template"]
eot = "<|eot_id|>" if llama else cfg["eos_token"]
lines = []
for c in convs:
    lines.append({"text": tmpl.render(messages=c, bos_token=cfg["bos_token"], eos_token=cfg["eos_token"],
                                      add_generation_prompt=False)})
    for m in c:
        if m["role"] == "assistant":
            lines.append({"text": (m["content"].strip() if llama else m["content"]) + eot})
with open(sys.argv[5], "w") as f:
    for l in lines:
        f.write(json.dumps(l, ensure_ascii=False) + "\n")
ids = [list(map(int, l.split())) for l in subprocess.run(["node", ref, tokdir, "jsonl", sys.argv[5], "text"],
       capture_output=True, text=True, check=True).stdout.splitlines()]
f = h5py.File(shard, "r")
tokens, offs, mask = f["tokens"][:], f["doc_offsets"][:], f["loss_mask"][:]
eod = int(f.attrs["eod_id"])
assert len(offs) - 1 == len(convs), f"{len(offs) - 1} documents for {len(convs)} conversations"
k = 0
for d, c in enumerate(convs):
    doc, m = list(tokens[offs[d]:offs[d + 1]]), list(mask[offs[d]:offs[d + 1]])
    whole = ids[k]; k += 1
    assert doc[-1] == eod and m[-1] == 0, f"conversation {d}: no unmasked EOD at the end"
    assert doc[:-1] == whole, f"conversation {d}: tokens {doc[:-1]} != reference {whole}"
    want = []
    for msg in c:
        if msg["role"] == "assistant":
            want += ids[k]; k += 1
    got = [t for t, b in zip(doc, m) if b]
    assert got == want, f"conversation {d}: targets {got} != assistant contents {want}"
    runs = sum(1 for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1]))
    assert runs == sum(msg["role"] == "assistant" for msg in c), f"conversation {d}: {runs} runs of targets"
print(f"{len(convs)} conversations, {len(tokens)} tokens, {int(mask.sum())} targets")
PY

# Llama 3.1's eos_token is its end-of-turn token: documents end at <|end_of_text|> instead.
for case in "llama3_1 llama3 --eod-token <|end_of_text|>" "mistral_nemo mistral"; do
  set -- $case
  out=$("$bin/tessera-preprocess" --input "$work/chats.jsonl" --output-prefix "$work/$1" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/$1" --chat-template auto --workers 2 \
    "${@:3}" 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then bad "preprocess $1: rc $rc $out"; continue; fi
  grep -q "4 conversations (template $2, with loss masks)" <<<"$out" \
    && grep -q "1 conversation(s) left out: no assistant turn, nothing to learn (the first: $work/chats.jsonl:4)" <<<"$out" \
    && ok "$1: --chat-template auto is $2; the conversation without an answer reported (line 4)" \
    || bad "$1: $out"
  if [ "$1" = mistral_nemo ]; then
    grep -q "note: the template's end-of-turn token '</s>' is the tokenizer's end-of-document token" <<<"$out" \
      && ok "mistral: the end-of-turn token that is also the EOD is pointed out" || bad "mistral note: $out"
  fi
  res=$("$py" "$work/check.py" "$work/${1}_00000.h5" "$hf/$1" "$work/chats.jsonl" "$src/tests/data/hf_reference.mjs" "$work/ref.jsonl" 2>&1) \
    && ok "$1: tokens equal Jinja2 + Tokenizers.js's, targets are exactly the assistant turns: $res" \
    || bad "$1: $res"
done

# tessera-inspect: the targets in brackets; --json with loss_mask, position_ids, document_starts.
ins=(--data-path "$work/llama3_1" --global-batch-size 1 --train-iters 1 --iteration 1 --seq-length 48
     --max-position-embeddings 64)
text=$("$bin/tessera-inspect" "${ins[@]}" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/llama3_1" 2>&1)
grep -q "targets count, in \[brackets\]" <<<"$text" && grep -qF "<|eot_id|>]<|end_of_text|>" <<<"$text" \
  && ! grep -qF "[<|start_header_id|>" <<<"$text" \
  && ok "tessera-inspect brackets the targets: $(grep -oF '[Au revoir, à bientôt.<|eot_id|>]' <<<"$text")" \
  || bad "tessera-inspect text: $text"
# --sft packs whole conversations: a sample's padding (no token) shows as padding (issue 71).
sft=$("$bin/tessera-inspect" "${ins[@]}" --sft --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/llama3_1" --seq-length 64 2>&1)
rc=$?
[ $rc -eq 0 ] && grep -qE "<pad x[0-9]+>" <<<"$sft" && ! grep -q "outside the vocabulary" <<<"$sft" \
  && ok "tessera-inspect --sft text: padding shown as $(grep -oE '<pad x[0-9]+>' <<<"$sft" | head -1)" \
  || bad "tessera-inspect --sft text: rc $rc, $sft"
js=$("$bin/tessera-inspect" "${ins[@]}" --json --reset-position-ids 2>&1)
"$py" - "$js" <<'PY' && ok "tessera-inspect --json: loss_mask, position_ids (reset after the EOD), document_starts" || bad "tessera-inspect --json: $js"
import json, sys
r = json.loads(sys.argv[1])
t, m, p, s = r["tokens"], r["loss_mask"], r["position_ids"], r["document_starts"]
T = len(t) - 1
assert len(m) == len(p) == T
want_s = [0] + [i + 1 for i in range(T - 1) if t[i] == 128001]  # after <|end_of_text|>
assert len(want_s) > 1 and s == want_s, (s, want_s)
for a, b in zip(s, s[1:] + [T]):
    assert p[a:b] == list(range(b - a)), p
targets = [t[i + 1] for i in range(T) if m[i]]
assert targets and 128009 in targets and not set(targets) & {128000, 128001, 128006, 128007}, targets
PY

# tessera-generate --chat-template: a tiny model trained on the Llama 3.1 chat shards answers a
# prompt rendered with the template; its prompt is the ids Jinja2 + Tokenizers.js give for the
# conversation with add_generation_prompt, and greedy decoding from those ids (--prompt-ids)
# gives the same answer up to <|eot_id|>.
if timeout 300 "$bin/tessera-train" --config "$src/configs/gpt2-tiny.ini" --num-layers 2 --hidden-size 32 \
     --seq-length 48 --max-position-embeddings 64 --vocab-size 0 --data-path "$work/llama3_1" --split 100,0,0 \
     --global-batch-size 4 --micro-batch-size 2 --train-iters 3 --eval-interval 0 --threads 1 --device cpu \
     --save "$work/gen-ckpt" > "$work/gen-train.log" 2>&1; then
  G=(--load "$work/gen-ckpt" --threads 1 --device cpu --greedy --max-new-tokens 6)
  ans=$("$bin/tessera-generate" "${G[@]}" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/llama3_1" \
    --chat-template auto --system "Be brief." --prompt "Hi" 2>"$work/gen.err")
  "$py" - "$hf/llama3_1" "$work/gp.jsonl" <<'PY'
import json, sys
from jinja2.sandbox import ImmutableSandboxedEnvironment
cfg = json.load(open(sys.argv[1] + "/tokenizer_config.json"))
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
text = env.from_string(cfg["chat_template"]).render(
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    bos_token=cfg["bos_token"], eos_token=cfg["eos_token"], add_generation_prompt=True)
open(sys.argv[2], "w").write(json.dumps({"text": text}) + "\n")
PY
  ref=$(node "$src/tests/data/hf_reference.mjs" "$hf/llama3_1" jsonl "$work/gp.jsonl" text)
  n=$(wc -w <<<"$ref")
  ids=$("$bin/tessera-generate" "${G[@]}" --prompt-ids "$ref" 2>/dev/null | sed 's/.*| //')
  want=$(awk '{ for (i = 1; i <= NF && $i != 128009; i++) printf "%s%s", (i > 1 ? " " : ""), $i }' <<<"$ids")
  text=$(node "$src/tests/data/hf_reference.mjs" "$hf/llama3_1" decode "${want:-128009}")
  [ -z "$want" ] && text=""
  out=$("$bin/tessera-generate" "${G[@]}" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/llama3_1" \
    --system "x" --prompt "Hi" 2>&1); rc=$?
  [ $rc -eq 2 ] && grep -q -- "--system needs --chat-template" <<<"$out" && ok "refused: generate --system without a template" \
    || bad "generate --system alone: rc $rc $out"
  out=$("$bin/tessera-generate" "${G[@]}" --chat-template llama3 --prompt-ids "1 2" 2>&1); rc=$?
  [ $rc -eq 2 ] && grep -q -- "--chat-template renders text prompts with the tokenizer" <<<"$out" \
    && ok "refused: generate --chat-template with --prompt-ids" || bad "generate template + ids: rc $rc $out"
  if grep -q "^tessera-generate: $n prompt tokens prefilled" "$work/gen.err" && [ "$ans" = "Hi$text" ]; then
    ok "tessera-generate --chat-template auto: $n prompt tokens as Jinja2 + Tokenizers.js render them, the answer equals --prompt-ids' up to <|eot_id|> ('${ans#Hi}')"
  else
    bad "generate with the template: '$ans' vs 'Hi$text' ($(cat "$work/gen.err"); reference $n ids)"
  fi
else
  bad "training on the chat shards: $(tail -3 "$work/gen-train.log")"
fi

refuse() {  # refuse WHAT PATTERN ARGS...
  local what=$1 pattern=$2 out rc
  shift 2
  out=$("$bin/tessera-preprocess" --output-prefix "$work/bad" --workers 1 "$@" 2>&1); rc=$?
  if [ $rc -eq 2 ] && [ "$(wc -l <<<"$out")" -eq 1 ] && grep -q -- "$pattern" <<<"$out"; then ok "refused: $what"
  else bad "$what: rc $rc: $out"; fi
}
L3=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/llama3_1")
printf '%s\n' '{"messages": [{"role": "robot", "content": "beep"}]}' > "$work/role.jsonl"
printf '%s\n' '{"messages": "hello"}' > "$work/list.jsonl"
printf '%s\n' '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}' > "$work/alt.jsonl"
printf '%s\n' '{"messages": [{"role": "user", "content": "a"}]}' > "$work/none.jsonl"
refuse "an unknown template" "--chat-template 'zephyr' is not a template (allowed: chatml, llama3, mistral, auto)" \
  --input "$work/chats.jsonl" "${L3[@]}" --chat-template zephyr
refuse "an unknown role" "role.jsonl:1: message 0 has role 'robot' (allowed: system, user, assistant)" \
  --input "$work/role.jsonl" "${L3[@]}" --chat-template llama3
refuse "messages that are not a list" "list.jsonl:1: \"messages\" is not a list of messages" \
  --input "$work/list.jsonl" "${L3[@]}" --chat-template llama3
refuse "a template whose special tokens the tokenizer lacks" "writes the special token '<|im_start|>', which the tokenizer" \
  --input "$work/chats.jsonl" "${L3[@]}" --chat-template chatml
refuse "auto without a chat_template" "has no chat_template; name the template" \
  --input "$work/chats.jsonl" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/gpt4o" --chat-template auto
refuse "mistral's roles not alternating" "alt.jsonl:1: message 1 is a user turn" \
  --input "$work/alt.jsonl" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf/mistral_nemo" --chat-template mistral
refuse "no conversation to learn from" "none of the 1 conversations has an assistant turn" \
  --input "$work/none.jsonl" "${L3[@]}" --chat-template llama3
exit $fail
