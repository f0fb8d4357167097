// dist_optimizer.cpp: AdamW over this DP rank's blocks of the flat buffers.
#include "step/dist_optimizer.hpp"

#include <algorithm>
#include <cstring>

namespace tessera {

DistributedAdamW::DistributedAdamW(GPTModel& model, Backend& backend, Communicator& dp,
                                   double beta1, double beta2, double eps, Communicator* expert_dp,
                                   const std::vector<bool>* skip, Communicator* replicas,
                                   Communicator* expert_replicas)
    : model_(model), params_(model.params()), be_(backend), dp_(dp) {
  hyper_.beta1 = beta1;
  hyper_.beta2 = beta2;
  hyper_.eps = eps;
  TESSERA_CHECK(params_.layout().shards == dp.size(), "the flat buffers are laid out for ",
                params_.layout().shards, " data-parallel blocks, the DP group has ", dp.size(),
                " ranks");
  const auto& buckets = params_.buckets();
  const auto& specs = params_.specs();
  const bool split = params_.layout().shard_split > 1;
  int64_t cut_total = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const FlatBucket& fb = buckets[b];
    Communicator* comm = fb.expert && expert_dp ? expert_dp : &dp;
    Communicator* reps = fb.expert && expert_dp ? expert_replicas : replicas;
    if (reps && reps->size() == 1) reps = nullptr;
    const int P = comm->size(), r = comm->rank();
    TESSERA_CHECK(fb.numel() % P == 0, "bucket of ", fb.numel(), " elements for ", P, " blocks");
    Block k;
    k.comm = comm;
    k.replicas = reps;
    k.split = split && reps;
    k.bucket = static_cast<int>(b);
    k.cut_numel = fb.numel() / P;
    k.cut_begin = fb.begin + r * k.cut_numel;
    k.cut_shard_begin = cut_total;
    cut_total += k.cut_numel;
    const int parts = k.split ? reps->size() : 1, part = k.split ? reps->rank() : 0;
    TESSERA_CHECK(k.cut_numel % parts == 0, "block of ", k.cut_numel, " elements for ", parts,
                  " replicas");
    const int64_t n = k.cut_numel / parts;
    k.flat_begin = k.cut_begin + part * n;
    k.flat_end = k.flat_begin + n;
    k.shard_begin = shard_numel_;
    shard_numel_ += n;
    std::vector<AdamWSegment> seg;  // the parameters' parts in the block; padding is left out
    std::vector<bool> decays;       // per segment: takes the step's weight decay
    for (int p = fb.first_param; p < fb.end_param; ++p) {
      const ParamSpec& s = specs[p];
      if (skip && (*skip)[static_cast<size_t>(p)]) continue;
      const int64_t lo = std::max(k.flat_begin, s.flat_offset);
      const int64_t hi = std::min(k.flat_end, s.flat_offset + s.numel());
      if (lo >= hi) continue;
      if (!seg.empty() && seg.back().end == lo - k.flat_begin && decays.back() == s.weight_decay) {
        seg.back().end = hi - k.flat_begin;
      } else {
        seg.push_back({lo - k.flat_begin, hi - k.flat_begin, 0.0});
        decays.push_back(s.weight_decay);
      }
    }
    blocks_.push_back(k);
    segments_.push_back(std::move(seg));
    decays_.push_back(std::move(decays));
  }
  {
    AllocationLabel label(
        "the Adam moments of this rank's blocks (2 x fp32, distributed optimizer)");
    m_ = Tensor({shard_numel_}, DType::F32, be_.allocator());
    v_ = Tensor({shard_numel_}, DType::F32, be_.allocator());
  }
  zero_moments();
  if (!params_.has_master()) {
    AllocationLabel label("the fp32 master weights of this rank's blocks (distributed optimizer)");
    master_ = Tensor({shard_numel_}, DType::F32, be_.allocator());
    be_.zero(master_);
  }
  if (params_.layout().units_only_grads) {
    AllocationLabel label("the gradient shard of this rank's blocks (Megatron-FSDP)");
    g_ = Tensor({cut_total}, DType::F32, be_.allocator());
    be_.zero(g_);
  }
  if (params_.layout().units_only_compute) {
    if (params_.compute_dtype() == DType::F32 && cut_total == shard_numel_) {
      c_ = master_;
      c_is_master_ = true;
    } else {
      AllocationLabel label("the compute copy of this rank's blocks (Megatron-FSDP)");
      c_ = Tensor({cut_total}, params_.compute_dtype(), be_.allocator());
      be_.zero(c_);
    }
  }
  gathers_.resize(buckets.size());
  buckets_of_piece_ = buckets_of_pieces(specs, buckets, model.shard());
}

Tensor DistributedAdamW::block_weights(const Block& k) const {
  return owns_master() ? master_.view(k.shard_begin, {k.numel()})
                       : params_.flat_compute().view(k.flat_begin, {k.numel()});
}

Tensor DistributedAdamW::block_compute(const Block& k) const {
  if (c_.defined()) return c_.view(k.cut_shard_begin + (k.flat_begin - k.cut_begin), {k.numel()});
  return params_.flat_compute().view(k.flat_begin, {k.numel()});
}

Tensor DistributedAdamW::block_grads(const Block& k) const {
  if (g_.defined()) return g_.view(k.cut_shard_begin + (k.flat_begin - k.cut_begin), {k.numel()});
  return params_.flat_grads().view(k.flat_begin, {k.numel()});
}

void DistributedAdamW::reduce_replicas() {
  std::vector<std::unique_ptr<PendingOp>> ops;
  for (const Block& k : blocks_) {
    if (!k.replicas) continue;
    if (k.split) {  // the cut's sum over the instances, this rank's part of it
      Tensor cut =
          g_.defined() ? cut_grads(k) : params_.flat_grads().view(k.cut_begin, {k.cut_numel});
      ops.push_back(k.replicas->reduce_scatter_async(cut));
    } else {
      Tensor g = block_grads(k);
      ops.push_back(k.replicas->all_reduce_async(g, ReduceOp::Sum));
    }
  }
  for (auto& op : ops) op->wait();
}

void DistributedAdamW::gather_replicas() {
  std::vector<std::unique_ptr<PendingOp>> ops;
  for (const Block& k : blocks_) {
    if (!k.split) continue;
    if (params_.compute_dtype() == DType::F32) {  // f32: the part's updated weights
      Tensor c = block_compute(k);
      be_.cast(c, master_.view(k.shard_begin, {k.numel()}));
    }
    Tensor cut = cut_compute(k);
    ops.push_back(k.replicas->all_gather_async(cut));
  }
  for (auto& op : ops) op->wait();
}

void DistributedAdamW::zero_moments() {
  be_.zero(m_);
  be_.zero(v_);
}

Tensor& DistributedAdamW::state(const char* which) {
  if (std::strcmp(which, "exp_avg") == 0) return m_;
  if (std::strcmp(which, "exp_avg_sq") == 0) return v_;
  TESSERA_CHECK(std::strcmp(which, "master") == 0, "no optimizer state named ", which);
  TESSERA_CHECK(owns_master(), "f32 training: the master weights are the parameters");
  return master_;
}

void DistributedAdamW::step(double lr, double weight_decay, bool overlap_gather,
                            double grad_scale) {
  ++step_;
  hyper_.lr = lr;
  hyper_.grad_scale = grad_scale;
  for (size_t i = 0; i < segments_.size(); ++i)
    for (size_t j = 0; j < segments_[i].size(); ++j)
      segments_[i][j].weight_decay = decays_[i][j] ? weight_decay : 0.0;
  wait_all();  // a gather still in flight writes the compute copy
  // With master weights of its own, the block's compute copy (bf16/f16) in the same pass (none
  // in f32 under FSDP's sharded parameters: the master shard is the compute copy's).
  const bool copy = owns_master() && params_.compute_dtype() != DType::F32;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& k = blocks_[i];
    const Shape n{k.numel()};
    Tensor g = block_grads(k);
    Tensor p = block_weights(k);
    Tensor m = m_.view(k.shard_begin, n), v = v_.view(k.shard_begin, n);
    Tensor c = block_compute(k);
    be_.adamw_step_flat(p, g, m, v, segments_[i], hyper_, step_, copy ? &c : nullptr);
  }
  gather_replicas();         // outer optimizer sharding: each cut whole again
  if (c_.defined()) return;  // sharded parameters: FSDP gathers each unit when a pass needs it
  // Forward order: the bucket holding the first parameters (the last bucket) first.
  for (int b = static_cast<int>(gathers_.size()) - 1; b >= 0; --b) start_gather(b);
  if (!overlap_gather) wait_all();
}

void DistributedAdamW::publish() {
  wait_all();
  if (owns_master() && !c_is_master_)
    for (const Block& k : blocks_) {
      Tensor c = block_compute(k);
      be_.cast(c, master_.view(k.shard_begin, {k.numel()}));
    }
  gather_replicas();
  if (c_.defined()) return;  // sharded parameters: gathered per unit by FSDP
  for (int b = static_cast<int>(gathers_.size()) - 1; b >= 0; --b) start_gather(b);
  wait_all();
}

void DistributedAdamW::start_gather(int b) {
  const FlatBucket& fb = params_.buckets()[static_cast<size_t>(b)];
  Tensor view = params_.flat_compute().view(fb.begin, {fb.numel()});
  gathers_[static_cast<size_t>(b)] = blocks_[static_cast<size_t>(b)].comm->all_gather_async(view);
}

void DistributedAdamW::wait_params(int piece) {
  // The piece's kernels are queued after the gathers of its buckets; the host does not block.
  for (int b : buckets_of_piece_[static_cast<size_t>(piece_slot(piece, model_.shard()))]) {
    auto& g = gathers_[static_cast<size_t>(b)];
    if (g) {
      g->wait_device();
      g.reset();
    }
  }
}

void DistributedAdamW::wait_all() {
  for (auto& g : gathers_)
    if (g) {
      g->wait();
      g.reset();
    }
}

std::vector<Tensor> DistributedAdamW::grad_blocks(const std::vector<bool>& counted) const {
  return block_views(counted, false);
}

std::vector<Tensor> DistributedAdamW::param_blocks(const std::vector<bool>& counted) const {
  return block_views(counted, true);
}

std::vector<Tensor> DistributedAdamW::block_views(const std::vector<bool>& counted,
                                                  bool params) const {
  std::vector<Tensor> out;
  const auto& specs = params_.specs();
  for (const Block& k : blocks_) {
    if (!k.counted()) continue;  // HSDP: another instance's rank counts this one
    const FlatBucket& fb = params_.buckets()[static_cast<size_t>(k.bucket)];
    for (int p = fb.first_param; p < fb.end_param; ++p) {
      if (!counted[static_cast<size_t>(p)]) continue;
      const ParamSpec& s = specs[static_cast<size_t>(p)];
      const int64_t lo = std::max(k.flat_begin, s.flat_offset);
      const int64_t hi = std::min(k.flat_end, s.flat_offset + s.numel());
      if (lo >= hi) continue;
      if (!params)
        out.push_back(block_grads(k).view(lo - k.flat_begin, {hi - lo}));
      else if (owns_master())  // this block's f32 master weights
        out.push_back(master_.view(k.shard_begin + (lo - k.flat_begin), {hi - lo}));
      else  // f32 training: the parameters themselves
        out.push_back(params_.flat_compute().view(lo, {hi - lo}));
    }
  }
  return out;
}

Tensor DistributedAdamW::grad_block(const std::string& name) const {
  if (!params_.has(name)) return Tensor();
  const ParamSpec& s = params_.spec(name);
  for (const Block& k : blocks_) {
    const FlatBucket& fb = params_.buckets()[static_cast<size_t>(k.bucket)];
    if (s.flat_offset >= fb.begin && s.flat_offset < fb.end) {
      TESSERA_CHECK(fb.end_param - fb.first_param == 1, name, " shares its bucket");
      return block_grads(k);
    }
  }
  throw Error(name + " is in no bucket");
}

void DistributedAdamW::set_state(const char* which, const ParamSpec& spec, const float* values) {
  Tensor& st = state(which);
  for (const Block& k : blocks_) {
    const int64_t lo = std::max(k.flat_begin, spec.flat_offset);
    const int64_t hi = std::min(k.flat_end, spec.flat_offset + spec.numel());
    if (lo >= hi) continue;
    Tensor dst = st.view(k.shard_begin + (lo - k.flat_begin), {hi - lo});
    be_.copy_from_host(dst, values + (lo - spec.flat_offset));
  }
}

std::vector<float> DistributedAdamW::gather_state(const char* which, bool want) {
  Tensor& st = state(which);
  std::vector<float> host;
  if (want) host.assign(static_cast<size_t>(params_.numel()), 0.f);
  // One device scratch of the largest bucket, allocated before the first collective (every rank
  // asks for the same size), reused bucket by bucket.
  int64_t largest = 0;
  for (const FlatBucket& fb : params_.buckets()) largest = std::max(largest, fb.numel());
  Tensor scratch;
  {
    AllocationLabel label("the gather buffer of one bucket (checkpoint save)");
    scratch = Tensor({largest}, DType::F32, be_.allocator());
  }
  for (const Block& k : blocks_) {
    const FlatBucket& fb = params_.buckets()[static_cast<size_t>(k.bucket)];
    Tensor full = scratch.view(0, {fb.numel()});
    Tensor mine = full.view(k.flat_begin - fb.begin, {k.numel()});
    be_.cast(mine, st.view(k.shard_begin, {k.numel()}));  // a device copy
    if (k.split) {                                        // the cut from its replicas' parts first
      Tensor cut = full.view(k.cut_begin - fb.begin, {k.cut_numel});
      k.replicas->all_gather_async(cut)->wait();
    }
    k.comm->all_gather_async(full)->wait();
    if (want) be_.copy_to_host(host.data() + fb.begin, full);
  }
  return host;
}

}  // namespace tessera
