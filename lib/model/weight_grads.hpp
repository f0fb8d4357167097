// weight_grads.hpp: the zero-bubble schedule's split backward (run/pipeline.hpp, ZB-H1). A
// backward is two passes there: B, the input gradients the previous stage waits for, and W, the
// weight gradients nobody waits for, run later to fill the pipeline's bubble. While a B pass
// records, the weight halves of the backward's GEMMs (matmul_backward's weight and bias
// gradients, the experts' grouped ones) do not run: the two operands they read, the GEMM's input
// and the gradient of its output, are copied into buffers the pass holds (the slot of the
// micro-batch is free for the next forward once B is done), and the W pass runs them later, in the
// order B met them, piece by piece. Each weight's gradient then takes its micro-batches' sums in
// the order a whole backward gives them (W passes run oldest first), and every GEMM half is the
// kernel the whole backward runs: the gradients are the same bits. The other weight gradients
// (norms, the embedding's scatter, FP8 layers' GEMMs) stay in B; they are small.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "backend/backend.hpp"

namespace tessera {

class WeightGradStore {
 public:
  explicit WeightGradStore(Backend& be) : be_(be) {}
  WeightGradStore(const WeightGradStore&) = delete;
  WeightGradStore& operator=(const WeightGradStore&) = delete;

  // One B pass (a micro-batch of one model chunk): between begin_pass and end_pass the weight
  // halves are recorded; begin_piece names the piece (model/params.hpp) the GEMMs that follow
  // belong to, in the order the backward meets them.
  void begin_pass();
  void begin_piece(int piece);
  void end_pass();
  bool recording() const { return recording_; }
  // Records the weight half of matmul_backward(dinp, dw, dbias, dout, inp, w) (whose input half
  // the caller runs), or of a grouped call's groups (their dweight set).
  void defer(Tensor& dw, Tensor* dbias, const Tensor& dout, const Tensor& inp, const Tensor& w);
  void defer_grouped(const std::vector<Backend::GroupedGemm>& groups);
  // The same for embedding_backward(dtable, dout, ids, row_begin): recorded where a deferred GEMM
  // also writes the table's gradient (a tied output layer on the rank), so that the table takes
  // its sums in the whole backward's order.
  void defer_embedding(Tensor& dtable, const Tensor& dout, const Tensor& ids, int64_t row_begin);

  // Recorded passes whose W has not run, and the bytes of operands they hold.
  int pending() const { return static_cast<int>(passes_.size()) - (recording_ ? 1 : 0); }
  double pending_bytes() const;
  // The bytes of the oldest pending pass (0 without).
  double oldest_bytes() const;
  // The most bytes of buffers the store has held at once (pending passes and its free pool).
  double held_bytes() const { return held_bytes_; }
  // Runs the oldest pending pass: each piece's GEMM halves, then piece_done(piece), piece by piece
  // in the order B met them (pieces without GEMMs too).
  void run_oldest(const std::function<void(int)>& piece_done);

 private:
  struct Gemm {
    Tensor dw, db, dout, inp, w;  // db undefined without a bias; an embedding's: inp the ids
  };
  enum class Kind { Gemm, Grouped, Embedding };
  struct Entry {
    int piece = 0;
    Kind kind = Kind::Gemm;
    std::vector<Gemm> gemms;  // one, or a grouped call's groups
    int64_t row_begin = 0;    // an embedding's first vocabulary row
  };
  struct Pass {
    std::vector<int> pieces;      // in the order B met them
    std::vector<Entry> entries;   // in the order B recorded them
    std::vector<Tensor> buffers;  // the copies' storage, back to the pool after W
    double bytes = 0;
  };
  // A new entry of `kind` in the recording pass's current piece.
  Entry entry(Kind kind) const;
  // A copy of `t` in a buffer of the recording pass (reused from the pool where one fits; with
  // `headroom`, a new one a quarter larger: an expert block's size changes with the routing).
  Tensor hold(const Tensor& t, bool headroom = false);
  Tensor take(DType dtype, const Shape& shape, bool headroom = false);  // not yet filled

  Backend& be_;
  std::deque<Pass> passes_;        // oldest first; the last is the recording one while recording_
  std::vector<Tensor> pool_;       // buffers of passes whose W has run
  std::vector<int32_t> ids_host_;  // defer_embedding's staging
  bool recording_ = false;
  double held_bytes_ = 0;
};

}  // namespace tessera
