// grid_layout.cpp: the process grid's arithmetic (comm/grid_layout.hpp).
#include "comm/grid_layout.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace tessera {

GridLayout GridLayout::make(int world, int tp, int pp, int cp) {
  using detail::concat;
  if (tp < 1)
    throw ConfigError(
        concat("--tensor-model-parallel-size=", tp, " is out of range (allowed: >= 1)"));
  if (pp < 1)
    throw ConfigError(
        concat("--pipeline-model-parallel-size=", pp, " is out of range (allowed: >= 1)"));
  if (cp < 1)
    throw ConfigError(concat("--context-parallel-size=", cp, " is out of range (allowed: >= 1)"));
  if (world % (tp * cp * pp) != 0) {
    if (cp == 1)
      throw ConfigError(concat("world size ", world,
                               " is not divisible by --tensor-model-parallel-size=", tp,
                               " x --pipeline-model-parallel-size=", pp, " = ", tp * pp,
                               " (run a multiple of ", tp * pp, " ranks, or change TP/PP)"));
    throw ConfigError(
        concat("world size ", world, " is not divisible by --tensor-model-parallel-size=", tp,
               " x --context-parallel-size=", cp, " x --pipeline-model-parallel-size=", pp, " = ",
               tp * cp * pp, " (run a multiple of ", tp * cp * pp, " ranks, or change TP/CP/PP)"));
  }
  GridLayout g;
  g.world = world;
  g.tp = tp;
  g.pp = pp;
  g.cp = cp;
  g.dp = world / (tp * cp * pp);
  return g;
}

GridCoords GridLayout::coords(int rank) const {
  GridCoords c;
  c.tp = rank % tp;
  c.cp = (rank / tp) % cp;
  c.dp = (rank / (tp * cp)) % dp;
  c.pp = rank / (tp * cp * dp);
  return c;
}

std::vector<std::vector<int>> GridLayout::tp_groups() const {
  std::vector<std::vector<int>> g;
  for (int p = 0; p < pp; ++p)
    for (int d = 0; d < dp; ++d)
      for (int k = 0; k < cp; ++k) {
        g.emplace_back();
        for (int t = 0; t < tp; ++t) g.back().push_back(rank_of(t, p, d, k));
      }
  return g;
}

std::vector<std::vector<int>> GridLayout::pp_groups() const {
  std::vector<std::vector<int>> g;
  for (int d = 0; d < dp; ++d)
    for (int k = 0; k < cp; ++k)
      for (int t = 0; t < tp; ++t) {
        g.emplace_back();
        for (int p = 0; p < pp; ++p) g.back().push_back(rank_of(t, p, d, k));
      }
  return g;
}

std::vector<std::vector<int>> GridLayout::dp_groups() const {
  std::vector<std::vector<int>> g;
  for (int p = 0; p < pp; ++p)
    for (int k = 0; k < cp; ++k)
      for (int t = 0; t < tp; ++t) {
        g.emplace_back();
        for (int d = 0; d < dp; ++d) g.back().push_back(rank_of(t, p, d, k));
      }
  return g;
}

std::vector<std::vector<int>> GridLayout::cp_groups() const {
  std::vector<std::vector<int>> g;
  for (int p = 0; p < pp; ++p)
    for (int d = 0; d < dp; ++d)
      for (int t = 0; t < tp; ++t) {
        g.emplace_back();
        for (int k = 0; k < cp; ++k) g.back().push_back(rank_of(t, p, d, k));
      }
  return g;
}

std::vector<std::vector<int>> GridLayout::grad_groups() const {
  std::vector<std::vector<int>> g;
  for (int p = 0; p < pp; ++p)
    for (int t = 0; t < tp; ++t) {
      g.emplace_back();
      for (int d = 0; d < dp; ++d)
        for (int k = 0; k < cp; ++k) g.back().push_back(rank_of(t, p, d, k));
    }
  return g;
}

std::vector<std::vector<int>> GridLayout::model_parallel_groups() const {
  std::vector<std::vector<int>> g;
  for (int d = 0; d < dp; ++d)
    for (int k = 0; k < cp; ++k) {
      g.emplace_back();
      for (int p = 0; p < pp; ++p)
        for (int t = 0; t < tp; ++t) g.back().push_back(rank_of(t, p, d, k));
    }
  return g;
}

std::vector<std::vector<int>> GridLayout::embedding_groups() const {
  std::vector<std::vector<int>> g;
  for (const auto& p : pp_groups()) {
    if (p.size() == 1)
      g.push_back({p[0]});
    else
      g.push_back({p.front(), p.back()});
  }
  return g;
}

void check_expert_parallel(const GridLayout& layout, int ep) {
  if (ep < 1 || layout.dp % ep != 0)
    throw ConfigError(detail::concat(
        "--expert-model-parallel-size=", ep, " does not divide the data-parallel size ", layout.dp,
        " (world ", layout.world, " / (TP ", layout.tp, " x PP ", layout.pp,
        "); experts are split over ranks carved out of DP: allowed a divisor of ", layout.dp, ")"));
}

void check_optimizer_instances(const GridLayout& layout, int ep, int instances) {
  const int grad = layout.dp * layout.cp;
  if (instances < 1 || grad % instances != 0)
    throw ConfigError(detail::concat(
        "--num-distributed-optimizer-instances=", instances,
        " does not divide the data-parallel ranks DP ", layout.dp, " x CP ", layout.cp, " = ", grad,
        " (each instance is an equal group of consecutive data-parallel ranks)"));
  const int expert = layout.dp / std::max(ep, 1) * layout.cp;
  if (ep > 1 && expert % instances != 0)
    throw ConfigError(detail::concat(
        "--num-distributed-optimizer-instances=", instances,
        " does not divide the expert-data-parallel ranks DP ", layout.dp, " / EP ", ep, " x CP ",
        layout.cp, " = ", expert, " (the routed experts' state is split into the same instances)"));
}

}  // namespace tessera
