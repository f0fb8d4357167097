// checkpointer.cpp: saving, committing and loading the training run's checkpoints
// (train/checkpointer.hpp).
#include "train/checkpointer.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "checkpoint/verify.hpp"
#include "core/logging.hpp"
#include "core/nvtx.hpp"
#include "core/test_hooks.hpp"
#include "core/timer.hpp"
#include "run/layout.hpp"
#include "step/muon.hpp"
#include "train/fp8_checkpoint.hpp"
#include "train/router_checkpoint.hpp"

namespace tessera {

// --async-save: the state staged in host buffers (pinned on the GPU), the HDF5 write and its
// read-back verification on a thread of their own; the commit (the atomic rename and the latest
// file, agreed by every rank) on the training thread once every rank's write has finished.
struct TrainingCheckpointer::AsyncSave {
  explicit AsyncSave(Backend& b) : be(b) {}
  ~AsyncSave() {
    if (thread.joinable()) thread.join();
    for (auto& s : staged) be.free_host(s.data);
  }
  // Staging buffer k (parameters, exp_avg, exp_avg_sq) of at least n floats, reused save to save.
  float* stage(int k, size_t n) {
    if (staged[k].size < n) {
      be.free_host(staged[k].data);
      staged[k].data = nullptr;
      staged[k].data = static_cast<float*>(be.alloc_host(n * sizeof(float)));
      staged[k].size = n;
    }
    return staged[k].data;
  }
  Backend& be;
  struct Buffer {
    float* data = nullptr;
    size_t size = 0;
  } staged[3];
  std::vector<float> gathered[3];  // the distributed optimizer's state, gathered on DP rank 0
  std::vector<float> experts[3];   // expert parallelism: the state with every expert
  std::thread thread;              // the writer of this rank's shard (DP rank 0 only)
  std::atomic<bool> done{true};
  std::string error;  // why the write failed (set by the thread before done)
  int64_t iteration = 0;
  std::string dir;
  Timer started;
  double blocked_seconds = 0;
};

TrainingCheckpointer::TrainingCheckpointer(GPTModel& model, Backend& be, const TrainConfig& cfg,
                                           const ParallelContext& ctx, OptimizerSet& optimizers,
                                           IterationTimers& timers,
                                           const std::function<void(int64_t)>& on_progress)
    : model_(model),
      be_(be),
      cfg_(cfg),
      ctx_(ctx),
      optimizers_(optimizers),
      timers_(timers),
      on_progress_(on_progress) {
  if (cfg_.save.empty()) return;
  const std::string why = one_rank_tries(
      *ctx_.world, 0, [&] { prepare_save_dir(cfg_.save); },
      "--save is not usable (reported by rank 0)");
  if (!why.empty()) throw ConfigError(why);
  // --async-save: the staging buffers (pinned host memory on the GPU) are taken now, at start-up,
  // not by the first save, so no save blocks the loop for their allocation (0.43 s of a 2.7 s
  // synchronous save at GPT-2 124M on the H200, docs/performance.md).
  if (cfg_.async_save && ctx_.dp_rank < ctx_.ep_size && ctx_.cp_rank == 0) {
    async_ = std::make_unique<AsyncSave>(be_);
    Tensor* state[3];
    saved_states(state);
    for (int k = 0; k < 3; ++k)
      if (state[k] && state[k]->defined() && be_.device() != Device::CPU)
        async_->stage(k, static_cast<size_t>(state[k]->numel()));
  }
}

TrainingCheckpointer::~TrainingCheckpointer() = default;

void TrainingCheckpointer::after_iteration(const TrainState& state) {
  finish_async(/*blocking=*/false);  // a background save done on every rank commits
  if (!cfg_.save.empty() && cfg_.save_interval > 0 && state.iteration % cfg_.save_interval == 0)
    save(cfg_.save, state);
}

void TrainingCheckpointer::save_at_stop(const TrainState& state) {
  if (!cfg_.save.empty() && last_saved_ != state.iteration) save(cfg_.save, state);
  finish_async(/*blocking=*/true);  // a stop waits for the write to finish
}

std::string TrainingCheckpointer::save_for_rerun(TrainState state, const std::string& rerun_state) {
  state.rerun_state = rerun_state;
  save(cfg_.save, state);  // the same iteration saved before is replaced
  finish_async(/*blocking=*/true);
  return cfg_.save + "/" + iteration_dir_name(state.iteration);
}

void TrainingCheckpointer::wait() {
  finish_async(/*blocking=*/true);
}

CheckpointMeta TrainingCheckpointer::make_meta(const TrainState& state) const {
  CheckpointMeta meta;
  meta.iteration = state.iteration;
  meta.consumed_samples = state.consumed_samples;
  meta.optimizer_steps = optimizers_.steps_taken();
  meta.lr_schedule_samples = cfg_.lr_schedule_in_samples ? optimizers_.lr_samples() : -1;
  meta.seed = cfg_.seed;
  meta.model = model_.config();
  meta.tp_size = ctx_.tp_size;
  meta.pp_size = ctx_.pp_size;
  meta.pipeline_layout = saved_pipeline_layout(model_.config(), cfg_, ctx_.pp_size);
  meta.dp_size = ctx_.dp_size;
  meta.has_optimizer = !cfg_.no_save_optim;
  meta.config_text = cfg_.config_text;
  meta.tokenizer = cfg_.data_tokenizer;
  meta.rerun_state = state.rerun_state;
  const LossScaler& scaler = optimizers_.scaler();
  if (scaler.is_dynamic()) {
    meta.has_loss_scale = true;
    meta.skipped_iterations = optimizers_.skipped_iterations();
    meta.loss_scale = scaler.scale();
    meta.loss_scale_growth_tracker = scaler.growth_tracker();
    meta.loss_scale_hysteresis_tracker = scaler.hysteresis_tracker();
  }
  return meta;
}

void TrainingCheckpointer::save(const std::string& dir, const TrainState& state) {
  NVTX_RANGE("checkpoint-save");
  {
    IterationTimers::Scope timed(timers_, IterationTimers::SaveCheckpoint);
    finish_async(/*blocking=*/true);  // the next save waits for the previous one
    Timer t;
    const int64_t iteration = state.iteration;
    const CheckpointMeta meta = make_meta(state);
    // Directory set-up by rank 0; a failure there is everyone's failure.
    const std::string set_up = one_rank_tries(
        *ctx_.world, 0, [&] { begin_checkpoint_dir(dir, iteration); },
        "checkpoint directory set-up failed on rank 0");
    if (!set_up.empty()) throw Error(set_up);
    const bool async = cfg_.async_save;
    if (async && !async_) async_ = std::make_unique<AsyncSave>(be_);
    const std::string path = dir + "/" + iteration_dir_name(iteration) + ".tmp/" +
                             shard_file_name(ctx_.tp_rank, ctx_.pp_rank);
    const std::string error = write_shard(path, meta, async);
    double failed = error.empty() ? 0 : 1;
    if (async) {
      // Staging failed somewhere (host memory): reported now, as a synchronous save would.
      ctx_.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
      if (failed) {
        if (async_->thread.joinable()) async_->thread.join();
        commit(dir, iteration, failed, error);  // abandons the directory and throws
      }
      async_pending_ = true;
      async_->iteration = iteration;
      async_->dir = dir;
      async_->blocked_seconds = t.seconds();
      async_->started.reset();
      last_saved_ = iteration;
      if (on_progress_) on_progress_(iteration);
      TLOG(info) << "checkpoint of iteration " << iteration << ": state staged in "
                 << async_->blocked_seconds << " s; writing " << dir << "/"
                 << iteration_dir_name(iteration) << " in the background (--async-save)";
    } else {
      commit(dir, iteration, failed, error);
      last_saved_ = iteration;
      if (on_progress_) on_progress_(iteration);
      TLOG(info) << "saved checkpoint " << dir << "/" << iteration_dir_name(iteration) << " in "
                 << t.seconds() << " s";
    }
  }
  // Megatron's save-checkpoint timer (every timing level), min and max over the ranks. Collected
  // outside the log statement: a filtered-out record (ranks that do not print) evaluates nothing.
  const std::vector<IterationTimers::Row> rows =
      timers_.collect(*ctx_.world, {IterationTimers::SaveCheckpoint}, 1);
  TLOG(info) << timers_.format(rows);
}

std::string TrainingCheckpointer::write_shard(const std::string& path, const CheckpointMeta& meta,
                                              bool async) {
  // The distributed optimizer's state is gathered (collective over DP) into the global layout on
  // data-parallel rank 0, which writes the same file as without it.
  std::vector<float> local_gathered[3];
  std::vector<float>* gathered = async ? async_->gathered : local_gathered;
  if (DistributedAdamW* dist = optimizers_.distributed()) {
    optimizers_.sync_params();
    // (With expert parallelism every EP rank of the first expert-data-parallel replica: each
    // holds its experts' blocks in full.)
    const bool want = ctx_.dp_rank < ctx_.ep_size && ctx_.cp_rank == 0;
    if (dist->owns_master()) gathered[0] = dist->gather_state("master", want);
    if (!cfg_.no_save_optim) {
      gathered[1] = dist->gather_state("exp_avg", want);
      gathered[2] = dist->gather_state("exp_avg_sq", want);
    }
  }
  // DP replicas hold the same state: data-parallel rank 0 of each (tp, pp) writes its file. With
  // expert parallelism the file holds every expert all the same (checkpoints do not depend on
  // EP): the other EP ranks of the first replica send it theirs. CP ranks hold the same state.
  if (!(ctx_.dp_rank < ctx_.ep_size && ctx_.cp_rank == 0)) return std::string();
  try {
    // Testing (core/test_hooks.hpp): this rank's write fails after a few datasets.
    const int fail_after = test_hooks::save_fault_after(ctx_.world_rank, meta.iteration);
    // The writer reads host memory: device state is staged through host buffers first; an
    // asynchronous save stages everything (the next step changes the state in place).
    const float* host[3];
    std::vector<float> staged[3];
    stage_states(async, gathered, staged, host);
    ShardTensors tensors;
    tensors.specs = &model_.params().specs();
    tensors.params = host[0], tensors.exp_avg = host[1], tensors.exp_avg_sq = host[2];
    std::vector<float> local_full[3];
    if (ctx_.ep_size > 1) {
      std::vector<float>* full = async ? async_->experts : local_full;
      gather_experts(host, ep_specs_, full);
      if (ctx_.dp_rank != 0) throw SkipWrite{};
      tensors.specs = &ep_specs_;
      tensors.params = host[0] ? full[0].data() : nullptr;
      tensors.exp_avg = host[1] ? full[1].data() : nullptr;
      tensors.exp_avg_sq = host[2] ? full[2].data() : nullptr;
    }
    tensors.extra = fp8_checkpoint_tensors(model_, be_);      // FP8's delayed scaling, staged
    for (ExtraTensor& e : router_checkpoint_tensors(model_))  // the MoE routers' expert biases
      tensors.extra.push_back(std::move(e));
    if (!async) {
      write_checkpoint_shard(path, meta, model_.shard(), tensors, fail_after);
      return std::string();
    }
    AsyncSave* a = async_.get();
    a->error.clear();
    a->done.store(false, std::memory_order_release);
    a->thread = std::thread([a, path, meta, shard = model_.shard(), tensors, fail_after] {
      try {
        write_checkpoint_shard(path, meta, shard, tensors, fail_after);
      } catch (const std::exception& e) {
        a->error = e.what();
      }
      a->done.store(true, std::memory_order_release);
    });
  } catch (const SkipWrite&) {  // an EP rank that sent its experts to DP rank 0
  } catch (const std::exception& e) {
    TLOG(error) << "checkpoint save failed here: " << e.what();
    return *e.what() ? e.what() : "the checkpoint write failed";
  }
  return std::string();
}

void TrainingCheckpointer::saved_states(Tensor* state[3]) {
  ParamStore& ps = model_.params();
  state[0] = state[1] = state[2] = nullptr;
  if (ps.has_master()) state[0] = &ps.flat_params();
  AdamW* adam = optimizers_.replicated();
  if (adam && !cfg_.no_save_optim) {  // --no-save-optim: no moments to stage
    state[1] = &adam->exp_avg();
    state[2] = &adam->exp_avg_sq();
  }
}

void TrainingCheckpointer::stage_states(bool async, std::vector<float> gathered[3],
                                        std::vector<float> staged[3], const float* host[3]) {
  Tensor* state[3];
  saved_states(state);
  for (int k = 0; k < 3; ++k) {
    if (!state[k]) {
      host[k] = gathered[k].data();
    } else if (async) {
      const size_t n = static_cast<size_t>(state[k]->numel());
      float* buf = async_->stage(k, n);
      if (be_.device() == Device::CPU)
        std::memcpy(buf, state[k]->f32(), n * sizeof(float));
      else
        be_.copy_to_host(buf, *state[k]);
      host[k] = buf;
    } else if (be_.device() == Device::CPU) {
      host[k] = state[k]->f32();
    } else {
      staged[k].resize(static_cast<size_t>(state[k]->numel()));
      be_.copy_to_host(staged[k].data(), *state[k]);
      host[k] = staged[k].data();
    }
  }
}

void TrainingCheckpointer::gather_experts(const float* const local[3],
                                          std::vector<ParamSpec>& specs,
                                          std::vector<float> full[3]) {
  // The specs of this (tp, pp) shard with every expert (expert-parallel size 1), in a plain flat
  // layout; the non-expert values are this rank's, each expert's comes from its EP rank (a sum
  // with zeros: exact).
  ModelShard one = model_.shard();
  one.ep_size = 1;
  one.ep_rank = 0;
  specs = build_param_specs(model_.config(), one);
  layout_flat_buffer(specs, FlatLayout{});
  int64_t total = 0;
  for (const ParamSpec& s : specs) total = std::max(total, s.flat_offset + s.numel());
  for (int k = 0; k < 3; ++k)
    if (local[k]) full[k].assign(static_cast<size_t>(total), 0.f);
  const ParamStore& ps = model_.params();
  const int El = model_.config().num_experts / ctx_.ep_size;
  std::vector<double> buf;
  for (const ParamSpec& s : specs) {
    const bool mine = ps.has(s.name);
    if (!s.expert) {
      TESSERA_CHECK(mine, "parameter ", s.name, " missing on an expert-parallel rank");
      for (int k = 0; k < 3; ++k)
        if (local[k])
          std::copy(local[k] + ps.spec(s.name).flat_offset,
                    local[k] + ps.spec(s.name).flat_offset + s.numel(),
                    full[k].begin() + s.flat_offset);
      continue;
    }
    const size_t at = s.name.find(".experts.") + 9;
    const int owner = std::stoi(s.name.substr(at)) / El;
    buf.assign(static_cast<size_t>(3 * s.numel()), 0.0);
    if (owner == ctx_.ep_rank) {
      TESSERA_CHECK(mine, "expert parameter ", s.name, " missing on its expert-parallel rank");
      for (int k = 0; k < 3; ++k)
        if (local[k]) {
          const float* src = local[k] + ps.spec(s.name).flat_offset;
          for (int64_t i = 0; i < s.numel(); ++i)
            buf[static_cast<size_t>(k * s.numel() + i)] = src[i];
        }
    }
    ctx_.ep->all_reduce_f64(buf.data(), static_cast<int64_t>(buf.size()), ReduceOp::Sum);
    for (int k = 0; k < 3; ++k)
      if (local[k])
        for (int64_t i = 0; i < s.numel(); ++i)
          full[k][static_cast<size_t>(s.flat_offset + i)] =
              static_cast<float>(buf[static_cast<size_t>(k * s.numel() + i)]);
  }
}

void TrainingCheckpointer::commit(const std::string& dir, int64_t iteration, double failed,
                                  const std::string& error) {
  ctx_.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
  std::string why = error;
  if (ctx_.world_rank == 0) {
    try {
      if (failed)
        abandon_checkpoint_dir(dir, iteration);
      else
        commit_checkpoint_dir(dir, iteration, cfg_.keep_checkpoints);
    } catch (const std::exception& e) {
      failed = 2;
      why = e.what();
    }
  }
  ctx_.world->all_reduce_f64(&failed, 1, ReduceOp::Max);
  if (failed)
    throw Error(detail::concat("saving the checkpoint of iteration ", iteration, " to '", dir,
                               "' failed", why.empty() ? " on another rank" : ": " + why,
                               "; the previous checkpoint is intact"));
}

void TrainingCheckpointer::finish_async(bool blocking) {
  if (!async_pending_) return;
  AsyncSave& a = *async_;
  if (!blocking) {  // every rank asks at the same point; all go on until every write is done
    double busy = a.thread.joinable() && !a.done.load(std::memory_order_acquire) ? 1 : 0;
    ctx_.world->all_reduce_f64(&busy, 1, ReduceOp::Sum);
    if (busy > 0) return;
  }
  Timer waited;
  if (a.thread.joinable()) a.thread.join();
  async_pending_ = false;
  for (auto& g : a.gathered) std::vector<float>().swap(g);  // the next save gathers afresh
  const double failed = a.error.empty() ? 0 : 1;
  if (failed) TLOG(error) << "checkpoint save failed here: " << a.error;
  commit(a.dir, a.iteration, failed, a.error);
  TLOG(info) << "saved checkpoint " << a.dir << "/" << iteration_dir_name(a.iteration) << " in "
             << a.started.seconds() << " s in the background (--async-save; the loop was blocked "
             << a.blocked_seconds << " s staging the state"
             << (blocking ? detail::concat(" and ", waited.seconds(), " s waiting for the write")
                          : std::string())
             << ")";
}

// ---- loading ----------------------------------------------------------------------------------

TrainState TrainingCheckpointer::load_checked(const std::string& dir, bool model_only,
                                              bool load_optimizer, bool fallback,
                                              const RerunTracker& tracker) {
  std::string damage, error;
  TrainState state;
  try {
    state = load(dir, model_only, load_optimizer);
  } catch (const CheckpointDamaged& e) {
    damage = e.what();
  } catch (const AgreedConfigError&) {
    throw;  // the run's options against the checkpoint: every rank has it
  } catch (const ConfigError& e) {
    error = e.what();  // a file that cannot be read, or the run's own error: decided below
  }
  // A checkpoint that cannot be read whole is damaged too, as verify finds it (rank 0 reads it
  // whole, once, for every rank); another error is the user's to fix, not to fall back.
  if (!(error = first_message(*ctx_.world, error)).empty()) {
    std::vector<double> damaged{ctx_.world_rank == 0 && checkpoint_damaged(dir) ? 1.0 : 0.0};
    broadcast_f64(*ctx_.world, damaged, 0);
    if (damaged[0] == 0) throw AgreedConfigError(error);
    damage = error;
  }
  damage = first_message(*ctx_.world, damage);  // a damaged file some ranks read: every rank's
  if (damage.empty()) return state;
  // Rank 0 reads the older checkpoints of the directory whole, newest first, until one verifies.
  std::vector<double> found{-1.0};
  std::vector<int64_t> present;                         // rank 0's listing, for the messages
  const int64_t named = parse_iteration_dir_name(dir);  // --load iter_N: its --save directory
  std::string save_dir = dir;
  if (named >= 0) save_dir = std::filesystem::path(dir).lexically_normal().parent_path().string();
  if (save_dir.empty()) save_dir = ".";
  if (ctx_.world_rank == 0) {
    int64_t bad = named;  // the damaged iteration: older ones are candidates
    if (bad < 0) {
      try {
        bad = parse_iteration_dir_name(resolve_checkpoint_dir(dir));
      } catch (const ConfigError&) {  // `latest` names a missing iteration: that one
        std::ifstream in(dir + "/latest_checkpointed_iteration.txt");
        if (!(in >> bad)) bad = -1;
      }
    }
    std::vector<int64_t> its = checkpoint_iterations(save_dir);
    std::sort(its.begin(), its.end());
    present = its;
    std::reverse(its.begin(), its.end());
    for (int64_t it : its) {
      if (bad >= 0 && it >= bad) continue;
      try {
        if (verify_checkpoint(save_dir, it).clean()) {
          found[0] = static_cast<double>(it);
          break;
        }
      } catch (const ConfigError&) {
      }
    }
  }
  broadcast_f64(*ctx_.world, found, 0);
  const int64_t it = static_cast<int64_t>(found[0]);
  // The iterations present, from rank 0 (which lists the directory), for the messages.
  std::vector<double> listed(present.begin(), present.end());
  broadcast_f64(*ctx_.world, listed, 0);
  present.assign(listed.begin(), listed.end());
  if (it < 0)
    throw AgreedConfigError(
        damage + "; no older checkpoint in '" + save_dir +
        "' verifies (iterations present: " + checkpoint_iterations_text(present) + ")");
  const std::string older = save_dir + "/" + iteration_dir_name(it);
  if (!fallback)
    throw AgreedConfigError(damage + "; the newest checkpoint that verifies is iteration " +
                            std::to_string(it) + " (" + older +
                            "; iterations present: " + checkpoint_iterations_text(present) +
                            "): resume from it with --load-fallback");
  if (ctx_.world_rank == 0) {
    TLOG(warning) << damage << "; --load-fallback: loading iteration " << it << " instead ("
                  << older << ", verified whole)";
    TrackerLine l;
    l.host = "-";
    l.iteration = it;
    l.status = RerunStatus::LoadFallback;
    l.result = "-";
    l.message = "--load-fallback: " + damage + "; loaded iteration " + std::to_string(it);
    tracker.append(l);
  }
  return load(older, model_only, load_optimizer);
}

TrainState TrainingCheckpointer::load(const std::string& dir, bool model_only,
                                      bool load_optimizer) {
  finish_async(/*blocking=*/true);
  Timer t;
  CheckpointReader r(dir);
  try {  // the same checkpoint and options on every rank: the same answer
    r.check_model(model_.config());
  } catch (const ConfigError& e) {
    throw AgreedConfigError(e.what());
  }
  const CheckpointMeta& m = r.meta();
  const bool optimizer = m.has_optimizer && !model_only && load_optimizer;
  const std::string other = optimizer_state_mismatch(m.config_text, cfg_.optimizer, r.path());
  if (optimizer && !other.empty()) TLOG(warning) << other;  // AdamW's moments vs Muon's momentum
  load_optimizer_state(r, optimizer && other.empty());
  // The routers' expert biases are model state: loaded with the weights (or a line says why not).
  if (const std::string why = restore_router_state(r, model_); !why.empty()) TLOG(info) << why;
  if (!model_only)  // FP8's delayed scaling continues where it was (or a line says why not)
    if (const std::string why = restore_fp8_state(r, model_, be_); !why.empty())
      TLOG(warning) << why;
  // The sample-based schedule's position: stored by a ramped run; otherwise every consumed
  // sample was an update's (a constant batch without skipped steps).
  const int64_t lr_samples = !optimizer                   ? 0
                             : m.lr_schedule_samples >= 0 ? m.lr_schedule_samples
                                                          : m.consumed_samples;
  const bool scale = optimizer && m.has_loss_scale && optimizers_.scaler().is_dynamic();
  if (scale)
    optimizers_.scaler().restore(m.loss_scale, m.loss_scale_growth_tracker,
                                 m.loss_scale_hysteresis_tracker);
  optimizers_.restore_position(lr_samples,
                               scale ? m.skipped_iterations : optimizers_.skipped_iterations());
  optimizers_.set_steps_taken(optimizer ? m.optimizer_steps : 0);
  TrainState state;
  if (!model_only) {
    state.iteration = m.iteration;
    state.consumed_samples = m.consumed_samples;
    state.rerun_state = m.rerun_state;
  }
  last_saved_ = state.iteration;
  log_loaded(r, model_only, load_optimizer, t.seconds(), state.iteration);
  return state;
}

void TrainingCheckpointer::load_optimizer_state(CheckpointReader& r, bool optimizer) {
  ParamStore& ps = model_.params();
  std::vector<float> host;  // each slice is read on the host, then copied to the backend
  auto load = [&](const char* group, const ParamSpec& s, Tensor dst) {
    host.resize(static_cast<size_t>(s.numel()));
    r.read_slice(group, s, host.data());
    be_.copy_from_host(dst, host.data());
  };
  if (DistributedAdamW* dist = optimizers_.distributed()) {
    // Each rank keeps the parts of the global tensors in its blocks.
    optimizers_.sync_params();
    if (!optimizer) dist->zero_moments();
    for (const ParamSpec& s : ps.specs()) {
      host.resize(static_cast<size_t>(s.numel()));
      r.read_slice("model", s, host.data());
      if (dist->owns_master()) {
        dist->set_state("master", s, host.data());
      } else {
        Tensor p = ps.param(s);
        be_.copy_from_host(p, host.data());
      }
      if (optimizer)
        for (const char* which : {"exp_avg", "exp_avg_sq"}) {
          r.read_slice((std::string("optimizer/") + which).c_str(), s, host.data());
          dist->set_state(which, s, host.data());
        }
    }
    dist->publish();
    return;
  }
  AdamW& adam = *optimizers_.replicated();
  for (const ParamSpec& s : ps.specs()) {
    load("model", s, ps.param(s));
    if (optimizer) {
      load("optimizer/exp_avg", s, adam.exp_avg().view(s.flat_offset, s.local_shape));
      load("optimizer/exp_avg_sq", s, adam.exp_avg_sq().view(s.flat_offset, s.local_shape));
    }
  }
  model_.sync_compute_weights();
  if (!optimizer) {
    be_.zero(adam.exp_avg());
    be_.zero(adam.exp_avg_sq());
  }
}

void TrainingCheckpointer::log_loaded(const CheckpointReader& r, bool model_only,
                                      bool load_optimizer, double seconds,
                                      int64_t iteration) const {
  const CheckpointMeta& m = r.meta();
  const bool same = m.tp_size == ctx_.tp_size && m.pp_size == ctx_.pp_size;
  TLOG(info) << "loaded checkpoint " << r.path() << " (iteration " << m.iteration
             << ", consumed samples " << m.consumed_samples << ", saved at TP " << m.tp_size
             << " x PP " << m.pp_size << " x DP " << m.dp_size
             << (same ? ""
                      : "; resharded on load to TP " + std::to_string(ctx_.tp_size) + " x PP " +
                            std::to_string(ctx_.pp_size))
             << (m.has_optimizer ? "" : "; no optimizer state in it: Adam starts from zero")
             << (model_only ? "; model only: iteration, data and optimizer start fresh" : "")
             << (!model_only && !load_optimizer
                     ? "; --no-load-optim: the optimizer and its step count start fresh"
                     : "")
             << ") in " << seconds << " s; the checksums of what it read verified in "
             << r.hash_seconds() << " s ("
             << (seconds > 0 ? static_cast<int>(100 * r.hash_seconds() / seconds + 0.5) : 0)
             << " % of the load)";
  if (!model_only && load_optimizer) {  // the schedule continues: say where it changes course
    const bool length_matters = (cfg_.lr_decay_iters == 0 && cfg_.lr_decay_style != "constant") ||
                                optimizers_.weight_decay_scheduled();
    const std::string changed = schedule_changes(m.config_text, cfg_.config_text, length_matters);
    if (!changed.empty() && ctx_.world_rank == 0)  // the same on every rank: said once
      TLOG(warning) << "the learning-rate / weight-decay schedule differs from checkpoint "
                    << r.path() << "'s (" << changed << "); this run's options are used from "
                    << "iteration " << iteration + 1
                    << " (as Megatron-LM's --override-opt_param-scheduler)";
  }
  if (!m.has_optimizer && !model_only && load_optimizer && ctx_.world_rank == 0)
    TLOG(warning) << "checkpoint " << r.path()
                  << " holds no optimizer state; Adam moments start at zero";
}

}  // namespace tessera
