// result_validator.cpp: result validation and reruns (train/result_validator.hpp).
#include "train/result_validator.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "comm/gather_strings.hpp"
#include "core/hash.hpp"
#include "core/logging.hpp"

namespace tessera {

namespace {
std::string number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

double parse_number(const std::string& s) {
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  return std::strtod(s.c_str(), nullptr);
}

std::string where(int rank, const std::string& host, int device) {
  return "rank " + std::to_string(rank) + " (host " + host +
         (device >= 0 ? ", device " + std::to_string(device) : std::string(", CPU")) + ")";
}
}  // namespace

bool SpikeDetector::spiky(double v) const {
  if (recent_.empty() || !std::isfinite(v)) return false;
  const double largest = *std::max_element(recent_.begin(), recent_.end());
  return std::fabs(v) > factor_ * largest;
}

void SpikeDetector::accept(double v) {
  if (!std::isfinite(v)) return;
  recent_.push_back(std::fabs(v));
  if (recent_.size() > window_) recent_.pop_front();
}

double compare_results(double a, double b) {
  if (a == b || (std::isnan(a) && std::isnan(b))) return 0;
  if (!std::isfinite(a) || !std::isfinite(b)) return std::numeric_limits<double>::infinity();
  const double s = a + b;
  return s == 0 ? std::fabs(a - b) : std::fabs(2 * (a - b) / s);
}

ResultValidator::ResultValidator(const TrainConfig& cfg, const ParallelContext& ctx, Backend& be)
    : cfg_(cfg),
      ctx_(ctx),
      be_(be),
      host_(host_name()),
      device_(be.device_index()),
      tracker_(cfg.rejected_tracker_file) {
  mode_ = cfg.rerun_mode == "disabled"       ? Mode::Disabled
          : cfg.rerun_mode == "report_stats" ? Mode::ReportStats
                                             : Mode::ValidateResults;
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job) job = std::getenv("SLURM_JOBID");
  job_ = job && *job ? job : "N/A";
  skip_.insert(cfg.iterations_to_skip.begin(), cfg.iterations_to_skip.end());
  for (const auto& [it, r] : cfg.error_injection_at)
    if (r >= ctx.world->size())
      throw ConfigError("--error-injection-at " + std::to_string(it) + ":" + std::to_string(r) +
                        ": the job has " + std::to_string(ctx.world->size()) + " rank(s) (0 to " +
                        std::to_string(ctx.world->size() - 1) + ")");
  // Every rank appends to the tracker file: one that cannot is every rank's error now.
  std::string why;
  try {
    tracker_.check_writable();
  } catch (const ConfigError& e) {
    why = e.what();
  }
  if (const std::string m = first_message(*ctx_.world, why); !m.empty()) throw ConfigError(m);
}

void ResultValidator::start(const std::string& rerun_state, int64_t next_iteration) {
  // Rank 0 reads the tracker file; every rank parses the same text (the same decisions).
  std::vector<double> text;
  if (ctx_.world_rank == 0)
    for (unsigned char c : tracker_.read_text()) text.push_back(c);
  broadcast_f64(*ctx_.world, text, 0);
  std::string all;
  for (double c : text) all.push_back(static_cast<char>(static_cast<int>(c)));
  const std::vector<TrackerLine> lines = parse_tracker_text(all);
  for (const TrackerLine& l : lines)
    if (!l.injected.empty()) injected_before_.insert({l.iteration, l.rank});
  const TrackerSkips skips = skipped_iterations(lines);
  auto list = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t i : v) s += (s.empty() ? "" : " ") + std::to_string(i);
    return s;
  };
  if (!skips.skip.empty())
    TLOG(info) << "result validation: skipping iteration(s) " << list(skips.skip)
               << " (reproduced twice on a rank in the tracker file " << tracker_.path() << ")";
  if (!skips.multi_rank.empty())
    TLOG(info) << "result validation: not skipping iteration(s) " << list(skips.multi_rank)
               << " of the tracker file " << tracker_.path()
               << ": they failed on more than one rank in one job";
  skip_.insert(skips.skip.begin(), skips.skip.end());
  TLOG(info) << "result validation: " << cfg_.rerun_mode
             << (mode_ == Mode::Disabled ? std::string()
                 : cfg_.check_nan        ? std::string(" (NaN/Inf checks of each rank's loss") +
                                        (nan_check_grads() ? " and gradient buckets" : "") +
                                        " before their reductions)"
                                  : std::string(" (no NaN/Inf checks)"))
             << (cfg_.check_spiky_loss ? "; spiky loss rejected" : "")
             << (cfg_.check_large_grads ? "; large gradients rejected" : "") << "; tracker file "
             << (tracker_.enabled() ? tracker_.path() : std::string("none"));
  int64_t it = -1;
  std::vector<Failure> failures;
  if (rerun_state.empty()) return;
  if (mode_ != Mode::ValidateResults) {  // the pending diagnosis is dropped: said
    TLOG(warning) << "result validation: the checkpoint holds a pending rerun of iteration "
                  << next_iteration << " on other hardware (saved at exit 16); --rerun-mode "
                  << cfg_.rerun_mode
                  << " does not run it, and the diagnosis is dropped (relaunch with --rerun-mode "
                     "validate_results to finish it)";
    return;
  }
  if (!decode_state(rerun_state, it, failures) || it != next_iteration) {
    TLOG(warning) << "result validation: the checkpoint's pending rerun does not apply to this "
                     "run (another world size or iteration); ignored";
    return;
  }
  const std::string name = "iteration " + std::to_string(it);
  if (skip_.count(it)) {
    TLOG(info) << name << ": the checkpoint asks for a rerun on other hardware, but the "
               << "iteration is skipped; training on";
    return;
  }
  std::string ranks, hosts;
  for (const Failure& f : failures) {
    ranks += (ranks.empty() ? "" : ",") + std::to_string(f.rank);
    hosts += (hosts.empty() ? "" : ",") + f.host;
  }
  const std::string tracked = " (tracker file " + tracker_.path() + ")";
  bool persistent = false, correct = false;
  for (const TrackerLine& l : lines)
    for (const Failure& f : failures)
      if (l.iteration == it && l.rank == f.rank) {
        persistent |= l.status == RerunStatus::SecondRerunNotReproducible;
        correct |= l.status == RerunStatus::SecondRerunReproducible;
      }
  // Collective from here: every rank took the same decisions so far; the hardware is per rank.
  double same_hardware = 0;
  for (const Failure& f : failures)
    if (f.rank == ctx_.world_rank && f.host == host_ && f.device == device_) same_hardware = 1;
  ctx_.world->all_reduce_f64(&same_hardware, 1, ReduceOp::Max);
  if (correct)  // the tracker file has the diagnosis, and does not skip the iteration
    throw RerunExit(kExitFailedOnResultValidation,
                    name + ": other hardware already reproduced the result of rank(s) " + ranks +
                        " (first on host " + hosts + ")" + tracked +
                        "; it is not skipped (several ranks failed in one job), so this launch "
                        "would only repeat it: skip it with --iterations-to-skip " +
                        std::to_string(it) + " or resume from an earlier checkpoint");
  if (persistent && same_hardware > 0)
    throw RerunExit(kExitFailedOnResultValidation,
                    name + ": host " + hosts + " was found faulty (rank(s) " + ranks +
                        "; a persistent error)" + tracked +
                        " and this launch runs there again: exclude it (sbatch --exclude=" + hosts +
                        ")");
  if (persistent) {
    TLOG(info) << name << ": diagnosed as a persistent error of host " << hosts << tracked
               << "; training on without it";
    return;
  }
  if (same_hardware > 0)
    throw RerunExit(kExitResumeToDisambiguate,
                    name + ": rescheduled on the hardware whose result is to be checked (rank(s) " +
                        ranks + " on host " + hosts +
                        "); exit 16 again: resume from the same checkpoint on other nodes "
                        "(sbatch --exclude=" +
                        hosts + ")");
  TLOG(info) << name << ": rerunning it from the checkpoint on other hardware (the first run's "
             << "rank(s) " << ranks << " on host " << hosts << ")";
  state_ = State::FromCheckpoint;
  from_checkpoint_ = failures;
}

StepStats ResultValidator::skip_without_loss(TrainState& state, StepStats st) const {
  if (ctx_.world_rank == 0)  // every rank skips alike (the count is the grid's): one says it
    TLOG(warning) << "iteration " << st.iteration << ": no token of its global batch (samples "
                  << state.consumed_samples << " to "
                  << state.consumed_samples + st.global_batch - 1
                  << ") counts toward the loss (the data's /loss_mask is 0 there, or every target "
                     "is padding); the iteration is skipped: no update, its samples consumed";
  st.skipped = st.not_run = true;
  state.iteration = st.iteration;
  state.consumed_samples += st.global_batch;
  return st;
}

StepStats ResultValidator::skip_step(TrainState& state) const {
  StepStats st;
  st.iteration = state.iteration + 1;
  st.global_batch = cfg_.global_batch_at(ctx_.dp_size, state.consumed_samples);
  st.skipped = st.not_run = true;
  state.iteration = st.iteration;
  state.consumed_samples += st.global_batch;
  TLOG(info) << "iteration " << st.iteration << " skipped (--iterations-to-skip or the tracker "
             << "file): its " << st.global_batch << " samples consumed, no update";
  return st;
}

bool ResultValidator::nan_check_grads() const {
  // fp16: an overflow is expected now and then and skips the update (Megatron's check is off).
  return cfg_.check_nan && cfg_.compute_dtype != DType::F16;
}

bool ResultValidator::checks_gradients() const {
  if (mode_ == Mode::ReportStats) return true;
  return nan_check_grads() || (mode_ == Mode::ValidateResults && cfg_.check_large_grads);
}

bool ResultValidator::injects_now() const {
  if (mode_ != Mode::ValidateResults) return false;
  const int rank = ctx_.world_rank;
  if (injected_before_.count({iteration_, rank})) return false;  // once in the run's lineage
  for (const auto& [it, r] : cfg_.error_injection_at)
    if (it == iteration_ && r == rank) return true;
  if (cfg_.error_injection_rate <= 0) return false;
  // Random but a function of --seed, the iteration and the rank: the same on a rerun and a resume.
  const uint64_t key[3] = {cfg_.seed, static_cast<uint64_t>(iteration_),
                           static_cast<uint64_t>(rank)};
  const uint64_t h = xxh64(key, sizeof key, 0x5e1ec7edULL);
  return h % static_cast<uint64_t>(cfg_.error_injection_rate) == 0;
}

void ResultValidator::begin_attempt(int64_t iteration, int attempt) {
  iteration_ = iteration;
  attempt_ = attempt;
  grad_norm2_ = 0;
  bucket_seen_ = false;
  if (attempt == 0 && state_ != State::FromCheckpoint) {
    state_ = State::Initial;
    rejected_ = rejected_fatal_ = rejected_grads_ = false;
    rejected_injected_.clear();
  }
  injecting_.clear();
  if (state_ == State::Initial && attempt == 0 && injects_now()) {
    injecting_ = cfg_.error_injection_type;
  } else if (state_ == State::InPlace &&
             (rejected_injected_ == "persistent_error" || rejected_injected_ == "correct_result")) {
    injecting_ = rejected_injected_;  // the same hardware reproduces it
  } else if (state_ == State::FromCheckpoint) {
    for (const Failure& f : from_checkpoint_)  // other hardware: only a correct result repeats
      if (f.rank == ctx_.world_rank && f.injected == "correct_result") injecting_ = f.injected;
  }
}

void ResultValidator::check_bucket(const Tensor& grads) {
  be_.collect_sum_squares(grads, !bucket_seen_);
  bucket_seen_ = true;
}

void ResultValidator::check(double local_loss, bool has_loss, double flags[kFlags]) {
  for (int i = 0; i < kFlags; ++i) flags[i] = 0;
  loss_ = local_loss;
  has_loss_ = has_loss;
  grad_norm_ = bucket_seen_ ? std::sqrt(be_.collected_sum_squares()) : 0.0;
  if (!injecting_.empty())  // the injected error: this rank's result is not a number
    (has_loss ? loss_ : grad_norm_) = std::numeric_limits<double>::quiet_NaN();
  if (attempt_ == 0) {
    first_loss_ = loss_;
    first_grad_norm_ = grad_norm_;
  }
  if (mode_ == Mode::ReportStats || state_ != State::Initial || attempt_ != 0) return;
  const bool bad_loss = has_loss && !std::isfinite(loss_);
  const bool bad_grads = nan_check_grads() && !std::isfinite(grad_norm_);
  const bool fatal = !injecting_.empty() || (cfg_.check_nan && bad_loss) || bad_grads;
  const bool validating = mode_ == Mode::ValidateResults;
  const bool spiky_loss =
      validating && cfg_.check_spiky_loss && has_loss && loss_spikes_.spiky(loss_);
  const bool large_grads = validating && cfg_.check_large_grads && grad_spikes_.spiky(grad_norm_);
  if (!fatal && !spiky_loss && !large_grads) return;
  rejected_ = true;
  rejected_fatal_ = fatal;
  rejected_grads_ = fatal ? !bad_loss : !spiky_loss;
  rejected_result_ = rejected_grads_ ? grad_norm_ : loss_;
  rejected_injected_ = injecting_;
  flags[fatal ? 0 : 1] = 1;
  const std::string what = std::string(rejected_grads_ ? "gradient norm " : "loss ") +
                           number(rejected_result_) +
                           (fatal ? " is not finite" : " is more than 10x the largest recent one") +
                           (injecting_.empty() ? "" : " (injected: " + injecting_ + ")");
  TLOG(warning) << "iteration " << iteration_ << ": unexpected result on "
                << where(ctx_.world_rank, host_, device_) << ": " << what;
  write(mode_ == Mode::Disabled ? RerunStatus::RerunDisabled : RerunStatus::InitialRun,
        rejected_result_, injecting_, what);
}

void ResultValidator::write(RerunStatus s, double result, const std::string& injected,
                            const std::string& message) {
  TrackerLine l;
  l.host = host_;
  l.device = device_;
  l.job = job_;
  l.rank = ctx_.world_rank;
  l.iteration = iteration_;
  l.status = s;
  l.result = number(result);
  l.injected = injected;
  l.message = message;
  tracker_.append(l);
}

bool ResultValidator::rerun(const double reduced[kFlags]) {
  if (mode_ == Mode::ReportStats) {
    if (attempt_ == 0) return true;  // every iteration twice
    const double pairs[2][2] = {{first_loss_, loss_}, {first_grad_norm_, grad_norm_}};
    for (int i = has_loss_ ? 0 : 1; i < 2; ++i) {
      if (i == 1 && !checks_gradients()) continue;
      const double c = compare_results(pairs[i][0], pairs[i][1]);
      ++stats_compared_;
      if (c == 0) ++stats_identical_;
      stats_max_ = std::max(stats_max_, c);
    }
    return false;
  }
  if (mode_ == Mode::Disabled) {
    if (reduced[0] <= 0) return false;
    const std::string mine =
        rejected_fatal_
            ? "iteration " + std::to_string(iteration_) + ": " +
                  (rejected_grads_ ? "gradient norm " : "loss ") + number(rejected_result_) +
                  " on " + where(ctx_.world_rank, host_, device_) +
                  "; training stopped (--rerun-mode disabled: nothing is rerun; lower "
                  "--lr, raise --lr-warmup-iters or set --clip-grad)"
            : "";
    throw RerunExit(1, first_message(*ctx_.world, mine));
  }
  if (state_ == State::FromCheckpoint) return decide_from_checkpoint();
  if (state_ == State::InPlace) return decide_in_place();
  if (reduced[0] + reduced[1] <= 0) {  // the common case: nothing rejected
    if (has_loss_) loss_spikes_.accept(loss_);
    grad_spikes_.accept(grad_norm_);
    return false;
  }
  TLOG(info) << "iteration " << iteration_ << ": a result was rejected on "
             << static_cast<int64_t>(reduced[0] + reduced[1])
             << " rank(s); rerunning the iteration in place";
  state_ = State::InPlace;
  return true;
}

std::vector<ResultValidator::Failure> ResultValidator::gather_failures(int code) {
  std::ostringstream mine;
  if (code > 0)
    mine << code << '\t' << host_ << '\t' << device_ << '\t' << number(rejected_result_) << '\t'
         << (rejected_grads_ ? 1 : 0) << '\t' << (rejected_fatal_ ? 1 : 0) << '\t'
         << rejected_injected_;
  const std::vector<std::string> all = all_gather_strings(*ctx_.world, mine.str());
  std::vector<Failure> out;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    std::istringstream in(all[r]);
    std::string c, host, device, result, grads, fatal, injected;
    std::getline(in, c, '\t');
    std::getline(in, host, '\t');
    std::getline(in, device, '\t');
    std::getline(in, result, '\t');
    std::getline(in, grads, '\t');
    std::getline(in, fatal, '\t');
    std::getline(in, injected);
    Failure f;
    f.rank = static_cast<int>(r);
    f.host = host;
    f.device = std::atoi(device.c_str());
    f.result = parse_number(result);
    f.grads = grads == "1";
    f.code = std::atoi(c.c_str());
    f.fatal = fatal == "1";
    f.injected = injected;
    out.push_back(f);
  }
  return out;
}

bool ResultValidator::decide_in_place() {
  state_ = State::Initial;
  // Outcome codes: 1 not fatal, differs; 2 not fatal, reproduced; 3 fatal, differs; 4 fatal,
  // reproduced.
  int code = 0;
  double now = 0;
  if (rejected_) {
    now = rejected_grads_ ? grad_norm_ : loss_;
    const double tolerance = rejected_grads_ ? 1e-3 : 0.0;
    const bool same = compare_results(rejected_result_, now) <= tolerance;
    code = 1 + (rejected_fatal_ ? 2 : 0) + (same ? 1 : 0);
    write(same ? RerunStatus::FirstRerunReproducible : RerunStatus::FirstRerunNotReproducible, now,
          rejected_injected_,
          std::string("rerun in place gave ") + number(now) + " (first run " +
              number(rejected_result_) + ")");
  }
  const std::vector<Failure> all = gather_failures(code);
  std::vector<Failure> reproduced;
  std::string transient;
  for (const Failure& f : all) {
    const int c = f.code;
    if (c == 4) reproduced.push_back(f);
    if (c == 3 && transient.empty()) transient = where(f.rank, f.host, f.device);
  }
  if (!reproduced.empty()) {
    pending_state_ = encode_state(reproduced);
    std::string ranks;
    for (const Failure& f : reproduced)
      ranks += (ranks.empty() ? "" : ", ") + where(f.rank, f.host, f.device);
    pending_message_ = "iteration " + std::to_string(iteration_) +
                       ": the rerun in place reproduced the rejected result of " + ranks +
                       "; exit 16: resume from this checkpoint on other hardware to tell a "
                       "faulty device from a real result";
    if (cfg_.save.empty())  // nothing to resume from: the diagnosis ends here
      throw RerunExit(kExitFailedOnResultValidation,
                      "iteration " + std::to_string(iteration_) +
                          ": the rerun in place reproduced the rejected result of " + ranks +
                          "; there is no --save to checkpoint for a rerun on other hardware, so "
                          "exit 17 (run with --save to get exit 16 and the diagnosis)");
    return false;  // the trainer saves, then exit16()
  }
  if (!transient.empty())
    throw RerunExit(kExitFailedOnResultValidation,
                    "iteration " + std::to_string(iteration_) +
                        ": transient error: the rerun in place did not reproduce the rejected "
                        "result of " +
                        transient +
                        "; exit 17 (nothing saved): resume from the last checkpoint, and "
                        "suspect that host if it happens again" +
                        (tracker_.enabled() ? " (tracker file " + tracker_.path() + ")" : ""));
  for (const Failure& f : all)
    TLOG(info) << "iteration " << iteration_ << ": " << where(f.rank, f.host, f.device)
               << (f.code == 2 ? ": the rejected result is reproducible"
                               : ": the rejected result was not reproduced")
               << " (not fatal); training goes on with the rerun's";
  if (has_loss_) loss_spikes_.accept(loss_);
  grad_spikes_.accept(grad_norm_);
  return false;
}

bool ResultValidator::decide_from_checkpoint() {
  state_ = State::Initial;
  int code = 0;
  for (const Failure& f : from_checkpoint_) {
    if (f.rank != ctx_.world_rank) continue;
    const double now = f.grads ? grad_norm_ : loss_;
    const bool same = compare_results(f.result, now) <= (f.grads ? 1e-3 : 0.0);
    code = same ? 2 : 1;
    rejected_result_ = now;
    rejected_grads_ = f.grads;
    rejected_fatal_ = true;
    rejected_injected_ = f.injected;
    write(same ? RerunStatus::SecondRerunReproducible : RerunStatus::SecondRerunNotReproducible,
          now, f.injected,
          "rerun from the checkpoint on other hardware gave " + number(now) + "; " + f.host +
              " gave " + number(f.result));
  }
  const std::vector<Failure> outcome = gather_failures(code);
  std::string persistent, correct;
  for (const Failure& f : outcome) {
    const Failure* first = nullptr;
    for (const Failure& g : from_checkpoint_)
      if (g.rank == f.rank) first = &g;
    if (!first) continue;
    const std::string who = where(first->rank, first->host, first->device);
    if (f.code == 1)
      persistent += (persistent.empty() ? "" : ", ") + who + " gave " + number(first->result) +
                    ", host " + f.host + " gives " + number(f.result);
    else
      correct += (correct.empty() ? "" : ", ") + who;
  }
  from_checkpoint_.clear();
  const std::string it = "iteration " + std::to_string(iteration_);
  const std::string tracked =
      tracker_.enabled() ? " (tracker file " + tracker_.path() + ")" : std::string();
  if (!persistent.empty())
    throw RerunExit(kExitFailedOnResultValidation,
                    it + ": persistent error: other hardware does not reproduce the result (" +
                        persistent + "): the first host is faulty; exclude it and resume" +
                        tracked);
  throw RerunExit(kExitFailedOnResultValidation,
                  it + ": correct result: other hardware reproduces the rejected result of " +
                      correct + "; it is real (data or settings, not a device)" +
                      (tracker_.enabled()
                           ? "; the next launch skips the iteration" + tracked
                           : "; skip it with --iterations-to-skip " + std::to_string(iteration_)));
}

void ResultValidator::exit16(const std::string& checkpoint) {
  const std::string m = pending_message_ + " (saved " + checkpoint + ")";
  pending_state_.clear();
  throw RerunExit(kExitResumeToDisambiguate, m);
}

void ResultValidator::end_step(int64_t iteration) {
  if (mode_ != Mode::ReportStats) return;
  if (stats_first_ == 0) stats_first_ = iteration;
  if (cfg_.log_interval <= 0 || iteration % cfg_.log_interval != 0) return;
  double sums[2] = {static_cast<double>(stats_compared_), static_cast<double>(stats_identical_)};
  double worst = stats_max_;
  ctx_.world->all_reduce_f64(sums, 2, ReduceOp::Sum);
  ctx_.world->all_reduce_f64(&worst, 1, ReduceOp::Max);
  TLOG(info) << "result validation (report_stats), iterations " << stats_first_ << " to "
             << iteration << ": " << static_cast<int64_t>(sums[0]) << " results rerun, "
             << static_cast<int64_t>(sums[1]) << " identical, largest relative difference "
             << worst;
  stats_first_ = 0;
  stats_compared_ = stats_identical_ = 0;
  stats_max_ = 0;
}

std::string ResultValidator::encode_state(const std::vector<Failure>& failures) const {
  std::ostringstream o;
  o << "rerun iteration=" << iteration_ << " world=" << ctx_.world->size() << "\n";
  for (const Failure& f : failures)
    o << "failed rank=" << f.rank << " host=" << f.host << " device=" << f.device
      << " result=" << number(f.result) << " grads=" << (f.grads ? 1 : 0)
      << " injected=" << (f.injected.empty() ? "-" : f.injected) << "\n";
  return o.str();
}

bool ResultValidator::decode_state(const std::string& text, int64_t& iteration,
                                   std::vector<Failure>& failures) const {
  std::istringstream in(text);
  std::string line;
  int world = -1;
  iteration = -1;
  failures.clear();
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind, kv;
    words >> kind;
    Failure f;
    while (words >> kv) {
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) return false;
      const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
      if (kind == "rerun" && k == "iteration") iteration = std::atoll(v.c_str());
      if (kind == "rerun" && k == "world") world = std::atoi(v.c_str());
      if (k == "rank") f.rank = std::atoi(v.c_str());
      if (k == "host") f.host = v;
      if (k == "device") f.device = std::atoi(v.c_str());
      if (k == "result") f.result = parse_number(v);
      if (k == "grads") f.grads = v == "1";
      if (k == "injected") f.injected = v == "-" ? "" : v;
    }
    if (kind == "failed") failures.push_back(f);
  }
  return iteration > 0 && world == ctx_.world->size() && !failures.empty();
}

}  // namespace tessera
