// slots.hpp: the dimensions and allocation helpers of a rank's activation buffers
// (model/activation_slots.cpp builds them; the parts allocate their own through it).
#pragma once

#include <memory>
#include <vector>

#include "model/activations.hpp"
#include "model/layer_spec.hpp"
#include "model/parts.hpp"

namespace tessera {

struct SlotBuilder {
  SlotBuilder(const GPTConfig& config, const ModelShard& model_shard, int batch, int seq,
              DType dtype, Allocator& alloc, bool for_inference = false);

  const GPTConfig& cfg;
  const ModelShard& shard;
  const int B, T;
  const DType compute;
  Allocator& al;
  // Generation's buffers: the forward's alone (no backward scratch), MoE dropless.
  const bool inference;
  const int64_t N = int64_t(B) * T, C = cfg.hidden_size;
  // Sequence parallelism: the LayerNorm/dropout/residual tensors (and the LayerNorm statistics)
  // hold this rank's Nl of the N token rows; the LayerNorm outputs stay whole (gathered for the
  // GEMMs that read them).
  const bool sp = shard.sequence_parallel && shard.tp_size > 1;
  const int64_t Nl = sp ? N / shard.tp_size : N;
  const int64_t heads_l = cfg.num_attention_heads / shard.tp_size;
  const int64_t hl = heads_l * cfg.head_dim();
  // qkv holds the rank's query heads and its key and value groups.
  const int64_t qkvl = hl + 2 * (cfg.kv_heads() / shard.tp_size) * cfg.head_dim();
  const int64_t vl = cfg.padded_vocab_size(shard.tp_size) / shard.tp_size;
  // The parts of this rank's layers (planning instances: no model), by local index.
  std::vector<LayerSpec> specs;
  std::vector<std::unique_ptr<AttentionPart>> attention;
  std::vector<std::unique_ptr<MlpPart>> mlp;
  int64_t fl_max = 0;  // the widest dense MLP of this rank's layers

  const AttentionPart& attention_of(int l) const {
    return *attention[static_cast<size_t>(shard.local_index(l))];
  }
  const MlpPart& mlp_of(int l) const { return *mlp[static_cast<size_t>(shard.local_index(l))]; }
  Tensor f(Shape s) const { return Tensor(std::move(s), compute, al); }       // activations
  Tensor f32(Shape s) const { return Tensor(std::move(s), DType::F32, al); }  // statistics
  Tensor i32(Shape s) const { return Tensor(std::move(s), DType::I32, al); }
  // A residual-stream tensor: (B,T,C), or this rank's (Nl,C) rows under sequence parallelism.
  Tensor res() const { return sp ? f({Nl, C}) : f({B, T, C}); }
  // A norm's output (every row) and its statistics (own rows; RMSNorm keeps no mean).
  void norm(Tensor& out, Tensor& mean, Tensor& rstd) const;
};

}  // namespace tessera
