// recompute.cpp: the recomputation plan of a pipeline stage.
#include "model/recompute.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "model/params.hpp"

namespace tessera {

std::string RecomputeConfig::describe() const {
  switch (granularity) {
    case RecomputeGranularity::None:
      return "none";
    case RecomputeGranularity::Selective:
      return "selective";
    case RecomputeGranularity::Full:
      break;
  }
  if (method == RecomputeMethod::Uniform)
    return detail::concat("full (uniform, ", num_layers, " layer", num_layers == 1 ? "" : "s",
                          " per chunk)");
  return detail::concat("full (block, the first ", num_layers, " layer", num_layers == 1 ? "" : "s",
                        " of each stage, or of each model chunk with virtual stages)");
}

void RecomputeConfig::validate(int stage_layers, bool virtual_stages) const {
  if (!full()) return;
  if (num_layers < 1 || num_layers > stage_layers)
    throw ConfigError(detail::concat(
        num_layers_option, "=", num_layers, " does not fit ",
        virtual_stages ? "a model chunk (virtual pipeline stage) of " : "a pipeline stage of ",
        stage_layers, " layer", stage_layers == 1 ? "" : "s", " (allowed: 1 to ", stage_layers,
        ")"));
}

RecomputeGranularity parse_recompute_granularity(const std::string& s) {
  if (s == "full") return RecomputeGranularity::Full;
  if (s == "selective") return RecomputeGranularity::Selective;
  if (s == "none" || s.empty()) return RecomputeGranularity::None;
  throw ConfigError("--recompute-granularity=" + s +
                    " is not a granularity (allowed: full, selective)");
}

RecomputeMethod parse_recompute_method(const std::string& s) {
  if (s == "uniform") return RecomputeMethod::Uniform;
  if (s == "block") return RecomputeMethod::Block;
  throw ConfigError("--recompute-method=" + s + " is not a method (allowed: uniform, block)");
}

namespace {

// A stage's plan; --recompute-num-layers beyond its layers covers them all (uneven stages: the
// count is checked against the largest).
std::vector<LayerRecompute> stage_plan(const RecomputeConfig& rc, int layer_begin, int layer_end) {
  const int n = layer_end - layer_begin;
  std::vector<LayerRecompute> plan(static_cast<size_t>(n));
  if (n == 0 || rc.granularity == RecomputeGranularity::None) return plan;
  for (int i = 0; i < n; ++i) {
    LayerRecompute& p = plan[static_cast<size_t>(i)];
    const int l = layer_begin + i;
    if (rc.selective()) {
      p.kind = RecomputeGranularity::Selective;
    } else if (rc.method == RecomputeMethod::Uniform) {
      p.kind = RecomputeGranularity::Full;
      p.chunk_begin = layer_begin + i / rc.num_layers * rc.num_layers;
      p.chunk_end = std::min(layer_end, p.chunk_begin + rc.num_layers);
    } else if (i < rc.num_layers) {  // block: one-layer chunks at the start of the stage
      p.kind = RecomputeGranularity::Full;
      p.chunk_begin = l;
      p.chunk_end = l + 1;
    }
  }
  return plan;
}

}  // namespace

std::vector<LayerRecompute> plan_recompute(const RecomputeConfig& rc, int layer_begin,
                                           int layer_end) {
  if (layer_end > layer_begin && rc.granularity != RecomputeGranularity::None)
    rc.validate(layer_end - layer_begin);
  return stage_plan(rc, layer_begin, layer_end);
}

std::vector<LayerRecompute> plan_recompute(const RecomputeConfig& rc, const ModelShard& shard) {
  std::vector<LayerRecompute> plan;
  // --recompute-num-layers was checked against the widest stage of the whole model
  // (validate_layout); a narrower stage recomputes all its layers (Megatron-LM's slicing).
  for (const LayerRange& c : shard.chunks) {
    const auto p = stage_plan(rc, c.begin, c.end);
    plan.insert(plan.end(), p.begin(), p.end());
  }
  plan.resize(plan.size() + static_cast<size_t>(shard.mtp_count));  // MTP's layers keep all
  return plan;
}

}  // namespace tessera
