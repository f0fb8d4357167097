// trainer.cpp: the training loop.
#include "train/trainer.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "core/logging.hpp"
#include "core/timer.hpp"

namespace tessera {

Trainer::Trainer(const GPTConfig& model_cfg, const TrainConfig& train_cfg, Backend& backend,
                 TokenDataset& data)
    : model_cfg_(model_cfg), cfg_(train_cfg), be_(backend), data_(data),
      schedule_(train_cfg.lr, train_cfg.min_lr, train_cfg.lr_warmup_iters,
                train_cfg.lr_decay_iters > 0 ? train_cfg.lr_decay_iters : train_cfg.train_iters,
                train_cfg.lr_decay_style) {
  model_cfg_.validate();
  cfg_.validate(1);
  TESSERA_CHECK(data.seq_length() == model_cfg_.seq_length, "dataset sequence length ",
                data.seq_length(), " differs from --seq-length ", model_cfg_.seq_length);
  ModelShard shard;
  shard.layer_end = model_cfg_.num_layers;
  model_ = std::make_unique<GPTModel>(model_cfg_, shard, be_, tp_comm_);
  model_->init_parameters(cfg_.seed);
  optimizer_ = std::make_unique<AdamW>(model_->params(), be_, cfg_.adam_beta1, cfg_.adam_beta2,
                                       cfg_.adam_eps, cfg_.weight_decay);
  acts_ = model_->make_activations(cfg_.micro_batch_size, model_cfg_.seq_length);
  batch_.resize(static_cast<size_t>(cfg_.global_batch(1)) * (model_cfg_.seq_length + 1));
  if (!cfg_.metrics_file.empty()) {
    metrics_.open(cfg_.metrics_file, std::ios::app);
    if (!metrics_)
      throw ConfigError("--metrics-file '" + cfg_.metrics_file +
                        "' cannot be opened for appending; check the directory exists");
  }
}

void Trainer::load_global_batch() {
  // The global batch is samples [consumed, consumed + global batch) of the dataset, whatever the
  // micro-batch size, so the trajectory does not depend on how the batch is cut.
  const int64_t gbs = cfg_.global_batch(1), S = model_cfg_.seq_length + 1;
  for (int64_t i = 0; i < gbs; ++i) data_.get(consumed_samples_ + i, batch_.data() + i * S);
}

StepStats Trainer::train_step() {
  Timer timer;
  const int B = cfg_.micro_batch_size, T = model_cfg_.seq_length;
  const int64_t S = T + 1;
  const int micro = cfg_.num_micro_batches(1);
  load_global_batch();
  // Loss tokens of the whole global batch, known before any backward so every micro-batch's
  // gradient is scaled by the same 1/N (the loss is the mean over the global batch).
  int64_t loss_tokens = 0;
  for (int64_t s = 0; s < int64_t(micro) * B; ++s)
    for (int t = 1; t <= T; ++t) loss_tokens += batch_[s * S + t] >= 0;
  TESSERA_CHECK(loss_tokens > 0, "iteration ", iteration_ + 1, ": the global batch has no loss tokens");
  const float grad_scale = static_cast<float>(1.0 / static_cast<double>(loss_tokens));

  model_->zero_grads();
  double loss_sum = 0;
  for (int mb = 0; mb < micro; ++mb) {
    int32_t* ids = acts_.ids.i32();
    int32_t* tg = acts_.targets.i32();
    for (int b = 0; b < B; ++b) {
      const int32_t* sample = batch_.data() + (int64_t(mb) * B + b) * S;
      std::memcpy(ids + b * T, sample, sizeof(int32_t) * T);
      std::memcpy(tg + b * T, sample + 1, sizeof(int32_t) * T);
    }
    loss_sum += model_->forward(acts_, grad_scale);
    model_->backward(acts_);
  }

  StepStats st;
  st.iteration = iteration_ + 1;
  st.loss_tokens = loss_tokens;
  st.loss = loss_sum / static_cast<double>(loss_tokens);
  st.grad_norm = std::sqrt(grad_sum_squares(model_->params(), be_));
  if (!std::isfinite(st.loss) || !std::isfinite(st.grad_norm))
    throw Error(detail::concat("iteration ", st.iteration, ": loss is ", st.loss,
                               " and grad norm is ", st.grad_norm,
                               "; training stopped (lower --lr, raise --lr-warmup-iters or set --clip-grad)"));
  clip_grads(model_->params(), be_, st.grad_norm, cfg_.clip_grad);
  st.lr = schedule_.lr(st.iteration);
  optimizer_->step(st.lr);
  iteration_ = st.iteration;
  consumed_samples_ += cfg_.global_batch(1);
  st.seconds = timer.seconds();
  return st;
}

void Trainer::log_iteration(const StepStats& s, double interval_loss, double interval_seconds,
                            int n) {
  const double sec = interval_seconds / n;
  const double tokens = static_cast<double>(cfg_.global_batch(1)) * model_cfg_.seq_length;
  const double tok_s = tokens / sec;
  const double gflops = model_cfg_.train_flops_per_token() * tok_s / 1e9;
  char line[512];
  int len = std::snprintf(
      line, sizeof line,
      " iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
      "learning rate: %.6E | global batch size: %5d | lm loss: %.6E | grad norm: %.3f | "
      "tokens/s: %.0f | GFLOP/s: %.2f",
      (long long)s.iteration, (long long)cfg_.train_iters, (long long)consumed_samples_, sec * 1e3,
      s.lr, cfg_.global_batch(1), interval_loss / n, s.grad_norm, tok_s, gflops);
  if (cfg_.peak_tflops > 0 && len > 0 && len < (int)sizeof line)
    std::snprintf(line + len, sizeof line - len, " | MFU: %.1f%%",
                  100.0 * gflops / (cfg_.peak_tflops * 1e3));
  TLOG(info) << line;
  if (metrics_.is_open()) {
    char js[512];
    std::snprintf(js, sizeof js,
                  "{\"iteration\": %lld, \"consumed_samples\": %lld, \"lm_loss\": %.9g, "
                  "\"lr\": %.9g, \"grad_norm\": %.9g, \"ms_per_iter\": %.4f, \"tokens_per_s\": "
                  "%.3f, \"gflops_per_s\": %.4f}\n",
                  (long long)s.iteration, (long long)consumed_samples_, interval_loss / n, s.lr,
                  s.grad_norm, sec * 1e3, tok_s, gflops);
    metrics_ << js;
    metrics_.flush();
  }
}

std::vector<StepStats> Trainer::train() {
  std::vector<StepStats> all;
  double interval_loss = 0, interval_seconds = 0;
  int in_interval = 0;
  while (iteration_ < cfg_.train_iters) {
    StepStats s = train_step();
    all.push_back(s);
    interval_loss += s.loss;
    interval_seconds += s.seconds;
    ++in_interval;
    if (s.iteration % cfg_.log_interval == 0 || s.iteration == cfg_.train_iters) {
      log_iteration(s, interval_loss, interval_seconds, in_interval);
      interval_loss = interval_seconds = 0;
      in_interval = 0;
    }
  }
  return all;
}

}  // namespace tessera
