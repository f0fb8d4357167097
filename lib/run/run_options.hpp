// run_options.hpp: what tessera-train's options resolve to (parse_run_options in options.hpp
// fills it; the option groups of options/ each set their part).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/attention_backend.hpp"
#include "core/logging.hpp"
#include "data/blended_dataset.hpp"
#include "data/shard.hpp"
#include "data/tokenizer.hpp"
#include "model/gpt_config.hpp"
#include "run/train_config.hpp"

namespace tessera {

struct ClusterSpec;

struct RunOptions {
  GPTConfig model;
  TrainConfig train;
  LogOptions log;
  int tp = 1, pp = 1;  // tensor- and pipeline-parallel sizes; DP = world / (TP * PP)
  int ep = 1;          // expert-parallel size (MoE): carved out of DP
  int cp = 1;          // context-parallel size: DP = world / (TP * CP * PP)
  int threads = 0;     // 0: this rank's share of the cores in its affinity mask
  // resolved to "cpu" or "cuda" by parse_run_options through resolve_device (a program that runs
  // no backend, tessera-inspect, leaves it: "auto" stays)
  std::string device = "auto";
  int ranks_per_gpu = 1;  // --ranks-per-gpu: local ranks that may share one GPU
  std::function<std::string(const RunOptions&, const std::string& host)> resolve_device;
  // Which attention kernels run (Megatron's --attention-backend), and --deterministic-mode.
  AttentionBackend attention_backend = AttentionBackend::Auto;
  bool deterministic_mode = false;
  bool mock_data = false;  // synthetic data; also the source when no --data-path is given
  // --data-path: one prefix of HDF5 token shards or a Megatron blend, cut into train, valid and
  // test by --split; or (instead) the three splits' own prefixes or blends.
  DataBlend data_path;
  DataBlend train_data_path, valid_data_path, test_data_path;
  std::string split = "969,30,1";
  std::string data_cache_path;  // where the blend's index file goes ("": beside the first prefix)
  // The world rank and size of the processes that open the data (tessera-train sets them from
  // MPI; world rank 0 writes the blend's index file): the options library needs no MPI.
  int launch_rank = 0, launch_world = 1;
  bool has_data() const { return !data_path.empty() || !train_data_path.empty(); }
  // The tokenizer of the training data and the prefix it came from (set by open_train_data;
  // the validation and test data must share it).
  ShardMeta data_meta;
  std::string data_meta_prefix;
  std::string load;            // checkpoint directory to start from
  bool finetune = false;       // --load the model only: iteration, data and optimizer start fresh
  bool skip_train = false;     // evaluate (after --load) and exit
  bool no_load_optim = false;  // --load without the optimizer state
  bool load_fallback = false;  // --load of a damaged checkpoint: the newest older one that verifies
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
  // What a --dry-run checks the layout against (options/planning.cpp, docs/planning.md):
  // --cluster (loaded into cluster_spec), --world-size (0: the MPI world); without a cluster,
  // this host's GPU (set by tessera-train before its dry run; 0: none) or memory.
  std::string cluster;
  std::shared_ptr<const ClusterSpec> cluster_spec;
  int world_size = 0;
  std::string collective_plan;  // --collective-plan: the prefix of each rank's planned calls
  double local_gpu_bytes = 0;
  std::string local_gpu;
  double host_memory_bytes = 0;
  // A ConfigError's text with a note naming the options it mentions that came from --config.
  std::function<std::string(const std::string&)> with_origins;
};

}  // namespace tessera
