// step_stats.hpp: what one training iteration reports (every rank the same figures).
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

struct StepStats {
  int64_t iteration = 0;
  double loss = 0;       // sum of token losses / loss tokens of the global batch
  double grad_norm = 0;  // before clipping
  double num_zeros = 0;  // zeros in the gradient (--log-num-zeros-in-grad; 0 otherwise)
  double lr = 0;
  double weight_decay = 0;  // the decay of the weight matrices and embeddings this step
  double seconds = 0;
  int64_t loss_tokens = 0;
  double pipeline_wait_seconds = 0;  // blocked receiving from neighbouring stages (the bubble)
  double pipeline_seconds = 0;       // the whole schedule: forwards, backwards and waits
  double pipeline_start = 0;         // when the schedule started, seconds into the step
  double dp_wait_seconds = 0;        // waiting for data-parallel reductions after the backward
  double p2p_bytes = 0;              // sent to neighbouring stages by this rank
  double data_wait_seconds = 0;      // blocked waiting for this step's samples
  double loss_scale = 1;             // fp16: the scale this step's backward used
  bool skipped = false;              // fp16: gradients overflowed, no update (grad_norm is 0)
  // Not run at all: --iterations-to-skip, the rerun tracker's skip, or a global batch in which no
  // token counts toward the loss. Its samples are consumed; it has no loss and no log line (as
  // Megatron's skipped iterations); the next line counts its samples.
  bool not_run = false;
  int global_batch = 0;  // samples of this step (changes during a batch-size ramp)
};

// Where training stands: what a checkpoint stores besides the model and the optimizer.
struct TrainState {
  int64_t iteration = 0;         // iterations done (skipped fp16 steps included)
  int64_t consumed_samples = 0;  // samples of those iterations
  // A rerun pending on other hardware (train/result_validator.hpp), saved with the checkpoint
  // before exit 16 and loaded from it; empty: none.
  std::string rerun_state;
};

}  // namespace tessera
