// muon_plan.cpp: Muon's matrices of a rank and their scratch (run/muon_plan.hpp).
#include "run/muon_plan.hpp"

#include <algorithm>
#include <map>
#include <tuple>

namespace tessera {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

int64_t leading(const Shape& s) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < s.size(); ++i) n *= s[i];
  return n;
}

MuonMatrix whole(const ParamSpec& s, int tp) {
  MuonMatrix m;
  m.name = s.name;
  m.offset = s.flat_offset;
  m.rows = leading(s.local_shape);
  m.cols = s.local_shape.back();
  const int last = static_cast<int>(s.global_shape.size()) - 1;
  m.split = s.split_axis < 0 || tp == 1 ? MuonMatrix::Split::None
            : s.split_axis == last      ? MuonMatrix::Split::Cols
                                        : MuonMatrix::Split::Rows;
  m.global_rows = leading(s.global_shape);
  m.global_cols = s.global_shape.back();
  return m;
}

// `m` cut into `parts` equal row blocks (the query, key and value projections), named.
void add_parts(std::vector<MuonMatrix>& out, const MuonMatrix& m,
               const std::vector<std::string>& parts) {
  const int64_t n = static_cast<int64_t>(parts.size());
  for (int64_t i = 0; i < n; ++i) {
    MuonMatrix p = m;
    p.name = m.name + ":" + parts[size_t(i)];
    p.rows = m.rows / n;
    p.global_rows = m.global_rows / n;
    p.offset = m.offset + i * p.rows * m.cols;
    out.push_back(p);
  }
}

}  // namespace

bool is_muon_param(const ParamSpec& s) {
  // As Megatron routes them (emerging_optimizers.py: the scalar optimizer takes the parameters
  // tagged is_embedding_or_output_parameter, the word embedding and the output layer, and those
  // not 2-D): the learned position embedding is a Muon matrix. Weights decay; biases (Tessera
  // keeps a fused projection's bias as [3, heads, head_dim], a vector in Megatron) and norms do
  // not.
  return s.global_shape.size() >= 2 && s.weight_decay && s.name != "wte" && s.name != "lm_head";
}

std::vector<MuonMatrix> plan_muon_matrices(const std::vector<ParamSpec>& specs, int tp,
                                           bool split_qkv) {
  std::vector<MuonMatrix> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    if (!is_muon_param(s)) continue;
    const MuonMatrix m = whole(s, tp);
    if (ends_with(s.name, "attn.qkv.weight") && split_qkv) {
      add_parts(out, m, {"q", "k", "v"});  // [3, heads, head_dim, hidden]
    } else if (ends_with(s.name, "attn.kv.weight") && split_qkv) {
      add_parts(out, m, {"k", "v"});  // [2, groups, head_dim, hidden]
    } else if (ends_with(s.name, "attn.q.weight") && !split_qkv && i + 1 < specs.size() &&
               ends_with(specs[i + 1].name, "attn.kv.weight")) {
      // One matrix of the query rows and the key/value rows (glued: contiguous in the buffers).
      const MuonMatrix kv = whole(specs[i + 1], tp);
      MuonMatrix qkv = m;
      qkv.name = s.name.substr(0, s.name.size() - 8) + "qkv";  // "layers.0.attn.qkv"
      qkv.rows = m.rows + kv.rows;
      qkv.global_rows = m.global_rows + kv.global_rows;
      out.push_back(qkv);
      ++i;
    } else {
      out.push_back(m);
    }
  }
  return out;
}

MuonNsShape muon_ns_shape(const MuonMatrix& m, int tp, const std::string& tp_mode) {
  MuonNsShape s{m.rows, m.cols, m.rows <= m.cols, false};
  if (m.split == MuonMatrix::Split::None || tp == 1 || tp_mode == "blockwise") return s;
  if (tp_mode == "distributed") {
    s.wide = m.split == MuonMatrix::Split::Cols;
    return s;
  }
  s.gathered = true;
  if (m.split == MuonMatrix::Split::Rows) {
    s.rows = m.rows * tp;
    s.wide = s.rows <= s.cols;
  } else {
    s.cols = m.cols * tp;
    s.wide = true;
  }
  return s;
}

std::vector<std::vector<const MuonMatrix*>> muon_batches(const std::vector<const MuonMatrix*>& ms,
                                                         int tp, const std::string& tp_mode) {
  std::vector<std::vector<const MuonMatrix*>> batches;
  std::map<std::tuple<int64_t, int64_t, int, bool>, size_t> open;  // shape -> its open batch
  for (const MuonMatrix* m : ms) {
    const MuonNsShape ns = muon_ns_shape(*m, tp, tp_mode);
    const auto key = std::make_tuple(m->rows, m->cols, static_cast<int>(m->split), ns.wide);
    const int64_t whole = ns.rows * ns.cols;
    auto it = open.find(key);
    if (it != open.end() && int64_t(batches[it->second].size() + 1) * whole <= kMuonBatchElements) {
      batches[it->second].push_back(m);
      continue;
    }
    open[key] = batches.size();
    batches.push_back({m});
  }
  return batches;
}

double muon_scratch_bytes(const std::vector<MuonMatrix>& matrices, int tp,
                          const TrainConfig::Muon& opt, bool device) {
  double peak = 0;
  const bool lowp = device && opt.matmul_prec != "high";
  std::vector<const MuonMatrix*> all;
  for (const MuonMatrix& m : matrices) all.push_back(&m);
  for (const auto& batch : muon_batches(all, tp, opt.tp_mode)) {
    const MuonMatrix& m = *batch[0];
    const MuonNsShape ns = muon_ns_shape(m, tp, opt.tp_mode);
    const double L = double(batch.size()), X = L * double(ns.rows) * double(ns.cols);
    const double blocks = ns.gathered && m.split == MuonMatrix::Split::Cols ? tp : 1;
    const double g = double(ns.wide ? ns.rows : ns.cols);
    double bytes = 4.0 * L * double(m.numel());          // the batch's directions
    if (opt.nesterov) bytes += 4.0 * double(m.numel());  // Nesterov's term, one at a time
    if (ns.gathered) bytes += 4.0 * X;                   // the whole matrices
    bytes += 4.0 * X / blocks;                           // a product (one block of each)
    bytes += 3 * 4.0 * L * g * g;                        // A, A^2, B
    if (lowp) bytes += 2.0 * X + 2 * 2.0 * L * g * g;    // bf16 copies of X, A, B
    peak = std::max(peak, bytes);
  }
  return peak;
}

}  // namespace tessera
