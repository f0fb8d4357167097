// metrics.cpp: the iteration log line, the metrics file and TensorBoard (train/metrics.hpp).
#include "train/metrics.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/logging.hpp"
#include "core/paths.hpp"
#include "run/memory_estimate.hpp"
#include "runtime/process_grid.hpp"
#include "step/optimizer_set.hpp"

namespace tessera {

namespace {
std::string format(const char* fmt, double v) {
  char buf[400];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}
}  // namespace

namespace {
// A number in the metrics file: JSON has no NaN or infinity, so a non-finite value is null.
std::string json_number(const char* fmt, double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}
}  // namespace

void FigureSink::add(const Figure& f, double value) {
  if (at_log_) {
    if (f.log) *line_ += std::string(" | ") + f.log + ": " + format(f.log_format, value);
    if (f.json && json_)
      *json_ += std::string(", \"") + f.json + "\": " +
                (std::isfinite(value) ? format(f.json_format, value) : std::string("null"));
  }
  if (tb_ && f.tensorboard && f.tensorboard_every_step != at_log_)
    tb_->add_scalar(f.tensorboard, value, step_);
}

std::string validation_loss_text(const std::string& where, double loss) {
  if (std::isnan(loss))
    return " validation loss at " + where +
           " | none: no token of the samples evaluated counts toward the loss";
  char line[320];
  std::snprintf(line, sizeof line,
                " validation loss at %s | lm loss value: %.9E | lm loss PPL: %.6E", where.c_str(),
                loss, std::exp(std::min(loss, 700.0)));
  return line;
}

TrainingMetrics::TrainingMetrics(const MetricContext& c, IterationTimers& timers)
    : c_(c), timers_(timers), sources_(make_metric_sources(c)) {
  const TrainConfig& cfg = c_.cfg;
  Communicator& world = *c_.ctx.world;
  if (!cfg.metrics_file.empty()) {  // rank 0 writes the metrics; its failure is every rank's
    const std::string why = one_rank_tries(
        world, 0,
        [&] {
          create_parent_dirs(cfg.metrics_file, "--metrics-file");
          metrics_.open(cfg.metrics_file, std::ios::app);
          if (!metrics_)
            throw ConfigError("--metrics-file '" + cfg.metrics_file +
                              "' cannot be opened for appending; check its permissions");
        },
        "--metrics-file is not usable (reported by rank 0)");
    if (!why.empty()) throw ConfigError(why);
  }
  if (!cfg.tensorboard_dir.empty()) {  // the last rank writes (Megatron's); its failure is all's
    const std::string why = one_rank_tries(
        world, world.size() - 1,
        [&] { tb_ = std::make_unique<TensorBoardWriter>(cfg.tensorboard_dir); },
        "--tensorboard-dir '" + cfg.tensorboard_dir +
            "' cannot be written (reported by the last rank)");
    if (!why.empty()) throw ConfigError(why);
  }
}

TrainingMetrics::~TrainingMetrics() = default;

void TrainingMetrics::begin_step() {
  for (auto& src : sources_) src->begin_step();
}

void TrainingMetrics::begin_run() {
  interval_loss_ = interval_loss_all_ = interval_seconds_ = 0;
  in_interval_ = in_interval_updated_ = 0;
}

void TrainingMetrics::collect(const StepStats& s) {
  for (auto& src : sources_) src->collect(s);
}

void TrainingMetrics::record(const StepStats& s, int64_t consumed_samples) {
  const TrainConfig& cfg = c_.cfg;
  if (s.not_run) {  // no loss, no line (Megatron's skipped iterations): the next line counts it
    skipped_samples_ += s.global_batch;
    ++skipped_iterations_;
    if (s.iteration == cfg.train_iters) log_skipped(s, consumed_samples);  // no next line
    return;
  }
  if (tb_ && s.iteration % cfg.tensorboard_log_interval == 0) {
    // Megatron's tags; "vs samples" puts the consumed samples on the x axis.
    tb_->add_scalar("learning-rate", s.lr, s.iteration);
    tb_->add_scalar("learning-rate vs samples", s.lr, consumed_samples);
    tb_->add_scalar("batch-size", s.global_batch, s.iteration);
    tb_->add_scalar("lm loss", s.loss, s.iteration);
    tb_->add_scalar("lm loss vs samples", s.loss, consumed_samples);
    tb_->add_scalar("grad-norm", s.grad_norm, s.iteration);
    tb_->add_scalar("iteration-time", s.seconds, s.iteration);
  }
  {
    FigureSink at_step(tb_ && s.iteration % cfg.tensorboard_log_interval == 0 ? tb_.get() : nullptr,
                       s.iteration);
    for (auto& src : sources_) src->step(s, at_step);
  }
  interval_seconds_ += s.seconds;
  interval_samples_ += s.global_batch;
  ++in_interval_;
  interval_loss_all_ += s.loss;
  if (!s.skipped) {  // Megatron averages the loss over the steps that updated
    interval_loss_ += s.loss;
    ++in_interval_updated_;
  }
  if (s.iteration % cfg.log_interval == 0 || s.iteration == cfg.train_iters) {
    log_line(s, consumed_samples);
    interval_samples_ = 0;
    interval_loss_ = interval_loss_all_ = interval_seconds_ = 0;
    in_interval_ = in_interval_updated_ = 0;
  }
}

void TrainingMetrics::log_skipped(const StepStats& s, int64_t consumed_samples) {
  const std::string counts = detail::concat("skipped iterations: ", skipped_iterations_,
                                            " | skipped samples: ", skipped_samples_);
  TLOG(info) << detail::concat(" iteration ", s.iteration, "/", c_.cfg.train_iters,
                               " | consumed samples: ", consumed_samples, " | ", counts);
  if (metrics_.is_open())
    metrics_ << "{\"iteration\": " << s.iteration << ", \"consumed_samples\": " << consumed_samples
             << ", \"skipped_iterations\": " << skipped_iterations_
             << ", \"skipped_samples\": " << skipped_samples_ << "}\n"
             << std::flush;
  skipped_iterations_ = skipped_samples_ = 0;
}

void TrainingMetrics::log_line(const StepStats& s, int64_t consumed_samples) {
  const TrainConfig& cfg = c_.cfg;
  const ParallelContext& ctx = c_.ctx;
  const int n = in_interval_;
  // An interval of skipped steps only shows their mean loss.
  const double mean = in_interval_updated_ > 0 ? interval_loss_ / in_interval_updated_
                                               : interval_loss_all_ / in_interval_;
  const double loss = mean * in_interval_ / n;
  const double sec = interval_seconds_ / n;
  const int gbs = s.global_batch;
  const int ranks = ctx.tp_size * ctx.pp_size * ctx.dp_size * ctx.cp_size;
  // Over the interval's samples (a batch-size ramp changes them from step to step).
  const double samples = interval_samples_ > 0 ? static_cast<double>(interval_samples_) : gbs * n;
  const double tok_s = samples * c_.model.config().seq_length / interval_seconds_;
  const double gflops = c_.model.config().train_flops_per_token() * tok_s / 1e9 / ranks;
  char buf[512];
  std::snprintf(
      buf, sizeof buf,
      " iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
      "learning rate: %.6E | global batch size: %5d | lm loss: %.6E | grad norm: %.3f | "
      "tokens/s: %.0f | throughput per GPU (TFLOP/s/GPU): %.3f",
      (long long)s.iteration, (long long)cfg.train_iters, (long long)consumed_samples, sec * 1e3,
      s.lr, gbs, loss, s.grad_norm, tok_s, gflops / 1e3);
  std::string line = buf;
  if (skipped_iterations_ > 0)  // since the last line, not run (and not in its averages)
    line += " | skipped iterations: " + std::to_string(skipped_iterations_) +
            " | skipped samples: " + std::to_string(skipped_samples_);
  std::snprintf(buf, sizeof buf,
                "{\"iteration\": %lld, \"consumed_samples\": %lld, \"global_batch_size\": %d, ",
                (long long)s.iteration, (long long)consumed_samples, s.global_batch);
  std::string json = buf;
  if (skipped_iterations_ > 0)
    json += "\"skipped_iterations\": " + std::to_string(skipped_iterations_) +
            ", \"skipped_samples\": " + std::to_string(skipped_samples_) + ", ";
  skipped_iterations_ = skipped_samples_ = 0;
  json += "\"lm_loss\": " + json_number("%.17g", loss) + ", \"lr\": " + json_number("%.17g", s.lr) +
          ", \"grad_norm\": " + json_number("%.17g", s.grad_norm) +
          ", \"ms_per_iter\": " + json_number("%.4f", sec * 1e3) +
          ", \"tokens_per_s\": " + json_number("%.3f", tok_s) +
          ", \"gflops_per_s_per_rank\": " + json_number("%.4f", gflops) +
          ", \"tflops_per_gpu\": " + json_number("%.6f", gflops / 1e3);
  {  // every source's figures (collective ones included: every rank logs at the same iterations)
    FigureSink at_log(&line, metrics_.is_open() ? &json : nullptr, tb_.get(), s.iteration);
    const LogInterval interval{s, gflops};
    for (auto& src : sources_) src->report(interval, at_log);
  }
  TLOG(info) << line;
  for (auto& src : sources_)
    for (const std::string& l : src->lines_after()) TLOG(info) << l;
  const std::vector<IterationTimers::Row> timed =
      timers_.collect(*ctx.world, timers_.iteration_timers(), n);
  if (!timed.empty()) TLOG(info) << timers_.format(timed);
  if (tb_) {
    if (cfg.log_timers_to_tensorboard)
      for (const IterationTimers::Row& r : timed)
        tb_->add_scalar(r.name + "-time", r.max_ms, s.iteration);
    tb_->flush();
  }
  if (metrics_.is_open()) {
    metrics_ << json;
    if (!timed.empty()) metrics_ << ", \"timers_ms\": " << IterationTimers::json(timed);
    metrics_ << "}\n" << std::flush;
    metrics_.flush();
  }
}

double evaluation_loss(double loss_sum, double tokens, const TokenDataset& data, int64_t begin,
                       int64_t end) {
  if (tokens > 0) return loss_sum / tokens;
  TLOG(warning) << "evaluation: no token of samples " << begin << " to " << end - 1 << " of "
                << data.describe()
                << " counts toward the loss (its /loss_mask is 0 there): no loss";
  return std::numeric_limits<double>::quiet_NaN();
}

void TrainingMetrics::record_validation(int64_t iteration, double loss, int64_t consumed_samples) {
  if (std::isnan(loss)) return;  // no counted token: said by evaluation_loss
  TLOG(info) << validation_loss_text("iteration " + std::to_string(iteration), loss);
  if (metrics_.is_open())
    metrics_ << "{\"iteration\": " << iteration
             << ", \"valid_lm_loss\": " << json_number("%.17g", loss) << "}\n"
             << std::flush;
  if (tb_) {
    tb_->add_scalar("lm loss validation", loss, iteration);
    tb_->add_scalar("lm loss validation vs samples", loss, consumed_samples);
    if (c_.cfg.log_validation_ppl_to_tensorboard) {
      tb_->add_scalar("lm loss validation ppl", std::exp(std::min(loss, 20.0)), iteration);
      tb_->add_scalar("lm loss validation ppl vs samples", std::exp(std::min(loss, 20.0)),
                      consumed_samples);
    }
    tb_->flush();
  }
}

void TrainingMetrics::memory_report_after(Backend& be, const StepStats& s) {
  const int64_t every = c_.cfg.memory_report_interval;
  if (s.not_run || (memory_reported_ && !(every > 0 && s.iteration % every == 0))) return;
  memory_reported_ = true;
  memory_report(be, s.iteration);
}

void TrainingMetrics::memory_report(Backend& be, int64_t iteration) {
  const ParallelContext& ctx = c_.ctx;
  const Backend::MemoryStats m = be.memory_stats();
  const int R = ctx.world->size(), me = ctx.world->rank();
  constexpr int F = 6;  // figures per rank, every rank's gathered by a sum
  std::vector<double> all(static_cast<size_t>(F * R), 0.0);
  const GridLayout layout = GridLayout::make(R, ctx.tp_size, ctx.pp_size, ctx.cp_size);
  const MemoryEstimate e =
      estimate_rank_memory(c_.model.config(), c_.cfg, layout, ctx.pp_rank, ctx.ep_size);
  double* mine = all.data() + F * me;
  mine[0] = m.allocated;
  mine[1] = m.max_allocated;
  mine[2] = m.reserved;
  mine[3] = e.total_bytes();
  // Megatron-FSDP's pool of gathered weights and unreduced gradients, held and estimated.
  const FsdpUnits* fsdp = c_.optimizers.fsdp();
  mine[4] = fsdp ? static_cast<double>(fsdp->pool_bytes()) : 0.0;
  mine[5] = e.fsdp_pool_bytes;
  ctx.world->all_reduce_f64(all.data(), static_cast<int64_t>(all.size()), ReduceOp::Sum);
  const double MB = 1024.0 * 1024.0;
  for (int r = 0; r < R; ++r) {
    const double* f = all.data() + F * r;
    char line[400];
    int n = std::snprintf(
        line, sizeof line,
        "[Rank %d] (after %lld iterations) memory (MB) | allocated: %.2f | max allocated: "
        "%.2f | reserved (%s): %.2f | --dry-run estimate: %.2f",
        r, (long long)iteration, f[0] / MB, f[1] / MB, m.reserved_what, f[2] / MB, f[3] / MB);
    if (fsdp && n > 0 && n < static_cast<int>(sizeof line))
      std::snprintf(line + n, sizeof line - static_cast<size_t>(n),
                    " | FSDP units' pool: %.0f bytes (estimate %.0f)", f[4], f[5]);
    TLOG(info) << line;
  }
}

void TrainingMetrics::flush() {
  if (tb_) tb_->flush();
}

}  // namespace tessera
