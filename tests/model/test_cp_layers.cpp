// test_cp_layers.cpp (run with mpirun -np 2 and -np 4): context parallelism in the model. Each
// rank holds its two chunks (core/context_parallel.hpp) of every sample and runs attention around
// the ring of all ranks; its activations must be the single-rank model's rows at the same global
// positions, its loss the single-rank loss over its tokens, and after the gradients are summed
// over the ring (what the trainer's DP x CP reduction does) every rank's parameter gradients must
// be the single-rank gradients to 1e-6 (Megatron-LM's ring had wrong attention gradients, #1464).
// For GPT-2 with attention and hidden dropout (masks keyed by global positions), the Llama family
// (RoPE at global positions, grouped-query attention: only the key/value heads travel), ALiBi and
// a dropless MoE (its load-balancing loss summed over the ring: the router's gradient too).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.hpp"
#include "comm/mpi/mpi.hpp"
#include "core/context_parallel.hpp"
#include "model/gpt.hpp"

using namespace tessera;

namespace {

double max_abs_of(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, (double)std::fabs(t.f32()[i]));
  return m;
}

// Rows (B, T_local, C) of the CP rank against the reference's (B, T, C) at the global positions.
void expect_rows(const Tensor& got, const Tensor& want, int B, int T, int rank, int cp, double tol,
                 const std::string& what) {
  const int64_t C = want.numel() / (int64_t(B) * T), Tl = T / cp, c = Tl / 2;
  ASSERT_EQ(got.numel(), int64_t(B) * Tl * C) << what;
  const double m = max_abs_of(want);
  ASSERT_GT(m, 0.0) << what << " is all zeros";
  for (int b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t) {
      const int64_t p = cp_position(rank, cp, c, t);
      for (int64_t k = 0; k < C; ++k)
        ASSERT_NEAR(got.f32()[(b * Tl + t) * C + k], want.f32()[(b * T + p) * C + k], tol * m)
            << what << " sample " << b << " position " << p << " feature " << k;
    }
}

enum class Variant { Gpt2Dropout, Llama, Alibi, Moe };

void check(Variant v) {
  MpiCommunicator ring(MPI_COMM_WORLD);
  const int cp = ring.size(), rank = ring.rank();
  GPTConfig cfg;
  cfg.num_layers = 2;
  cfg.hidden_size = 24;
  cfg.num_attention_heads = 4;
  cfg.seq_length = 16;
  cfg.vocab_size = 61;
  cfg.make_vocab_size_divisible_by = 16;
  if (v == Variant::Gpt2Dropout) {
    cfg.attention_dropout = 0.1;
    cfg.hidden_dropout = 0.1;
  } else if (v == Variant::Llama) {
    cfg.position_embedding_type = "rope";
    cfg.normalization = "RMSNorm";
    cfg.swiglu = true;
    cfg.ffn_hidden_size = 40;
    cfg.group_query_attention = true;
    cfg.num_query_groups = 2;
    cfg.untie_embeddings_and_output_weights = true;
    cfg.add_bias_linear = false;
  } else if (v == Variant::Alibi) {
    cfg.position_embedding_type = "alibi";
  } else {  // dropless MoE: the load-balancing counts and statistics span the ring
    cfg.num_experts = 4;
    cfg.moe_router_topk = 2;
    cfg.moe_ffn_hidden_size = 20;
    cfg.moe_aux_loss_coeff = 0.05;
    cfg.moe_z_loss_coeff = 0.001;
  }
  cfg.validate();
  auto be = make_cpu_backend();
  ModelShard one;
  one.chunks = {{0, 2}};
  ModelShard mine = one;
  mine.cp_size = cp;
  mine.cp_rank = rank;
  LocalCommunicator local;
  GPTModel ref(cfg, one, *be, local), par(cfg, mine, *be, local);
  par.set_context_comm(ring);
  ref.init_parameters(3);
  par.init_parameters(3);
  for (GPTModel* m : {&ref, &par})  // biases and norms away from 0/1, identically
    for (const ParamSpec& s : m->params().specs()) {
      if (s.init == ParamInit::Normal) continue;
      float* p = m->params().param(s).f32();
      for (int64_t i = 0; i < s.numel(); ++i)
        p[i] += 0.1f * std::sin(0.37 * double(global_element_index(s, i)) + s.name.size());
    }
  const int B = 2, T = cfg.seq_length, Tl = T / cp, c = Tl / 2;
  std::mt19937 g(4);
  std::uniform_int_distribution<int> tok(0, 60);
  Activations ar = ref.make_activations(B, T), ap = par.make_activations(B, Tl);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      ar.ids.i32()[b * T + t] = tok(g);
      ar.targets.i32()[b * T + t] = t == 5 ? -1 : tok(g);  // one position without a loss
    }
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tl; ++t) {
      const int64_t p = cp_position(rank, cp, c, t);
      ap.ids.i32()[b * Tl + t] = ar.ids.i32()[b * T + p];
      ap.targets.i32()[b * Tl + t] = ar.targets.i32()[b * T + p];
    }
  DropoutContext d;
  d.training = true;
  d.seed = 1234;
  d.iteration = 3;
  d.sample_begin = 7;
  ar.dropout = ap.dropout = d;
  const float scale = 1.0f / (B * T);
  ref.zero_grads();
  par.zero_grads();
  const double lr = ref.forward(ar, scale);
  double lp = par.forward(ap, scale);
  ring.all_reduce_f64(&lp, 1, ReduceOp::Sum);
  EXPECT_NEAR(lp, lr, 1e-6 * lr);
  expect_rows(ap.input, ar.input, B, T, rank, cp, 1e-6, "embedding output");
  for (int l = 0; l < 2; ++l) {
    expect_rows(ap.layers[l].att, ar.layers[l].att, B, T, rank, cp, 1e-5, "attention output");
    expect_rows(ap.layers[l].res2, ar.layers[l].res2, B, T, rank, cp, 1e-5, "layer output");
  }
  ref.backward(ar);
  par.backward(ap);
  expect_rows(ap.dres, ar.dres, B, T, rank, cp, 1e-5, "gradient of the embedding output");
  // The trainer sums gradients over DP x CP: then every rank holds the single-rank gradients.
  for (const ParamSpec& s : par.params().specs()) {
    Tensor gp = par.params().grad(s);
    ring.all_reduce(gp, ReduceOp::Sum);
    const Tensor gr = ref.params().grad(s.name);
    const double m = max_abs_of(gr);
    if (m == 0.0 && s.expert) {  // an expert no token chose: no gradient on any rank either
      EXPECT_EQ(max_abs_of(gp), 0.0) << s.name;
      continue;
    }
    ASSERT_GT(m, 0.0) << s.name;
    for (int64_t i = 0; i < s.numel(); ++i)
      ASSERT_NEAR(gp.f32()[i], gr.f32()[i], 1e-6 * m) << s.name << " element " << i;
  }
}

}  // namespace

TEST(ContextParallel, Gpt2WithDropoutMatchesTheSingleRankModel) {
  check(Variant::Gpt2Dropout);
}
TEST(ContextParallel, LlamaMatchesTheSingleRankModel) {
  check(Variant::Llama);
}
TEST(ContextParallel, AlibiMatchesTheSingleRankModel) {
  check(Variant::Alibi);
}
TEST(ContextParallel, MoeMatchesTheSingleRankModel) {
  check(Variant::Moe);
}
