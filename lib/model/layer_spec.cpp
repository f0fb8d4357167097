// layer_spec.cpp: the per-layer spec list and the parts it chooses (model/layer_spec.hpp). The
// one place in lib/model/ and lib/inference/ that reads the family options; a new attention or
// MLP kind is a part file plus its lines here.
#include "model/layer_spec.hpp"

#include "model/parts.hpp"

namespace tessera {

std::vector<LayerSpec> build_layer_specs(const GPTConfig& cfg) {
  std::vector<LayerSpec> specs;
  for (int l = 0; l < cfg.total_layers(); ++l) {
    LayerSpec s;
    s.attention = cfg.multi_latent_attention ? AttentionKind::MultiLatent : AttentionKind::Standard;
    s.qk_norm = cfg.qk_layernorm;
    s.mlp = cfg.is_moe_layer(l) ? MlpKind::MoE : MlpKind::Dense;
    s.activation = cfg.swiglu         ? MlpActivation::SwiGLU
                   : cfg.squared_relu ? MlpActivation::SquaredRelu
                                      : MlpActivation::Gelu;
    s.dense_width = s.mlp == MlpKind::MoE ? cfg.moe_shared_expert_intermediate_size : cfg.ffn();
    specs.push_back(s);
  }
  return specs;
}

// The parts (each in its own file).
std::unique_ptr<AttentionPart> make_standard_attention(const LayerSpec&, const GPTConfig&,
                                                       const ModelShard&, PartServices*);
std::unique_ptr<AttentionPart> make_mla_attention(const LayerSpec&, const GPTConfig&,
                                                  const ModelShard&, PartServices*);
std::unique_ptr<MlpPart> make_dense_mlp(const LayerSpec&, const GPTConfig&, const ModelShard&,
                                        PartServices*);
std::unique_ptr<MlpPart> make_moe_mlp(const LayerSpec&, const GPTConfig&, const ModelShard&,
                                      PartServices*);

std::unique_ptr<AttentionPart> make_attention_part(const LayerSpec& spec, const GPTConfig& cfg,
                                                   const ModelShard& shard,
                                                   PartServices* services) {
  switch (spec.attention) {
    case AttentionKind::MultiLatent:
      return make_mla_attention(spec, cfg, shard, services);
    case AttentionKind::Standard:
      break;
  }
  return make_standard_attention(spec, cfg, shard, services);
}

std::unique_ptr<MlpPart> make_mlp_part(const LayerSpec& spec, const GPTConfig& cfg,
                                       const ModelShard& shard, PartServices* services) {
  switch (spec.mlp) {
    case MlpKind::MoE:
      return make_moe_mlp(spec, cfg, shard, services);
    case MlpKind::Dense:
      break;
  }
  return make_dense_mlp(spec, cfg, shard, services);
}

}  // namespace tessera
