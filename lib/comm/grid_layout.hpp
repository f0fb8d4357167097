// grid_layout.hpp: the arithmetic of the (TP, CP, DP, PP) process grid (DESIGN.md invariant 1,
// Megatron's default order: rank = tp + TP * (cp + CP * (dp + DP * pp))): which world ranks form
// each group. No MPI: --dry-run, the planner and the tests use it as ProcessGrid
// (runtime/process_grid.hpp) does.
#pragma once

#include <vector>

namespace tessera {

struct GridCoords {
  int tp = 0, pp = 0, dp = 0, cp = 0;
};

// The pure arithmetic of the layout, usable without MPI (tests, --dry-run, the layout table).
struct GridLayout {
  int world = 1, tp = 1, pp = 1, dp = 1, cp = 1;
  // Throws ConfigError naming the numbers when world is not divisible by tp * cp * pp.
  static GridLayout make(int world, int tp, int pp, int cp = 1);
  GridCoords coords(int rank) const;
  int rank_of(int tp_rank, int pp_rank, int dp_rank, int cp_rank = 0) const {
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank));
  }
  // The world ranks of each group, in group-rank order, one vector per group. The TP, PP,
  // model-parallel and embedding groups are per (dp, cp): every context-parallel rank is a model
  // replica of its own for them. dp_groups are the data-parallel ranks of the same (tp, cp, pp);
  // grad_groups the ranks whose gradients are summed (DP x CP of the same (tp, pp), rank order
  // cp + CP * dp; the DP groups when CP = 1); cp_groups the context-parallel rings.
  std::vector<std::vector<int>> tp_groups() const;
  std::vector<std::vector<int>> pp_groups() const;
  std::vector<std::vector<int>> dp_groups() const;
  std::vector<std::vector<int>> cp_groups() const;
  std::vector<std::vector<int>> grad_groups() const;
  std::vector<std::vector<int>> model_parallel_groups() const;  // TP x PP of one (dp, cp)
  std::vector<std::vector<int>> embedding_groups() const;  // first and last stage of (tp, cp, dp)
};

// Expert parallelism's condition on the grid: EP divides the data-parallel size (ConfigError
// naming both otherwise). ProcessGrid::use_expert_parallel and --dry-run's layout check call it.
void check_expert_parallel(const GridLayout& layout, int ep);

// HSDP / the partial distributed optimizer's condition: `instances` divides the gradient group
// (DP x CP) and, with expert parallelism, the expert-data-parallel group (DP / EP x CP), each cut
// into `instances` groups of consecutive ranks. ConfigError naming the numbers otherwise.
void check_optimizer_instances(const GridLayout& layout, int ep, int instances);

}  // namespace tessera
