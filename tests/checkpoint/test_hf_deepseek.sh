#!/usr/bin/env bash
# test_hf_deepseek.sh: Hugging Face DeepseekV3ForCausalLM import and export as a user runs them. A
# random tiny DeepSeek-V3 written by an independent writer (hf_deepseek_tool.py: multi-latent
# attention with YaRN, layer 0 dense, 8 routed experts in 4 groups with their
# e_score_correction_bias and a shared expert, one multi-token prediction layer with DeepSeek's
# copies of the embedding and head) is imported at TP2 x PP3 with EP2, exported again and compared
# byte for byte (the expert biases and the MTP layer included); greedy generation from the import
# equals the tool's float64 forward (written from Hugging Face's modeling_deepseek_v3) at TP1 and
# TP2; a run trained from the import moves the biases, which its export carries and a second
# import reads back; configs/deepseek-v3.ini counts the parameters of DeepSeek-V3's config.json;
# settings Tessera does not compute and exports the class cannot hold are one line each.
# Usage: test_hf_deepseek.sh BIN_DIR SOURCE_DIR
set -u
bin=$1
src=$2
tool="python3 $src/tests/checkpoint/hf_deepseek_tool.py"
ltool="python3 $src/tests/checkpoint/hf_llama_tool.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
conv() { "$bin/tessera-convert" "$@" > "$work/conv.log" 2>&1 || { bad "tessera-convert $*: $(tail -2 "$work/conv.log")"; return 1; }; }
gen() {  # gen NP CKPT
  local cmd=("$bin/tessera-generate" --load "$2" --threads 1 --prompt-ids "3 14 15 92 65" --max-new-tokens 6 --greedy --tensor-model-parallel-size "$1")
  if [ "$1" -gt 1 ]; then timeout 300 mpirun --oversubscribe --bind-to none -np "$1" "${cmd[@]}" 2>/dev/null
  else timeout 300 "${cmd[@]}" 2>/dev/null; fi
}
P="3 14 15 92 65"

# Round trips: f32 in two shards with the query latent and MTP; bf16 without either.
for case in "ds --shards 2 --dtype f32 --seed 3|f32|--target-expert-model-parallel-size 2" \
            "ds-plain --shards 1 --dtype bf16 --seed 5 --no-q-lora --mtp 0|bf16|"; do
  IFS='|' read -r spec dtype ep <<<"$case"
  set -- $spec
  name=$1; shift
  $tool make "$work/$name" "$@" || { bad "$name: the tool could not write the model"; continue; }
  conv --from-hf "$work/$name" --save "$work/$name-ck" --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 3 $ep || continue
  grep -q "multi-latent attention (.*YaRN x4.*expert bias" "$work/conv.log" || bad "$name: the import log: $(head -1 "$work/conv.log")"
  conv --to-hf --load "$work/$name-ck" --save "$work/$name-out" --export-dtype "$dtype" --max-shard-size 8KB || continue
  if out=$($ltool compare "$work/$name" "$work/$name-out"); then
    ok "$name: HF -> TP2 x PP3 $ep -> HF ($dtype, $(ls "$work/$name-out"/*.safetensors | wc -l) files) is byte-identical: $out"
  else
    bad "$name: round trip: $out"
  fi
  grep -q '"model_type": "deepseek_v3"' "$work/$name-out/config.json" || bad "$name: config.json: $(head -3 "$work/$name-out/config.json")"
done
grep -q '"model.layers.3.mlp.gate.e_score_correction_bias"\|model.layers.3.shared_head.head.weight' <(cat "$work/ds-out"/model.safetensors.index.json) \
  && ok "the export holds the MTP layer's expert bias and shared head (index)" || bad "MTP tensors missing from the export's index"
ref=$($tool greedy "$work/ds" "$P" 6); rc=$?
if [ $rc -ne 0 ]; then bad "the reference has no clear greedy choice (rc $rc)"; else
  for np in 1 2; do
    got=$(gen "$np" "$work/ds-ck")
    [ "$got" = "$ref" ] && ok "greedy from the import at TP$np == the float64 reference: $got" || bad "TP$np greedy '$got' vs reference '$ref'"
  done
fi

# Training from the import moves the expert biases (updated each step); the export carries them and
# a second import reads them back (its export is the same bytes).
if timeout 300 "$bin/tessera-train" --load "$work/ds-ck" --use-checkpoint-args --mock-data --seq-length 8 \
     --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --threads 1 --log-interval 1 \
     --moe-router-bias-update-rate 0.01 --save "$work/trained" --save-interval 3 --device cpu > "$work/train.log" 2>&1 &&
   conv --to-hf --load "$work/trained" --save "$work/trained-hf" --export-dtype f32 &&
   conv --from-hf "$work/trained-hf" --save "$work/trained-ck2" &&
   conv --to-hf --load "$work/trained-ck2" --save "$work/trained-hf2" --export-dtype f32; then
  if moved=$(python3 - "$src/tests/checkpoint" "$work/ds" "$work/trained-hf" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from hf_llama_tool import read_dir, to_floats
a, b = read_dir(sys.argv[2]), read_dir(sys.argv[3])
moved = 0.0
for n in a:
    if n.endswith("e_score_correction_bias"):
        x, y = to_floats(a[n][0], a[n][2]), to_floats(b[n][0], b[n][2])
        moved = max(moved, max(abs(p - q) for p, q in zip(x, y)))
print("%.4g" % moved)
sys.exit(0 if moved > 0.005 else 1)
PY
  ) && $ltool compare "$work/trained-hf" "$work/trained-hf2" > /dev/null; then
    ok "three steps moved the expert biases (by up to $moved); export -> import -> export keeps them, byte for byte"
  else
    bad "expert biases after training: moved by '$moved', or lost between the exports"
  fi
else
  bad "training from the import: $(tail -2 "$work/train.log")"
fi

# The parameter counts of DeepSeek-V3's config.json.
read -r total active < <($tool count "$src/tests/checkpoint/hf_configs/deepseek-v3.json")
dry=$("$bin/tessera-train" --config "$src/configs/deepseek-v3.ini" --dry-run 2>&1)
grep -q "^parameters: $total (model)" <<<"$dry" && grep -q "^MoE: $active parameters active per token" <<<"$dry" \
  && ok "configs/deepseek-v3.ini: --dry-run counts $total parameters ($active active), as DeepSeek-V3's config.json" \
  || bad "deepseek-v3.ini: HF config $total / $active; --dry-run: $(grep -E '^(parameters|MoE)' <<<"$dry")"

# Bad input: one line naming the file or option, exit 2.
expect() {  # expect DESCRIPTION PATTERN -- tessera-convert ARGS
  local what=$1 pattern=$2 out rc
  shift 3
  out=$("$bin/tessera-convert" "$@" 2>&1); rc=$?
  if [ $rc -eq 2 ] && grep -qE -- "$pattern" <<<"$out" && [ "$(grep -c 'error:' <<<"$out")" -eq 1 ]; then ok "$what -> rc 2"
  else bad "$what: rc $rc: $out"; fi
}
jset() {  # jset DIR KEY JSON
  python3 -c 'import json, sys; p = sys.argv[1] + "/config.json"; c = json.load(open(p)); c[sys.argv[2]] = json.loads(sys.argv[3]); json.dump(c, open(p, "w"), indent=2)' "$@"
}
for c in 'quantization_config|{"quant_method": "fp8", "fmt": "e4m3"}|has quantization_config \(FP8 block-quantized weights\) \(allowed: bf16 or f32 weights' \
         'topk_method|"greedy"|has topk_method "greedy" \(allowed: noaux_tc' \
         'scoring_func|"softmax"|has scoring_func "softmax" \(allowed: sigmoid\)' \
         'norm_topk_prob|false|has norm_topk_prob false' \
         'num_key_value_heads|2|has num_key_value_heads 2 for 4 heads' \
         'n_group|3|has n_group 3 and topk_group 2 for 8 experts' \
         'num_experts_per_tok|1|has num_experts_per_tok 1 with norm_topk_prob' \
         'rope_interleave|false|has rope_interleave false \(allowed: true'; do
  IFS='|' read -r key value pattern <<<"$c"
  rm -rf "$work/b" && cp -r "$work/ds" "$work/b" && jset "$work/b" "$key" "$value"
  expect "config.json $key $value" "$pattern" -- --from-hf "$work/b" --save "$work/x"
done
# A key the import does not read is said (one warning naming it), not ignored; it still converts.
rm -rf "$work/b" "$work/x" && cp -r "$work/ds" "$work/b" && jset "$work/b" sliding_window 512
out=$("$bin/tessera-convert" --from-hf "$work/b" --save "$work/x" 2>&1); rc=$?
if [ $rc -eq 0 ] && grep -q 'key "sliding_window" is not read by the DeepSeek-V3 import' <<<"$out" \
   && ! grep -q 'key "architectures"' <<<"$out"; then ok "an unknown config key is named in a warning"
else bad "unknown config key: rc $rc: $out"; fi
rm -rf "$work/x"
rm -rf "$work/b" && cp -r "$work/ds" "$work/b" && jset "$work/b" rope_scaling '{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "mscale": 1.0, "mscale_all_dim": 0.5}'
expect "YaRN with mscale != mscale_all_dim" "has rope_scaling mscale 1 and mscale_all_dim 0.5" -- --from-hf "$work/b" --save "$work/x"
rm -rf "$work/b" && cp -r "$work/ds" "$work/b" && python3 - "$work/b" <<'PY'
import json, struct, sys
d = sys.argv[1]
idx = json.load(open(d + "/model.safetensors.index.json"))["weight_map"]
f = d + "/" + idx["model.layers.3.embed_tokens.weight"]
data = bytearray(open(f, "rb").read())
(n,) = struct.unpack("<Q", data[:8])
h = json.loads(data[8:8 + n])
at = 8 + n + h["model.layers.3.embed_tokens.weight"]["data_offsets"][0]
data[at:at + 4] = struct.pack("<f", 12.5)
open(f, "wb").write(bytes(data))
PY
expect "an MTP embedding copy that differs" "model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight" -- --from-hf "$work/b" --save "$work/x"
expect "a DeepSeek-V3 checkpoint exported as Llama" "has multi-latent attention; LlamaForCausalLM has none: export it with --hf-architecture deepseek_v3" -- --to-hf --load "$work/ds-ck" --save "$work/y" --hf-architecture llama
timeout 300 "$bin/tessera-train" --config "$src/configs/qwen3-tiny.ini" --mock-data --vocab-size 100 --train-iters 1 --threads 1 --log-interval 1 --save "$work/q3-ck" > "$work/train2.log" 2>&1 \
  && expect "a Qwen3 checkpoint exported as DeepSeek-V3" "has no multi-latent attention; DeepseekV3ForCausalLM has not" -- --to-hf --load "$work/q3-ck" --save "$work/y" --hf-architecture deepseek_v3 \
  || bad "training a Qwen3 checkpoint: $(tail -2 "$work/train2.log")"
[ ! -e "$work/x" ] && [ ! -e "$work/y" ] && ok "nothing written by the refused conversions" || bad "a refused conversion left files"
[ $fail -eq 0 ] && echo "HF DeepSeek-V3 import/export: all passed"
exit $fail
