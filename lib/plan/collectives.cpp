// collectives.cpp: one rank's training step recorded on the shape backend (plan/collectives.hpp).
#include "plan/collectives.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>

#include "backend/shape_backend.hpp"
#include "data/dataset.hpp"
#include "model/gpt.hpp"
#include "model/layer_spec.hpp"
#include "model/pass_observer.hpp"
#include "step/optimizer_set.hpp"
#include "step/step_executor.hpp"
#include "step/timers.hpp"
#include "step/training_step.hpp"

namespace tessera {

namespace {

// Marks the recorder with the piece whose pass runs: its forward (each micro-batch's turn
// counted), its backward (recomputation included: a forward inside a backward is the backward's)
// up to its grads_ready observers (registered after this one: the TP sums, the buckets).
class PieceMarks final : public PassObserver {
 public:
  PieceMarks(CallRecorder& rec, std::function<bool()> last) : rec_(rec), last_(std::move(last)) {}
  void before_forward(int piece) override {
    if (!in_backward_) rec_.mark = {piece, CallPass::Forward, forwards_[piece]++, false};
  }
  void after_forward(int) override {
    if (!in_backward_) rec_.mark = CallMark{};
  }
  void before_backward(int piece) override {
    in_backward_ = true;
    rec_.mark = {piece, CallPass::Backward, backwards_[piece]++, last_()};
  }
  void after_backward(int) override {
    in_backward_ = false;
    rec_.mark = CallMark{};
  }

 private:
  CallRecorder& rec_;
  std::function<bool()> last_;
  bool in_backward_ = false;
  std::map<int, int> forwards_, backwards_;
};

// What decides a layer's calls beyond the run's options: its parts and whether its GEMMs run in
// FP8.
std::string layer_kind(const GPTConfig& cfg, const Fp8Config& fp8, const LayerSpec& s, int l) {
  return std::to_string(int(s.attention)) + "/" + std::to_string(int(s.qk_norm)) + "/" +
         std::to_string(int(s.mlp)) + "/" + std::to_string(int(s.activation)) + "/" +
         std::to_string(s.dense_width) + "/" +
         std::to_string(fp8.enabled && fp8.layer_in_fp8(l, cfg.num_layers));
}

// PieceCalls' recording: one stage of the fewest consecutive layers holding every kind, the
// data-parallel size the expert-parallel one, full recomputation layer by layer.
struct PieceRecording {
  TrainConfig t;
  GridLayout layout;
  LayerRange layers;
  std::vector<int> recorded;  // per layer of the model (MTP's included): the recorded one
};

PieceRecording piece_recording(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                               int ep) {
  PieceRecording r;
  r.t = t;
  r.t.virtual_pipeline_size = 1;
  r.t.pipeline_split = {};  // one stage: its layers are the window below
  r.t.dist_opt_instances = 1;
  r.t.outer_dp_shards_optim = false;
  if (r.t.recompute.full()) {
    r.t.recompute.method = RecomputeMethod::Uniform;
    r.t.recompute.num_layers = 1;
  }
  r.layout = GridLayout::make(layout.tp * layout.cp * std::max(1, ep), layout.tp, 1, layout.cp);
  const std::vector<LayerSpec> specs = build_layer_specs(cfg);
  const int L = cfg.num_layers;
  std::vector<std::string> kinds;
  for (int l = 0; l < L; ++l) kinds.push_back(layer_kind(cfg, t.fp8, specs[size_t(l)], l));
  std::vector<std::string> distinct = kinds;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  // The shortest window [a, b) holding every kind (two pointers over the layers).
  std::map<std::string, int> in_window;
  int best_a = 0, best_b = L;
  for (int a = 0, b = 0; a < L; ++a) {
    while (b < L && in_window.size() < distinct.size()) ++in_window[kinds[size_t(b++)]];
    if (in_window.size() < distinct.size()) break;
    if (b - a < best_b - best_a) best_a = a, best_b = b;
    if (--in_window[kinds[size_t(a)]] == 0) in_window.erase(kinds[size_t(a)]);
  }
  r.layers = {best_a, best_b};
  r.recorded.resize(specs.size());
  for (int l = 0; l < int(specs.size()); ++l) {
    r.recorded[size_t(l)] = l;  // multi-token prediction's layers: recorded as they are
    if (l < L)
      for (int k = best_a; k < best_b; ++k)
        if (kinds[size_t(k)] == kinds[size_t(l)]) {
          r.recorded[size_t(l)] = k;
          break;
        }
  }
  return r;
}

}  // namespace

int CollectivePlan::piece_micro_batches(const TrainConfig& t, const GridLayout& layout) {
  // Interleaved 1F1B takes a multiple of the pipeline's size.
  return t.virtual_pipeline_size > 1 ? layout.pp * ((2 + layout.pp - 1) / layout.pp) : 2;
}

CollectivePlan::CollectivePlan(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout,
                               int ep, int world_rank, bool device, int micro_batches,
                               const LayerRange* layers) {
  CallRecorder rec;
  RecordingGridSpec spec;
  spec.layout = layout;
  spec.ep = std::max(1, ep);
  spec.instances = std::max(1, t.dist_opt_instances);
  spec.pipeline_ring = t.virtual_pipeline_size > 1;  // as tessera-train sets its grid up
  spec.device = device;
  const RecordingGrid grid(spec, world_rank, rec);
  const ParallelContext& ctx = grid.context();
  // One step of the full global batch (a ramp's later one), resolved as the trainer resolves it.
  TrainConfig run = t;
  if (!run.rampup_batch_size.empty()) {
    run.global_batch_size = run.global_batch(layout.dp);
    run.rampup_batch_size.clear();
  }
  if (micro_batches > 0) run.global_batch_size = run.micro_batch_size * layout.dp * micro_batches;
  if (run.train_iters <= 0 && run.train_samples <= 0) run.train_iters = 1;
  run = run.resolved(layout.dp);

  // The trainer's components (train/trainer.cpp builds them the same way), on no arithmetic.
  const std::unique_ptr<Backend> be = make_shape_backend(device ? Device::CUDA : Device::CPU);
  const std::unique_ptr<GPTModel> model = make_training_model(cfg, run, *be, ctx, layers);
  shard_ = model->shard();
  const std::unique_ptr<TokenDataset> data =
      make_mock_dataset(model->config().vocab_size, cfg.seq_length, run.seed);
  IterationTimers timers;
  std::unique_ptr<StepExecutor> executor;
  PieceMarks marks(rec, [&] { return executor && executor->in_last_backward(); });
  model->add_observer(&marks);  // first: its marks bracket the other observers' calls
  struct Unobserve {
    GPTModel& m;
    PassObserver* o;
    ~Unobserve() { m.remove_observer(o); }
  } unobserve{*model, &marks};
  OptimizerSet optimizers(*model, *be, run, ctx, timers);
  executor = std::make_unique<StepExecutor>(*model, *be, run, ctx, *data, timers);
  optimizers.observe_backward([&] { return executor->in_last_backward(); });
  // The batch stays unread (its tokens do not change a call): the buffers only need their shapes.
  executor->shape(run.global_batch(layout.dp));

  // Iteration 1 as Trainer::train_step runs it (host reductions record nothing).
  StepStats st;
  st.iteration = 1;
  st.global_batch = executor->global_batch();
  st.loss_tokens = static_cast<int64_t>(executor->count_loss_tokens());
  st.loss_scale = optimizers.loss_scale();
  TrainingStep step{*model, *executor, optimizers, ctx, timers};
  const float moe_loss_scale = float(st.loss_scale * run.micro_batch_size / st.global_batch);
  const Timer clock;
  rec.on = true;
  step.attempt(st, false, executor->first_sample(0), moe_loss_scale, clock);
  step.end_hooks();
  optimizers.step(st.iteration, 0.0, st.global_batch);
  rec.on = false;
  calls_ = std::move(rec.calls);
}

CallList CollectivePlan::piece_forward(int piece) const {
  CallList out;
  for (const CollectiveCall& c : calls_)
    if (c.mark.piece == piece && c.mark.pass == CallPass::Forward && c.mark.turn == 0)
      out.push_back(c);
  return out;
}

CallList CollectivePlan::piece_backward(int piece, bool last_micro) const {
  // The first backward of the piece that is (not) the step's last; a step of one micro-batch
  // has only the last.
  int turn = -1;
  for (const CollectiveCall& c : calls_)
    if (c.mark.piece == piece && c.mark.pass == CallPass::Backward && c.mark.last == last_micro) {
      turn = c.mark.turn;
      break;
    }
  CallList out;
  for (const CollectiveCall& c : calls_)
    if (c.mark.piece == piece && c.mark.pass == CallPass::Backward && c.mark.turn == turn)
      out.push_back(c);
  return out;
}

}  // namespace tessera

namespace tessera {

PieceCalls::PieceCalls(const GPTConfig& cfg, const TrainConfig& t, const GridLayout& layout, int ep)
    : plan_([&] {
        const PieceRecording r = piece_recording(cfg, t, layout, ep);
        recorded_ = r.recorded;
        layers_ = r.layers;
        return CollectivePlan(cfg, r.t, r.layout, ep, 0, false,
                              CollectivePlan::piece_micro_batches(r.t, r.layout), &layers_);
      }()) {}

std::string PieceCalls::key(const TrainConfig& t, const GridLayout& layout, int ep) {
  const RecomputeConfig& rc = t.recompute;
  std::string k;
  // Full recomputation is recorded layer by layer whatever its method; the buckets, the
  // distributed optimizer and FSDP's gathers are data-parallel calls the pieces' readers skip,
  // while FSDP's sharded gradients move the TP sums into every micro-batch.
  for (const int64_t v : {int64_t(layout.tp), int64_t(layout.cp), int64_t(std::max(1, ep)),
                          int64_t(t.sequence_parallel), int64_t(t.micro_batch_size),
                          int64_t(t.compute_dtype), int64_t(rc.granularity), int64_t(t.fp8.enabled),
                          int64_t(t.fp8.recipe), int64_t(t.fsdp_shards_grads())})
    k += std::to_string(v) + ",";
  return k;
}

int PieceCalls::of(int layer) const {
  return layer >= 0 && layer < int(recorded_.size()) ? recorded_[size_t(layer)] : layer;
}

const PieceCalls& PieceCallsCache::get(const GPTConfig& cfg, const TrainConfig& t,
                                       const GridLayout& layout, int ep) {
  std::unique_ptr<PieceCalls>& slot = calls_[PieceCalls::key(t, layout, ep)];
  if (!slot) slot = std::make_unique<PieceCalls>(cfg, t, layout, ep);
  return *slot;
}

}  // namespace tessera
