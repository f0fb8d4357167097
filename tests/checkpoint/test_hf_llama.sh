#!/usr/bin/env bash
# test_hf_llama.sh: Hugging Face LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM and
# MixtralForCausalLM (4 experts, top 2) import
# and export as a user runs them. A random
# tiny Llama directory written by an independent writer (hf_llama_tool.py: plain Python, sharded
# safetensors with model.safetensors.index.json, bf16) is imported to TP2 x PP2, exported again and
# compared byte for byte; greedy generation from the import equals the tool's float64 reference
# forward (written from the Llama definitions) at TP1 and TP2; grouped-query and
# multi-head, tied and untied, with and without biases and Llama 3's RoPE scaling, bf16 and f32;
# Qwen2 (q/k/v biases, tied and untied, a head_dim other than hidden/heads), Qwen3 (q_norm and
# k_norm, head_dim 6 in a 16-wide model) and Qwen3-MoE (a dense first layer, 4 experts, the top 2
# renormalized or not; also imported at EP 4) and Mistral the same way; the parameter counts of
# configs/qwen3-8b.ini and qwen3-30b-a3b.ini are those of Hugging Face's config.json; bad directories, sliding windows and exports Hugging Face cannot hold get one clear line.
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
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
conv() { "$bin/tessera-convert" "$@" > "$work/conv.log" 2>&1 || { bad "tessera-convert $*: $(tail -2 "$work/conv.log")"; return 1; }; }
gen() {  # gen NP TP CKPT PROMPT NEW
  local cmd=("$bin/tessera-generate" --load "$3" --threads 1 --prompt-ids "$4" --max-new-tokens "$5" --greedy --tensor-model-parallel-size "$2")
  if [ "$1" -gt 1 ]; then timeout 300 mpirun --oversubscribe --bind-to none -np "$1" "${cmd[@]}" 2>/dev/null
  else timeout 300 "${cmd[@]}" 2>/dev/null; fi
}
P="3 14 15 92 65"

# A: grouped-query (2 key/value heads for 4), untied, no biases, bf16, two shards.
for case in "gqa --shards 2 --dtype bf16 --groups 2 --seed 1|bf16|2|llama" \
            "mha --shards 1 --dtype f32 --groups 4 --tied --bias --seed 2|f32|1|llama" \
            "scaled --shards 1 --dtype bf16 --groups 2 --rope-scaling --theta 100 --seed 3|bf16|1|llama" \
            "qwen2 --arch qwen2 --shards 2 --dtype f32 --groups 2 --tied --theta 1000000 --seed 7|f32|2|qwen2" \
            "qwen2-hd --arch qwen2 --shards 1 --dtype bf16 --groups 2 --head-dim 6 --seed 9|bf16|1|qwen2" \
            "mistral --arch mistral --shards 1 --dtype f32 --groups 2 --theta 10000 --seed 6|f32|1|mistral" \
            "mixtral --arch mixtral --shards 2 --dtype f32 --groups 2 --theta 1000000 --seed 8|f32|2|mixtral" \
            "mixtral-bf16 --arch mixtral --shards 1 --dtype bf16 --groups 4 --tied --seed 10|bf16|1|mixtral" \
            "qwen3 --arch qwen3 --shards 2 --dtype bf16 --groups 2 --head-dim 6 --theta 1000000 --seed 11|bf16|2|qwen3" \
            "qwen3-tied --arch qwen3 --shards 1 --dtype f32 --groups 4 --tied --seed 13|f32|1|qwen3" \
            "qwen3-moe --arch qwen3_moe --shards 2 --dtype f32 --groups 2 --theta 1000000 --seed 12|f32|2|qwen3_moe" \
            "qwen3-moe-plain --arch qwen3_moe --shards 1 --dtype f32 --groups 2 --theta 1000000 --no-norm-topk --seed 16|f32|1|qwen3_moe"; do
  IFS='|' read -r spec dtype tp arch <<<"$case"
  set -- $spec
  name=$1; shift
  $tool make "$work/$name" "$@" || { bad "$name: the tool could not write the model"; continue; }
  conv --from-hf "$work/$name" --save "$work/$name-ck" --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 || continue
  grep -q "RoPE (base .*RMSNorm, SwiGLU" "$work/conv.log" || bad "$name: the import log names no Llama architecture: $(head -1 "$work/conv.log")"
  # A Mistral import exports as LlamaForCausalLM unless asked (the same model); Qwen2 by itself.
  as=(); [ "$arch" = mistral ] && as=(--hf-architecture mistral)
  conv --to-hf --load "$work/$name-ck" --save "$work/$name-out" --export-dtype "$dtype" --max-shard-size 6KB "${as[@]}" || continue
  shards=$(ls "$work/$name-out"/*.safetensors | wc -l)
  if out=$($tool compare "$work/$name" "$work/$name-out"); then
    ok "$name: HF -> TP2 x PP2 -> HF ($dtype, $shards shard files) is byte-identical: $out"
  else
    bad "$name: round trip: $out"
  fi
  grep -q "\"model_type\": \"$arch\"" "$work/$name-out/config.json" && [ "$shards" -gt 1 ] && [ -f "$work/$name-out/model.safetensors.index.json" ] \
    && ok "$name: config.json and model.safetensors.index.json written" || bad "$name: export files: $(ls "$work/$name-out")"
  # Again into the same directory: refused without --overwrite (issue 58), nothing touched.
  before=$(ls -l --time-style=+%s.%N "$work/$name-out" | md5sum)
  out=$("$bin/tessera-convert" --to-hf --load "$work/$name-ck" --save "$work/$name-out" 2>&1); rc=$?
  [ $rc -eq 2 ] && grep -q "already holds a Hugging Face model (config.json): give a new or empty directory, or --overwrite" <<<"$out" &&
    [ "$(ls -l --time-style=+%s.%N "$work/$name-out" | md5sum)" = "$before" ] &&
    ok "$name: an export over an export without --overwrite -> rc 2, untouched" || bad "$name: export over export: rc $rc $out"
  # With --overwrite, as one file: the earlier shards and index must go.
  conv --to-hf --load "$work/$name-ck" --save "$work/$name-out" --export-dtype "$dtype" "${as[@]}" --overwrite || continue
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
# Issue 39's new-user cases: a size that is not a whole number, a zero head count, NaN weights.
cp -r "$work/b" "$work/half" && sed -i 's/"hidden_size": 16/"hidden_size": 16.5/' "$work/half/config.json"
expect "hidden_size 16.5" "half/config.json' has \"hidden_size\": 16.5 \(allowed: a whole number >= 1\)" -- --from-hf "$work/half" --save "$work/x"
cp -r "$work/b" "$work/kv0" && sed -i 's/"num_key_value_heads": 2/"num_key_value_heads": 0/' "$work/kv0/config.json"
expect "num_key_value_heads 0" "kv0/config.json' has \"num_key_value_heads\": 0 \(allowed: a whole number >= 1, or null\)" -- --from-hf "$work/kv0" --save "$work/x"
cp -r "$work/b" "$work/nan" && python3 - "$work/nan/model.safetensors" <<'PY'
import json, struct, sys
p = sys.argv[1]
data = bytearray(open(p, "rb").read())
(n,) = struct.unpack("<Q", data[:8])
h = json.loads(data[8:8 + n])
name, t = next((k, v) for k, v in h.items() if k != "__metadata__")
at = 8 + n + t["data_offsets"][0]
data[at:at + 2] = b"\xc0\x7f" if t["dtype"] == "BF16" else b"\x00\x7e"
if t["dtype"] == "F32": data[at:at + 4] = struct.pack("<f", float("nan"))
open(p, "wb").write(bytes(data))
print(name)
PY
expect "a NaN weight" "nan/model.safetensors': tensor \"[a-z_.0-9]+\" holds NaN at element 0 \(damaged or not a trained checkpoint\)" -- --from-hf "$work/nan" --save "$work/x"
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
sed -i 's/"model_type": "llama"/"model_type": "gemma"/' "$work/kind/config.json"
expect "another model type" "model_type \"gemma\" \(allowed: gpt2, llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, deepseek_v3\)" -- --from-hf "$work/kind" --save "$work/x"
# Mixtral: router settings Tessera does not have, and an expert count the tensors contradict.
$tool make "$work/mx" --arch mixtral
cp -r "$work/mx" "$work/jitter" && sed -i 's/"router_jitter_noise": 0.0/"router_jitter_noise": 0.01/' "$work/jitter/config.json"
# router_aux_loss_coef travels: HF -> checkpoint -> HF (0.02), and from a trained run (0.01).
if timeout 120 "$bin/tessera-convert" --from-hf "$work/mx" --save "$work/mx-ck" > /dev/null 2>&1 &&
   timeout 120 "$bin/tessera-convert" --to-hf --load "$work/mx-ck" --save "$work/mx-hf" > /dev/null 2>&1 &&
   grep -q '"router_aux_loss_coef": 0.02,' "$work/mx-hf/config.json"; then
  ok "router_aux_loss_coef 0.02 through an import and an export"
else
  bad "router_aux_loss_coef after import and export: $(grep router_aux "$work/mx-hf/config.json")"
fi
if timeout 300 "$bin/tessera-train" --config "$src/configs/mixtral-tiny.ini" --mock-data --vocab-size 100 --num-layers 1 \
     --train-iters 1 --threads 1 --log-interval 1 --save "$work/mxt-ck" > "$work/train.log" 2>&1 &&
   timeout 120 "$bin/tessera-convert" --to-hf --load "$work/mxt-ck" --save "$work/mxt-hf" > /dev/null 2>&1 &&
   grep -q '"router_aux_loss_coef": 0.01,' "$work/mxt-hf/config.json"; then
  ok "a trained Mixtral's --moe-aux-loss-coeff 0.01 in its export's router_aux_loss_coef"
else
  bad "router_aux_loss_coef of a trained Mixtral: $(grep router_aux "$work/mxt-hf/config.json"; tail -n 2 "$work/train.log")"
fi
expect "Mixtral with router_jitter_noise" "has router_jitter_noise 0.01; Tessera's router has no jitter \(allowed: 0\)" -- --from-hf "$work/jitter" --save "$work/x"
cp -r "$work/mx" "$work/rtype" && sed -i 's/"router_jitter_noise"/"router_type": "sinkhorn", "router_jitter_noise"/' "$work/rtype/config.json"
expect "Mixtral with an unknown router setting" "has router setting \"router_type\", which this importer does not know" -- --from-hf "$work/rtype" --save "$work/x"
cp -r "$work/mx" "$work/fewer" && sed -i 's/"num_local_experts": 4/"num_local_experts": 3/' "$work/fewer/config.json"
expect "Mixtral with fewer experts than the files hold" "block_sparse_moe.gate.weight has shape \\[4, 16\\], config.json implies \\[3, 16\\]" -- --from-hf "$work/fewer" --save "$work/x"
cp -r "$work/mx" "$work/topk" && sed -i 's/"num_experts_per_tok": 2/"num_experts_per_tok": 5/' "$work/topk/config.json"
expect "Mixtral with num_experts_per_tok above the experts" "has num_local_experts 4 and num_experts_per_tok 5" -- --from-hf "$work/topk" --save "$work/x"
expect "a Mixtral checkpoint exported as Llama" "is a mixture of experts; export it with --hf-architecture mixtral" -- --to-hf --load "$work/mixtral-ck" --save "$work/y" --hf-architecture llama
expect "a Llama checkpoint exported as Mixtral" "is a dense model; MixtralForCausalLM is a mixture of experts" -- --to-hf --load "$work/gqa-ck" --save "$work/y" --hf-architecture mixtral
# Qwen3 and Qwen3-MoE settings Tessera does not compute, and a Qwen3-MoE import at EP 4 (each
# rank's experts by global index) that exports the same bytes.
$tool make "$work/q3b" --arch qwen3
cp -r "$work/q3b" "$work/q3bias" && sed -i 's/"attention_bias": false/"attention_bias": true/' "$work/q3bias/config.json"
expect "Qwen3 with attention_bias true" "q3bias/config.json' has attention_bias true \(biases on q, k, v and o_proj but not the MLP\)" -- --from-hf "$work/q3bias" --save "$work/x"
cp -r "$work/q3b" "$work/q3window" && sed -i 's/"use_sliding_window": false/"use_sliding_window": true/' "$work/q3window/config.json"
expect "Qwen3 with use_sliding_window true" "q3window/config.json' has use_sliding_window true; Tessera's attention is full causal" -- --from-hf "$work/q3window" --save "$work/x"
jset() {  # jset DIR KEY JSON: config.json's KEY set to the JSON value
  python3 -c 'import json, sys; p = sys.argv[1] + "/config.json"; c = json.load(open(p)); c[sys.argv[2]] = json.loads(sys.argv[3]); json.dump(c, open(p, "w"), indent=2)' "$@"
}
$tool make "$work/qmb" --arch qwen3_moe
cp -r "$work/qmb" "$work/qmonly" && jset "$work/qmonly" mlp_only_layers "[0, 5]"
expect "Qwen3-MoE with mlp_only_layers past the layers" "qmonly/config.json' has mlp_only_layers entry 5 \(allowed: layers 0 to 1\)" -- --from-hf "$work/qmonly" --save "$work/x"
cp -r "$work/qmb" "$work/qmdense" && jset "$work/qmdense" mlp_only_layers "[0, 1]"
expect "Qwen3-MoE with every layer dense" "makes no layer sparse \(decoder_sparse_step 1, mlp_only_layers\): import it as a dense qwen3 model" -- --from-hf "$work/qmdense" --save "$work/x"
cp -r "$work/qmb" "$work/qmswap" && jset "$work/qmswap" mlp_only_layers "[1]"
expect "Qwen3-MoE whose mlp_only_layers contradicts the files" "has no tensor model.layers.0.mlp.gate.weight \(config.json implies it\)" -- --from-hf "$work/qmswap" --save "$work/x"
# decoder_sparse_step 2 without mlp_only_layers makes the same layer 1 sparse: the same import.
cp -r "$work/qmb" "$work/qmstep" && jset "$work/qmstep" mlp_only_layers "[]" && jset "$work/qmstep" decoder_sparse_step 2
if conv --from-hf "$work/qmstep" --save "$work/qmstep-ck" && grep -q "MoE in 1 of 2 layers" "$work/conv.log" &&
   conv --to-hf --load "$work/qmstep-ck" --save "$work/qmstep-out" --export-dtype bf16 &&
   $tool compare "$work/qmb" "$work/qmstep-out" > /dev/null; then
  ok "Qwen3-MoE decoder_sparse_step 2 makes layer 1 sparse, as mlp_only_layers [0] does"
else
  bad "Qwen3-MoE decoder_sparse_step 2: $(head -1 "$work/conv.log")"
fi
cp -r "$work/qmb" "$work/qmrouter" && jset "$work/qmrouter" router_temperature 2.0
expect "Qwen3-MoE with an unknown router setting" "has router setting \"router_temperature\", which this importer does not know" -- --from-hf "$work/qmrouter" --save "$work/x"
if conv --from-hf "$work/qwen3-moe" --save "$work/qm-ep4" --target-expert-model-parallel-size 4 &&
   conv --to-hf --load "$work/qm-ep4" --save "$work/qm-ep4-out" --export-dtype f32 &&
   out=$($tool compare "$work/qwen3-moe" "$work/qm-ep4-out"); then
  ok "Qwen3-MoE -> EP 4 -> HF is byte-identical: $out"
else
  bad "Qwen3-MoE at EP 4: ${out:-the conversion failed}"
fi
# norm_topk_prob is read, not assumed: the plain top-2 model's reference continuation changes when
# its config.json says norm_topk_prob true, and the import above followed the file's false.
cp -r "$work/qwen3-moe-plain" "$work/qmflip" && sed -i 's/"norm_topk_prob": false/"norm_topk_prob": true/' "$work/qmflip/config.json"
plain=$($tool greedy "$work/qwen3-moe-plain" "$P" 6) && flip=$($tool greedy "$work/qmflip" "$P" 6) && [ "$plain" != "$flip" ] \
  && ok "norm_topk_prob changes the Qwen3-MoE reference's continuation ($plain vs $flip)" \
  || bad "norm_topk_prob: the reference gives '$plain' either way"
# The parameter counts Hugging Face's configs give, from configs/qwen3-8b.ini and qwen3-30b-a3b.ini.
for m in qwen3-8b qwen3-30b-a3b; do
  read -r total active < <($tool count "$src/tests/checkpoint/hf_configs/$m.json")
  dry=$("$bin/tessera-train" --config "$src/configs/$m.ini" --dry-run 2>&1)
  if grep -q "^parameters: $total (model)" <<<"$dry" &&
     { [ "$total" = "$active" ] || grep -q "^MoE: $active parameters active per token" <<<"$dry"; }; then
    ok "configs/$m.ini: --dry-run counts $total parameters ($active active), as Hugging Face's config.json"
  else
    bad "configs/$m.ini: HF config gives $total / $active; --dry-run: $(grep -E '^(parameters|MoE)' <<<"$dry")"
  fi
done
# Sliding windows: Tessera's attention is full causal.
$tool make "$work/mw" --arch mistral
cp -r "$work/mw" "$work/window" && sed -i 's/"sliding_window": null/"sliding_window": 4096/' "$work/window/config.json"
expect "Mistral with sliding_window 4096" "window/config.json' has sliding_window 4096; Tessera's attention is full causal \(allowed: sliding_window null\)" -- --from-hf "$work/window" --save "$work/x"
cp -r "$work/mw" "$work/nowindow"
python3 -c 'import json, sys; p = sys.argv[1]; c = json.load(open(p)); del c["sliding_window"]; json.dump(c, open(p, "w"))' "$work/nowindow/config.json"
expect "Mistral without a sliding_window key (default 4096)" "has sliding_window absent \(MistralConfig's default 4096\)" -- --from-hf "$work/nowindow" --save "$work/x"
$tool make "$work/qw" --arch qwen2
cp -r "$work/qw" "$work/qwindow" && sed -i 's/"use_sliding_window": false/"use_sliding_window": true/' "$work/qwindow/config.json"
expect "Qwen2 with use_sliding_window true" "qwindow/config.json' has use_sliding_window true; Tessera's attention is full causal" -- --from-hf "$work/qwindow" --save "$work/x"
cp -r "$work/qw" "$work/qnobias" && python3 - "$work/qnobias" <<'PY'
import json, struct, sys
p = sys.argv[1] + "/model.safetensors"
data = open(p, "rb").read()
(n,) = struct.unpack("<Q", data[:8])
h = json.loads(data[8:8 + n])
h.pop("model.layers.1.self_attn.k_proj.bias")
t = json.dumps(h).encode()
t += b" " * (-len(t) % 8)
open(p, "wb").write(struct.pack("<Q", len(t)) + t + data[8 + n:])
PY
expect "Qwen2 without a k_proj bias" "has no tensor model.layers.1.self_attn.k_proj.bias \(config.json implies it\)" -- --from-hf "$work/qnobias" --save "$work/x"
# Exports Hugging Face cannot hold, and architectures that do not fit the checkpoint.
expect "a Qwen2 checkpoint exported as Llama" "has biases on q, k and v only \(--add-qkv-bias\); LlamaForCausalLM's attention_bias also covers o_proj: export it with --hf-architecture qwen2" -- --to-hf --load "$work/qwen2-ck" --save "$work/y" --hf-architecture llama
expect "a Qwen2 checkpoint exported as Mistral" "has linear biases; MistralForCausalLM has none: export it with --hf-architecture qwen2" -- --to-hf --load "$work/qwen2-ck" --save "$work/y" --hf-architecture mistral
expect "a Llama checkpoint exported as Qwen2" "has no QKV biases; Qwen2ForCausalLM has biases on q, k and v only" -- --to-hf --load "$work/gqa-ck" --save "$work/y" --hf-architecture qwen2
expect "an unknown --hf-architecture" "--hf-architecture=gemma is not known \(allowed: llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, deepseek_v3\)" -- --to-hf --load "$work/gqa-ck" --save "$work/y" --hf-architecture gemma
# Qwen3 and Qwen3-MoE: what their classes cannot hold, both ways.
expect "a Qwen3 checkpoint exported as Llama" "normalizes its query and key heads \(--qk-layernorm\); LlamaForCausalLM does not: export it with --hf-architecture qwen3" -- --to-hf --load "$work/qwen3-ck" --save "$work/y" --hf-architecture llama
expect "a Llama checkpoint exported as Qwen3" "has no query/key norms; Qwen3ForCausalLM has them \(q_norm, k_norm\): train with --qk-layernorm" -- --to-hf --load "$work/gqa-ck" --save "$work/y" --hf-architecture qwen3
expect "a Qwen3-MoE checkpoint exported as Mixtral" "normalizes its query and key heads \(--qk-layernorm\); MixtralForCausalLM does not: export it with --hf-architecture qwen3_moe" -- --to-hf --load "$work/qwen3-moe-ck" --save "$work/y" --hf-architecture mixtral
expect "a dense Qwen3 checkpoint exported as Qwen3-MoE" "is a dense model; Qwen3MoeForCausalLM is a mixture of experts: export it with --hf-architecture qwen3" -- --to-hf --load "$work/qwen3-ck" --save "$work/y" --hf-architecture qwen3_moe
for opt in rotary-interleaved apply-layernorm-1p; do
  timeout 300 "$bin/tessera-train" --config "$src/configs/qwen2-tiny.ini" --mock-data --vocab-size 100 --train-iters 1 --threads 1 --log-interval 1 --$opt --save "$work/$opt-ck" > "$work/train.log" 2>&1 || { bad "training a --$opt checkpoint: $(tail -2 "$work/train.log")"; continue; }
  expect "exporting a --$opt checkpoint" "\(--$opt\); Qwen2ForCausalLM (rotates halves|has no such option)" -- --to-hf --load "$work/$opt-ck" --save "$work/y"
done
timeout 300 "$bin/tessera-train" --config "$src/configs/gpt2-tiny.ini" --mock-data --vocab-size 100 --train-iters 1 --threads 1 --log-interval 1 --squared-relu --save "$work/relu2-ck" > "$work/train.log" 2>&1 \
  && expect "exporting a GPT-2 --squared-relu checkpoint" "GPT2LMHeadModel has none of --kv-channels, --apply-layernorm-1p and --squared-relu" -- --to-hf --load "$work/relu2-ck" --save "$work/y" \
  || bad "training a GPT-2 --squared-relu checkpoint: $(tail -2 "$work/train.log")"
[ ! -e "$work/y" ] && ok "nothing written by the refused exports" || bad "a refused export left $work/y"
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
