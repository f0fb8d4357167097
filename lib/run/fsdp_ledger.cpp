// fsdp_ledger.cpp: Megatron-FSDP's buffer bookkeeping (run/fsdp_ledger.hpp).
#include "run/fsdp_ledger.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace tessera {

namespace {
constexpr int kNone = -3;
}  // namespace

FsdpLedger::FsdpLedger(std::vector<Unit> units, const ModelShard& shard, bool grads, bool params,
                       DType compute, Allocator* alloc)
    : units_(std::move(units)),
      shard_(shard),
      grads_(grads),
      params_(params),
      compute_(compute),
      alloc_(alloc) {
  state_.resize(units_.size());
  of_piece_.resize(static_cast<size_t>(num_piece_slots(shard_)));
  for (size_t b = 0; b < units_.size(); ++b)
    for (int piece : units_[b].pieces)
      of_piece_[static_cast<size_t>(piece_slot(piece, shard_))].push_back(static_cast<int>(b));
}

const std::vector<int>& FsdpLedger::units_of(int piece) const {
  return of_piece_[static_cast<size_t>(piece_slot(piece, shard_))];
}

Tensor FsdpLedger::take(int64_t numel, DType dtype) {
  const std::pair<int64_t, int> key{numel, static_cast<int>(dtype)};
  if (!alloc_) {  // counting only
    int& n = free_count_[key];
    if (n > 0)
      --n;
    else
      pool_bytes_ += numel * static_cast<int64_t>(dtype_size(dtype));
    return Tensor();
  }
  auto& list = free_[key];
  if (!list.empty()) {
    Tensor t = list.back();
    list.pop_back();
    return t;
  }
  AllocationLabel label("Megatron-FSDP's pool: a unit's gathered weights or unreduced gradients");
  Tensor t({numel}, dtype, *alloc_);
  pool_bytes_ += static_cast<int64_t>(t.nbytes());
  return t;
}

void FsdpLedger::give(Tensor& mem, int64_t numel, DType dtype) {
  const std::pair<int64_t, int> key{numel, static_cast<int>(dtype)};
  if (!alloc_)
    ++free_count_[key];
  else
    free_[key].push_back(mem);
  mem = Tensor();
}

int FsdpLedger::next_piece(int piece, bool forward) const {
  const int C = shard_.num_chunks();
  if (forward) {
    if (piece == kHeadPiece) return kNone;
    if (piece == kEmbedPiece) {
      const LayerRange& r = shard_.chunks[0];
      return r.end > r.begin ? r.begin : C == 1 && shard_.head_piece() ? kHeadPiece : kNone;
    }
    for (int c = 0; c < C; ++c) {
      const LayerRange& r = shard_.chunks[static_cast<size_t>(c)];
      if (piece < r.begin || piece >= r.end) continue;
      if (piece + 1 < r.end) return piece + 1;
      return c == C - 1 && shard_.head_piece() ? kHeadPiece : kNone;
    }
    return kNone;
  }
  if (piece == kEmbedPiece) return kNone;
  if (piece == kHeadPiece) {
    const LayerRange& r = shard_.chunks[static_cast<size_t>(C - 1)];
    return r.end > r.begin ? r.end - 1 : C == 1 && shard_.has_embedding ? kEmbedPiece : kNone;
  }
  for (int c = 0; c < C; ++c) {
    const LayerRange& r = shard_.chunks[static_cast<size_t>(c)];
    if (piece < r.begin || piece >= r.end) continue;
    if (piece > r.begin) return piece - 1;
    return c == 0 && shard_.has_embedding ? kEmbedPiece : kNone;
  }
  return kNone;
}

void FsdpLedger::prefetch(int piece) {
  if (piece == kNone) return;
  for (int b : units_of(piece)) {
    State& st = state_[static_cast<size_t>(b)];
    if (st.param_users > 0 || st.prefetched) continue;  // held, or already on its way
    st.param_mem = take(units_[static_cast<size_t>(b)].numel, compute_);
    st.prefetched = true;
    if (actions_) actions_->gather(b, st.param_mem);
  }
}

void FsdpLedger::acquire_params(int piece) {
  if (!params_) return;
  std::vector<int> wait;  // the units this acquire holds first: their gathers to wait for
  for (int b : units_of(piece)) {
    State& st = state_[static_cast<size_t>(b)];
    if (st.param_users++ > 0) continue;
    wait.push_back(b);
    if (st.prefetched) {
      st.prefetched = false;
    } else {
      st.param_mem = take(units_[static_cast<size_t>(b)].numel, compute_);
      if (actions_) actions_->gather(b, st.param_mem);
    }
  }
  if (actions_)  // every gather of the piece started before the first wait
    for (int b : wait) actions_->wait_gather(b);
}

void FsdpLedger::before_forward(int piece) {
  acquire_params(piece);
  if (params_ && !in_backward_) prefetch(next_piece(piece, true));  // not a recomputation's
}

void FsdpLedger::after_backward(int piece) {
  release_params(piece);
  in_backward_ = false;
}

void FsdpLedger::release_params(int piece) {
  if (!params_) return;
  for (int b : units_of(piece)) {
    State& st = state_[static_cast<size_t>(b)];
    TESSERA_CHECK(st.param_users > 0, "FSDP unit ", b, " released without being gathered");
    if (--st.param_users > 0) continue;
    if (actions_) actions_->release_params(b);
    give(st.param_mem, units_[static_cast<size_t>(b)].numel, compute_);
  }
}

void FsdpLedger::before_backward(int piece) {
  acquire_params(piece);
  if (params_) prefetch(next_piece(piece, false));
  in_backward_ = true;
  if (!grads_) return;
  for (int b : units_of(piece)) {
    State& st = state_[static_cast<size_t>(b)];
    while (st.reducing) complete_oldest();  // the previous micro-batch's reduction first
    if (st.grads_bound) continue;           // bound by an earlier piece of this micro-batch
    st.grad_mem = take(units_[static_cast<size_t>(b)].numel, DType::F32);
    st.grads_bound = true;
    st.pending = static_cast<int>(units_[static_cast<size_t>(b)].pieces.size());
    if (actions_) actions_->bind_grads(b, st.grad_mem);
  }
}

void FsdpLedger::grads_ready(int piece) {
  if (!grads_) return;
  for (int b : units_of(piece)) {
    State& st = state_[static_cast<size_t>(b)];
    TESSERA_CHECK(st.grads_bound && st.pending > 0, "FSDP unit ", b,
                  " reported ready without its backward");
    if (--st.pending > 0) continue;
    st.reducing = true;
    if (actions_) actions_->start_reduce(b);
    in_flight_.push_back(b);
    while (static_cast<int>(in_flight_.size()) > kInFlight) complete_oldest();
  }
}

void FsdpLedger::complete_oldest() {
  const int b = in_flight_.front();
  in_flight_.pop_front();
  if (actions_) actions_->finish_reduce(b);
  State& st = state_[static_cast<size_t>(b)];
  give(st.grad_mem, units_[static_cast<size_t>(b)].numel, DType::F32);
  st.grads_bound = false;
  st.reducing = false;
}

void FsdpLedger::finish() {
  while (!in_flight_.empty()) complete_oldest();
  for (size_t b = 0; b < state_.size(); ++b) {  // a prefetch no piece took (none in a step)
    State& st = state_[b];
    if (!st.prefetched) continue;
    st.prefetched = false;
    if (actions_) {
      actions_->wait_gather(static_cast<int>(b));
      actions_->release_params(static_cast<int>(b));
    }
    give(st.param_mem, units_[b].numel, compute_);
  }
}

std::vector<FsdpLedger::Unit> fsdp_units(const std::vector<ParamSpec>& specs,
                                         const std::vector<FlatBucket>& buckets,
                                         const ModelShard& shard) {
  const auto pieces = param_pieces(specs, shard);
  std::vector<FsdpLedger::Unit> units;
  for (const FlatBucket& fb : buckets) {
    FsdpLedger::Unit u;
    u.numel = fb.numel();
    for (int p = fb.first_param; p < fb.end_param; ++p)
      for (int piece : pieces[static_cast<size_t>(p)])
        if (std::find(u.pieces.begin(), u.pieces.end(), piece) == u.pieces.end())
          u.pieces.push_back(piece);
    units.push_back(std::move(u));
  }
  return units;
}

int64_t fsdp_pool_bytes(const std::vector<ParamSpec>& specs, const std::vector<FlatBucket>& buckets,
                        const ModelShard& shard, bool grads, bool params, DType compute,
                        const std::vector<PipeStep>& steps,
                        const std::vector<LayerRecompute>& plan) {
  if (!grads && !params) return 0;
  FsdpLedger ledger(fsdp_units(specs, buckets, shard), shard, grads, params, compute, nullptr);
  const int last = shard.num_chunks() - 1;
  // The hooks in GPTModel's order (model/gpt.cpp: forward, backward, recompute_for_backward).
  for (const PipeStep& s : steps) {
    const LayerRange& r = shard.chunks[static_cast<size_t>(s.chunk)];
    const bool embed = s.chunk == 0 && shard.has_embedding;
    const bool head = s.chunk == last && shard.head_piece();
    if (s.forward) {
      if (embed) ledger.before_forward(kEmbedPiece), ledger.after_forward(kEmbedPiece);
      for (int l = r.begin; l < r.end; ++l) ledger.before_forward(l), ledger.after_forward(l);
      if (head) ledger.before_forward(kHeadPiece), ledger.after_forward(kHeadPiece);
      continue;
    }
    auto backward = [&](int piece, const LayerRecompute* rc) {
      ledger.before_backward(piece);
      if (rc && rc->kind == RecomputeGranularity::Full && rc->chunk_last(piece))
        for (int k = rc->chunk_begin; k < rc->chunk_end; ++k)
          ledger.before_forward(k), ledger.after_forward(k);
      ledger.grads_ready(piece);
      ledger.after_backward(piece);
    };
    if (head) backward(kHeadPiece, nullptr);
    for (int l = r.end - 1; l >= r.begin; --l)
      backward(l, &plan[static_cast<size_t>(shard.local_index(l))]);
    if (embed) backward(kEmbedPiece, nullptr);
  }
  ledger.finish();
  return ledger.pool_bytes();
}

}  // namespace tessera
