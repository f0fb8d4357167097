// recompute.hpp: activation recomputation (Megatron's --recompute-granularity / -method /
// -num-layers). What a layer keeps between its forward and its backward:
//
//   none       everything its backward reads (docs/training.md lists the buffers);
//   selective  the GEMM outputs (qkv, fc1) and the residual stream (res1, the layer output):
//              expensive to recompute. The LayerNorm outputs, the attention core (its output
//              and lse, from qkv) and the GELU output, cheap to recompute and large, are
//              recomputed just before the layer's backward (Megatron's selective recomputation
//              of the attention core, plus the LayerNorms and GELU);
//   full       only the input of each chunk of layers: the backward of a chunk first re-runs the
//              chunk's forward into a working set that every micro-batch shares.
//
// Recomputation re-runs the same kernels on the same inputs, so losses and gradients are bitwise
// the same as without it (tests/train/test_memory.cpp).
#pragma once

#include <string>
#include <vector>

namespace tessera {

enum class RecomputeGranularity { None, Full, Selective };
enum class RecomputeMethod { Uniform, Block };

struct RecomputeConfig {
  RecomputeGranularity granularity = RecomputeGranularity::None;
  // Full only. Uniform: the stage's layers in chunks of num_layers, each keeping only its input.
  // Block: the first num_layers layers of each stage recomputed one by one, the rest stored.
  RecomputeMethod method = RecomputeMethod::Uniform;
  int num_layers = 1;
  const char* num_layers_option = "--recompute-num-layers";  // the option that set it (errors)

  bool full() const { return granularity == RecomputeGranularity::Full; }
  bool selective() const { return granularity == RecomputeGranularity::Selective; }
  // "none", "selective", "full (uniform, 2 layers per chunk)", ... for logs and --dry-run.
  std::string describe() const;
  // ConfigError when num_layers does not fit a stage (a model chunk with virtual stages) of
  // `stage_layers` layers.
  void validate(int stage_layers, bool virtual_stages = false) const;
};

// "full" | "selective" | "none" -> granularity; ConfigError naming --recompute-granularity.
RecomputeGranularity parse_recompute_granularity(const std::string& s);
// "uniform" | "block" -> method; ConfigError naming --recompute-method.
RecomputeMethod parse_recompute_method(const std::string& s);

// How one layer of a stage keeps its activations.
struct LayerRecompute {
  RecomputeGranularity kind = RecomputeGranularity::None;
  int chunk_begin = 0, chunk_end = 0;  // full: the chunk [begin, end) of global layer indices
  bool chunk_last(int layer) const { return layer == chunk_end - 1; }
};

struct ModelShard;
// The plan of every layer of a shard, in ModelShard::layers() order: each model chunk planned on
// its own (a full-recomputation group never spans two chunks).
std::vector<LayerRecompute> plan_recompute(const RecomputeConfig& rc, const ModelShard& shard);
// The plan for layers [layer_begin, layer_end) of a stage (or model chunk), one entry per layer.
std::vector<LayerRecompute> plan_recompute(const RecomputeConfig& rc, int layer_begin,
                                           int layer_end);

}  // namespace tessera
