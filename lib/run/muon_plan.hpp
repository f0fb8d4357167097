// muon_plan.hpp: which of a rank's parameters Muon updates, cut into the matrices it
// orthogonalizes (issue 59; docs/training.md "Muon"), and the scratch that costs. No backend: the
// optimizer (step/muon.hpp) and the memory estimate both read it.
//
// As Megatron-Core (Megatron-LM d98e8a6 with Emerging-Optimizers v0.3.0): every weight matrix
// except the word and position embeddings and the output layer is a Muon matrix (the router and
// each routed expert's weights included); norms and biases (Megatron's 1-D parameters; Tessera
// keeps some biases in several dimensions, [3, heads, head_dim]: the parameters without weight
// decay) and those three stay on AdamW. A weight is the matrix (the product of its leading
// dimensions x its last one) it is as a GEMM's operand. With --muon-split-qkv (the default) the
// query, key and value projections are three matrices (all query heads together, all key heads, all
// value heads); without it one. SwiGLU's gate and up projection are one matrix, each MLA projection
// its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/params.hpp"
#include "run/train_config.hpp"

namespace tessera {

struct MuonMatrix {
  std::string name;            // the parameter's ("layers.0.attn.qkv.weight:q" for a split part)
  int64_t offset = 0;          // flat offset of its first local element
  int64_t rows = 0, cols = 0;  // this rank's piece, row-major, contiguous
  // How tensor parallelism cuts the whole matrix: not at all, into row blocks or column blocks.
  enum class Split { None, Rows, Cols } split = Split::None;
  int64_t global_rows = 0, global_cols = 0;  // the whole matrix (the scale's dimensions)
  int64_t numel() const { return rows * cols; }
};

// Whether a spec is on Muon (a matrix that is not an embedding or the output layer).
bool is_muon_param(const ParamSpec& s);

// The Muon matrices of `specs` (a rank's, in flat order) at tensor-parallel size `tp`.
std::vector<MuonMatrix> plan_muon_matrices(const std::vector<ParamSpec>& specs, int tp,
                                           bool split_qkv);

// The matrix Newton-Schulz iterates on for `m` under --muon-tp-mode `tp_mode` at TP `tp`: the
// whole matrix gathered (duplicated, cut by TP), else this rank's piece; `wide`: the Gram matrix
// is over the rows (X X^T) rather than the columns (a column-cut matrix gathered iterates on its
// column blocks, a distributed one over the side TP does not cut).
struct MuonNsShape {
  int64_t rows = 0, cols = 0;
  bool wide = true, gathered = false;
};
MuonNsShape muon_ns_shape(const MuonMatrix& m, int tp, const std::string& tp_mode);

// Newton-Schulz's batches: the matrices of `ms` (in their order) that iterate together, one
// batched GEMM per product: the same piece, TP cut and Newton-Schulz shape, at most
// kMuonBatchElements elements of whole matrices in a batch (a larger matrix alone).
constexpr int64_t kMuonBatchElements = int64_t(64) << 20;  // 256 MiB in f32
std::vector<std::vector<const MuonMatrix*>> muon_batches(const std::vector<const MuonMatrix*>& ms,
                                                         int tp, const std::string& tp_mode);

// The Newton-Schulz scratch of one step, in bytes, for the largest batch of `matrices` (f32: the
// batch's directions, the gathered whole matrices under the duplicated TP mode, a product, the
// Gram matrices; bf16 copies on CUDA).
double muon_scratch_bytes(const std::vector<MuonMatrix>& matrices, int tp,
                          const TrainConfig::Muon& m, bool device);

}  // namespace tessera
