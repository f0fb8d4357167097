// step_executor.cpp: the pipeline schedule of one step on this rank (step/step_executor.hpp).
#include "step/step_executor.hpp"

#include <cstring>

#include "comm/collective_names.hpp"
#include "core/logging.hpp"
#include "core/nvtx.hpp"
#include "core/phase_timer.hpp"
#include "core/timer.hpp"
#include "model/mtp.hpp"
#include "run/context_parallel.hpp"
#include "run/layout.hpp"
#include "run/memory_estimate.hpp"

namespace tessera {

namespace {
constexpr int kTagForward = 1, kTagBackward = 2;
}

StepExecutor::StepExecutor(GPTModel& model, Backend& be, const TrainConfig& cfg,
                           const ParallelContext& ctx, const TokenDataset& data,
                           IterationTimers& timers)
    : model_(model), be_(be), cfg_(cfg), ctx_(ctx), data_(data), timers_(timers) {
  const int V = cfg_.virtual_pipeline_size;
  TESSERA_CHECK(V == 1 || ctx_.pp_size == 1 || !(ctx_.first_stage() || ctx_.last_stage()) ||
                    be_.device() == Device::CPU || (ctx_.pp_wrap && ctx_.pp_wrap_grad),
                "virtual pipeline stages on the GPU need the ring's own communicators "
                "(ProcessGrid::use_pipeline_ring before use_nccl)");
}

StepExecutor::~StepExecutor() = default;

int StepExecutor::local_seq() const {
  return model_.config().seq_length / ctx_.cp_size;
}

void StepExecutor::shape(int global_batch) {
  if (global_batch == global_batch_) return;
  global_batch_ = global_batch;
  const int micro = num_micro_batches();
  const int V = cfg_.virtual_pipeline_size;
  pipeline_ = schedule_interleaved(ctx_.pp_size, ctx_.pp_rank, micro, V);
  chunk_slots_ = V > 1 ? pipeline_chunk_slots(pipeline_, V)
                       : std::vector<int>{pipeline_slots(ctx_.pp_size, ctx_.pp_rank, micro)};
  split_backward_ = false;
  if (cfg_.zero_bubble) {  // ZB-H1: the same F/B order (and slots), the W passes placed after
    const ZeroBubbleHold h = zero_bubble_hold(model_.config(), model_.shard(), cfg_, ctx_.pp_size,
                                              ctx_.pp_rank, micro, local_seq());
    pipeline_ = schedule_zero_bubble(ctx_.pp_size, ctx_.pp_rank, micro, V, h.passes);
    split_backward_ = h.passes > 0;
  }
  slots_.clear();  // the previous shape's buffers go back first (the sends on them completed)
  slots_ = model_.make_activation_slots(cfg_.micro_batch_size, local_seq(), chunk_slots_);
  slot_offset_.clear();
  for (int c = 0, offset = 0; c < V; offset += chunk_slots_[c++]) slot_offset_.push_back(offset);
  sends_.clear();
  sends_.resize(slots_.size());
  if (ctx_.last_stage()) {
    micro_losses_ = Tensor();
    AllocationLabel label("the token losses of one step");
    micro_losses_ =
        Tensor({int64_t(micro) * cfg_.micro_batch_size * local_seq()}, DType::F32, be_.allocator());
  }
  const int64_t local = global_batch / ctx_.dp_size;
  batch_.resize(static_cast<size_t>(local) * (model_.config().seq_length + 1));
  prefetch_.reset();  // its read in flight (of the previous shape) finishes first
  prefetch_ = std::make_unique<Prefetcher>(data_, local);
}

Activations& StepExecutor::slot(int chunk, int micro) {
  return slots_[static_cast<size_t>(slot_offset_[chunk] + micro % chunk_slots_[chunk])];
}

// The pipeline's links. With virtual stages the pipeline is a ring: the last stage's next is the
// first; the wrap-around takes its own communicators where the grid made them
// (ProcessGrid::use_pipeline_ring; the first stage is rank 0 there, the last rank 1).
StepExecutor::Link StepExecutor::forward_in() const {
  if (ctx_.pp_rank > 0) return {ctx_.pp, ctx_.pp_rank - 1};
  return ctx_.pp_wrap ? Link{ctx_.pp_wrap, 1} : Link{ctx_.pp, ctx_.pp_size - 1};
}
StepExecutor::Link StepExecutor::forward_out() const {
  if (ctx_.pp_rank < ctx_.pp_size - 1) return {ctx_.pp, ctx_.pp_rank + 1};
  return ctx_.pp_wrap ? Link{ctx_.pp_wrap, 0} : Link{ctx_.pp, 0};
}
StepExecutor::Link StepExecutor::backward_in() const {
  if (ctx_.pp_rank < ctx_.pp_size - 1) return {ctx_.pp_backward(), ctx_.pp_rank + 1};
  return ctx_.pp_wrap_grad ? Link{ctx_.pp_wrap_grad, 0} : Link{ctx_.pp_backward(), 0};
}
StepExecutor::Link StepExecutor::backward_out() const {
  if (ctx_.pp_rank > 0) return {ctx_.pp_backward(), ctx_.pp_rank - 1};
  return ctx_.pp_wrap_grad ? Link{ctx_.pp_wrap_grad, 1}
                           : Link{ctx_.pp_backward(), ctx_.pp_size - 1};
}

int64_t StepExecutor::first_sample(int64_t consumed) const {
  return dp_slice_begin(consumed, global_batch_, ctx_.dp_size, ctx_.dp_rank);
}

void StepExecutor::load_training_batch(int64_t consumed, StepStats& st) {
  TESSERA_PHASE("data-wait");
  IterationTimers::Scope timed(timers_, IterationTimers::BatchGenerator);
  // The next step's slice (of its batch size, which a ramp may change: then the read is wasted).
  const int64_t next = consumed + global_batch_;
  read_error_.clear();
  try {  // a bad sample stops every rank (count_loss_tokens agrees on it), not just this one
    // The training data's masks (an evaluation's may have sized mask_ for its own data).
    const bool masked = data_.has_loss_mask();
    batch_masked_ = false;
    if (masked) mask_.resize(batch_.size());
    prefetch_->fetch(
        first_sample(consumed), batch_.data(),
        dp_slice_begin(next, cfg_.global_batch_at(ctx_.dp_size, next), ctx_.dp_size, ctx_.dp_rank),
        masked ? mask_.data() : nullptr);
    batch_masked_ = masked;
  } catch (const std::exception& e) {
    read_error_ = e.what();
    if (read_error_.empty()) read_error_ = "reading this step's samples failed";
  }
  st.data_wait_seconds = prefetch_->take_wait_seconds();
}

void StepExecutor::load_batch(const TokenDataset& data, int64_t begin) {
  const int64_t local = global_batch_ / ctx_.dp_size;
  const int64_t S = model_.config().seq_length + 1;
  read_error_.clear();
  batch_masked_ = data.has_loss_mask();
  if (batch_masked_) mask_.resize(batch_.size());
  try {
    for (int64_t i = 0; i < local; ++i) {
      data.get(begin + i, batch_.data() + i * S);
      if (batch_masked_) data.get_loss_mask(begin + i, mask_.data() + i * S);
    }
  } catch (const std::exception& e) {
    read_error_ = e.what();
    if (read_error_.empty()) read_error_ = "reading the evaluation samples failed";
  }
}

void StepExecutor::sample_targets(const int32_t* sample, const uint8_t* mask,
                                  int32_t* targets) const {
  const int T = model_.config().seq_length;
  counts_.resize(static_cast<size_t>(T));
  loss_counts(sample, mask, T, cfg_.documents, counts_.data());
  targets[0] = -1;
  for (int p = 1; p <= T; ++p) targets[p] = counts_[p - 1] ? sample[p] : -1;
}

const uint8_t* StepExecutor::mask_of(int64_t s) const {
  return batch_masked_ ? mask_.data() + s * (model_.config().seq_length + 1) : nullptr;
}

float StepExecutor::micro_grad_scale(int micro, double loss_scale) const {
  if (loss_scale == 0) return 0.f;  // evaluation
  if (cfg_.per_token_loss) return static_cast<float>(loss_scale / global_tokens_);
  const double n = micro_tokens_[static_cast<size_t>(micro)];
  const double micro_batches = double(global_batch_) / cfg_.micro_batch_size;
  return n > 0 ? static_cast<float>(loss_scale / (n * micro_batches)) : 0.f;
}

double StepExecutor::count_loss_tokens() {
  const int T = model_.config().seq_length, B = cfg_.micro_batch_size;
  const int64_t S = T + 1;
  double v[2] = {0, read_error_.empty() ? 0.0 : 1.0};  // loss tokens, ranks that failed to read
  micro_tokens_.assign(static_cast<size_t>(num_micro_batches()), 0.0);
  sample_targets_.resize(static_cast<size_t>(S));
  if (read_error_.empty())
    for (int64_t s = 0; s < static_cast<int64_t>(batch_.size()) / S; ++s) {
      sample_targets(batch_.data() + s * S, mask_of(s), sample_targets_.data());
      for (int t = 1; t <= T; ++t)
        micro_tokens_[static_cast<size_t>(s / B)] += sample_targets_[t] >= 0;
    }
  for (double n : micro_tokens_) v[0] += n;
  // Over the world, so that a rank that could not read its samples stops every rank before the
  // step uses them; the TP x CP x PP ranks of a DP rank hold the same samples (their counts
  // agree).
  ctx_.world->all_reduce_f64(v, 2, ReduceOp::Sum);
  if (v[1] > 0) {
    const std::string why = first_message(*ctx_.world, read_error_);
    read_error_.clear();
    throw AgreedConfigError(why);
  }
  global_tokens_ = v[0] / (ctx_.tp_size * ctx_.pp_size * ctx_.cp_size);
  for (size_t m = 0; m < micro_tokens_.size() && !said_empty_; ++m)
    if (micro_tokens_[m] == 0 && global_tokens_ > 0) {
      said_empty_ = true;
      // The DP rank's samples: its TP, CP and PP ranks hold the same; its first one says it.
      if (ctx_.tp_rank != 0 || ctx_.cp_rank != 0 || ctx_.pp_rank != 0) break;
      TLOG(warning) << "a micro-batch of data-parallel rank " << ctx_.dp_rank
                    << " has no token whose loss counts (its loss masks are all 0): it adds "
                       "nothing to the gradient (said once)";
    }
  return global_tokens_;
}

double StepExecutor::run(bool with_backward, int64_t iteration, int64_t sample_begin,
                         double loss_scale, float moe_loss_scale, StepStats& st) {
  dropout_ = DropoutContext{};  // evaluation: none
  if (with_backward) {
    dropout_.training = true;
    dropout_.seed = cfg_.seed;
    dropout_.iteration = iteration;
  }
  sample_begin_ = sample_begin;
  moe_loss_scale_ = moe_loss_scale;
  if (with_backward) {
    for (const PipeStep& p : pipeline_) {
      if (p.weight) {
        weight_micro(p.micro, p.chunk);
        continue;
      }
      Activations& a = slot(p.chunk, p.micro);
      if (p.forward)
        forward_micro(p.micro, a, micro_grad_scale(p.micro, loss_scale), st);
      else
        backward_micro(p.micro, a, st);
    }
  } else {  // forward only: every stage runs the micro-batches in order (each chunk in turn)
    for (int m = 0; m < num_micro_batches(); ++m)
      for (int c = 0; c < cfg_.virtual_pipeline_size; ++c)
        forward_micro(m, slot(c, m), micro_grad_scale(m, loss_scale), st);
  }
  trace_pipeline_pass(PipePass::None);
  {
    PhaseSequence phase;
    if (ctx_.pp_size > 1) phase("pipeline-p2p");  // the last sends of the step
    for (auto& s : sends_)
      if (s) s->wait();
  }
  return ctx_.last_stage() ? sum_micro_losses() : 0.0;
}

// Documents inside the micro-batch's samples (run/sample_layout.hpp): their position ids and
// first visible keys to the model, from the whole samples (a document may span the chunks of
// context parallelism; the model keeps this rank's rows where a row's own position is read).
void StepExecutor::stage_documents(int micro, Activations& a) {
  const LtorOptions& d = cfg_.documents;
  const int B = cfg_.micro_batch_size, T = model_.config().seq_length;
  const int64_t S = T + 1;
  if (!d.reset_position_ids && !d.reset_attention_mask) return;
  host_positions_.resize(static_cast<size_t>(B) * T);
  host_key_begin_.resize(static_cast<size_t>(B) * T);
  for (int b = 0; b < B; ++b) {  // packed samples: the documents their flags mark
    const int64_t s = int64_t(micro) * B + b;
    ltor_layout(batch_.data() + s * S, mask_of(s), T, d, host_positions_.data() + b * T,
                host_key_begin_.data() + b * T, nullptr);
  }
  model_.set_documents(a, d.reset_position_ids ? host_positions_.data() : nullptr,
                       d.reset_attention_mask ? host_key_begin_.data() : nullptr);
}

// Multi-token prediction's inputs of micro-batch `micro`: for depth k each position's token
// k + 1 ahead and target k + 1 ahead in the whole sample (none past its end), then cut to this
// rank's rows as the main ones are (context parallelism: its chunks).
void StepExecutor::stage_mtp(int micro, Activations& a) {
  const int B = cfg_.micro_batch_size, T = local_seq();
  const int64_t S = model_.config().seq_length + 1;
  std::vector<int32_t> ids(static_cast<size_t>(B) * T), tg(ids.size()), shifted(S), shifted_tg(S),
      scratch(static_cast<size_t>(T));
  for (int k = 0; k < model_.config().mtp_num_layers; ++k) {
    for (int b = 0; b < B; ++b) {
      const int64_t s = int64_t(micro) * B + b;
      const int32_t* sample = batch_.data() + s * S;
      sample_targets(sample, mask_of(s), sample_targets_.data());
      // shifted[q]: the token k + 1 after q; shifted_tg[q + 1]: the target k + 1 after q's
      // (the layout cp_sample_tokens and the main targets use: target of q at q + 1).
      for (int64_t q = 0; q < S; ++q) {
        shifted[static_cast<size_t>(q)] = q + k + 1 < S - 1 ? sample[q + k + 1] : 0;
        shifted_tg[static_cast<size_t>(q)] =
            q >= 1 && q + k + 1 <= S - 1 ? sample_targets_[static_cast<size_t>(q + k + 1)] : -1;
      }
      int32_t* ib = ids.data() + b * T;
      int32_t* tb = tg.data() + b * T;
      if (ctx_.cp_size > 1) {
        cp_sample_tokens(shifted.data(), T, ctx_.cp_rank, ctx_.cp_size, ib, scratch.data());
        cp_sample_tokens(shifted_tg.data(), T, ctx_.cp_rank, ctx_.cp_size, scratch.data(), tb);
      } else {
        std::memcpy(ib, shifted.data(), sizeof(int32_t) * T);
        std::memcpy(tb, shifted_tg.data() + 1, sizeof(int32_t) * T);
      }
    }
    model_.mtp()->set_inputs(a, k, ids.data(), tg.data());
  }
}

// Inputs and targets of micro-batch `micro`, staged on the host and copied to the backend.
void StepExecutor::stage_micro_batch(int micro, Activations& a) {
  // T: this rank's tokens of each sample (all of them without context parallelism).
  const int B = cfg_.micro_batch_size, T = local_seq();
  const int64_t S = model_.config().seq_length + 1;
  host_ids_.resize(static_cast<size_t>(B) * T);
  host_targets_.resize(static_cast<size_t>(B) * T);
  sample_targets_.resize(static_cast<size_t>(S));
  cp_ids_.resize(static_cast<size_t>(T));
  for (int b = 0; b < B; ++b) {
    const int64_t s = int64_t(micro) * B + b;
    const int32_t* sample = batch_.data() + s * S;
    // The targets whose loss counts (loss masks, --eod-mask-loss), -1 elsewhere.
    sample_targets(sample, mask_of(s), sample_targets_.data());
    if (ctx_.cp_size > 1) {  // this rank's chunks (run/context_parallel.hpp)
      cp_sample_tokens(sample, T, ctx_.cp_rank, ctx_.cp_size, host_ids_.data() + b * T,
                       host_targets_.data() + b * T);
      cp_sample_tokens(sample_targets_.data(), T, ctx_.cp_rank, ctx_.cp_size, cp_ids_.data(),
                       host_targets_.data() + b * T);
      continue;
    }
    std::memcpy(host_ids_.data() + b * T, sample, sizeof(int32_t) * T);
    std::memcpy(host_targets_.data() + b * T, sample_targets_.data() + 1, sizeof(int32_t) * T);
  }
  stage_documents(micro, a);
  const bool mtp = model_.mtp() && (model_.ends_in_head(a) || model_.ends_in_mtp(a));
  if (mtp) stage_mtp(micro, a);
  // The ids: the embedding's, and multi-token prediction's (it embeds them shifted).
  if (model_.embeds(a) || mtp) be_.copy_from_host(a.ids, host_ids_.data());
  if (model_.ends_in_head(a)) be_.copy_from_host(a.targets, host_targets_.data());
}

void StepExecutor::forward_micro(int micro, Activations& a, float grad_scale, StepStats& st) {
  const int B = cfg_.micro_batch_size, T = local_seq();
  NVTX_RANGE("forward");
  trace_pipeline_pass(PipePass::Forward, micro, a.chunk);
  const int slot = static_cast<int>(&a - slots_.data());
  PhaseSequence phase;
  if (sends_[slot]) {
    phase("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardSend);
    // The slot's buffers may still be on their way out. On the device the compute stream waits,
    // not the host: a host blocked here could not post the receive another rank's send (ahead
    // of ours on that rank's stream) is waiting for.
    sends_[slot]->wait_device();
  }
  phase("batch-to-device");
  stage_micro_batch(micro, a);
  const bool first = model_.embeds(a), last = model_.ends_in_head(a);
  phase.close();
  // Dropout masks keyed by the micro-batch's global samples (the slot keeps them for the backward).
  a.dropout = dropout_;
  a.dropout.sample_begin = sample_begin_ + int64_t(micro) * B;
  a.moe_loss_scale = moe_loss_scale_;
  if (!first) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardRecv);
    Timer w;
    const Link in = forward_in();
    in.comm->recv(a.input, in.peer, kTagForward);
    st.pipeline_wait_seconds += w.seconds();
  }
  {
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardCompute);
    if (first) model_.embed_forward(a);
    for (int l = model_.chunk_layers(a).begin; l < model_.chunk_layers(a).end; ++l)
      model_.block_forward(l, a);
    if (model_.ends_in_mtp(a)) model_.mtp_forward(a, grad_scale);
    if (last) {
      Tensor out = micro_losses_.view(int64_t(micro) * B * T, {int64_t(B) * T});
      model_.head_forward(a, grad_scale, out);  // summed once per step, in sum_micro_losses
    }
  }
  if (!last) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardSend);
    const Tensor& out = model_.stage_output(a);
    const Link to = forward_out();
    sends_[slot] = to.comm->send_async(out, to.peer, kTagForward);
    st.p2p_bytes += out.nbytes();
  }
}

void StepExecutor::backward_micro(int micro, Activations& a, StepStats& st) {
  // Zero-bubble's B pass (the input gradients; the W pass later) or the whole backward.
  NvtxRange range(split_backward_ ? "backward-input" : "backward");
  trace_pipeline_pass(split_backward_ ? PipePass::InputGrad : PipePass::Backward, micro, a.chunk);
  const int slot = static_cast<int>(&a - slots_.data());
  // The last micro-batch of its chunk: the chunk's gradients are complete after it (after its W
  // pass with the backward split).
  last_backward_ = !split_backward_ && micro == num_micro_batches() - 1;
  if (!model_.ends_in_head(a)) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::BackwardRecv);
    Timer w;
    const Link in = backward_in();
    in.comm->recv(a.dres, in.peer, kTagBackward);
    st.pipeline_wait_seconds += w.seconds();
  }
  if (sends_[slot]) {  // the forward's send of the stage output: full recomputation rewrites it
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::ForwardSend);
    sends_[slot]->wait_device();
  }
  {
    IterationTimers::Scope timed(timers_, IterationTimers::BackwardCompute);
    model_.backward(a, split_backward_);
  }
  if (!model_.embeds(a)) {
    TESSERA_PHASE("pipeline-p2p");
    IterationTimers::Scope timed(timers_, IterationTimers::BackwardSend);
    if (sends_[slot]) sends_[slot]->wait_device();
    const Link to = backward_out();
    sends_[slot] = to.comm->send_async(a.dres, to.peer, kTagBackward);
    st.p2p_bytes += a.dres.nbytes();
  }
}

void StepExecutor::weight_micro(int micro, int chunk) {
  NVTX_RANGE("backward-weight");
  trace_pipeline_pass(PipePass::WeightGrad, micro, chunk);
  last_backward_ = micro == num_micro_batches() - 1;  // the chunk's gradients complete after it
  IterationTimers::Scope timed(timers_, IterationTimers::BackwardCompute);
  model_.weight_backward();
}

double StepExecutor::sum_micro_losses() {
  // One device round trip per step; summed in double, micro-batch by micro-batch, token by token
  // (the order a host-side sum per micro-batch would take).
  TESSERA_PHASE("loss-readback");
  host_losses_.resize(static_cast<size_t>(micro_losses_.numel()));
  be_.copy_to_host(host_losses_.data(), micro_losses_);
  const size_t per = host_losses_.size() / static_cast<size_t>(num_micro_batches());
  double sum = 0;
  for (int m = 0; m < num_micro_batches(); ++m) {
    double s = 0;
    for (size_t i = 0; i < per; ++i) s += host_losses_[m * per + i];
    sum += s;
  }
  return sum;
}

}  // namespace tessera
