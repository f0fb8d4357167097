// options.hpp: the command-line / config-file options of tessera-train, with Megatron's names.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/logging.hpp"
#include "data/blended_dataset.hpp"
#include "data/dataset.hpp"
#include "data/shard.hpp"
#include "data/tokenizer.hpp"
#include "model/gpt_config.hpp"
#include "train/train_config.hpp"

namespace tessera {

struct RunOptions {
  GPTConfig model;
  TrainConfig train;
  LogOptions log;
  int tp = 1, pp = 1;           // tensor- and pipeline-parallel sizes; DP = world / (TP * PP)
  int ep = 1;                   // expert-parallel size (MoE): carved out of DP
  int cp = 1;                   // context-parallel size: DP = world / (TP * CP * PP)
  int threads = 0;              // 0: this rank's share of the cores in its affinity mask
  std::string device = "auto";  // resolved to "cpu" or "cuda" by parse_run_options
  bool mock_data = false;       // synthetic data; also the source when no --data-path is given
  // --data-path: one prefix of HDF5 token shards or a Megatron blend, cut into train, valid and
  // test by --split; or (instead) the three splits' own prefixes or blends.
  DataBlend data_path;
  DataBlend train_data_path, valid_data_path, test_data_path;
  std::string split = "969,30,1";
  std::string data_cache_path;  // where the blend's index file goes ("": beside the first prefix)
  bool has_data() const { return !data_path.empty() || !train_data_path.empty(); }
  // The tokenizer of the training data and the prefix it came from (set by open_train_data;
  // the validation and test data must share it).
  ShardMeta data_meta;
  std::string data_meta_prefix;
  std::string load;            // checkpoint directory to start from
  bool finetune = false;       // --load the model only: iteration, data and optimizer start fresh
  bool skip_train = false;     // evaluate (after --load) and exit
  bool no_load_optim = false;  // --load without the optimizer state
  bool use_checkpoint_args = false;  // the model's options come from --load's checkpoint
  // --load names a directory without a checkpoint yet (absent or empty: the first run of a
  // requeued job whose --load is its --save): training starts fresh, as in Megatron-LM.
  bool load_fresh = false;
  // Megatron's tokenizer options, when given: checked against the tokenizer the data's shards
  // were made with (or, with mock data, the vocabulary's size).
  TokenizerOptions tokenizer;
  bool tokenizer_given = false;
  // Lines rank 0 logs at start-up: Megatron options accepted without effect, config-file values
  // the command line replaced, a --load that starts fresh.
  std::vector<std::string> notes;
  // A ConfigError's text with a note naming the options it mentions that came from --config.
  std::function<std::string(const std::string&)> with_origins;
};

// Why `dir` holds no checkpoint yet ("" when it holds one, or something that must be looked at:
// a damaged checkpoint stays an error). Absent, empty, or only other files and the leftovers of a
// save that never finished (iter_N.tmp) count as none.
std::string no_checkpoint_in(const std::string& dir);

// "0,8,16" -> {0, 8, 16}; "all" -> {} (every rank). ConfigError naming `option` otherwise.
std::vector<int> parse_rank_list(const std::string& text, const std::string& option);

// The recomputation the Megatron options ask for (--recompute-granularity, --recompute-method,
// --recompute-num-layers, and the older --checkpoint-activations / --checkpoint-num-layers);
// empty strings and 0 mean "not given". ConfigError naming the option for a bad combination.
RecomputeConfig recompute_options(const std::string& granularity, const std::string& method,
                                  int num_layers, bool checkpoint_activations,
                                  int checkpoint_num_layers);

class OptionParser;
// Another program that takes tessera-train's options (tessera-inspect reads a run's config): its
// name and usage line for --help and errors, and a group of options of its own.
struct RunOptionsProgram {
  std::string name = "tessera-train";
  std::string usage = "[--config FILE] [options]";
  std::function<void(OptionParser&)> add_options;
  // Only the data matters (the micro-batch size is not checked against the global batch).
  bool data_only = false;
};

// Parses argv (and --config). Returns false when --help was printed. Throws ConfigError for an
// unknown option, a bad value or a missing config file; validates everything before returning.
bool parse_run_options(int argc, const char* const* argv, RunOptions& out,
                       const RunOptionsProgram& program = RunOptionsProgram());

// The training dataset the options ask for: the train split of --data-path, or mock data. Sets
// model.vocab_size from the shards when it was not given. ConfigError for an empty train split.
std::unique_ptr<TokenDataset> open_train_data(RunOptions& opts);

// The start-up log's lines about the data: for shards, one line per dataset (weight, documents,
// tokens, samples per epoch, samples the run draws from it) and one for the blend.
std::vector<std::string> data_report(const TokenDataset& data, const TrainConfig& t, int dp_size);

// The validation data for --eval-interval / --skip-train: the valid split of --data-path, or mock
// data of another stream. ConfigError when the split is needed but empty.
std::unique_ptr<TokenDataset> open_valid_data(const RunOptions& opts);
// The test split for the evaluation at the end of training; null when it is empty.
std::unique_ptr<TokenDataset> open_test_data(const RunOptions& opts);

// Cores this process may run on (sched_getaffinity), at least 1.
int affinity_cores();
// This rank's share of its cores: affinity cores / ranks on the node whose masks overlap it, so
// 8 unbound ranks on 2 cores run one thread each. node is MPI_COMM_TYPE_SHARED of the world.
int default_threads(MPI_Comm node);
// Sets the OpenMP and OpenBLAS thread counts.
void set_num_threads(int n);

class ProcessGrid;
// This rank's backend for a resolved --device (resolve_device), on the GPU of its local rank;
// with CUDA, the grid's device-tensor groups switch to NCCL (collective: every rank calls it).
// A rank that cannot take its GPU ends the whole job with the reason (exit code 2).
// `pipeline_ring`: virtual pipeline stages (ProcessGrid::use_pipeline_ring before the NCCL
// communicators are made).
std::unique_ptr<Backend> make_rank_backend(ProcessGrid& grid, const std::string& device,
                                           bool pipeline_ring = false);

// What one rank of pipeline stage `stage` holds: the figures --dry-run prints
// and the GPU benchmark compares its measured peak with.
struct MemoryEstimate {
  int64_t parameters = 0;         // on this rank
  int64_t expert_parameters = 0;  // of them, routed experts' (MoE; E/EP experts per MoE layer)
  double dispatch_bytes = 0;      // MoE: one layer's token-dispatch buffers (in activation_bytes)
  double expert_bytes = 0;        // MoE: the routed experts' weights, gradients and optimizer state
  int slots = 1;  // micro-batches whose activations are alive at once (summed over model chunks)
  double param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  int stage_layers = 0;
  double activation_layer_bytes = 0;   // kept per layer per micro-batch (mean over the stage)
  double activation_shared_bytes = 0;  // scratch and recompute working set, counted once
  // The LayerNorm/dropout/residual regions' share of activation_layer_bytes, and what it would be
  // without sequence parallelism (TP times as much); both 0 at TP 1.
  double sp_region_layer_bytes = 0, sp_region_layer_bytes_without = 0;
  double total_bytes() const {
    return param_bytes + grad_bytes + optimizer_bytes + activation_bytes;
  }
};
struct GridLayout;
// `ep`: the expert-parallel size (MoE), carved out of layout.dp.
MemoryEstimate estimate_rank_memory(const GPTConfig& cfg, const TrainConfig& t,
                                    const GridLayout& layout, int stage, int ep = 1);

// Context parallelism's ring (model/context_parallel.cpp): the bytes one rank sends per
// transformer layer per micro-batch. A K/V block is the rank's key and value heads
// (B x S/CP x 2 x KV heads/TP x head dim, compute dtype); the forward sends CP − 1 of them, the
// backward CP − 1 again plus CP dK/dV blocks (the last one home to its owner); recomputation
// (selective or full) runs the forward's ring again. Zeros at CP 1.
struct RingTraffic {
  double block = 0, forward = 0, backward = 0, recompute = 0;
  double per_layer() const { return forward + backward + recompute; }
};
RingTraffic cp_ring_traffic(const GPTConfig& cfg, const TrainConfig& t, int tp, int cp);

// What --dry-run prints: the layout, and per pipeline stage the parameters and estimated memory
// of one rank of that stage.
std::string dry_run_report(const RunOptions& opts, int world_size);

}  // namespace tessera
