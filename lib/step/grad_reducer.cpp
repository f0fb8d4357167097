// grad_reducer.cpp: bucketed, overlapped data-parallel reduction of gradients.
#include "step/grad_reducer.hpp"

namespace tessera {

GradReducer::GradReducer(GPTModel& model, Communicator& dp, bool reduce_scatter, bool overlap,
                         Communicator* expert_dp)
    : model_(model), dp_(dp), reduce_scatter_(reduce_scatter), overlap_(overlap) {
  const ModelShard& sh = model.shard();
  const auto pieces = param_pieces(model.params().specs(), sh);
  const int n = static_cast<int>(pieces.size());
  bucket_of_param_.assign(n, -1);
  sources_.assign(n, 1);
  params_of_layer_.resize(static_cast<size_t>(sh.num_layers()));
  for (int i = 0; i < n; ++i) {
    sources_[i] = static_cast<int>(pieces[i].size());  // wte on a stage with both ends: 2
    for (int piece : pieces[i]) {
      if (piece == kHeadPiece)
        head_params_.push_back(i);
      else if (piece == kEmbedPiece)
        embed_params_.push_back(i);
      else
        params_of_layer_[sh.local_index(piece)].push_back(i);
    }
  }
  for (const FlatBucket& fb : model.params().buckets()) {
    Bucket b;
    b.begin = fb.begin;
    b.end = fb.end;
    b.params = fb.end_param - fb.first_param;
    b.comm = fb.expert && expert_dp ? expert_dp : &dp;
    for (int p = fb.first_param; p < fb.end_param; ++p)
      bucket_of_param_[p] = static_cast<int>(buckets_.size());
    total_elems_ += fb.numel();
    buckets_.push_back(std::move(b));
  }
  TESSERA_CHECK(!reduce_scatter_ || model.params().layout().shards == dp.size(),
                "the flat buffers are laid out for ", model.params().layout().shards,
                " data-parallel blocks, the DP group has ", dp.size(), " ranks");
}

void GradReducer::begin_step() {
  remaining_ = sources_;
  for (Bucket& b : buckets_) {
    b.pending = b.params;
    b.op.reset();
  }
  armed_ = true;
}

void GradReducer::start(Bucket& b) {
  Tensor view = model_.params().flat_grads().view(b.begin, {b.end - b.begin});
  if (before_reduce) before_reduce(view);
  b.op = reduce_scatter_ ? b.comm->reduce_scatter_async(view)
                         : b.comm->all_reduce_async(view, ReduceOp::Sum);
}

void GradReducer::piece_ready(int piece) {
  if (!armed_ || !overlap_) return;
  const std::vector<int>& params = piece == kHeadPiece ? head_params_
                                   : piece == kEmbedPiece
                                       ? embed_params_
                                       : params_of_layer_[model_.shard().local_index(piece)];
  for (int p : params) {
    if (--remaining_[p] > 0) continue;
    Bucket& b = buckets_[bucket_of_param_[p]];
    if (--b.pending == 0) start(b);
  }
  for (Bucket& b : buckets_)  // give MPI a chance to progress what is in flight
    if (b.op) b.op->test();
}

void GradReducer::finish() {
  for (Bucket& b : buckets_) {
    if (!b.op) start(b);
    b.op->wait();
    b.op.reset();
  }
  armed_ = false;
}

}  // namespace tessera
