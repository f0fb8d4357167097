// step_executor.hpp: one pass of a global batch through this rank's pipeline stage: the slice of
// the batch this DP rank reads, the micro-batches in the pipeline schedule's order (1F1B or
// interleaved), the activation slots they use, the sends and receives between stages, and the
// token losses of the last stage.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "data/dataset.hpp"
#include "data/prefetcher.hpp"
#include "model/gpt.hpp"
#include "run/pipeline.hpp"
#include "run/train_config.hpp"
#include "step/step_stats.hpp"
#include "step/timers.hpp"

namespace tessera {

class StepExecutor {
 public:
  // `data` is the training data (read ahead by a prefetcher); evaluation reads its own.
  StepExecutor(GPTModel& model, Backend& be, const TrainConfig& cfg, const ParallelContext& ctx,
               const TokenDataset& data, IterationTimers& timers);
  ~StepExecutor();

  // Shapes the step for `global_batch` samples: the pipeline schedule, activation slots, token
  // losses, batch buffer and prefetcher (again only when the size changes: a batch-size ramp).
  void shape(int global_batch);
  int global_batch() const { return global_batch_; }
  // Micro-batches per step at the current global batch.
  int num_micro_batches() const { return global_batch_ / (cfg_.micro_batch_size * ctx_.dp_size); }
  // The first sample of this DP rank's slice of the step that starts at `consumed` samples.
  int64_t first_sample(int64_t consumed) const;

  // This DP rank's slice of the training step that starts at `consumed` samples, from the
  // prefetcher (which then reads the next step's slice ahead). A read error is kept for
  // count_loss_tokens, so that every rank stops together. Sets st.data_wait_seconds.
  void load_training_batch(int64_t consumed, StepStats& st);
  // The same for evaluation: `local` samples of `data` from `begin`, read now.
  void load_batch(const TokenDataset& data, int64_t begin);
  // Collective: the loss tokens of the global batch (targets >= 0 whose loss mask is 1, and not
  // after an EOD with --eod-mask-loss); also keeps each local micro-batch's count for the loss
  // normalization. Throws AgreedConfigError on every rank when any rank could not read its
  // samples, with that rank's words.
  double count_loss_tokens();

  // Runs the micro-batches of the loaded batch: the schedule's forwards and backwards (training,
  // dropout keyed by `iteration`) or forwards only (evaluation). Returns this rank's sum of the
  // token losses (last stage; 0 elsewhere). `sample_begin`: the slice's first global sample.
  // Each micro-batch's loss gradient is scaled by micro_grad_scale (loss_scale: fp16's; 1 else;
  // 0 in evaluation).
  double run(bool with_backward, int64_t iteration, int64_t sample_begin, double loss_scale,
             float moe_loss_scale, StepStats& st);
  // The scale of micro-batch `micro`'s token-loss gradients (after count_loss_tokens): its summed
  // token losses' weight in the step's objective times loss_scale. The weight is 1 / the global
  // batch's loss tokens with --calculate-per-token-loss; else Megatron's mean per micro-batch
  // averaged over the global batch's micro-batches, 1 / (its loss tokens x micro-batches), and 0
  // for a micro-batch without loss tokens. Both are 1 / (B*T*micro-batches) without masks.
  float micro_grad_scale(int micro, double loss_scale) const;
  // True while the backward of a step's last micro-batch runs (its chunk's gradients are
  // complete after it: the gradient reduction may start).
  bool in_last_backward() const { return last_backward_; }

 private:
  // Pipeline links: where a forward's input comes from and its output goes, and a backward's
  // gradient (a ring with virtual stages: the last stage feeds the first).
  struct Link {
    Communicator* comm;
    int peer;
  };
  Link forward_in() const;
  Link forward_out() const;
  Link backward_in() const;
  Link backward_out() const;
  // Context parallelism: this rank's tokens of each sample (all of them without).
  int local_seq() const;
  // The activation slot of micro-batch `micro` of model chunk `chunk`.
  Activations& slot(int chunk, int micro);
  void stage_micro_batch(int micro, Activations& a);
  void stage_mtp(int micro, Activations& a);  // multi-token prediction's shifted inputs
  void stage_documents(int micro, Activations& a);
  // The targets of a sample of seq+1 tokens (and its loss mask, null: all 1) at positions 1..seq
  // (position 0 unused): the token where its loss counts, -1 where it does not.
  void sample_targets(const int32_t* sample, const uint8_t* mask, int32_t* targets) const;
  // The loss mask of local sample s of the loaded batch; null when the batch has none.
  const uint8_t* mask_of(int64_t s) const;
  void forward_micro(int micro, Activations& a, float grad_scale, StepStats& st);
  void backward_micro(int micro, Activations& a, StepStats& st);
  // Zero-bubble's W pass: the oldest B pass's weight-gradient GEMMs (micro-batch `micro` of
  // model chunk `chunk`), then its pieces' grads_ready observers.
  void weight_micro(int micro, int chunk);
  double sum_micro_losses();

  GPTModel& model_;
  Backend& be_;
  const TrainConfig& cfg_;
  const ParallelContext& ctx_;
  const TokenDataset& data_;
  IterationTimers& timers_;
  int global_batch_ = 0;            // the global batch the buffers are shaped for
  std::vector<PipeStep> pipeline_;  // this rank's pipeline schedule of a step
  std::vector<Activations> slots_;  // one per micro-batch in flight on this stage, chunk by chunk
  std::vector<int> chunk_slots_, slot_offset_;  // per model chunk: its slots, the first one's index
  std::vector<std::unique_ptr<PendingOp>> sends_;  // per slot: the last send from its buffers
  bool last_backward_ = false;   // the backward running is the step's last micro-batch's
  bool split_backward_ = false;  // zero-bubble with W passes deferred: backwards are B passes
  DropoutContext dropout_;       // of the pass run() runs (training: the step's)
  int64_t sample_begin_ = 0;     // the first global sample of the pass's slice
  float moe_loss_scale_ = 1;     // this pass's weight of each micro-batch's MoE losses
  std::vector<int32_t> batch_;   // (local samples, T+1) tokens of this DP rank's slice of the step
  std::vector<uint8_t> mask_;    // their loss masks (data with /loss_mask), as batch_
  bool batch_masked_ = false;    // mask_ holds the loaded batch's masks
  std::vector<int32_t> sample_targets_, cp_ids_;  // one sample's targets; CP's discarded ids
  mutable std::vector<uint8_t> counts_;           // which of one sample's targets count
  std::vector<double> micro_tokens_;              // loss tokens of each local micro-batch
  double global_tokens_ = 0;                      // of the global batch
  bool said_empty_ = false;                       // a micro-batch without loss tokens was reported
  std::string read_error_;  // why this rank's samples could not be read, or empty
  std::vector<int32_t> host_ids_, host_targets_;          // one micro-batch, staged for the backend
  std::vector<int32_t> host_positions_, host_key_begin_;  // its documents (sample_layout.hpp)
  Tensor micro_losses_;  // last stage: (micro-batches x B*T) token losses of a step
  std::vector<float> host_losses_;
  std::unique_ptr<Prefetcher> prefetch_;
};

}  // namespace tessera
