// checkpoint.hpp: sharded HDF5 checkpoints (DESIGN.md invariants 4 and 6).
//
//   DIR/latest_checkpointed_iteration.txt        the iteration of the newest complete checkpoint
//   DIR/iter_0000100/mp_rank_TT_PPP.h5           one file per (tensor rank TT, pipeline stage PPP)
//     /model/<param>                              this shard of the parameter (fp32)
//     /optimizer/exp_avg/<param>, /exp_avg_sq/<param>   Adam moments (fp32; the parameters are the
//                                                 fp32 master weights)
//     each dataset: contiguous, attributes global_shape, split_axis, split_offset, dtype and xxh64
//     (XXH64 of the tensor's little-endian bytes, checked on every read)
//     root attributes: format_version, iteration, consumed_samples, optimizer_steps, seed, the
//     model shape, vocab_size, padded_vocab_size, the layout (tp/pp/dp sizes, this file's tp/pp
//     rank and layers), has_optimizer, config (the full option set as INI text)
//
// A checkpoint is written into iter_N.tmp/, every file is read back (checksums verified), all
// ranks agree, and only then is the directory renamed into place and the latest file replaced
// (atomically, last). Any layout can load any checkpoint: each rank reads exactly its slice of
// every global tensor from whichever files hold it (resharding on load).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/hdf5_handle.hpp"
#include "model/fp8_config.hpp"
#include "model/gpt_config.hpp"
#include "model/params.hpp"

namespace tessera {

constexpr int64_t kCheckpointFormatVersion = 1;

// Everything of a checkpoint besides the tensors.
struct CheckpointMeta {
  int64_t format_version = kCheckpointFormatVersion;
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  int64_t optimizer_steps = 0;
  // Samples of the updates taken, where the learning-rate schedule counts samples (a batch-size
  // ramp); -1: not stored (the schedule counts optimizer steps).
  int64_t lr_schedule_samples = -1;
  uint64_t seed = 0;
  GPTConfig model;
  int tp_size = 1, pp_size = 1, dp_size = 1;
  // The stage split the files were saved at when uneven (model/pipeline_split.hpp's layout
  // string, every layer written out); empty: the even split. Loading never needs it (files name
  // their layers); the verifier checks each file's layers against it.
  std::string pipeline_layout;
  bool has_optimizer = true;
  std::string config_text;  // the run's options, INI
  // The tokenizer of the training data (its shards' `tokenizer`: "gpt2-bpe", "hf:..."); empty
  // for mock data, an import, or a checkpoint before it was recorded. Generation checks it.
  std::string tokenizer;
  // fp16 dynamic loss scaling state (optional attributes; absent in f32/bf16 runs).
  bool has_loss_scale = false;
  double loss_scale = 0;
  int64_t loss_scale_growth_tracker = 0, loss_scale_hysteresis_tracker = 0;
  int64_t skipped_iterations = 0;  // fp16 steps skipped on overflow so far (for the log)
  // Result validation's rerun pending from this checkpoint (train/result_validator.hpp: the
  // iteration to rerun on other hardware, the ranks that failed and where); empty: none.
  std::string rerun_state;
};

// --target-expert-model-parallel-size of the offline tools: `ep` must be 1 for a dense model and
// divide the experts of a MoE one (ConfigError naming `source`). Checkpoints hold every expert by
// its global index, so nothing else depends on it.
void check_target_expert_parallel(const GPTConfig& model, int ep, const std::string& source);

std::string iteration_dir_name(int64_t iteration);      // "iter_0000100"
std::string shard_file_name(int tp_rank, int pp_rank);  // "mp_rank_00_000.h5"
// The iteration an iteration directory is named after ("ckpt/iter_0000100/" -> 100); -1 when the
// last component of `path` is not of that form.
int64_t parse_iteration_dir_name(const std::string& path);

// The names of the root attributes a shard file may have (docs/checkpoints.md's table).
const std::vector<std::string>& checkpoint_file_attributes();

// The attributes of one open shard file (everything but its tp_rank and layers). Throws
// ConfigError naming `file` when one is missing, of another format version, or out of range.
CheckpointMeta read_checkpoint_meta(hid_t file, const std::string& path);

// The tensors of one shard file: the parameters, and the Adam moments when `exp_avg` is given.
// State beside the parameters, written whole as group/spec.name (FP8's delayed scaling: one
// tensor per layer, the same on every TP rank; docs/checkpoints.md).
struct ExtraTensor {
  std::string group;
  ParamSpec spec;
  std::vector<float> data;
};
// FP8's delayed-scaling state of a layer (train/fp8_checkpoint.hpp): group "fp8", this name,
// shape (history length + 1, fp8_state_columns(num_experts)) (model/fp8_config.hpp).
inline std::string fp8_state_name(int layer) {
  return "layers." + std::to_string(layer) + ".fp8";
}
// The MoE router's aux-loss-free expert bias of a layer (train/router_checkpoint.hpp): group
// "router", this name, shape (num_experts).
inline constexpr const char* kRouterGroup = "router";
inline std::string expert_bias_name(int layer) {
  return "layers." + std::to_string(layer) + ".mlp.router.expert_bias";
}
struct ShardTensors {
  const std::vector<ParamSpec>* specs = nullptr;
  const float* params = nullptr;   // flat, in spec order (flat_offset)
  const float* exp_avg = nullptr;  // flat or null
  const float* exp_avg_sq = nullptr;
  std::vector<ExtraTensor> extra;
};

// Writes one shard file tensor by tensor (so a converter needs memory for one tensor only); each
// tensor is read back after it is written and checked against its checksum. Throws Error naming
// the file. `fail_after` >= 0 fails after that many tensors (fault injection for tests).
class CheckpointShardWriter {
 public:
  CheckpointShardWriter(const std::string& path, const CheckpointMeta& meta,
                        const ModelShard& shard, int fail_after = -1);
  ~CheckpointShardWriter();
  // group: "model", "optimizer/exp_avg" or "optimizer/exp_avg_sq"; data holds spec.local_shape.
  void write(const std::string& group, const ParamSpec& spec, const float* data);
  // Flushes and syncs the file; call once after the last tensor.
  void finish();

 private:
  std::string path_;
  std::unique_ptr<H5Id> file_;
  int written_ = 0, fail_after_;
  std::vector<float> readback_;
};

// Writes a whole shard from flat buffers (the trainer's parameters and Adam moments).
void write_checkpoint_shard(const std::string& path, const CheckpointMeta& meta,
                            const ModelShard& shard, const ShardTensors& t, int fail_after = -1);

// A tensor of a checkpoint that does not match its checksum (or cannot be read): the file is
// damaged, and an older checkpoint may be whole (--load-fallback).
class CheckpointDamaged : public ConfigError {
 public:
  explicit CheckpointDamaged(const std::string& what) : ConfigError(what) {}
};

// Reads a checkpoint directory (iter_N/ or a --load directory with its latest file).
class CheckpointReader {
 public:
  // `dir`: a directory with latest_checkpointed_iteration.txt, or an iter_NNNNNNN directory.
  explicit CheckpointReader(const std::string& dir);
  const CheckpointMeta& meta() const { return meta_; }
  const std::string& path() const { return path_; }
  // Throws ConfigError naming both values when the model shape differs from `cfg`.
  void check_model(const GPTConfig& cfg) const;
  // Fills `out` (target.local_shape) with the target's slice of tensor `target.name` from group
  // "model", "optimizer/exp_avg" or "optimizer/exp_avg_sq". Vocabulary padding rows are zero.
  void read_slice(const std::string& group, const ParamSpec& target, float* out) const;
  // Elements of the whole tensor group/name in the first shard file that has it (ExtraTensor);
  // -1 when no file has it. read_whole fills `out` with them (checksum verified; ConfigError
  // naming the file otherwise).
  int64_t whole_numel(const std::string& group, const std::string& name) const;
  void read_whole(const std::string& group, const std::string& name, float* out) const;
  // Seconds spent checking the checksums of what was read so far.
  double hash_seconds() const { return hash_seconds_; }

 private:
  struct SourceTensor {
    int file = 0;
    int pp_rank = 0;
    Shape global_shape, local_shape;
    int split_axis = -1;
    int64_t split_offset = 0;
  };
  std::string path_;
  CheckpointMeta meta_;
  std::vector<std::string> files_;
  std::vector<std::unique_ptr<H5Id>> handles_;
  std::map<std::string, std::vector<SourceTensor>> tensors_;  // model tensors by name
  mutable std::vector<float> scratch_;  // one source tensor, when a slice needs part of it
  mutable double hash_seconds_ = 0;
};

// Resolves --load: the iteration directory the latest file points to. Throws ConfigError naming
// the directory when there is no checkpoint.
std::string resolve_checkpoint_dir(const std::string& dir);

// Creates --save (with parents) and checks a file can be written there; ConfigError otherwise.
void prepare_save_dir(const std::string& save_dir);

// The complete checkpoints of a --save directory: its iter_NNNNNNN directories (sorted), and the
// iteration its latest file names (-1: no latest file, or one without an iteration number).
std::vector<int64_t> checkpoint_iterations(const std::string& dir);
int64_t latest_checkpoint_iteration(const std::string& dir);

// Offline writers (import, resharding) never move a run: throws ConfigError, naming the directory,
// its latest iteration and what to do, when `save_dir` already holds a checkpoint (a latest file,
// an iter_NNNNNNN directory or shard files), since writing `iteration` there would repoint its
// latest file (an import's iteration 0 would restart the run without its optimizer state).
void refuse_save_over_checkpoint(const std::string& save_dir, int64_t iteration);

// The directory operations of a save, done by one rank: create DIR/iter_N.tmp/ (fresh), and after
// all shards are written, move it into place, update the latest file, and keep only the newest
// `keep` checkpoints (0: all).
std::string begin_checkpoint_dir(const std::string& save_dir, int64_t iteration);
void commit_checkpoint_dir(const std::string& save_dir, int64_t iteration, int keep);
void abandon_checkpoint_dir(const std::string& save_dir, int64_t iteration);

}  // namespace tessera
