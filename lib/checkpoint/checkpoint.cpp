// checkpoint.cpp: writing, verifying and reading sharded checkpoints.
#include "checkpoint/checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/hdf5_check.hpp"
#include "core/paths.hpp"
#include "core/test_hooks.hpp"

namespace tessera {

namespace {

void remove_tree(const std::string& path) {
  DIR* d = opendir(path.c_str());
  if (d) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      const std::string p = path + "/" + n;
      if (is_dir(p))
        remove_tree(p);
      else
        ::unlink(p.c_str());
    }
    closedir(d);
  }
  ::rmdir(path.c_str());
}

void fsync_path(const std::string& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Contiguous storage (large sequential writes straight from the tensor) with the tensor's XXH64
// in the attribute "xxh64", checked whenever the tensor is read.
void write_tensor(hid_t group, const ParamSpec& s, const float* data) {
  std::vector<hsize_t> dims(s.local_shape.begin(), s.local_shape.end());
  H5Id space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  H5Id ds(H5Dcreate2(group, s.name.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT,
                     H5P_DEFAULT));
  HDF5_CHECK(ds.get());
  HDF5_CHECK(H5Dwrite(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
  h5_write_attr(ds.get(), "global_shape",
                std::vector<int64_t>(s.global_shape.begin(), s.global_shape.end()));
  h5_write_attr(ds.get(), "split_axis", static_cast<int64_t>(s.split_axis));
  h5_write_attr(ds.get(), "split_offset", s.split_offset);
  h5_write_attr(ds.get(), "dtype", std::string("f32"));
  h5_write_attr(ds.get(), "xxh64", static_cast<int64_t>(xxh64(data, sizeof(float) * s.numel())));
}

// Reads a whole dataset into `out` and checks it against its stored XXH64; false when either fails.
// hash_seconds (optional): the time the checksum took is added there.
bool read_verified(hid_t ds, float* out, int64_t n, double* hash_seconds = nullptr) {
  int64_t stored = 0;
  if (!h5_read_attr(ds, "xxh64", stored)) return false;
  if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0) return false;
  const auto t0 = std::chrono::steady_clock::now();
  const bool same = static_cast<uint64_t>(stored) == xxh64(out, sizeof(float) * n);
  if (hash_seconds)
    *hash_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return same;
}

// The attributes written here are listed in checkpoint_file_attributes() (tessera-checkpoint verify
// compares them between the files).
void write_meta(hid_t f, const CheckpointMeta& m, const ModelShard& sh) {
  h5_write_attr(f, "format_version", kCheckpointFormatVersion);
  h5_write_attr(f, "iteration", m.iteration);
  h5_write_attr(f, "consumed_samples", m.consumed_samples);
  h5_write_attr(f, "optimizer_steps", m.optimizer_steps);
  if (m.lr_schedule_samples >= 0) h5_write_attr(f, "lr_schedule_samples", m.lr_schedule_samples);
  if (m.has_loss_scale) {  // as text: exact for any double
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", m.loss_scale);
    h5_write_attr(f, "loss_scale", std::string(buf));
    h5_write_attr(f, "loss_scale_growth_tracker", m.loss_scale_growth_tracker);
    h5_write_attr(f, "loss_scale_hysteresis_tracker", m.loss_scale_hysteresis_tracker);
    h5_write_attr(f, "skipped_iterations", m.skipped_iterations);
  }
  h5_write_attr(f, "seed", static_cast<int64_t>(m.seed));
  h5_write_attr(f, "num_layers", static_cast<int64_t>(m.model.num_layers));
  h5_write_attr(f, "hidden_size", static_cast<int64_t>(m.model.hidden_size));
  h5_write_attr(f, "num_attention_heads", static_cast<int64_t>(m.model.num_attention_heads));
  h5_write_attr(f, "ffn_hidden_size", static_cast<int64_t>(m.model.ffn()));
  h5_write_attr(f, "seq_length", static_cast<int64_t>(m.model.seq_length));
  h5_write_attr(f, "max_position_embeddings", static_cast<int64_t>(m.model.max_positions()));
  h5_write_attr(f, "vocab_size", m.model.vocab_size);
  h5_write_attr(f, "make_vocab_size_divisible_by",
                static_cast<int64_t>(m.model.make_vocab_size_divisible_by));
  h5_write_attr(f, "padded_vocab_size", m.model.padded_vocab_size(m.tp_size));
  h5_write_attr(f, "layernorm_epsilon_x1e9",
                static_cast<int64_t>(std::llround(m.model.layernorm_epsilon * 1e9)));
  {  // the Llama family's options (absent in older checkpoints: GPT-2's values)
    const GPTConfig& c = m.model;
    char buf[128];
    h5_write_attr(f, "position_embedding_type", c.position_embedding_type);
    std::snprintf(buf, sizeof buf, "%.17g", c.rotary_base);
    h5_write_attr(f, "rotary_base", std::string(buf));
    std::snprintf(buf, sizeof buf, "%.17g", c.rotary_percent);
    h5_write_attr(f, "rotary_percent", std::string(buf));
    h5_write_attr(f, "normalization", c.normalization);
    if (c.use_rope_scaling) {  // factor, low and high frequency factors, original positions
      std::snprintf(buf, sizeof buf, "%.17g %.17g %.17g %.17g", c.rope_scaling_factor,
                    c.rope_scaling_low_freq_factor, c.rope_scaling_high_freq_factor,
                    c.rope_scaling_original_max_positions);
      h5_write_attr(f, "rope_scaling", std::string(buf));
    }
    h5_write_attr(f, "swiglu", static_cast<int64_t>(c.swiglu));
    h5_write_attr(f, "num_query_groups",
                  static_cast<int64_t>(c.group_query_attention ? c.num_query_groups : 0));
    h5_write_attr(f, "untie_embeddings_and_output_weights",
                  static_cast<int64_t>(c.untie_embeddings_and_output_weights));
    h5_write_attr(f, "add_bias_linear", static_cast<int64_t>(c.add_bias_linear));
    // Qwen2's and Megatron's smaller options (absent in older checkpoints: off)
    h5_write_attr(f, "add_qkv_bias", static_cast<int64_t>(c.add_qkv_bias));
    h5_write_attr(f, "kv_channels", static_cast<int64_t>(c.kv_channels));
    h5_write_attr(f, "apply_layernorm_1p", static_cast<int64_t>(c.apply_layernorm_1p));
    h5_write_attr(f, "rotary_interleaved", static_cast<int64_t>(c.rotary_interleaved));
    h5_write_attr(f, "squared_relu", static_cast<int64_t>(c.squared_relu));
    h5_write_attr(f, "qk_layernorm", static_cast<int64_t>(c.qk_layernorm));  // Qwen3
    if (c.mtp()) h5_write_attr(f, "mtp_num_layers", static_cast<int64_t>(c.mtp_num_layers));
    if (c.mla()) {  // multi-latent attention (absent: none) and YaRN
      h5_write_attr(f, "q_lora_rank", static_cast<int64_t>(c.q_lora_rank));
      h5_write_attr(f, "kv_lora_rank", static_cast<int64_t>(c.kv_lora_rank));
      h5_write_attr(f, "qk_head_dim", static_cast<int64_t>(c.qk_head_dim));
      h5_write_attr(f, "qk_pos_emb_head_dim", static_cast<int64_t>(c.qk_pos_emb_head_dim));
      h5_write_attr(f, "v_head_dim", static_cast<int64_t>(c.v_head_dim));
      h5_write_attr(f, "rope_type", c.rope_type);
      std::snprintf(buf, sizeof buf, "%.17g %.17g %.17g %.17g %.17g %d", c.rotary_scaling_factor,
                    c.mscale, c.mscale_all_dim, c.beta_fast, c.beta_slow,
                    c.original_max_position_embeddings);
      h5_write_attr(f, "yarn", std::string(buf));
    }
    if (c.moe()) {  // Mixture of Experts (absent: a dense model)
      h5_write_attr(f, "num_experts", static_cast<int64_t>(c.num_experts));
      h5_write_attr(f, "moe_router_topk", static_cast<int64_t>(c.moe_router_topk));
      h5_write_attr(f, "moe_ffn_hidden_size", static_cast<int64_t>(c.moe_ffn()));
      h5_write_attr(f, "moe_layer_freq", c.moe_layer_freq);
      h5_write_attr(f, "moe_router_score_function", c.moe_router_score_function);
      h5_write_attr(f, "moe_router_pre_softmax", static_cast<int64_t>(c.moe_router_pre_softmax));
      std::snprintf(buf, sizeof buf, "%.17g", c.moe_router_topk_scaling_factor);
      h5_write_attr(f, "moe_router_topk_scaling_factor", std::string(buf));
      h5_write_attr(f, "moe_shared_expert_intermediate_size",
                    static_cast<int64_t>(c.moe_shared_expert_intermediate_size));
      // DeepSeek-V3's router (absent in older checkpoints: off)
      h5_write_attr(f, "moe_router_enable_expert_bias",
                    static_cast<int64_t>(c.moe_router_enable_expert_bias));
      h5_write_attr(f, "moe_router_num_groups", static_cast<int64_t>(c.moe_router_num_groups));
      h5_write_attr(f, "moe_router_group_topk", static_cast<int64_t>(c.moe_router_group_topk));
      h5_write_attr(f, "moe_router_group_score_experts",
                    static_cast<int64_t>(c.moe_router_group_score_experts));
    }
  }
  h5_write_attr(f, "tensor_model_parallel_size", static_cast<int64_t>(m.tp_size));
  h5_write_attr(f, "pipeline_model_parallel_size", static_cast<int64_t>(m.pp_size));
  h5_write_attr(f, "data_parallel_size", static_cast<int64_t>(m.dp_size));
  h5_write_attr(f, "tp_rank", static_cast<int64_t>(sh.tp_rank));
  {  // the transformer layers in this file (several ranges with virtual pipeline stages)
    std::vector<int64_t> layers;
    for (int l : sh.layers()) layers.push_back(l);
    h5_write_attr(f, "layers", layers);
    h5_write_attr(f, "virtual_pipeline_model_parallel_size", static_cast<int64_t>(sh.num_chunks()));
  }
  h5_write_attr(f, "has_optimizer", static_cast<int64_t>(m.has_optimizer));
  h5_write_attr(f, "config", m.config_text);
  if (!m.rerun_state.empty()) h5_write_attr(f, "rerun_state", m.rerun_state);
}

}  // namespace

const std::vector<std::string>& checkpoint_file_attributes() {
  // Every root attribute write_meta below writes (some only in some runs).
  // clang-format off
  static const std::vector<std::string> names{
      "format_version", "iteration", "consumed_samples", "optimizer_steps",
      "lr_schedule_samples", "loss_scale", "loss_scale_growth_tracker",
      "loss_scale_hysteresis_tracker", "skipped_iterations", "rerun_state", "seed", "num_layers", "hidden_size",
      "num_attention_heads", "ffn_hidden_size", "seq_length", "max_position_embeddings",
      "vocab_size", "make_vocab_size_divisible_by", "padded_vocab_size", "layernorm_epsilon_x1e9",
      "position_embedding_type", "rotary_base", "rotary_percent", "normalization", "rope_scaling",
      "swiglu", "num_query_groups", "untie_embeddings_and_output_weights", "add_bias_linear",
      "add_qkv_bias", "kv_channels", "apply_layernorm_1p", "rotary_interleaved", "squared_relu",
      "qk_layernorm", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
      "v_head_dim", "rope_type", "yarn", "mtp_num_layers",
      "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
      "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
      "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias",
      "moe_router_num_groups", "moe_router_group_topk", "moe_router_group_score_experts",
      "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
      "tp_rank", "layers", "virtual_pipeline_model_parallel_size", "has_optimizer", "config"};
  // clang-format on
  return names;
}

void check_target_expert_parallel(const GPTConfig& model, int ep, const std::string& source) {
  if (ep < 1)
    throw ConfigError(detail::concat("--target-expert-model-parallel-size=", ep,
                                     " is out of range (allowed: >= 1)"));
  if (ep > 1 && !model.moe())
    throw ConfigError(detail::concat("--target-expert-model-parallel-size=", ep, ": '", source,
                                     "' is a dense model (no experts to split)"));
  if (model.moe() && model.num_experts % ep != 0)
    throw ConfigError(detail::concat("--target-expert-model-parallel-size=", ep,
                                     " does not divide the ", model.num_experts, " experts of '",
                                     source, "' (allowed: a divisor of ", model.num_experts, ")"));
}

std::string iteration_dir_name(int64_t iteration) {
  char b[32];
  std::snprintf(b, sizeof b, "iter_%07lld", (long long)iteration);
  return b;
}

int64_t parse_iteration_dir_name(const std::string& path) {
  size_t end = path.size();
  while (end > 1 && path[end - 1] == '/') --end;
  const size_t slash = path.rfind('/', end - 1);
  const std::string base = path.substr(slash == std::string::npos ? 0 : slash + 1,
                                       end - (slash == std::string::npos ? 0 : slash + 1));
  long long it = -1;
  char tail = 0;
  if (std::sscanf(base.c_str(), "iter_%lld%c", &it, &tail) != 1 || it < 0 ||
      base != iteration_dir_name(it))
    return -1;
  return it;
}

std::string shard_file_name(int tp_rank, int pp_rank) {
  char b[40];
  std::snprintf(b, sizeof b, "mp_rank_%02d_%03d.h5", tp_rank, pp_rank);
  return b;
}

CheckpointShardWriter::CheckpointShardWriter(const std::string& path, const CheckpointMeta& meta,
                                             const ModelShard& shard, int fail_after)
    : path_(path), fail_after_(fail_after) {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  silence_hdf5_errors();
  file_ = std::make_unique<H5Id>(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  if (!file_->valid())
    throw Error("cannot create checkpoint file '" + path +
                "'; check the directory is writable and has space");
  write_meta(file_->get(), meta, shard);
  for (const char* g : {"model", "optimizer", "optimizer/exp_avg", "optimizer/exp_avg_sq"}) {
    if (std::string(g) != "model" && !meta.has_optimizer) break;
    H5Id grp(H5Gcreate2(file_->get(), g, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    HDF5_CHECK(grp.get());
  }
}

CheckpointShardWriter::~CheckpointShardWriter() {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  file_.reset();
}

void CheckpointShardWriter::write(const std::string& group, const ParamSpec& spec,
                                  const float* data) {
  if (group != "model" && group.rfind("optimizer", 0) != 0) {  // a group beside them: made once
    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    if (H5Lexists(file_->get(), group.c_str(), H5P_DEFAULT) <= 0) {
      H5Id grp(H5Gcreate2(file_->get(), group.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
      HDF5_CHECK(grp.get());
    }
  }
  if (fail_after_ >= 0 && written_ >= fail_after_)
    throw Error("checkpoint file '" + path_ + "': write failed (injected fault)");
  // Testing: TESSERA_SLOW_SAVE_MS stretches each tensor's write, so fault tests can land a
  // kill or a signal inside a save.
  const long slow_ms = test_hooks::slow_save_ms();
  if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
  ++written_;
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  H5Id g(H5Gopen2(file_->get(), group.c_str(), H5P_DEFAULT));
  if (!g.valid()) throw Error("checkpoint file '" + path_ + "' has no group " + group);
  try {
    write_tensor(g.get(), spec, data);
  } catch (const Error& e) {
    throw Error("checkpoint file '" + path_ + "': writing " + group + "/" + spec.name +
                " failed (disk full?): " + e.what());
  }
  // Read it back and check it against the checksum of what was meant to be written.
  H5Id ds(H5Dopen2(g.get(), spec.name.c_str(), H5P_DEFAULT));
  readback_.resize(spec.numel());
  if (!ds.valid() || !read_verified(ds.get(), readback_.data(), spec.numel()))
    throw Error("checkpoint file '" + path_ + "': " + group + "/" + spec.name +
                " did not read back as written (disk full or failing?)");
}

void CheckpointShardWriter::finish() {
  {
    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    if (H5Fflush(file_->get(), H5F_SCOPE_GLOBAL) < 0)
      throw Error("checkpoint file '" + path_ + "': flush failed (disk full?)");
    file_.reset();
  }
  fsync_path(path_);
}

void write_checkpoint_shard(const std::string& path, const CheckpointMeta& meta,
                            const ModelShard& shard, const ShardTensors& t, int fail_after) {
  CheckpointShardWriter w(path, meta, shard, fail_after);
  for (const ParamSpec& s : *t.specs) w.write("model", s, t.params + s.flat_offset);
  if (meta.has_optimizer && t.exp_avg) {
    for (const ParamSpec& s : *t.specs) {
      w.write("optimizer/exp_avg", s, t.exp_avg + s.flat_offset);
      w.write("optimizer/exp_avg_sq", s, t.exp_avg_sq + s.flat_offset);
    }
  }
  for (const ExtraTensor& e : t.extra) {
    TESSERA_CHECK(static_cast<int64_t>(e.data.size()) == e.spec.numel(), "checkpoint tensor ",
                  e.group, "/", e.spec.name, " size");
    w.write(e.group, e.spec, e.data.data());
  }
  w.finish();
}

// ---- reading ------------------------------------------------------------------------------------

std::string resolve_checkpoint_dir(const std::string& dir) {
  if (!is_dir(dir))
    throw ConfigError("--load '" + dir +
                      "' is not a directory; pass the --save directory of a run");
  const std::string latest = dir + "/latest_checkpointed_iteration.txt";
  if (is_file(latest)) {
    std::ifstream in(latest);
    int64_t it = -1;
    if (!(in >> it) || it < 0)
      throw ConfigError("'" + latest + "' does not hold an iteration number; fix or remove it");
    const std::string sub = dir + "/" + iteration_dir_name(it);
    if (!is_dir(sub))
      throw ConfigError("'" + latest + "' points at iteration " + std::to_string(it) + " but " +
                        sub + " does not exist");
    return sub;
  }
  if (is_file(dir + "/" + shard_file_name(0, 0))) return dir;  // an iter_N directory itself
  throw ConfigError("--load '" + dir + "' has no latest_checkpointed_iteration.txt and no " +
                    shard_file_name(0, 0) + "; pass a directory written by --save");
}

// The model attributes of multi-latent attention, YaRN and multi-token prediction (absent in
// other checkpoints: off).
void read_deepseek_attributes(hid_t f, const std::string& file, GPTConfig& m) {
  int64_t x = 0;
  std::string text;
  if (h5_read_attr(f, "mtp_num_layers", x)) {  // multi-token prediction
    if (x < 0 || x > 64)
      throw ConfigError("checkpoint file '" + file + "' has mtp_num_layers " + std::to_string(x) +
                        ", outside 0..64 (damaged?)");
    m.mtp_num_layers = static_cast<int>(x);
  }
  if (h5_read_attr(f, "kv_lora_rank", x)) {  // multi-latent attention
    auto dim = [&](const char* name, int64_t lo) {
      int64_t v = 0;
      if (!h5_read_attr(f, name, v) || v < lo || v > (1 << 20))
        throw ConfigError(
            detail::concat("checkpoint file '", file, "' has no valid ", name, " (damaged?)"));
      return static_cast<int>(v);
    };
    m.multi_latent_attention = true;
    m.kv_lora_rank = dim("kv_lora_rank", 1);
    m.q_lora_rank = dim("q_lora_rank", 0);
    m.qk_head_dim = dim("qk_head_dim", 1);
    m.qk_pos_emb_head_dim = dim("qk_pos_emb_head_dim", 2);
    m.v_head_dim = dim("v_head_dim", 1);
    if (h5_read_attr(f, "rope_type", text)) m.rope_type = text;
    if (h5_read_attr(f, "yarn", text)) {
      std::istringstream in(text);
      in >> m.rotary_scaling_factor >> m.mscale >> m.mscale_all_dim >> m.beta_fast >> m.beta_slow >>
          m.original_max_position_embeddings;
      if (!in)
        throw ConfigError("checkpoint file '" + file + "' has a malformed yarn attribute '" + text +
                          "'");
    }
  }
}

CheckpointMeta read_checkpoint_meta(hid_t f, const std::string& file) {
  CheckpointMeta meta;
  int64_t v = 0;
  auto need = [&](const char* name, int64_t& out) {
    if (!h5_read_attr(f, name, out))
      throw ConfigError("checkpoint file '" + file + "' lacks attribute '" + name +
                        "'; it was not written by tessera (or is corrupt)");
  };
  need("format_version", v);
  if (v != kCheckpointFormatVersion)
    throw ConfigError("checkpoint file '" + file + "' has format_version " + std::to_string(v) +
                      "; this build reads version " + std::to_string(kCheckpointFormatVersion));
  meta.format_version = v;
  int64_t x = 0;
  need("iteration", meta.iteration);
  need("consumed_samples", meta.consumed_samples);
  need("optimizer_steps", meta.optimizer_steps);
  h5_read_attr(f, "lr_schedule_samples", meta.lr_schedule_samples);  // optional
  {
    std::string scale;
    if (h5_read_attr(f, "loss_scale", scale)) {
      meta.has_loss_scale = true;
      meta.loss_scale = std::strtod(scale.c_str(), nullptr);
      need("loss_scale_growth_tracker", meta.loss_scale_growth_tracker);
      need("loss_scale_hysteresis_tracker", meta.loss_scale_hysteresis_tracker);
      h5_read_attr(f, "skipped_iterations", meta.skipped_iterations);
    }
  }
  need("seed", x);
  meta.seed = static_cast<uint64_t>(x);
  GPTConfig& m = meta.model;
  // Shape attributes within sizes any model has, so a damaged file cannot overflow the sizes
  // computed from them (found by tests/fuzz/fuzz_checkpoint.cpp).
  auto bounded = [&](const char* name, int64_t hi) {
    need(name, x);
    if (x < 1 || x > hi)
      throw ConfigError("checkpoint file '" + file + "' has " + name + " " + std::to_string(x) +
                        ", outside 1.." + std::to_string(hi) + " (damaged?)");
    return static_cast<int>(x);
  };
  m.num_layers = bounded("num_layers", 1 << 16);
  m.hidden_size = bounded("hidden_size", 1 << 20);
  m.num_attention_heads = bounded("num_attention_heads", 1 << 16);
  m.ffn_hidden_size = bounded("ffn_hidden_size", 1 << 22);
  m.seq_length = bounded("seq_length", 1 << 24);
  m.max_position_embeddings = bounded("max_position_embeddings", 1 << 24);
  m.vocab_size = bounded("vocab_size", 1 << 30);
  m.make_vocab_size_divisible_by = bounded("make_vocab_size_divisible_by", 1 << 16);
  need("layernorm_epsilon_x1e9", x);
  m.layernorm_epsilon = static_cast<double>(x) * 1e-9;
  {  // optional: checkpoints from before the Llama family hold GPT-2 models
    std::string text;
    if (h5_read_attr(f, "position_embedding_type", text)) m.position_embedding_type = text;
    if (h5_read_attr(f, "rotary_base", text)) m.rotary_base = std::strtod(text.c_str(), nullptr);
    if (h5_read_attr(f, "rotary_percent", text))
      m.rotary_percent = std::strtod(text.c_str(), nullptr);
    if (h5_read_attr(f, "normalization", text)) m.normalization = text;
    if (h5_read_attr(f, "rope_scaling", text)) {
      m.use_rope_scaling = true;
      std::istringstream in(text);
      in >> m.rope_scaling_factor >> m.rope_scaling_low_freq_factor >>
          m.rope_scaling_high_freq_factor >> m.rope_scaling_original_max_positions;
      if (!in)
        throw ConfigError("checkpoint file '" + file +
                          "' has a malformed rope_scaling attribute '" + text + "'");
    }
    if (h5_read_attr(f, "swiglu", x)) m.swiglu = x != 0;
    if (h5_read_attr(f, "num_query_groups", x) && x != 0) {
      if (x < 0 || x > (1 << 16))
        throw ConfigError("checkpoint file '" + file + "' has num_query_groups " +
                          std::to_string(x) + ", outside 1..65536 (damaged?)");
      m.group_query_attention = true;
      m.num_query_groups = static_cast<int>(x);
    }
    if (h5_read_attr(f, "untie_embeddings_and_output_weights", x))
      m.untie_embeddings_and_output_weights = x != 0;
    if (h5_read_attr(f, "add_bias_linear", x)) m.add_bias_linear = x != 0;
    if (h5_read_attr(f, "add_qkv_bias", x)) m.add_qkv_bias = x != 0;
    if (h5_read_attr(f, "kv_channels", x)) {
      if (x < 0 || x > (1 << 16))
        throw ConfigError("checkpoint file '" + file + "' has kv_channels " + std::to_string(x) +
                          ", outside 0..65536 (damaged?)");
      m.kv_channels = static_cast<int>(x);
    }
    if (h5_read_attr(f, "apply_layernorm_1p", x)) m.apply_layernorm_1p = x != 0;
    if (h5_read_attr(f, "rotary_interleaved", x)) m.rotary_interleaved = x != 0;
    if (h5_read_attr(f, "squared_relu", x)) m.squared_relu = x != 0;
    if (h5_read_attr(f, "qk_layernorm", x)) m.qk_layernorm = x != 0;
    read_deepseek_attributes(f, file, m);     // MLA, YaRN, multi-token prediction
    if (h5_read_attr(f, "num_experts", x)) {  // Mixture of Experts
      auto moe_int = [&](const char* name, int64_t lo, int64_t hi) {
        int64_t v = 0;
        if (!h5_read_attr(f, name, v) || v < lo || v > hi)
          throw ConfigError(detail::concat("checkpoint file '", file, "' has no valid ", name,
                                           " (allowed: ", lo, " to ", hi, "; damaged?)"));
        return static_cast<int>(v);
      };
      if (x < 1 || x > (1 << 16))
        throw ConfigError("checkpoint file '" + file + "' has num_experts " + std::to_string(x) +
                          ", outside 1..65536 (damaged?)");
      m.num_experts = static_cast<int>(x);
      m.moe_router_topk = moe_int("moe_router_topk", 1, m.num_experts);
      m.moe_ffn_hidden_size = moe_int("moe_ffn_hidden_size", 1, 1 << 24);
      m.moe_shared_expert_intermediate_size =
          moe_int("moe_shared_expert_intermediate_size", 0, 1 << 24);
      m.moe_router_pre_softmax = moe_int("moe_router_pre_softmax", 0, 1) != 0;
      if (h5_read_attr(f, "moe_layer_freq", text)) m.moe_layer_freq = text;
      if (h5_read_attr(f, "moe_router_score_function", text)) m.moe_router_score_function = text;
      if (h5_read_attr(f, "moe_router_topk_scaling_factor", text))
        m.moe_router_topk_scaling_factor = std::strtod(text.c_str(), nullptr);
      int64_t v = 0;
      if (h5_read_attr(f, "moe_router_enable_expert_bias", v))
        m.moe_router_enable_expert_bias = v != 0;
      if (h5_read_attr(f, "moe_router_num_groups", v)) {
        m.moe_router_num_groups = moe_int("moe_router_num_groups", 0, m.num_experts);
        m.moe_router_group_topk = moe_int("moe_router_group_topk", 0, m.num_experts);
        m.moe_router_group_score_experts =
            moe_int("moe_router_group_score_experts", 0, m.num_experts);
      }
    }
  }
  meta.tp_size = bounded("tensor_model_parallel_size", 1 << 16);
  meta.pp_size = bounded("pipeline_model_parallel_size", 1 << 16);
  meta.dp_size = bounded("data_parallel_size", 1 << 24);
  need("has_optimizer", x);
  meta.has_optimizer = x != 0;
  h5_read_attr(f, "config", meta.config_text);
  h5_read_attr(f, "rerun_state", meta.rerun_state);  // optional: a rerun pending

  return meta;
}

CheckpointReader::CheckpointReader(const std::string& dir) {
  path_ = resolve_checkpoint_dir(dir);
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  silence_hdf5_errors();
  auto open = [&](const std::string& file) {
    if (!is_file(file))
      throw ConfigError("checkpoint '" + path_ + "' is missing shard file " + file +
                        " (incomplete copy?); restore it or use another checkpoint");
    if (H5Fis_hdf5(file.c_str()) <= 0)
      throw ConfigError("checkpoint file '" + file +
                        "' is not an HDF5 file (truncated or corrupt)");
    auto h = std::make_unique<H5Id>(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
    if (!h->valid())
      throw ConfigError("checkpoint file '" + file + "' cannot be opened (truncated or corrupt)");
    return h;
  };
  const std::string first = path_ + "/" + shard_file_name(0, 0);
  auto h0 = open(first);
  meta_ = read_checkpoint_meta(h0->get(), first);
  // The iteration directory names the checkpoint's iteration: every file, the first included, must
  // agree with it, so a damaged attribute is blamed on the file that holds it.
  const int64_t dir_iteration = parse_iteration_dir_name(path_);
  auto need = [&](hid_t f, const char* name, int64_t& out, const std::string& file) {
    if (!h5_read_attr(f, name, out))
      throw ConfigError("checkpoint file '" + file + "' lacks attribute '" + name +
                        "'; it was not written by tessera (or is corrupt)");
  };

  // A file past the recorded layout: the layout attributes of every file are damaged the same way
  // (reading only the files they name would leave parts of tensors unread).
  for (const std::string& extra :
       {shard_file_name(meta_.tp_size, 0), shard_file_name(0, meta_.pp_size)})
    if (is_file(path_ + "/" + extra))
      throw ConfigError(detail::concat("checkpoint '", path_, "' holds ", extra,
                                       ", outside the layout TP ", meta_.tp_size, " x PP ",
                                       meta_.pp_size,
                                       " its files record (damaged layout "
                                       "attributes?); use another checkpoint"));
  for (int pp = 0; pp < meta_.pp_size; ++pp)
    for (int tp = 0; tp < meta_.tp_size; ++tp) {
      const std::string file = path_ + "/" + shard_file_name(tp, pp);
      auto h = (tp == 0 && pp == 0) ? std::move(h0) : open(file);
      int64_t it = -1, ftp = -1;
      need(h->get(), "iteration", it, file);
      need(h->get(), "tp_rank", ftp, file);
      if (dir_iteration >= 0 && it != dir_iteration)
        throw ConfigError("checkpoint file '" + file + "' has iteration " + std::to_string(it) +
                          " but lies in " + iteration_dir_name(dir_iteration) +
                          " (damaged, or a file of another checkpoint); restore it or use "
                          "another checkpoint");
      if (it != meta_.iteration)
        throw ConfigError("checkpoint files '" + first + "' (iteration " +
                          std::to_string(meta_.iteration) + ") and '" + file + "' (iteration " +
                          std::to_string(it) +
                          ") disagree: one is damaged or belongs to another checkpoint; use "
                          "another checkpoint");
      if (ftp != tp)
        throw ConfigError("checkpoint file '" + file + "' has tp_rank " + std::to_string(ftp) +
                          " but its name says tensor rank " + std::to_string(tp) +
                          " (damaged, or a renamed file); restore it or use another checkpoint");
      int64_t ftp_size = -1, fpp_size = -1;
      need(h->get(), "tensor_model_parallel_size", ftp_size, file);
      need(h->get(), "pipeline_model_parallel_size", fpp_size, file);
      if (ftp_size != meta_.tp_size || fpp_size != meta_.pp_size)
        throw ConfigError(
            detail::concat("checkpoint files '", first, "' (TP ", meta_.tp_size, " x PP ",
                           meta_.pp_size, ") and '", file, "' (TP ", ftp_size, " x PP ", fpp_size,
                           ") disagree on the layout: one is damaged; use another checkpoint"));
      // Index the model tensors of this file.
      H5Id g(H5Gopen2(h->get(), "model", H5P_DEFAULT));
      if (!g.valid()) throw ConfigError("checkpoint file '" + file + "' has no /model group");
      hsize_t n = 0;
      H5Gget_num_objs(g.get(), &n);
      for (hsize_t i = 0; i < n; ++i) {
        char name[512];
        H5Gget_objname_by_idx(g.get(), i, name, sizeof name);
        H5Id ds(H5Dopen2(g.get(), name, H5P_DEFAULT));
        SourceTensor st;
        st.file = static_cast<int>(files_.size());
        st.pp_rank = pp;
        std::vector<int64_t> gs;
        int64_t ax = -1;
        if (!h5_read_attr(ds.get(), "global_shape", gs) ||
            !h5_read_attr(ds.get(), "split_axis", ax) ||
            !h5_read_attr(ds.get(), "split_offset", st.split_offset))
          throw ConfigError("checkpoint file '" + file + "': /model/" + name +
                            " lacks its layout attributes");
        st.global_shape.assign(gs.begin(), gs.end());
        st.split_axis = static_cast<int>(ax);
        H5Id space(H5Dget_space(ds.get()));
        const int nd = H5Sget_simple_extent_ndims(space.get());
        std::vector<hsize_t> dims(std::max(nd, 0));
        H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
        st.local_shape.assign(dims.begin(), dims.end());
        // The stored piece lies inside its global shape, and a vocabulary's global rows lie
        // between the vocabulary and the checkpoint's own padded size: a damaged extent or
        // attribute is refused here, before a read sizes a buffer by it (found by
        // tests/fuzz/fuzz_checkpoint.cpp).
        bool fits = nd >= 1 && st.local_shape.size() == st.global_shape.size() && ax >= -1 &&
                    ax < nd && st.split_offset >= 0;
        for (int d = 0; fits && d < nd; ++d)
          fits = st.global_shape[d] >= 0 && st.global_shape[d] <= (int64_t(1) << 31) &&
                 st.local_shape[d] >= 0 && st.local_shape[d] <= st.global_shape[d] &&
                 (d != ax || st.split_offset <= st.global_shape[d] - st.local_shape[d]);
        if (fits && (std::string(name) == "wte" || std::string(name) == "lm_head"))
          fits = st.global_shape[0] >= meta_.model.vocab_size &&
                 st.global_shape[0] <= meta_.model.padded_vocab_size(meta_.tp_size);
        if (!fits)
          throw ConfigError("checkpoint file '" + file + "': /model/" + name + " stores " +
                            shape_str(st.local_shape) + " at offset " +
                            std::to_string(st.split_offset) + " of global shape " +
                            shape_str(st.global_shape) + " split on axis " + std::to_string(ax) +
                            ", which do not fit together (damaged); use another checkpoint");
        tensors_[name].push_back(st);
      }
      files_.push_back(file);
      handles_.push_back(std::move(h));
    }
}

void CheckpointReader::check_model(const GPTConfig& c) const {
  const GPTConfig& m = meta_.model;
  auto differ = [&](const char* opt, int64_t have, int64_t want) {
    if (have != want)
      throw ConfigError(detail::concat("checkpoint '", path_, "' has --", opt, "=", have,
                                       " but this run has ", want,
                                       "; load it with the model options it was trained with"));
  };
  differ("num-layers", m.num_layers, c.num_layers);
  differ("hidden-size", m.hidden_size, c.hidden_size);
  differ("num-attention-heads", m.num_attention_heads, c.num_attention_heads);
  differ("ffn-hidden-size", m.ffn(), c.ffn());
  differ("max-position-embeddings", m.max_positions(), c.max_positions());
  differ("vocab-size", m.vocab_size, c.vocab_size);
  // what the checkpoint has with the option / without it
  auto option = [&](const char* opt, bool have, bool want, const char* with, const char* without) {
    if (have != want)
      throw ConfigError(detail::concat(
          "checkpoint '", path_, "' was trained ", have ? "with " : "without ", opt, " (",
          have ? with : without, ") but this run ", want ? "gives it" : "does not",
          "; load it with the model options it was trained with"));
  };
  option("--swiglu", m.swiglu, c.swiglu, "gate and up weights in mlp.fc1",
         "no gate weights in mlp.fc1");
  option("--untie-embeddings-and-output-weights", !m.tied_head(), !c.tied_head(),
         "an lm_head of its own", "the output layer tied to wte");
  option("--disable-bias-linear", !m.add_bias_linear, !c.add_bias_linear,
         "no biases in its linear layers", "biases in its linear layers");
  option("--group-query-attention", m.group_query_attention, c.group_query_attention,
         "attn.q and attn.kv weights", "a fused attn.qkv weight");
  differ("num-query-groups", m.kv_heads(), c.kv_heads());
  option("--add-qkv-bias", m.qkv_bias() && !m.add_bias_linear, c.qkv_bias() && !c.add_bias_linear,
         "biases on the QKV projection alone", "no QKV-only biases");
  differ("kv-channels", m.head_dim(), c.head_dim());
  option("--apply-layernorm-1p", m.apply_layernorm_1p, c.apply_layernorm_1p,
         "norm weights applied as 1 + w", "norm weights applied as w");
  option("--squared-relu", m.squared_relu, c.squared_relu, "a squared-ReLU MLP",
         "no squared-ReLU MLP");
  option("--qk-layernorm", m.qk_layernorm, c.qk_layernorm,
         m.mla() ? "latent norms (attn.q_down_norm, attn.kv_down_norm)"
                 : "attn.q_norm and attn.k_norm weights",
         "no query/key norms");
  option("--multi-latent-attention", m.mla(), c.mla(), "multi-latent attention",
         "standard attention");
  differ("mtp-num-layers", m.mtp_num_layers, c.mtp_num_layers);
  if (m.mla()) {
    differ("q-lora-rank", m.q_lora_rank, c.q_lora_rank);
    differ("kv-lora-rank", m.kv_lora_rank, c.kv_lora_rank);
    differ("qk-head-dim", m.qk_head_dim, c.qk_head_dim);
    differ("qk-pos-emb-head-dim", m.qk_pos_emb_head_dim, c.qk_pos_emb_head_dim);
    differ("v-head-dim", m.v_head_dim, c.v_head_dim);
  }
  differ("num-experts", m.num_experts, c.num_experts);
  if (m.moe()) {
    differ("moe-router-topk", m.moe_router_topk, c.moe_router_topk);
    differ("moe-ffn-hidden-size", m.moe_ffn(), c.moe_ffn());
    differ("moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size,
           c.moe_shared_expert_intermediate_size);
    option("--moe-router-pre-softmax", m.moe_router_pre_softmax, c.moe_router_pre_softmax,
           "the top-k of the softmax over all experts", "a softmax over the top-k logits");
    option("--moe-router-enable-expert-bias", m.moe_router_enable_expert_bias,
           c.moe_router_enable_expert_bias, "an aux-loss-free expert bias in its routers",
           "no expert bias");
    differ("moe-router-num-groups", m.moe_router_num_groups, c.moe_router_num_groups);
    if (m.moe_router_num_groups > 0) {
      differ("moe-router-group-topk", m.moe_router_group_topk, c.moe_router_group_topk);
      differ("moe-router-group-score-experts", m.moe_group_score_experts(),
             c.moe_group_score_experts());
    }
  }
  auto text = [&](const char* opt, const std::string& have, const std::string& want) {
    if (have != want)
      throw ConfigError(detail::concat("checkpoint '", path_, "' has ", opt, "=", have,
                                       " but this run has ", want,
                                       "; load it with the model options it was trained with"));
  };
  text("--position-embedding-type", m.position_embedding_type, c.position_embedding_type);
  if (std::llround(m.layernorm_epsilon * 1e9) != std::llround(c.layernorm_epsilon * 1e9))
    throw ConfigError(detail::concat(
        "checkpoint '", path_, "' has --norm-epsilon=", m.layernorm_epsilon, " but this run has ",
        c.layernorm_epsilon, "; load it with the model options it was trained with"));
  text("--normalization", m.normalization, c.normalization);
  if (m.moe()) {
    text("--moe-layer-freq", m.moe_layer_freq, c.moe_layer_freq);
    text("--moe-router-score-function", m.moe_router_score_function, c.moe_router_score_function);
    if (m.moe_router_topk_scaling_factor != c.moe_router_topk_scaling_factor)
      throw ConfigError(detail::concat(
          "checkpoint '", path_, "' has --moe-router-topk-scaling-factor=",
          m.moe_router_topk_scaling_factor, " but this run has ", c.moe_router_topk_scaling_factor,
          "; load it with the model options it was trained with"));
  }
  auto number = [&](const char* opt, double have, double want) {
    if (have != want)
      throw ConfigError(detail::concat("checkpoint '", path_, "' has ", opt, "=", have,
                                       " but this run has ", want,
                                       "; load it with the model options it was trained with"));
  };
  if (m.rope()) {
    number("--rotary-base", m.rotary_base, c.rotary_base);
    number("--rotary-percent", m.rotary_percent, c.rotary_percent);
    option("--rotary-interleaved", m.rotary_interleaved, c.rotary_interleaved,
           "rotary pairs (2i, 2i+1)", "rotary pairs (i, i + d/2)");
    option("--use-rope-scaling", m.use_rope_scaling, c.use_rope_scaling,
           "Llama 3's frequency scaling", "no frequency scaling");
    text("--rope-type", m.rope_type, c.rope_type);
    if (m.yarn()) {
      number("--rotary-scaling-factor", m.rotary_scaling_factor, c.rotary_scaling_factor);
      number("--mscale-all-dim", m.mscale_all_dim, c.mscale_all_dim);
      number("--beta-fast", m.beta_fast, c.beta_fast);
      number("--beta-slow", m.beta_slow, c.beta_slow);
      number("--original-max-position-embeddings", m.original_max_position_embeddings,
             c.original_max_position_embeddings);
    }
    if (m.use_rope_scaling) {
      number("--rope-scaling-factor", m.rope_scaling_factor, c.rope_scaling_factor);
      number("--rope-scaling-low-freq-factor", m.rope_scaling_low_freq_factor,
             c.rope_scaling_low_freq_factor);
      number("--rope-scaling-high-freq-factor", m.rope_scaling_high_freq_factor,
             c.rope_scaling_high_freq_factor);
      number("--rope-scaling-original-max-position-embeddings",
             m.rope_scaling_original_max_positions, c.rope_scaling_original_max_positions);
    }
  }
}

namespace {
// The dataset group/name of an open file; invalid when the file lacks it.
H5Id open_whole(hid_t f, const std::string& group, const std::string& name) {
  if (H5Lexists(f, group.c_str(), H5P_DEFAULT) <= 0) return H5Id(-1);
  const std::string path = group + "/" + name;
  if (H5Lexists(f, path.c_str(), H5P_DEFAULT) <= 0) return H5Id(-1);
  return H5Id(H5Dopen2(f, path.c_str(), H5P_DEFAULT));
}
}  // namespace

int64_t CheckpointReader::whole_numel(const std::string& group, const std::string& name) const {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  for (const auto& h : handles_) {
    H5Id ds = open_whole(h->get(), group, name);
    if (!ds.valid()) continue;
    H5Id space(H5Dget_space(ds.get()));
    const hssize_t n = H5Sget_simple_extent_npoints(space.get());
    return n < 0 ? -1 : static_cast<int64_t>(n);
  }
  return -1;
}

void CheckpointReader::read_whole(const std::string& group, const std::string& name,
                                  float* out) const {
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  for (size_t i = 0; i < handles_.size(); ++i) {
    H5Id ds = open_whole(handles_[i]->get(), group, name);
    if (!ds.valid()) continue;
    H5Id space(H5Dget_space(ds.get()));
    if (!read_verified(ds.get(), out, H5Sget_simple_extent_npoints(space.get()), &hash_seconds_))
      throw CheckpointDamaged("checkpoint file '" + files_[i] + "': " + group + "/" + name +
                              " does not match its checksum (damaged); use another checkpoint");
    return;
  }
  throw ConfigError("checkpoint '" + path_ + "' has no " + group + "/" + name);
}

void CheckpointReader::read_slice(const std::string& group, const ParamSpec& t, float* out) const {
  auto it = tensors_.find(t.name);
  if (it == tensors_.end())
    throw ConfigError("checkpoint '" + path_ + "' has no tensor " + t.name + " (another model?)");
  std::fill(out, out + t.numel(), 0.f);
  // Read from the first pipeline stage that holds the tensor (the tied wte exists twice).
  int pp = INT32_MAX;
  for (const SourceTensor& s : it->second) pp = std::min(pp, s.pp_rank);
  const int ax = t.split_axis;
  const bool vocab = t.name == "wte" || t.name == "lm_head";
  if (vocab && ax == 0 && t.split_offset >= meta_.model.vocab_size) return;  // all padding rows
  std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
  // Rows of the split axis the sources supply (the whole tensor for replicated ones): they must
  // cover the target's slice, vocabulary padding rows excepted.
  int64_t covered = 0, needed = 1;
  if (ax >= 0) {
    const int64_t end =
        vocab ? std::min<int64_t>(t.split_offset + t.local_shape[ax], meta_.model.vocab_size)
              : t.split_offset + t.local_shape[ax];
    needed = end - t.split_offset;
  }
  for (const SourceTensor& s : it->second) {
    if (s.pp_rank != pp) continue;
    if (s.split_axis != ax || s.global_shape.size() != t.global_shape.size())
      throw ConfigError("checkpoint '" + path_ + "': " + t.name + " has global shape " +
                        shape_str(s.global_shape) + " split on axis " +
                        std::to_string(s.split_axis) + ", expected " + shape_str(t.global_shape) +
                        " on axis " + std::to_string(ax));
    for (size_t d = 0; d < t.global_shape.size(); ++d)
      if (static_cast<int>(d) != (vocab ? 0 : -1) && s.global_shape[d] != t.global_shape[d])
        throw ConfigError("checkpoint '" + path_ + "': " + t.name + " has global shape " +
                          shape_str(s.global_shape) + ", this model needs " +
                          shape_str(t.global_shape));
    // The overlap along the split axis (all of it for replicated tensors); vocabulary rows only up
    // to the true vocabulary (padding differs between layouts and is zero).
    int64_t lo = 0, hi = 0, t_off = 0, s_off = 0;
    if (ax >= 0) {
      t_off = t.split_offset;
      s_off = s.split_offset;
      lo = std::max(t_off, s_off);
      hi = std::min(t_off + t.local_shape[ax], s_off + s.local_shape[ax]);
      if (vocab) hi = std::min<int64_t>(hi, meta_.model.vocab_size);
      if (hi <= lo) continue;
    }
    const hid_t file = handles_[s.file]->get();
    const std::string name = group + "/" + t.name;
    H5Id ds(H5Dopen2(file, name.c_str(), H5P_DEFAULT));
    if (!ds.valid())
      throw ConfigError("checkpoint file '" + files_[s.file] + "' has no " + name +
                        (group == "model" ? "; use another checkpoint"
                                          : ": its optimizer state is incomplete; resume from "
                                            "another checkpoint, or take the weights only with "
                                            "--finetune"));
    const int64_t src_n = shape_numel(s.local_shape);
    const bool whole = s.local_shape == t.local_shape && (ax < 0 || (lo == s_off && lo == t_off));
    // The whole source tensor is read (and its checksum checked); the overlap is copied out.
    float* dst = out;
    if (!whole) {
      scratch_.resize(static_cast<size_t>(src_n));
      dst = scratch_.data();
    }
    if (!read_verified(ds.get(), dst, src_n, &hash_seconds_))
      throw CheckpointDamaged(
          "checkpoint file '" + files_[s.file] + "': " + name +
          " fails its checksum or cannot be read (corrupt); use another checkpoint");
    if (!whole) {
      // Copy rows [lo, hi) along the axis (vocabulary rows < vocab_size for replicated wte).
      const int64_t a_lo = ax >= 0 ? lo - s_off : 0,
                    a_hi =
                        ax >= 0 ? hi - s_off : (vocab ? meta_.model.vocab_size : s.local_shape[0]);
      const int a = ax >= 0 ? ax : 0;
      int64_t inner = 1, outer = 1;
      for (size_t d = a + 1; d < s.local_shape.size(); ++d) inner *= s.local_shape[d];
      for (int d = 0; d < a; ++d) outer *= s.local_shape[d];
      const int64_t s_ext = s.local_shape[a], t_ext = t.local_shape[a];
      const int64_t t_shift = ax >= 0 ? lo - t_off - a_lo : 0;
      for (int64_t o = 0; o < outer; ++o)
        std::memcpy(out + (o * t_ext + a_lo + t_shift) * inner, dst + (o * s_ext + a_lo) * inner,
                    sizeof(float) * (a_hi - a_lo) * inner);
    }
    covered += ax >= 0 ? hi - lo : 1;
    if (ax < 0) break;
  }
  if (covered != needed)
    throw ConfigError(detail::concat(
        "checkpoint '", path_, "' supplies ", covered, " of the ", needed,
        ax >= 0 ? " indices along axis " + std::to_string(ax) + " from offset " +
                      std::to_string(t.split_offset)
                : std::string(" copy"),
        " of ", t.name,
        " (a missing or damaged shard, or damaged layout attributes); use another checkpoint"));
}

// ---- directory operations -----------------------------------------------------------------------

void prepare_save_dir(const std::string& save_dir) {
  // mkdir -p
  for (size_t i = 1; i <= save_dir.size(); ++i)
    if (i == save_dir.size() || save_dir[i] == '/') ::mkdir(save_dir.substr(0, i).c_str(), 0755);
  if (!is_dir(save_dir))
    throw ConfigError("--save '" + save_dir + "' cannot be created (" + std::strerror(errno) +
                      "); check the path and permissions");
  const std::string probe = save_dir + "/.tessera_write_test";
  // errno is taken where the probe fails: removing the probe sets it again.
  std::FILE* f = std::fopen(probe.c_str(), "w");
  int err = f ? 0 : errno;
  if (f && std::fputs("ok\n", f) < 0) err = errno;
  if (f && std::fclose(f) != 0 && err == 0) err = errno;
  std::remove(probe.c_str());
  if (!f || err != 0)
    throw ConfigError("--save '" + save_dir + "' is not writable (" +
                      std::strerror(err ? err : EIO) + "); choose a directory this job can write");
}

std::vector<int64_t> checkpoint_iterations(const std::string& dir) {
  std::vector<int64_t> iters;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const int64_t it = parse_iteration_dir_name(e->d_name);
      if (it >= 0 && is_dir(dir + "/" + e->d_name)) iters.push_back(it);
    }
    closedir(d);
  }
  std::sort(iters.begin(), iters.end());
  return iters;
}

int64_t latest_checkpoint_iteration(const std::string& dir) {
  std::ifstream in(dir + "/latest_checkpointed_iteration.txt");
  int64_t it = -1;
  if (!(in >> it) || it < 0) return -1;
  return it;
}

void refuse_save_over_checkpoint(const std::string& save_dir, int64_t iteration) {
  const bool has_latest = is_file(save_dir + "/latest_checkpointed_iteration.txt");
  const std::vector<int64_t> iters = checkpoint_iterations(save_dir);
  const bool shards = is_file(save_dir + "/" + shard_file_name(0, 0));
  if (!has_latest && iters.empty() && !shards) return;
  std::string holds;
  if (const int64_t latest = latest_checkpoint_iteration(save_dir); latest >= 0) {
    holds = "latest iteration " + std::to_string(latest);
  } else if (!iters.empty()) {
    holds = "iteration";
    if (iters.size() > 1) holds += "s";
    for (size_t i = 0; i < iters.size(); ++i) holds += (i ? ", " : " ") + std::to_string(iters[i]);
    if (has_latest) holds += "; its latest file holds no iteration number";
  } else {
    holds = shards ? "shard files of an iteration directory" : "a latest file";
  }
  throw ConfigError("--save '" + save_dir + "' already holds a checkpoint (" + holds +
                    "); writing iteration " + std::to_string(iteration) +
                    " there would make it the latest, and a run loading '" + save_dir +
                    "' would start from it: save to a new directory (or remove the checkpoints "
                    "in '" +
                    save_dir + "' first)");
}

std::string begin_checkpoint_dir(const std::string& save_dir, int64_t iteration) {
  prepare_save_dir(save_dir);
  const std::string tmp = save_dir + "/" + iteration_dir_name(iteration) + ".tmp";
  remove_tree(tmp);  // the leftovers of a save that died
  if (::mkdir(tmp.c_str(), 0755) != 0)
    throw Error("cannot create '" + tmp + "': " + std::strerror(errno) +
                "; check --save is writable");
  return tmp;
}

void abandon_checkpoint_dir(const std::string& save_dir, int64_t iteration) {
  remove_tree(save_dir + "/" + iteration_dir_name(iteration) + ".tmp");
}

void commit_checkpoint_dir(const std::string& save_dir, int64_t iteration, int keep) {
  const std::string name = iteration_dir_name(iteration);
  const std::string tmp = save_dir + "/" + name + ".tmp", final_dir = save_dir + "/" + name;
  if (is_dir(final_dir)) {  // saving the same iteration again: the new one replaces it
    const std::string old = final_dir + ".old";
    remove_tree(old);
    if (std::rename(final_dir.c_str(), old.c_str()) != 0)
      throw Error("cannot move aside '" + final_dir + "': " + std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::rename((final_dir + ".old").c_str(), final_dir.c_str());  // put the previous one back
    throw Error("cannot rename '" + tmp + "' to '" + final_dir + "': " + why);
  }
  fsync_path(save_dir);
  const std::string latest = save_dir + "/latest_checkpointed_iteration.txt";
  {
    std::ofstream out(latest + ".tmp");
    out << iteration << "\n";
    out.flush();
    if (!out) throw Error("cannot write '" + latest + ".tmp' (disk full?)");
  }
  fsync_path(latest + ".tmp");
  if (std::rename((latest + ".tmp").c_str(), latest.c_str()) != 0)
    throw Error("cannot update '" + latest + "': " + std::strerror(errno));
  fsync_path(save_dir);
  remove_tree(final_dir + ".old");
  if (keep <= 0) return;
  std::vector<int64_t> iters;
  if (DIR* d = opendir(save_dir.c_str())) {
    while (dirent* e = readdir(d)) {
      long long it = 0;
      char tail = 0;
      if (std::sscanf(e->d_name, "iter_%lld%c", &it, &tail) == 1) iters.push_back(it);
    }
    closedir(d);
  }
  std::sort(iters.begin(), iters.end());
  for (size_t i = 0; i + keep < iters.size(); ++i)
    if (iters[i] != iteration) remove_tree(save_dir + "/" + iteration_dir_name(iters[i]));
}

}  // namespace tessera
