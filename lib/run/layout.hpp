// layout.hpp: how a model and a batch map onto the process grid: which layers a rank holds, the
// first sample of a DP rank's slice, and the one check of the layout against the model and batch.
#pragma once

#include <cstdint>

#include "comm/communicator.hpp"
#include "model/gpt.hpp"
#include "run/train_config.hpp"

namespace tessera {

// The first sample of DP rank `dp_rank`'s slice of the global batch that starts after `consumed`
// samples: the global batch is samples [consumed, consumed + G) in every layout, and DP rank d
// takes its d-th contiguous G/DP of them.
inline int64_t dp_slice_begin(int64_t consumed, int64_t global_batch, int dp_size, int dp_rank) {
  return consumed + dp_rank * (global_batch / dp_size);
}

// This rank's shard: the layers of its pipeline stage as t's stage split, its virtual stages and
// sequence parallelism (where TP > 1) say; TP, EP and CP from ctx.
ModelShard make_model_shard(const GPTConfig& cfg, const ParallelContext& ctx, const TrainConfig& t);
// The uneven stage split of t at `pp` ranks as a layout string with every layer written out (what
// a checkpoint records); empty for the even split.
std::string saved_pipeline_layout(const GPTConfig& cfg, const TrainConfig& t, int pp);
// The pipeline rank that runs multi-token prediction on a stage of its own (t's layout string
// "...m|L"), -1 without one.
int standalone_mtp_rank(const GPTConfig& cfg, const TrainConfig& t, int pp);

// How this rank's flat gradient buffer is cut into data-parallel buckets for the run
// (OptimizerSet's, and the step-time predictor's collective plan, plan/collectives.hpp).
FlatLayout training_flat_layout(const TrainConfig& cfg, const GPTConfig& model_cfg,
                                const ParallelContext& ctx);

// Checks the layout against the model and batch, naming the numbers (ConfigError). Runs once per
// start: tessera-train calls it once its grid is built, dry_run_report (options/options.hpp) for
// --dry-run; a caller that builds a Trainer by hand (tests, benchmarks) calls it itself.
void validate_layout(const GPTConfig& cfg, const TrainConfig& t, int tp, int pp, int dp,
                     int cp = 1);

}  // namespace tessera
