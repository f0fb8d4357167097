// muon.hpp: Muon (issue 59; docs/training.md "Muon"): momentum orthogonalized by Newton-Schulz
// for the hidden layers' matrices (run/muon_plan.hpp says which), as Megatron-Core runs it
// (Megatron-LM d98e8a6, Emerging-Optimizers v0.3.0 orthogonalized_optimizer.py / muon_utils.py):
//
//   p <- p (1 - lr wd)                          decoupled weight decay
//   m <- beta m + (1 - beta) g                  (g: the clipped gradient; m starts at 0)
//   u  = Nesterov ? (1 - beta) g + beta m : m
//   p <- p - lr * scale(rows, cols) * extra * NS(u)
//
// NS: u / max(||u||_F, 1e-7), then per step (a, b, c) (quintic: five tuned tuples, cycled;
// simple: 3.4445, -4.7750, 2.0315) X <- a X + (b A + c A^2) X with A = X X^T (or, for a tall
// matrix, X <- a X + X (b A + c A^2) with A = X^T X: the same polynomial). A tensor-parallel
// matrix is orthogonalized whole: gathered on every TP rank (duplicated), or with its Gram
// matrices summed over TP (distributed); blockwise treats each shard as a matrix of its own
// (layout-dependent). Same-shaped matrices iterate together (muon_batches: one batched GEMM per
// product, cuBLAS's strided batches on CUDA, bf16 inputs unless --muon-fp32-matmul-prec high;
// f32 on the CPU).
//
// The momentum lives in AdamW's first-moment buffer at the matrix's offsets, so checkpoints save
// and reshard it as optimizer/exp_avg; the parameters Muon does not update take AdamW's step.
#pragma once

#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/params.hpp"
#include "run/muon_plan.hpp"
#include "run/train_config.hpp"
#include "step/dist_optimizer.hpp"

namespace tessera {

// The Newton-Schulz coefficients (a, b, c) of step k (0-based) of `type` ("quintic", "simple").
void muon_coefficients(const std::string& type, int k, double& a, double& b, double& c);
// The update's scale for a (rows, cols) matrix under `mode` (spectral, unit_rms_norm,
// shape_scaling).
double muon_scale(const std::string& mode, int64_t rows, int64_t cols);

// "" when a checkpoint saved with `saved_config` (its options, INI) holds optimizer state for
// `optimizer` ("adam", "muon"); else the warning that its moments are not reused (they start at
// zero; the schedule continues). A checkpoint without the key was saved by AdamW.
std::string optimizer_state_mismatch(const std::string& saved_config, const std::string& optimizer,
                                     const std::string& path);

class Muon {
 public:
  // `momentum`: the flat buffer of the parameters' size whose Muon ranges hold the momentum
  // (AdamW's first moment); `tp`: the tensor-parallel group.
  Muon(ParamStore& params, Backend& be, const TrainConfig::Muon& opt, Communicator& tp,
       Tensor& momentum);
  // Over the distributed optimizer (--optimizer dist_muon, or muon with
  // --use-distributed-optimizer): the momentum in its first moments; each step is layer-wise
  // (step_layerwise).
  Muon(ParamStore& params, Backend& be, const TrainConfig::Muon& opt, Communicator& tp,
       DistributedAdamW& dist);
  const std::vector<MuonMatrix>& matrices() const { return matrices_; }
  // One step: lr and wd of the schedules, `grad_scale` the clip coefficient (applied as the
  // gradients are read). In mixed precision the compute copy of each matrix is refreshed.
  void step(double lr, double weight_decay, double grad_scale);

 private:
  // Megatron's layer-wise distribution over the distributed optimizer's element blocks: each DP
  // rank updates the momentum of its blocks' elements; per bucket the update direction u is
  // all-gathered (each rank then has every matrix whole), the bucket's matrices are dealt to the
  // ranks in turn, each rank orthogonalizes its own and writes -lr s NS(u) into an otherwise zero
  // bucket, and a reduce-scatter hands every rank its block of that (exact: one rank's value plus
  // zeros); each rank applies it to its blocks. Two f32 collectives of the bucket per step (an
  // all-reduce's bytes); Newton-Schulz's compute divided by DP.
  void step_layerwise(double lr, double weight_decay, double grad_scale);
  // m <- beta m + (1 - beta) clip g, and u (f32, same shape) = the direction to orthogonalize.
  void momentum(Tensor& m, const Tensor& g, Tensor& u, double grad_scale);
  // NS(u) of each whole matrix of a batch (muon_batches), U (L, rows, cols) the directions of
  // this rank's pieces in the batch's order; returns the view of this rank's part of each (in U,
  // or in a gathered buffer `whole` it allocates).
  std::vector<Tensor> orthogonal(const std::vector<const MuonMatrix*>& batch, Tensor& U,
                                 Tensor& whole);
  // The update's scale times the extra factor, of the whole (or, blockwise, the local) matrix.
  double scale_of(const MuonMatrix& mm) const;
  // Newton-Schulz over L matrices at once, X (nb L, r, c) their blocks (block j of matrix i at
  // j L + i): column blocks (wide: Gram over the rows) or row blocks (tall: Gram over the
  // columns), each product one batched GEMM; `sum_over`: the group whose blocks make the matrices
  // (distributed), null when X is all of them.
  void orthogonalize(Tensor& X, int64_t L, bool wide, Communicator* sum_over);
  std::vector<const MuonMatrix*> all_matrices() const;

  ParamStore& params_;
  Backend& be_;
  TrainConfig::Muon opt_;
  Communicator& tp_;
  Tensor* momentum_ = nullptr;        // replicated: AdamW's first moment (flat offsets)
  DistributedAdamW* dist_ = nullptr;  // layer-wise: its first moments (shard offsets)
  std::vector<MuonMatrix> matrices_;
  bool lowp_ = false;  // bf16 GEMM inputs (CUDA, --muon-fp32-matmul-prec low or medium)
};

}  // namespace tessera
