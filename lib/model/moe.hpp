// moe.hpp: the Mixture-of-Experts layer as a part of a layer (model/parts.hpp; Megatron-Core's MoE
// layer, docs/model.md): the router, this rank's routed experts (with expert parallelism), the
// dispatch and combine, the shared expert (a DenseMlp). It owns its per-step state: the router's
// logged statistics, the tokens each expert received, the aux-loss-free expert bias. The MoE
// layers of a model share one step hook (MoeRouters, model/moe_routing.cpp), which sums every
// layer's loads over the global batch in one reduction and moves the biases.
//
// The passes are in model/moe.cpp, the router's state in model/moe_routing.cpp, the buffers and
// generation's MoE MLP in model/moe_part.cpp.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/mlp.hpp"
#include "model/parts.hpp"

namespace tessera {

class MoeMlp;

// What a MoE layer keeps of a micro-batch (the shared expert's tensors are the layer's fc1 and
// gelu). R: rows of the permuted buffer (token copies grouped by expert).
struct MoeBuffers {
  Tensor logits;       // (N,E) f32 router logits (every rank's rows, gathered)
  Tensor expert, row;  // (N,K) int32: each slot's expert and permuted row
  Tensor weight;       // (N,K) f32 routing weights
  Tensor x;            // (N*K,C) this rank's token copies grouped by expert
  Tensor out;          // (N*K,C) their expert outputs (partial sums over TP)
  // The expert side: the rows this rank's experts receive (R of them; with expert parallelism
  // from every rank of the EP group, by sender then expert; without, x and out).
  Tensor xe, fc1, act;              // (R,C), (R, expert fc1 width), (R, expert width)
  std::vector<int64_t> rows;        // the expert side's blocks: rows of each
  std::vector<int> block_expert;    // and its local expert
  std::vector<int64_t> send, recv;  // rows sent to / received from each EP rank
  // The allgather dispatcher (expert parallelism): every EP rank's routing weights and slots'
  // rows in this rank's expert side (-1: another rank's expert), (EP*N,K); and the expert side's
  // outputs (R,C), kept for the backward.
  Tensor ag_weight, ag_row, oute;
  std::vector<int64_t> routed;  // tokens routed to each expert (per load-balancing group)
  float loss_scale = 0;         // the micro-batch's Activations::moe_loss_scale
};

// The MoE layers' shared scratch: expert output and input gradients (R,C), the expert
// activation's and fc1's gradients, the routing weights' (N,K) and the logits' (N,E) gradients
// (f32), and two (N,C); with expert parallelism the expert side's outputs and gradients (R,C)
// before they return; the allgather dispatcher's gathered rows (EP*N,C: inputs, then outputs or
// gradients), logits (EP*N,E), experts (EP*N,K) and routing-weight gradients (EP*N,K); the logits
// in the compute dtype (N,E; mixed precision only).
struct MoeScratch {
  Tensor dout, dact, dfc1, dweight, dlogits, dx, tmp;
  Tensor oute, doute;
  Tensor ag_x, ag_y, ag_logits, ag_expert, ag_dweight;
  Tensor logits_c;
};

// The step hook of a model's MoE layers (one per model; each MoE part registers itself): each
// attempt of an iteration counts the routed tokens and the logged statistics again; after the
// step's last backward every layer's loads are summed over the global batch (one all-reduce) and
// the aux-loss-free expert biases move.
class MoeRouters final : public StepHook {
 public:
  void add(MoeMlp* layer) { layers_.push_back(layer); }
  void begin_attempt(bool rerun) override;
  void end_step(Communicator* grad_group) override;

 private:
  std::vector<MoeMlp*> layers_;  // in the order of the shard's layers
};

class MoeMlp final : public MlpPart, public MoeRouter {
 public:
  // A model's MoE part registers with the model's MoeRouters (PartServices::shared).
  MoeMlp(const GPTConfig& cfg, const ModelShard& shard, const LayerSpec& spec,
         PartServices* services);

  // The router (replicated; every TP rank routes its own rows), this rank's experts by their
  // global index (layout-free names), and the shared expert.
  void add_params(ParamSpecBuilder& b, int l) const override;
  void bind(const ParamStore& ps, int l) override;
  void reduce_tp_grads(int l) override;
  StepHook* step_hook() override { return routers_; }
  int64_t dense_width() const override { return spec_.dense_width / shard_.tp_size; }
  int64_t deferred_elements(const SlotBuilder& sb) const override;

  void recomputed_buffers(const SlotBuilder& sb, LayerActivations& la,
                          int64_t width) const override;
  void kept_buffers(const SlotBuilder& sb, LayerActivations& la, int64_t width) const override;
  void shared_buffers(const SlotBuilder& sb, Activations& shared) const override;
  void fit(const SlotBuilder& sb, LayerActivations& la) const override;

  // ln2 -> out (N,C), partial over TP like fc2's; the backward from the branch gradient dy
  // (N,C, every row) to a.dln (partial over TP); selective recomputation of the routed experts'
  // inputs and activations from the kept routing.
  void forward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
               Tensor& out) override;
  void recompute(PhaseSequence& phase, int l, Activations& a, LayerActivations& la) override;
  void backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                const Tensor& dy) override;

  MoeRouter* router() override { return this; }
  const Stats& stats() const override { return stats_; }
  std::vector<int64_t> take_logged_tokens() override;
  const std::vector<float>& expert_bias() const override;
  void set_expert_bias(const float* values) override;

  // The step hook's work for this layer (MoeRouters): a new attempt; the step's routed tokens
  // (E counts, CP-ring totals) to sum over the global batch, and that sum, which the logged
  // counts take and the expert bias follows.
  void begin_attempt();
  const std::vector<int64_t>& step_tokens();
  void end_step(const double* loads);

 private:
  // N*K token copies leave a rank; its experts receive R rows: the same ones without expert
  // parallelism, else at most N*min(K, local experts) from each of the EP ranks, or their
  // capacity (GPTConfig::moe_received_rows).
  struct Dims {
    int64_t E, K, NK, R, efl, glu;
    int ep;
    bool allgather;
  };
  Dims dims(const SlotBuilder& sb) const;
  // The forward in generation (a.inference): la.ln2 -> out, a partial sum over TP like fc2's
  // output. Dropless whatever the capacity factor (as Hugging Face's Mixtral); TP rank 0's logits
  // route every rank (a batch of new tokens need not divide over TP); no statistics.
  void infer(Activations& a, LayerActivations& la, Tensor& out);
  // The rows of a micro-batch this TP rank routes: its sequence-parallel rows, else its 1/TP.
  int64_t router_rows(const Activations& a) const;
  // The routing options: the model's with this layer's expert bias.
  MoERouting current_routing() const;
  Communicator& ep_group() const;
  void activation(Tensor& out, const Tensor& fc1) const {
    mlp_activation_forward(be(), spec_.activation, out, fc1);
  }
  Tensor& activation_backward(PhaseSequence& phase, Tensor& dact, Tensor& dfc1_swiglu,
                              const Tensor& fc1) const;
  // The steps of forward: the router logits (every rank's rows in MoeBuffers::logits); the logged
  // load-balance and z-loss metrics; the token copies to the expert side (counts first: plan;
  // or the allgather dispatcher); the experts' MLPs into oute; their outputs back into token
  // order in out.
  void router_forward(PhaseSequence& phase, Activations& a, LayerActivations& la);
  void record_stats(const Activations& a, const LayerActivations& la, int64_t group_rows);
  void count_step_tokens(const std::vector<int64_t>& routed);
  void dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la, int64_t group_rows,
                const std::vector<int64_t>& kept, bool allgather, const MoERouting& routing);
  void plan(LayerActivations& la, const std::vector<int64_t>& kept);
  void allgather_dispatch(PhaseSequence& phase, Activations& a, LayerActivations& la,
                          int64_t group_rows, const MoERouting& routing);
  void experts_forward(PhaseSequence& phase, int l, const Activations& a, LayerActivations& la,
                       Tensor& oute);
  void combine(PhaseSequence& phase, Activations& a, LayerActivations& la, Tensor& oute,
               Tensor& out, bool allgather);
  // The steps of backward, mirrors of the forward's: the expert outputs' and routing weights'
  // gradients from dy; the experts' MLPs' backward (input gradients into de); those back into
  // token order in a.dln; the router's gradients.
  void combine_backward(PhaseSequence& phase, Activations& a, LayerActivations& la,
                        const Tensor& dy, Tensor& de, bool allgather);
  void experts_backward(PhaseSequence& phase, int l, Activations& a, LayerActivations& la,
                        Tensor& de);
  void dispatch_backward(PhaseSequence& phase, Activations& a, LayerActivations& la, Tensor& de,
                         bool allgather);
  void router_grad(PhaseSequence& phase, Activations& a, LayerActivations& la);

  MoeRouters* routers_ = nullptr;
  std::unique_ptr<DenseMlp> shared_;               // the shared expert (null: none)
  Tensor router_w_, router_g_;                     // the router's weight and its gradient
  std::vector<MlpWeights> experts_w_, experts_g_;  // this rank's routed experts, in order
  MoERouting routing_;                             // the router's settings
  Stats stats_;                                    // since the attempt began
  // The expert bias (f32; E entries with --moe-router-enable-expert-bias), the step's routed
  // tokens (this rank's micro-batches, CP-ring totals) and the global counts since the last log.
  std::vector<float> expert_bias_;
  std::vector<int64_t> step_tokens_, logged_tokens_;
  // Testing (the layout-equivalence test): TESSERA_TEST_MOE_LOGIT_BIAS="e:v,e:v" adds v to
  // expert e's router logit (to force all tokens onto some experts), and
  // TESSERA_FAULT_MOE_DISPATCH=wrong-rank sends one token copy to the wrong expert rank.
  std::vector<std::pair<int, float>> test_logit_bias_;
  bool fault_wrong_rank_ = false;
  // Testing (GPT.RouterMutationsMissTheReference): TESSERA_FAULT_ROUTER.
  bool fault_bias_in_weights_ = false, fault_no_group_limit_ = false;
};

}  // namespace tessera
