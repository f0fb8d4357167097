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
#include "model/config_schema.hpp"

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

// A file's root attributes as the model's table reads and writes them.
class H5Attributes final : public AttributeSink, public AttributeSource {
 public:
  explicit H5Attributes(hid_t f) : f_(f) {}
  void put(const std::string& name, int64_t v) override { h5_write_attr(f_, name.c_str(), v); }
  void put(const std::string& name, const std::string& v) override {
    h5_write_attr(f_, name.c_str(), v);
  }
  bool get(const std::string& name, int64_t& v) override {
    return h5_read_attr(f_, name.c_str(), v);
  }
  bool get(const std::string& name, std::string& v) override {
    return h5_read_attr(f_, name.c_str(), v);
  }

 private:
  hid_t f_;
};

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
  H5Attributes attrs(f);
  write_model_attributes(m.model, attrs);  // model/config_schema.cpp
  h5_write_attr(f, "padded_vocab_size", m.model.padded_vocab_size(m.tp_size));
  h5_write_attr(f, "tensor_model_parallel_size", static_cast<int64_t>(m.tp_size));
  h5_write_attr(f, "pipeline_model_parallel_size", static_cast<int64_t>(m.pp_size));
  h5_write_attr(f, "data_parallel_size", static_cast<int64_t>(m.dp_size));
  h5_write_attr(f, "tp_rank", static_cast<int64_t>(sh.tp_rank));
  {  // the transformer layers in this file (several ranges with virtual pipeline stages)
    std::vector<int64_t> layers;
    for (int l : sh.layers()) layers.push_back(l);
    h5_write_attr(f, "layers", layers);
    h5_write_attr(f, "virtual_pipeline_model_parallel_size", static_cast<int64_t>(sh.num_chunks()));
    if (!m.pipeline_layout.empty())
      h5_write_attr(f, "pipeline_model_parallel_layout", m.pipeline_layout);
  }
  h5_write_attr(f, "has_optimizer", static_cast<int64_t>(m.has_optimizer));
  h5_write_attr(f, "config", m.config_text);
  if (!m.rerun_state.empty()) h5_write_attr(f, "rerun_state", m.rerun_state);
  if (!m.tokenizer.empty()) h5_write_attr(f, "tokenizer", m.tokenizer);
}

}  // namespace

const std::vector<std::string>& checkpoint_file_attributes() {
  // Every root attribute write_meta writes (some only in some runs): the run's, the model's (its
  // table, model/config_schema.cpp), the layout's.
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n{"format_version",
                               "iteration",
                               "consumed_samples",
                               "optimizer_steps",
                               "lr_schedule_samples",
                               "loss_scale",
                               "loss_scale_growth_tracker",
                               "loss_scale_hysteresis_tracker",
                               "skipped_iterations",
                               "rerun_state",
                               "seed"};
    for (const std::string& a : model_attribute_names()) n.push_back(a);
    for (const char* a :
         {"padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
          "data_parallel_size", "tp_rank", "layers", "virtual_pipeline_model_parallel_size",
          "pipeline_model_parallel_layout", "has_optimizer", "config", "tokenizer"})
      n.push_back(a);
    return n;
  }();
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
  H5Attributes attrs(f);
  read_model_attributes(attrs, meta.model, file);  // model/config_schema.cpp
  // Layout attributes within sizes any run has, so a damaged file cannot overflow the sizes
  // computed from them (found by tests/fuzz/fuzz_checkpoint.cpp).
  auto bounded = [&](const char* name, int64_t hi) {
    need(name, x);
    if (x < 1 || x > hi)
      throw ConfigError("checkpoint file '" + file + "' has " + name + " " + std::to_string(x) +
                        ", outside 1.." + std::to_string(hi) + " (damaged?)");
    return static_cast<int>(x);
  };
  meta.tp_size = bounded("tensor_model_parallel_size", 1 << 16);
  meta.pp_size = bounded("pipeline_model_parallel_size", 1 << 16);
  meta.dp_size = bounded("data_parallel_size", 1 << 24);
  need("has_optimizer", x);
  meta.has_optimizer = x != 0;
  h5_read_attr(f, "config", meta.config_text);
  h5_read_attr(f, "rerun_state", meta.rerun_state);  // optional: a rerun pending
  h5_read_attr(f, "tokenizer", meta.tokenizer);      // optional: the data's tokenizer
  h5_read_attr(f, "pipeline_model_parallel_layout", meta.pipeline_layout);  // optional: uneven

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
  check_same_model(meta_.model, c, path_);  // model/config_schema.cpp
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
