// grad_reducer.cpp: bucketed, overlapped data-parallel all-reduce of gradients.
#include "train/grad_reducer.hpp"

namespace tessera {

GradReducer::GradReducer(GPTModel& model, Communicator& dp, int64_t bucket_elems)
    : model_(model), dp_(dp) {
  const auto& specs = model.params().specs();
  const ModelShard& sh = model.shard();
  const int n = static_cast<int>(specs.size());
  bucket_of_param_.assign(n, -1);
  sources_.assign(n, 1);
  params_of_layer_.resize(sh.layer_end - sh.layer_begin);
  for (int i = 0; i < n; ++i) {
    const std::string& name = specs[i].name;
    if (name == "wte") {
      sources_[i] = int(sh.has_head) + int(sh.has_embedding);
      if (sh.has_head) head_params_.push_back(i);
      if (sh.has_embedding) embed_params_.push_back(i);
    } else if (name == "wpe") {
      embed_params_.push_back(i);
    } else if (name.rfind("lnf.", 0) == 0) {
      head_params_.push_back(i);
    } else {
      const int layer = std::stoi(name.substr(7, name.find('.', 7) - 7));  // "layers.<l>."
      params_of_layer_[layer - sh.layer_begin].push_back(i);
    }
  }
  // Buckets of whole parameters from the end of the buffer backwards.
  for (int i = n - 1; i >= 0;) {
    Bucket b;
    b.end = specs[i].flat_offset + specs[i].numel();
    int64_t size = 0;
    while (i >= 0 && (size < bucket_elems || b.params == 0)) {
      size += specs[i].numel();
      bucket_of_param_[i] = static_cast<int>(buckets_.size());
      ++b.params;
      --i;
    }
    b.begin = b.end - size;
    total_elems_ += size;
    buckets_.push_back(std::move(b));
  }
}

void GradReducer::begin() {
  remaining_ = sources_;
  for (Bucket& b : buckets_) {
    b.pending = b.params;
    b.op.reset();
  }
  armed_ = true;
}

void GradReducer::start(Bucket& b) {
  Tensor view = model_.params().flat_grads().view(b.begin, {b.end - b.begin});
  b.op = dp_.all_reduce_async(view, ReduceOp::Sum);
}

void GradReducer::piece_ready(int piece) {
  if (!armed_) return;
  const std::vector<int>& params = piece == GPTModel::kHeadPiece ? head_params_
                                   : piece == GPTModel::kEmbedPiece
                                       ? embed_params_
                                       : params_of_layer_[piece - model_.shard().layer_begin];
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
