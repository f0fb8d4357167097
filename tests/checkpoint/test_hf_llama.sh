#!/usr/bin/env bash
# test_hf_llama.sh: Hugging Face LlamaForCausalLM import and export as a user runs them. A random
# tiny Llama directory written by an independent writer (hf_llama_tool.py: plain Python, sharded
# safetensors with model.safetensors.index.json, bf16) is imported to TP2 x PP2, exported again and
# compared byte for byte; greedy generation from the import equals the tool's float64 reference
# forward (written from the Llama definitions) at TP1 and TP2; grouped-query and
# multi-head, tied and untied, with and without biases and Llama 3's RoPE scaling, bf16 and f32;
# bad directories get one clear line.
# Usage: test_hf_llama.sh BIN_DIR SOURCE_DIR
set -u
bin=$1
src=$2
tool="python3 $src/tests/checkpoint/hf_llama_tool.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fail=1; }
conv() { "$bin/tessera-convert" "$@" > "$work/conv.log" 2>&1 || { bad "tessera-convert $*: $(tail -2 "$work/conv.log")"; return 1; }; }
gen() {  # gen NP TP CKPT PROMPT NEW
  local cmd=("$bin/tessera-generate" --load "$3" --threads 1 --prompt-ids "$4" --max-new-tokens "$5" --greedy --tensor-model-parallel-size "$2")
  if [ "$1" -gt 1 ]; then timeout 300 mpirun --oversubscribe --bind-to none -np "$1" "${cmd[@]}" 2>/dev/null
  else timeout 300 "${cmd[@]}" 2>/dev/null; fi
}
P="3 14 15 92 65"

# A: grouped-query (2 key/value heads for 4), untied, no biases, bf16, two shards.
for case in "gqa --shards 2 --dtype bf16 --groups 2 --seed 1|bf16|2" \
            "mha --shards 1 --dtype f32 --groups 4 --tied --bias --seed 2|f32|1" \
            "scaled --shards 1 --dtype bf16 --groups 2 --rope-scaling --theta 100 --seed 3|bf16|1"; do
  IFS='|' read -r spec dtype tp <<<"$case"
  set -- $spec
  name=$1; shift
  $tool make "$work/$name" "$@" || { bad "$name: the tool could not write the model"; continue; }
  conv --from-hf "$work/$name" --save "$work/$name-ck" --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 || continue
  grep -q "RoPE (base .*RMSNorm, SwiGLU" "$work/conv.log" || bad "$name: the import log names no Llama architecture: $(head -1 "$work/conv.log")"
  conv --to-hf --load "$work/$name-ck" --save "$work/$name-out" --export-dtype "$dtype" --max-shard-size 6KB || continue
  shards=$(ls "$work/$name-out"/*.safetensors | wc -l)
  if out=$($tool compare "$work/$name" "$work/$name-out"); then
    ok "$name: HF -> TP2 x PP2 -> HF ($dtype, $shards shard files) is byte-identical: $out"
  else
    bad "$name: round trip: $out"
  fi
  grep -q '"model_type": "llama"' "$work/$name-out/config.json" && [ "$shards" -gt 1 ] && [ -f "$work/$name-out/model.safetensors.index.json" ] \
    && ok "$name: config.json and model.safetensors.index.json written" || bad "$name: export files: $(ls "$work/$name-out")"
  # Again into the same directory as one file: the earlier shards and index must go.
  conv --to-hf --load "$work/$name-ck" --save "$work/$name-out" --export-dtype "$dtype" || continue
  if [ "$(ls "$work/$name-out")" = "$(printf 'config.json\nmodel.safetensors')" ] && $tool compare "$work/$name" "$work/$name-out" > /dev/null; then
    ok "$name: re-exported as one file over the shards: no stale shard or index left, identical"
  else
    bad "$name: re-export into the same directory left: $(ls "$work/$name-out" | tr '\n' ' ')"
  fi
  ref=$($tool greedy "$work/$name" "$P" 6); rc=$?
  if [ $rc -ne 0 ]; then bad "$name: the reference has no clear greedy choice (rc $rc)"; continue; fi
  for np in 1 2; do
    got=$(gen "$np" "$np" "$work/$name-ck" "$P" 6)
    [ "$got" = "$ref" ] && ok "$name: greedy from the import at TP$np == the float64 reference: $got" || bad "$name: TP$np greedy '$got' vs reference '$ref'"
  done
done

# Bad directories: one line naming the file, exit 2.
expect() {  # expect DESCRIPTION PATTERN -- tessera-convert ARGS
  local what=$1 pattern=$2 out rc
  shift 3
  out=$("$bin/tessera-convert" "$@" 2>&1); rc=$?
  if [ $rc -eq 2 ] && grep -qE -- "$pattern" <<<"$out" && [ "$(grep -c 'error:' <<<"$out")" -eq 1 ]; then ok "$what -> rc 2"
  else bad "$what: rc $rc: $out"; fi
}
$tool make "$work/b" --groups 2
cp -r "$work/b" "$work/shape"
sed -i 's/"intermediate_size": 24/"intermediate_size": 32/' "$work/shape/config.json"
expect "config whose shapes disagree with the safetensors" "model.safetensors': model.layers.0.mlp.gate_proj.weight has shape \[24, 16\], config.json implies \[32, 16\]" -- --from-hf "$work/shape" --save "$work/x"
cp -r "$work/b" "$work/scaling"
sed -i 's/"rope_scaling": null/"rope_scaling": {"rope_type": "yarn", "factor": 4.0}/' "$work/scaling/config.json"
expect "rope_scaling yarn" "has rope_scaling of type \"yarn\" \(allowed: llama3, or rope_scaling null\)" -- --from-hf "$work/scaling" --save "$work/x"
cp -r "$work/b" "$work/groups"
sed -i 's/"num_key_value_heads": 2/"num_key_value_heads": 3/' "$work/groups/config.json"
expect "key/value heads not dividing the heads" "num-query-groups=3 does not divide --num-attention-heads=4" -- --from-hf "$work/groups" --save "$work/x"
cp -r "$work/b" "$work/layers"
sed -i 's/"num_hidden_layers": 2/"num_hidden_layers": 1/' "$work/layers/config.json"
expect "files holding more layers than config.json says" "has tensor model.layers.1.[a-z_.]*, which config.json does not describe \(1 layers" -- --from-hf "$work/layers" --save "$work/x"
cp -r "$work/b" "$work/partial"
sed -i 's/"rope_theta"/"partial_rotary_factor": 0.5, "rope_theta"/' "$work/partial/config.json"
expect "partial_rotary_factor 0.5" "has partial_rotary_factor 0.500000; LlamaForCausalLM rotates every feature" -- --from-hf "$work/partial" --save "$work/x"
cp -r "$work/b" "$work/kind"
sed -i 's/"model_type": "llama"/"model_type": "mixtral"/' "$work/kind/config.json"
expect "another model type" "model_type \"mixtral\" \(allowed: gpt2, llama\)" -- --from-hf "$work/kind" --save "$work/x"
$tool make "$work/sh" --shards 2
sed -i 's/model-00002-of-00002/model-00003-of-00002/' "$work/sh/model.safetensors.index.json"
expect "an index naming a missing shard" "model-00003-of-00002.safetensors' cannot be opened" -- --from-hf "$work/sh" --save "$work/x"
expect "a bad --max-shard-size" "--max-shard-size=1XB is not a size" -- --to-hf --load "$work/gqa-ck" --save "$work/y" --max-shard-size 1XB
expect "a bad --export-dtype" "--export-dtype=int8 is not a dtype \(allowed: bf16, f32, f16\)" -- --to-hf --load "$work/gqa-ck" --save "$work/y" --export-dtype int8
# Issue 27: a config.json nested 50,000 deep (a stack overflow before), a key twice in it, and an
# index that maps a tensor twice.
{ printf '{"deep": %s' "$(head -c 50000 /dev/zero | tr '\0' '[')"; tail -c +2 "$work/b/config.json"; } > "$work/deep.json"
cp -r "$work/b" "$work/deep" && mv "$work/deep.json" "$work/deep/config.json"
expect "config.json nested 50,000 deep" "'$work/deep/config.json' does not parse: nesting deeper than 512 levels at byte 520$" -- --from-hf "$work/deep" --save "$work/x"
cp -r "$work/b" "$work/twice"
sed -i 's/"model_type": "llama"/"model_type": "llama", "model_type": "llama"/' "$work/twice/config.json"
expect "a key twice in config.json" "'$work/twice/config.json' does not parse: duplicate key \"model_type\" at byte [0-9]+$" -- --from-hf "$work/twice" --save "$work/x"
$tool make "$work/map" --shards 2
sed -i 's/"weight_map": {/"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors", /' "$work/map/model.safetensors.index.json"
expect "an index mapping a tensor twice" "model.safetensors.index.json' does not parse: duplicate key \"model.embed_tokens.weight\" at byte [0-9]+$" -- --from-hf "$work/map" --save "$work/x"
[ ! -e "$work/x" ] && ok "nothing written by the refused imports" || bad "a refused import left $work/x"
help=$("$bin/tessera-convert" --help)
grep -q "GPT-2 (GPT2LMHeadModel) and the Llama family (LlamaForCausalLM" <<<"$help" && ! grep -q "Hugging Face GPT-2 \(format\|directory\)" <<<"$help" \
  && ok "tessera-convert --help names GPT-2 and the Llama family" || bad "tessera-convert --help: $(head -4 <<<"$help")"
[ $fail -eq 0 ] && echo "HF Llama import/export: all passed"
exit $fail
