// muon.cpp: Muon's step (step/muon.hpp).
#include "step/muon.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/ini.hpp"
#include "core/phase_timer.hpp"

namespace tessera {

void muon_coefficients(const std::string& type, int k, double& a, double& b, double& c) {
  // Emerging-Optimizers v0.3.0 muon_utils.py: "quintic" tuned per step, cycled; "simple" one
  // tuple for every step.
  static const double quintic[5][3] = {{4.0848, -6.8946, 2.9270},
                                       {3.9505, -6.3029, 2.6377},
                                       {3.7418, -5.5913, 2.3037},
                                       {2.8769, -3.1427, 1.2046},
                                       {2.8366, -3.0525, 1.2012}};
  if (type == "simple") {
    a = 3.4445, b = -4.7750, c = 2.0315;
    return;
  }
  TESSERA_CHECK(type == "quintic", "Muon: coefficient type ", type);
  const double* q = quintic[k % 5];
  a = q[0], b = q[1], c = q[2];
}

double muon_scale(const std::string& mode, int64_t rows, int64_t cols) {
  const double r = double(rows), c = double(cols);
  if (mode == "spectral") return std::sqrt(std::max(r, c));
  if (mode == "unit_rms_norm") return std::sqrt(r / c);
  TESSERA_CHECK(mode == "shape_scaling", "Muon: scale mode ", mode);
  return std::sqrt(std::max(1.0, r / c));
}

std::string optimizer_state_mismatch(const std::string& saved_config, const std::string& optimizer,
                                     const std::string& path) {
  const auto values = ini_values(saved_config);
  const auto it = values.find("optimizer");
  std::string saved = it == values.end() ? "adam" : it->second;
  if (saved == "dist_muon") saved = "muon";
  if (saved == optimizer) return std::string();
  return "checkpoint " + path + " holds " + saved +
         "'s optimizer state, this run uses --optimizer " + optimizer +
         ": its moments start at zero (the learning-rate schedule continues; resume "
         "with --optimizer " +
         saved + " to keep them)";
}

Muon::Muon(ParamStore& params, Backend& be, const TrainConfig::Muon& opt, Communicator& tp,
           Tensor& momentum)
    : params_(params), be_(be), opt_(opt), tp_(tp), momentum_(&momentum) {
  matrices_ = plan_muon_matrices(params.specs(), tp.size(), opt.split_qkv);
  lowp_ = be.device() != Device::CPU && opt.matmul_prec != "high";
}

Muon::Muon(ParamStore& params, Backend& be, const TrainConfig::Muon& opt, Communicator& tp,
           DistributedAdamW& dist)
    : params_(params), be_(be), opt_(opt), tp_(tp), dist_(&dist) {
  matrices_ = plan_muon_matrices(params.specs(), tp.size(), opt.split_qkv);
  lowp_ = be.device() != Device::CPU && opt.matmul_prec != "high";
}

std::vector<const MuonMatrix*> Muon::all_matrices() const {
  std::vector<const MuonMatrix*> all;
  for (const MuonMatrix& mm : matrices_) all.push_back(&mm);
  return all;
}

void Muon::orthogonalize(Tensor& X, int64_t L, bool wide, Communicator* sum_over) {
  Allocator& al = be_.allocator();
  const int64_t nb = X.dim(0) / L, r = X.dim(1), c = X.dim(2), n = r * c;
  auto block = [&](Tensor& t, int64_t j) { return t.view(j * L * n, {L, r, c}); };
  // Each matrix over its Frobenius norm (its blocks' squares, summed over `sum_over`).
  std::vector<double> ss(size_t(L), 0.0);
  for (int64_t i = 0; i < L; ++i) {
    std::vector<Tensor> mine;
    for (int64_t j = 0; j < nb; ++j) mine.push_back(X.view((j * L + i) * n, {r, c}));
    ss[size_t(i)] = be_.sum_squares_all(mine);
  }
  if (sum_over) sum_over->all_reduce_f64(ss.data(), L, ReduceOp::Sum);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < nb; ++j) {
      Tensor x = X.view((j * L + i) * n, {r, c});
      be_.scale(x, static_cast<float>(1.0 / std::max(std::sqrt(ss[size_t(i)]), 1e-7)));
    }
  // The Gram side: the rows of every block (wide) or the columns (tall).
  const int64_t g = wide ? r : c;
  Tensor A({L, g, g}, DType::F32, al), A2({L, g, g}, DType::F32, al), B({L, g, g}, DType::F32, al);
  const DType gd = lowp_ ? DType::BF16 : DType::F32;
  Tensor Ab, Bb, low;  // bf16 copies of A, B and X (lowp)
  if (lowp_) Ab = Tensor(A.shape(), gd, al), Bb = Tensor(B.shape(), gd, al);
  if (lowp_) low = Tensor(X.shape(), gd, al);
  Tensor prod({L, r, c}, DType::F32, al);  // one block of each matrix at a time
  for (int k = 0; k < opt_.ns_steps; ++k) {
    double a = 0, b = 0, cc = 0;
    muon_coefficients(opt_.coefficients, k, a, b, cc);
    if (lowp_) be_.cast(low, X);
    Tensor& src = lowp_ ? low : X;
    for (int64_t j = 0; j < nb; ++j) {
      const Tensor x = block(src, j);
      be_.gemm(A, x, !wide, x, wide, 1.f, j == 0 ? 0.f : 1.f);  // X X^T or X^T X, summed
    }
    if (sum_over) sum_over->all_reduce(A, ReduceOp::Sum);
    if (lowp_) be_.cast(Ab, A);
    be_.gemm(A2, lowp_ ? Ab : A, false, lowp_ ? Ab : A, false, 1.f, 0.f);
    be_.scale(A, static_cast<float>(b));
    be_.scale(A2, static_cast<float>(cc));
    be_.add(B, A, A2);
    if (lowp_) be_.cast(Bb, B);
    const Tensor& bm = lowp_ ? Bb : B;
    for (int64_t j = 0; j < nb; ++j) {
      const Tensor x = block(src, j);
      if (wide)
        be_.gemm(prod, bm, false, x, false, 1.f, 0.f);  // B X
      else
        be_.gemm(prod, x, false, bm, false, 1.f, 0.f);  // X B (B is symmetric)
      Tensor xj = block(X, j);
      be_.scale(xj, static_cast<float>(a));
      be_.add(xj, xj, prod);
    }
  }
}

void Muon::momentum(Tensor& m, const Tensor& g, Tensor& u, double grad_scale) {
  const double beta = opt_.momentum;
  be_.cast(u, g);  // a copy
  be_.scale(u, static_cast<float>((1 - beta) * grad_scale));
  be_.scale(m, static_cast<float>(beta));
  be_.add(m, m, u);
  if (opt_.nesterov) {  // u = (1 - beta) g + beta m
    Tensor bm(u.shape(), DType::F32, be_.allocator());
    be_.cast(bm, m);
    be_.scale(bm, static_cast<float>(beta));
    be_.add(u, u, bm);
  } else {
    be_.cast(u, m);
  }
}

double Muon::scale_of(const MuonMatrix& mm) const {
  const bool local = opt_.tp_mode == "blockwise";
  return muon_scale(opt_.scale_mode, local ? mm.rows : mm.global_rows,
                    local ? mm.cols : mm.global_cols) *
         opt_.extra_scale;
}

std::vector<Tensor> Muon::orthogonal(const std::vector<const MuonMatrix*>& batch, Tensor& U,
                                     Tensor& whole) {
  const MuonMatrix& mm = *batch[0];
  const int T = tp_.size(), r0 = tp_.rank();
  const int64_t L = static_cast<int64_t>(batch.size()), n = mm.numel();
  const Shape shape{mm.rows, mm.cols};
  const MuonNsShape ns = muon_ns_shape(mm, T, opt_.tp_mode);
  std::vector<Tensor> mine;
  if (ns.gathered && mm.split == MuonMatrix::Split::Rows) {
    // Each matrix gathered whole, its rows in shard order: one block of (T rows, cols) each.
    whole = Tensor({L, T * mm.rows, mm.cols}, DType::F32, be_.allocator());
    for (int64_t i = 0; i < L; ++i) {
      Tensor w = whole.view(i * T * n, {T * mm.rows, mm.cols});
      tp_.all_gather(w, U.view(i * n, shape));
      mine.push_back(whole.view((i * T + r0) * n, shape));
    }
    orthogonalize(whole, L, ns.wide, nullptr);
  } else if (ns.gathered) {
    // Column blocks: one gather of the batch puts block t of matrix i at t L + i, as
    // orthogonalize reads them (Newton-Schulz commutes with permuting the columns).
    whole = Tensor({T * L, mm.rows, mm.cols}, DType::F32, be_.allocator());
    tp_.all_gather(whole, U);
    for (int64_t i = 0; i < L; ++i) mine.push_back(whole.view((r0 * L + i) * n, shape));
    orthogonalize(whole, L, ns.wide, nullptr);
  } else {
    // Unsplit, blockwise (the shard alone), or distributed (the Gram matrices summed over TP).
    const bool distributed =
        opt_.tp_mode == "distributed" && mm.split != MuonMatrix::Split::None && T > 1;
    orthogonalize(U, L, ns.wide, distributed ? &tp_ : nullptr);
    for (int64_t i = 0; i < L; ++i) mine.push_back(U.view(i * n, shape));
  }
  return mine;
}

void Muon::step(double lr, double weight_decay, double grad_scale) {
  TESSERA_PHASE("muon-step");
  if (dist_) {
    step_layerwise(lr, weight_decay, grad_scale);
    return;
  }
  Allocator& al = be_.allocator();
  const bool mixed = params_.compute_dtype() != DType::F32;
  for (const auto& batch : muon_batches(all_matrices(), tp_.size(), opt_.tp_mode)) {
    const int64_t L = static_cast<int64_t>(batch.size()), n = batch[0]->numel();
    Tensor U({L, batch[0]->rows, batch[0]->cols}, DType::F32, al), whole;
    for (int64_t i = 0; i < L; ++i) {
      const MuonMatrix& mm = *batch[size_t(i)];
      const Shape shape{mm.rows, mm.cols};
      Tensor g = params_.flat_grads().view(mm.offset, shape);
      Tensor m = momentum_->view(mm.offset, shape);
      Tensor u = U.view(i * n, shape);
      momentum(m, g, u, grad_scale);
    }
    std::vector<Tensor> mine = orthogonal(batch, U, whole);
    for (int64_t i = 0; i < L; ++i) {
      const MuonMatrix& mm = *batch[size_t(i)];
      const Shape shape{mm.rows, mm.cols};
      Tensor p = params_.flat_params().view(mm.offset, shape);
      be_.scale(p, static_cast<float>(1 - lr * weight_decay));
      be_.scale(mine[size_t(i)], static_cast<float>(-lr * scale_of(mm)));
      be_.add(p, p, mine[size_t(i)]);
      if (mixed) {
        Tensor c = params_.flat_compute().view(mm.offset, shape);
        be_.cast(c, p);
      }
    }
  }
}

void Muon::step_layerwise(double lr, double weight_decay, double grad_scale) {
  Allocator& al = be_.allocator();
  const auto& buckets = params_.buckets();
  const bool mixed = params_.compute_dtype() != DType::F32;
  for (const DistributedAdamW::Block& k : dist_->blocks()) {
    const FlatBucket& fb = buckets[size_t(k.bucket)];
    std::vector<const MuonMatrix*> mine;
    for (const MuonMatrix& mm : matrices_)
      if (mm.offset >= fb.begin && mm.offset < fb.end) mine.push_back(&mm);
    if (mine.empty()) continue;
    // The momentum of this rank's elements, and their direction u into the bucket.
    Tensor U({fb.numel()}, DType::F32, al), O({fb.numel()}, DType::F32, al);
    be_.zero(U);
    be_.zero(O);
    for (const MuonMatrix* mm : mine) {
      const int64_t lo = std::max(k.flat_begin, mm->offset);
      const int64_t hi = std::min(k.flat_end, mm->offset + mm->numel());
      if (lo >= hi) continue;
      const Shape n{hi - lo};
      Tensor g = dist_->block_grads(k).view(lo - k.flat_begin, n);  // FSDP: the shard
      Tensor m = dist_->first_moment().view(k.shard_begin + (lo - k.flat_begin), n);
      Tensor u = U.view(lo - fb.begin, n);
      momentum(m, g, u, grad_scale);
    }
    k.comm->all_gather_async(U)->wait_device();  // every matrix whole, on every rank
    // The bucket's matrices dealt to the ranks in turn: -lr s NS(u) of one's own into O, the
    // same-shaped ones of a rank in batches (their directions copied out of the bucket).
    const int P = k.comm->size(), me = k.comm->rank();
    std::vector<const MuonMatrix*> own;
    for (size_t i = 0; i < mine.size(); ++i)
      if (static_cast<int>(i % size_t(P)) == me) own.push_back(mine[i]);
    for (const auto& batch : muon_batches(own, tp_.size(), opt_.tp_mode)) {
      const int64_t L = static_cast<int64_t>(batch.size()), n = batch[0]->numel();
      const Shape shape{batch[0]->rows, batch[0]->cols};
      Tensor B({L, shape[0], shape[1]}, DType::F32, al), whole;
      for (int64_t i = 0; i < L; ++i) {
        Tensor b = B.view(i * n, shape);
        be_.cast(b, U.view(batch[size_t(i)]->offset - fb.begin, shape));
      }
      std::vector<Tensor> parts = orthogonal(batch, B, whole);
      for (int64_t i = 0; i < L; ++i) {
        const MuonMatrix& mm = *batch[size_t(i)];
        be_.scale(parts[size_t(i)], static_cast<float>(-lr * scale_of(mm)));
        Tensor o = O.view(mm.offset - fb.begin, shape);
        be_.cast(o, parts[size_t(i)]);
      }
    }
    k.comm->reduce_scatter_async(O)->wait_device();  // this rank's block: its elements' updates
    Tensor w = dist_->block_weights(k), c = dist_->block_compute(k);
    const Tensor ob = O.view(int64_t(me) * k.numel(), {k.numel()});
    for (const MuonMatrix* mm : mine) {
      const int64_t lo = std::max(k.flat_begin, mm->offset);
      const int64_t hi = std::min(k.flat_end, mm->offset + mm->numel());
      if (lo >= hi) continue;
      const Shape n{hi - lo};
      Tensor p = w.view(lo - k.flat_begin, n);
      be_.scale(p, static_cast<float>(1 - lr * weight_decay));
      be_.add(p, p, ob.view(lo - k.flat_begin, n));
      if (mixed) {
        Tensor cp = c.view(lo - k.flat_begin, n);
        be_.cast(cp, p);
      }
    }
  }
}

}  // namespace tessera
