// reshard.cpp: a checkpoint at a target layout, one tensor at a time.
#include "checkpoint/reshard.hpp"

#include <cstdio>
#include <vector>

#include "core/error.hpp"

namespace tessera {

void validate_model_layout(const GPTConfig& cfg, int tp, int pp) {
  using detail::concat;
  if (tp < 1 || pp < 1)
    throw ConfigError(
        concat("target layout TP ", tp, " x PP ", pp, " is out of range (allowed: >= 1)"));
  if (cfg.num_attention_heads % tp != 0)
    throw ConfigError(concat("target tensor-parallel size ", tp, " does not divide the ",
                             cfg.num_attention_heads, " attention heads"));
  if (cfg.kv_heads() % tp != 0)
    throw ConfigError(concat("target tensor-parallel size ", tp, " does not divide the ",
                             cfg.kv_heads(),
                             " key/value heads (query groups); each rank holds whole key/value "
                             "heads, Tessera does not replicate them: use a TP that divides ",
                             cfg.kv_heads()));
  if (cfg.ffn() % tp != 0)
    throw ConfigError(
        concat("target tensor-parallel size ", tp, " does not divide the ffn width ", cfg.ffn()));
  if (cfg.num_layers % pp != 0)
    throw ConfigError(
        concat("target pipeline size ", pp, " does not divide the ", cfg.num_layers, " layers"));
}

void write_checkpoint(const std::string& save_dir, const CheckpointMeta& meta,
                      const SliceSource& source,
                      const std::function<void(const std::string&)>& progress,
                      const CheckpointReader* carry, const LayerStateSource& layer_state) {
  validate_model_layout(meta.model, meta.tp_size, meta.pp_size);
  refuse_save_over_checkpoint(save_dir, meta.iteration);
  const std::string tmp = begin_checkpoint_dir(save_dir, meta.iteration);
  try {
    std::vector<float> buf;
    const int files = meta.tp_size * meta.pp_size;
    int done = 0;
    for (int pp = 0; pp < meta.pp_size; ++pp)
      for (int tp = 0; tp < meta.tp_size; ++tp) {
        const ModelShard shard = model_shard_for(meta.model, meta.tp_size, tp, meta.pp_size, pp);
        const auto specs = build_param_specs(meta.model, shard);
        const std::string name = shard_file_name(tp, pp);
        CheckpointShardWriter w(tmp + "/" + name, meta, shard);
        int64_t elems = 0;
        for (const ParamSpec& s : specs) {
          buf.resize(s.numel());
          source("model", s, buf.data());
          w.write("model", s, buf.data());
          if (meta.has_optimizer) {
            source("optimizer/exp_avg", s, buf.data());
            w.write("optimizer/exp_avg", s, buf.data());
            source("optimizer/exp_avg_sq", s, buf.data());
            w.write("optimizer/exp_avg_sq", s, buf.data());
          }
          elems += s.numel();
        }
        for (int layer : shard.layers()) {  // per-layer state, carried whole
          if (!carry) break;
          const std::string n = fp8_state_name(layer);
          const int64_t k = carry->whole_numel("fp8", n);
          const int64_t cols = fp8_state_columns(meta.model.num_experts);
          if (k < 0 || k % cols != 0) continue;
          ParamSpec s;
          s.name = n;
          s.global_shape = s.local_shape = {k / cols, cols};
          buf.resize(k);
          carry->read_whole("fp8", n, buf.data());
          w.write("fp8", s, buf.data());
        }
        for (int layer : shard.layers()) {  // the MoE routers' expert biases, carried whole
          if (!carry || !meta.model.is_moe_layer(layer)) continue;
          const std::string n = expert_bias_name(layer);
          const int64_t k = carry->whole_numel(kRouterGroup, n);
          if (k != meta.model.num_experts) continue;
          ParamSpec s;
          s.name = n;
          s.global_shape = s.local_shape = {k};
          buf.resize(k);
          carry->read_whole(kRouterGroup, n, buf.data());
          w.write(kRouterGroup, s, buf.data());
        }
        if (layer_state)
          for (int layer : shard.layers())
            for (const ExtraTensor& e : layer_state(layer)) w.write(e.group, e.spec, e.data.data());
        w.finish();
        ++done;
        if (progress) {
          char line[256];
          std::snprintf(
              line, sizeof line, "[%d/%d] %s: %zu tensors, %lld parameters (layers %s%s%s)", done,
              files, name.c_str(), specs.size(), (long long)elems, shard.describe_layers().c_str(),
              shard.has_embedding ? ", embedding" : "", shard.has_head ? ", head" : "");
          progress(line);
        }
      }
    commit_checkpoint_dir(save_dir, meta.iteration, 0);
  } catch (...) {
    abandon_checkpoint_dir(save_dir, meta.iteration);
    throw;
  }
}

}  // namespace tessera
