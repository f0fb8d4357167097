// trainer.hpp: the training loop: global batch -> micro-batches with gradient accumulation ->
// grad norm, clipping -> AdamW -> log line and JSONL metrics.
#pragma once

#include <fstream>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "data/dataset.hpp"
#include "model/gpt.hpp"
#include "train/lr_schedule.hpp"
#include "train/optimizer.hpp"
#include "train/train_config.hpp"

namespace tessera {

struct StepStats {
  int64_t iteration = 0;
  double loss = 0;        // sum of token losses / loss tokens of the global batch
  double grad_norm = 0;   // before clipping
  double lr = 0;
  double seconds = 0;
  int64_t loss_tokens = 0;
};

class Trainer {
 public:
  Trainer(const GPTConfig& model_cfg, const TrainConfig& train_cfg, Backend& backend,
          TokenDataset& data);

  GPTModel& model() { return *model_; }
  AdamW& optimizer() { return *optimizer_; }
  int64_t iteration() const { return iteration_; }
  int64_t consumed_samples() const { return consumed_samples_; }

  // Runs one iteration on the next global batch. Throws Error naming the iteration when the loss
  // or the gradient norm is not finite.
  StepStats train_step();
  // Runs train_iters iterations with logging; returns the stats of every iteration.
  std::vector<StepStats> train();

 private:
  void load_global_batch();
  void log_iteration(const StepStats& s, double interval_loss, double interval_seconds, int n);

  GPTConfig model_cfg_;
  TrainConfig cfg_;
  Backend& be_;
  TokenDataset& data_;
  LocalCommunicator tp_comm_;
  std::unique_ptr<GPTModel> model_;
  std::unique_ptr<AdamW> optimizer_;
  LrSchedule schedule_;
  Activations acts_;
  std::vector<int32_t> batch_;  // (micro-batches, B, T+1) tokens of this rank's share of the step
  int64_t iteration_ = 0, consumed_samples_ = 0;
  std::ofstream metrics_;
};

}  // namespace tessera
