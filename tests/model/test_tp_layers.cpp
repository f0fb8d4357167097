// test_tp_layers.cpp (run with mpirun -np 2 and -np 4): each tensor-parallel layer of the GPT model
// -- vocab-parallel embedding, column-parallel QKV and fc1, row-parallel projection and fc2,
// attention on a share of the heads, vocab-parallel cross-entropy -- gives, forward and backward,
// what the single-rank layer gives: the same activations, and gradients equal to the matching
// slice of the single-rank gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.hpp"
#include "comm/mpi/mpi.hpp"
#include "model/gpt.hpp"

using namespace tessera;

namespace {
void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  double max_abs = 0;
  for (int64_t i = 0; i < want.numel(); ++i)
    max_abs = std::max(max_abs, (double)std::fabs(want.f32()[i]));
  ASSERT_GT(max_abs, 0.0) << what << " is all zeros";
  for (int64_t i = 0; i < want.numel(); ++i)
    ASSERT_NEAR(got.f32()[i], want.f32()[i], tol * max_abs) << what << " element " << i;
}
}  // namespace

namespace {
// The model of `cfg` at TP = the world size against the single-rank model, forward and backward;
// the gradients of replicated parameters that each TP rank sees a share of (Qwen3's q/k norms)
// are summed over TP as the trainer sums them (reduce_sequence_parallel_grads).
void check_every_layer(const GPTConfig& cfg) {
  MpiCommunicator tp(MPI_COMM_WORLD);
  const int n = tp.size();
  auto be = make_cpu_backend();
  ModelShard one;
  one.chunks = {{0, 2}};
  ModelShard mine = one;
  mine.tp_size = n;
  mine.tp_rank = tp.rank();
  LocalCommunicator local;
  GPTModel ref(cfg, one, *be, local), par(cfg, mine, *be, tp);
  ref.init_parameters(3);
  par.init_parameters(3);
  // Perturb biases and LayerNorm away from 0/1 identically (by global index) on both models.
  for (GPTModel* m : {&ref, &par})
    for (const ParamSpec& s : m->params().specs()) {
      if (s.init == ParamInit::Normal) continue;
      float* p = m->params().param(s).f32();
      for (int64_t i = 0; i < s.numel(); ++i)
        p[i] += 0.1f * std::sin(0.37 * double(global_element_index(s, i)) + s.name.size());
    }
  const int B = 2, T = 9;
  std::mt19937 g(4);
  std::uniform_int_distribution<int> tok(0, 60);
  Activations ar = ref.make_activations(B, T), ap = par.make_activations(B, T);
  for (int i = 0; i < B * T; ++i) {
    ar.ids.i32()[i] = ap.ids.i32()[i] = tok(g);
    ar.targets.i32()[i] = ap.targets.i32()[i] = tok(g);
  }
  const float scale = 1.0f / (B * T);
  ref.zero_grads();
  par.zero_grads();
  const double lr = ref.forward(ar, scale), lp = par.forward(ap, scale);
  EXPECT_NEAR(lp, lr, 1e-5 * lr);
  expect_close(ap.input, ar.input, 1e-6, "embedding output");
  for (int l = 0; l < 2; ++l) {
    expect_close(ap.layers[l].ln1, ar.layers[l].ln1, 1e-5, "ln1");
    expect_close(ap.layers[l].res1, ar.layers[l].res1, 1e-5, "attention block output");
    expect_close(ap.layers[l].res2, ar.layers[l].res2, 1e-5, "mlp block output");
  }
  ref.backward(ar);
  par.backward(ap);
  for (int l = 0; l < cfg.num_layers; ++l) par.reduce_sequence_parallel_grads(l);
  expect_close(ap.dres, ar.dres, 1e-5, "gradient of the embedding output");
  // Every parameter gradient is the slice of the single-rank gradient this rank holds.
  for (const ParamSpec& s : par.params().specs()) {
    const Tensor gp = par.params().grad(s), gr = ref.params().grad(s.name);
    Tensor want({s.numel()});
    double max_abs = 0;
    for (int64_t i = 0; i < gr.numel(); ++i)
      max_abs = std::max(max_abs, (double)std::fabs(gr.f32()[i]));
    const int64_t ref_row =
        ref.params().spec(s.name).global_shape.size() > 1
            ? shape_numel(Shape(s.global_shape.begin() + 1, s.global_shape.end()))
            : 1;
    for (int64_t i = 0; i < s.numel(); ++i) {
      int64_t gi = global_element_index(s, i);
      // wte: global rows past the single-rank padding have no counterpart (and are padding).
      if (s.name == "wte" && gi / ref_row >= ref.padded_vocab()) {
        ASSERT_EQ(gp.f32()[i], 0.f) << "padding row of wte has a gradient";
        continue;
      }
      ASSERT_NEAR(gp.f32()[i], gr.f32()[gi], 1e-5 * max_abs) << s.name << " element " << i;
    }
  }
}
}  // namespace

TEST(TensorParallel, EveryLayerMatchesTheSingleRankLayer) {
  GPTConfig cfg;
  cfg.num_layers = 2;
  cfg.hidden_size = 24;
  cfg.num_attention_heads = 4;
  cfg.seq_length = 9;
  cfg.vocab_size = 61;  // padded to 64 * TP: whole padding shards on the last ranks at TP 4
  cfg.make_vocab_size_divisible_by = 16;
  check_every_layer(cfg);
}

// Qwen3: per-head query/key RMSNorms before RoPE, 4 heads of 10 channels (40 wide in a 24-wide
// model; at TP 4 one head per rank), SwiGLU, no biases.
TEST(TensorParallel, Qwen3LayersMatchTheSingleRankLayers) {
  GPTConfig cfg;
  cfg.num_layers = 2;
  cfg.hidden_size = 24;
  cfg.num_attention_heads = 4;
  cfg.kv_channels = 10;
  cfg.qk_layernorm = true;
  cfg.position_embedding_type = "rope";
  cfg.normalization = "RMSNorm";
  cfg.swiglu = true;
  cfg.add_bias_linear = false;
  cfg.seq_length = 9;
  cfg.vocab_size = 61;
  cfg.make_vocab_size_divisible_by = 16;
  check_every_layer(cfg);
}

// Multi-latent attention (DeepSeek-V3): the latents replicated (their gradients summed over TP),
// the up-projections split by heads, YaRN, latent RMSNorms; 4 heads of 6 + 4 RoPE features.
TEST(TensorParallel, MlaLayersMatchTheSingleRankLayers) {
  GPTConfig cfg;
  cfg.num_layers = 2;
  cfg.hidden_size = 24;
  cfg.num_attention_heads = 4;
  cfg.multi_latent_attention = true;
  cfg.q_lora_rank = 10;
  cfg.kv_lora_rank = 8;
  cfg.qk_head_dim = 6;
  cfg.qk_pos_emb_head_dim = 4;
  cfg.v_head_dim = 5;
  cfg.qk_layernorm = true;
  cfg.rotary_interleaved = true;
  cfg.rope_type = "yarn";
  cfg.rotary_scaling_factor = 4;
  cfg.original_max_position_embeddings = 4;
  cfg.mscale = cfg.mscale_all_dim = 0.707;
  cfg.position_embedding_type = "rope";
  cfg.normalization = "RMSNorm";
  cfg.swiglu = true;
  cfg.add_bias_linear = false;
  cfg.seq_length = 9;
  cfg.vocab_size = 61;
  cfg.make_vocab_size_divisible_by = 16;
  check_every_layer(cfg);
}
