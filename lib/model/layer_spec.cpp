// layer_spec.cpp: the per-layer spec list and the parts it chooses (model/layer_spec.hpp). The
// one place in lib/model/ and lib/inference/ that reads the family options; a new attention or
// MLP kind is a part file plus a line here.
#include "model/layer_spec.hpp"

#include "model/parts.hpp"

namespace tessera {

// The parts (each in its own file).
std::unique_ptr<AttentionPart> make_standard_attention(const LayerSpec&, const GPTConfig&,
                                                       const ModelShard&, GPTModel*);
std::unique_ptr<AttentionPart> make_mla_attention(const LayerSpec&, const GPTConfig&,
                                                  const ModelShard&, GPTModel*);
std::unique_ptr<MlpPart> make_dense_mlp(const LayerSpec&, const GPTConfig&, const ModelShard&,
                                        GPTModel*);
std::unique_ptr<MlpPart> make_moe_mlp(const LayerSpec&, const GPTConfig&, const ModelShard&,
                                      GPTModel*);

std::unique_ptr<AttentionPart> make_attention_part(const LayerSpec& spec, const GPTConfig& cfg,
                                                   const ModelShard& shard, GPTModel* model) {
  switch (spec.attention) {
    case AttentionKind::MultiLatent:
      return make_mla_attention(spec, cfg, shard, model);
    case AttentionKind::Standard:
      break;
  }
  return make_standard_attention(spec, cfg, shard, model);
}

std::unique_ptr<MlpPart> make_mlp_part(const LayerSpec& spec, const GPTConfig& cfg,
                                       const ModelShard& shard, GPTModel* model) {
  switch (spec.mlp) {
    case MlpKind::MoE:
      return make_moe_mlp(spec, cfg, shard, model);
    case MlpKind::Dense:
      break;
  }
  return make_dense_mlp(spec, cfg, shard, model);
}

}  // namespace tessera
