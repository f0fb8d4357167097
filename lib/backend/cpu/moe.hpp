// moe.hpp: the Mixture-of-Experts router and token permutation on host arrays (f32), the
// readable reference of the MoE ops (Backend::moe_*, docs/model.md "Mixture of Experts").
//
// Shapes: N tokens, E experts, K experts per token (top-k), C features per row, R = rows of the
// permuted buffer (the token copies kept, grouped by expert, tokens in order within an expert).
#pragma once

#include <cstdint>
#include <vector>

namespace tessera {

// How tokens choose their experts (Megatron-Core's TopKRouter, the aux-loss-free options aside).
struct MoERouting {
  int experts = 0, topk = 1;
  bool sigmoid = false;      // score function: sigmoid (renormalized over the k) or softmax
  bool pre_softmax = false;  // softmax over all experts, then the top k (not renormalized)
  double scaling = 0;        // routing weights times this (0: unscaled)
  // Token dropping (capacity_factor > 0): each expert keeps at most
  // ceil(N * K / E * capacity_factor) token copies per call, those of the highest routing weight
  // (probs; ties: the earlier token) or the earliest tokens (position).
  double capacity_factor = 0;
  bool drop_by_position = false;
  // Group-limited routing (groups > 0): the experts in `groups` equal groups; a token keeps the
  // group_topk groups of the largest sum of their group_score best choice scores (ties: the lower
  // group) and takes its top k among their experts.
  int groups = 0, group_topk = 0, group_score = 0;
  // Aux-loss-free balancing (sigmoid only): expert e's choice score is sigmoid(z_e) + bias[e];
  // the weights are the sigmoid scores without it. Empty: no bias.
  std::vector<float> expert_bias;
  // Whether the choice is by scores other than the logits' order (a bias or groups).
  bool keyed() const { return groups > 0 || !expert_bias.empty(); }
};

// The choice score of expert e (f32, as the CUDA kernel computes it): the logit (softmax over the
// top k), the softmax probability p_e (pre-softmax), or sigmoid(z_e) + bias (sigmoid).
float moe_choice_score(float z, float p, int e, const MoERouting& r);

// The routing of N tokens. For each token its k slots, best first (ties: the lower expert):
//   expert[n*K + k]  the expert, or -1 - expert when the slot was dropped (over capacity);
//   weight[n*K + k]  the routing weight before dropping (a dropped slot contributes nothing);
//   row[n*K + k]     the slot's row in the permuted buffer, -1 when dropped.
// routed[g*E + e]: tokens of group g (rows [g*group_rows, (g+1)*group_rows)) whose top k holds e,
// before dropping (the load-balancing statistics). kept[e]: rows of expert e after dropping; the
// permuted buffer holds expert 0's rows, then expert 1's, ... Returns the rows kept (R).
int64_t moe_route_host(const float* logits, int64_t N, const MoERouting& r, int64_t group_rows,
                       int32_t* expert, float* weight, int32_t* row, std::vector<int64_t>& routed,
                       std::vector<int64_t>& kept);

// The second half of moe_route_host, for a backend that chose the experts and weights itself:
// from expert (valid expert ids, modified for dropped slots) and weight, the routed and kept
// counts, the dropping and the rows.
int64_t moe_assign_rows_host(int32_t* expert, const float* weight, int64_t N, const MoERouting& r,
                             int64_t group_rows, int32_t* row, std::vector<int64_t>& routed,
                             std::vector<int64_t>& kept);

// The load-balancing scores (softmax over all E experts, or the sigmoid normalized over them)
// summed per group into score_sums (groups x E), and the sum over tokens of logsumexp(logits)^2.
void moe_router_stats_host(const float* logits, int64_t N, const MoERouting& r, int64_t group_rows,
                           std::vector<double>& score_sums, double& lse_sq_sum);

// The router's backward: dlogits (N,E) overwritten with the gradient through the routing weights
// (dweight (N,K): d objective / d weight of each slot; dropped slots carry none), plus
// aux_grad[g*E + e] * d score(n, e) for n in group g (the load-balancing loss, d loss / d score),
// plus z_grad * d logsumexp(logits(n))^2 (the z-loss).
void moe_router_backward_host(float* dlogits, const float* logits, int64_t N, const MoERouting& r,
                              const int32_t* expert, const float* weight, const float* dweight,
                              int64_t group_rows, const std::vector<double>& aux_grad,
                              double z_grad);

// x_perm[row] = x[n] for each kept slot (n, k) (rows of C floats).
void moe_permute_host(float* x_perm, const float* x, const int32_t* row, int64_t N, int K,
                      int64_t C);
// y[n] = sum over n's kept slots of weight * out[row] (overwritten).
void moe_unpermute_host(float* y, const float* out, const int32_t* row, const float* weight,
                        int64_t N, int K, int64_t C);
// The unpermute's backward: dout[row] = weight * dy[n]; dweight[n*K+k] = <dy[n], out[row]> (0 for
// dropped slots).
void moe_unpermute_backward_host(float* dout, float* dweight, const float* dy, const float* out,
                                 const int32_t* row, const float* weight, int64_t N, int K,
                                 int64_t C);
// The permute's backward: dx[n] = sum over n's kept slots of dx_perm[row] (overwritten).
void moe_permute_backward_host(float* dx, const float* dx_perm, const int32_t* row, int64_t N,
                               int K, int64_t C);

}  // namespace tessera
