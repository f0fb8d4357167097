// layer_spec.hpp: what each transformer layer is made of, decided once from the config
// (docs/architecture.md, "The model as parts"). As Megatron-Core's TransformerLayer specs: an
// attention part (standard multi-head / grouped-query attention with optional q/k norms, or
// multi-latent attention) and an MLP part (a dense MLP with its activation, or a mixture of
// experts), per layer, so DeepSeek's dense first layers are a list entry like any other.
//
// build_layer_specs is the one place in lib/model/ and lib/inference/ that reads the family
// options of GPTConfig (scripts/check-structure checks it); everything after it asks its parts.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/gpt_config.hpp"

namespace tessera {

class PartServices;
class AttentionPart;
class MlpPart;

enum class AttentionKind { Standard, MultiLatent };
enum class MlpKind { Dense, MoE };
enum class MlpActivation { Gelu, SwiGLU, SquaredRelu };

struct LayerSpec {
  AttentionKind attention = AttentionKind::Standard;
  // Standard: each query and key head normalized before RoPE (--qk-layernorm); multi-latent: the
  // query and key/value latents normalized.
  bool qk_norm = false;
  MlpKind mlp = MlpKind::Dense;
  MlpActivation activation = MlpActivation::Gelu;  // the dense MLP's and every expert's
  // The dense MLP's width at TP 1: the MLP's (--ffn-hidden-size), or in a MoE layer its shared
  // expert's (0: none).
  int64_t dense_width = 0;
};

// One entry per transformer layer with parameters (the model's, then multi-token prediction's).
std::vector<LayerSpec> build_layer_specs(const GPTConfig& cfg);

// The parts of a spec, for a model's shard (`services` its model's; null: to plan parameters and
// buffers only). cfg and shard must outlive them.
struct ModelShard;
std::unique_ptr<AttentionPart> make_attention_part(const LayerSpec& spec, const GPTConfig& cfg,
                                                   const ModelShard& shard, PartServices* services);
std::unique_ptr<MlpPart> make_mlp_part(const LayerSpec& spec, const GPTConfig& cfg,
                                       const ModelShard& shard, PartServices* services);

}  // namespace tessera
