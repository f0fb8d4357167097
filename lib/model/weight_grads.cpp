// weight_grads.cpp: zero-bubble's deferred weight-gradient GEMMs (model/weight_grads.hpp).
#include "model/weight_grads.hpp"

#include <algorithm>
#include <limits>

#include "core/error.hpp"

namespace tessera {

void WeightGradStore::begin_pass() {
  TESSERA_CHECK(!recording_, "zero-bubble: a B pass began inside another");
  passes_.emplace_back();
  recording_ = true;
}

void WeightGradStore::begin_piece(int piece) {
  if (recording_) passes_.back().pieces.push_back(piece);
}

void WeightGradStore::end_pass() {
  TESSERA_CHECK(recording_, "zero-bubble: a B pass ended without beginning");
  recording_ = false;
}

Tensor WeightGradStore::take(DType dtype, const Shape& shape, bool headroom) {
  Pass& p = passes_.back();
  const int64_t numel = shape_numel(shape);
  const size_t need = static_cast<size_t>(numel) * dtype_size(dtype);
  // The smallest pooled buffer of the dtype that fits (MoE's expert blocks change size with the
  // routing: a buffer serves any block up to its size).
  auto best = pool_.end(), largest_short = pool_.end();
  for (auto it = pool_.begin(); it != pool_.end(); ++it) {
    if (it->dtype() != dtype) continue;
    if (it->nbytes() >= need && (best == pool_.end() || it->nbytes() < best->nbytes())) best = it;
    if (it->nbytes() < need &&
        (largest_short == pool_.end() || it->nbytes() > largest_short->nbytes()))
      largest_short = it;
  }
  Tensor buffer;
  if (best != pool_.end()) {
    buffer = *best;
    pool_.erase(best);
  } else {
    // None fits: a larger one replaces the largest that falls short, so that routing's changing
    // block sizes do not grow the pool (an expert block's buffer gets a quarter more room).
    if (largest_short != pool_.end()) pool_.erase(largest_short);
    AllocationLabel label("zero-bubble's weight-gradient operands (held from B to W)");
    const int64_t room = headroom ? numel + numel / 4 : numel;
    buffer = Tensor({std::max<int64_t>(room, 1)}, dtype, be_.allocator());
    double total = 0;
    for (const Tensor& b : pool_) total += static_cast<double>(b.nbytes());
    for (const Pass& q : passes_)
      for (const Tensor& b : q.buffers) total += static_cast<double>(b.nbytes());
    held_bytes_ = std::max(held_bytes_, total + static_cast<double>(buffer.nbytes()));
  }
  p.buffers.push_back(buffer);
  p.bytes += static_cast<double>(need);
  return buffer.view(0, shape);
}

Tensor WeightGradStore::hold(const Tensor& t, bool headroom) {
  Tensor copy = take(t.dtype(), t.shape(), headroom);
  if (t.numel() > 0) be_.cast(copy, t);
  return copy;
}

WeightGradStore::Entry WeightGradStore::entry(Kind kind) const {
  TESSERA_CHECK(recording_ && !passes_.back().pieces.empty(),
                "zero-bubble: a weight gradient deferred outside a B pass's piece");
  Entry e;
  e.piece = static_cast<int>(passes_.back().pieces.size()) - 1;
  e.kind = kind;
  return e;
}

void WeightGradStore::defer(Tensor& dw, Tensor* dbias, const Tensor& dout, const Tensor& inp,
                            const Tensor& w) {
  Entry e = entry(Kind::Gemm);
  e.gemms.push_back({dw, dbias ? *dbias : Tensor(), hold(dout), hold(inp), w});
  passes_.back().entries.push_back(std::move(e));
}

void WeightGradStore::defer_grouped(const std::vector<Backend::GroupedGemm>& groups) {
  Entry e = entry(Kind::Grouped);
  for (const Backend::GroupedGemm& g : groups)
    if (g.dweight)
      e.gemms.push_back({*g.dweight, Tensor(), hold(*g.dout, true), hold(*g.inp, true), *g.weight});
  if (!e.gemms.empty()) passes_.back().entries.push_back(std::move(e));
}

void WeightGradStore::defer_embedding(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                      int64_t row_begin) {
  Entry e = entry(Kind::Embedding);
  e.row_begin = row_begin;
  // The ids go through the host (the backends copy floating-point tensors only): a few
  // thousand integers per micro-batch.
  ids_host_.resize(static_cast<size_t>(ids.numel()));
  if (ids.numel() > 0) be_.copy_to_host(ids_host_.data(), ids);
  Tensor held_ids = take(ids.dtype(), ids.shape());
  if (ids.numel() > 0) be_.copy_from_host(held_ids, ids_host_.data());
  e.gemms.push_back({dtable, Tensor(), hold(dout), held_ids, Tensor()});
  passes_.back().entries.push_back(std::move(e));
}

double WeightGradStore::pending_bytes() const {
  double b = 0;
  for (size_t i = 0; i + (recording_ ? 1 : 0) < passes_.size(); ++i) b += passes_[i].bytes;
  return b;
}

double WeightGradStore::oldest_bytes() const {
  return pending() > 0 ? passes_.front().bytes : 0.0;
}

void WeightGradStore::run_oldest(const std::function<void(int)>& piece_done) {
  TESSERA_CHECK(pending() > 0, "zero-bubble: a W pass without a B pass before it");
  Pass p = std::move(passes_.front());
  passes_.pop_front();
  size_t next = 0;
  for (size_t k = 0; k < p.pieces.size(); ++k) {
    for (; next < p.entries.size() && p.entries[next].piece == static_cast<int>(k); ++next) {
      Entry& e = p.entries[next];
      if (e.kind == Kind::Embedding) {
        Gemm& g = e.gemms.front();
        be_.embedding_backward(g.dw, g.dout, g.inp, e.row_begin);
        continue;
      }
      if (e.kind == Kind::Gemm) {
        Gemm& g = e.gemms.front();
        be_.matmul_backward(nullptr, g.dw, g.db.defined() ? &g.db : nullptr, g.dout, g.inp, g.w);
        continue;
      }
      std::vector<Backend::GroupedGemm> groups;
      for (Gemm& g : e.gemms) groups.push_back({nullptr, &g.dw, &g.inp, &g.dout, &g.w});
      be_.grouped_matmul_backward(groups);
    }
    if (piece_done) piece_done(p.pieces[k]);
  }
  for (Tensor& b : p.buffers) pool_.push_back(std::move(b));
}

}  // namespace tessera
