// test_cuda_train.cpp: whole training steps on the CUDA backend against the CPU reference: f32
// losses and weights within 1e-5 relative, bf16 within 1% of the CPU's bf16 run and of f32, fp16
// with dynamic loss scaling finite and learning; generation (CUDA graphs) against the CPU's ids.
// Skips where no CUDA device is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "backend/backend.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device.hpp"
#include "data/dataset.hpp"
#include "inference/generator.hpp"
#include "model/params.hpp"
#include "train/tiny.hpp"
#include "train/trainer.hpp"

using namespace tessera;

namespace {
GPTConfig model() {
  return testing_util::small_gpt(128, 2, 96, 300);  // head dim 64: the tiled attention kernels
}
struct Result {
  std::vector<double> losses;
  std::vector<float> params;
};
// The Llama family (issue 15) on the same shape: RoPE (scaled), RMSNorm, SwiGLU, 2 query groups
// of 1 head (grouped-query attention in the tiled kernels), untied head, no biases.
void llama(GPTConfig& m) {
  m.position_embedding_type = "rope";
  m.rotary_base = 500000;
  m.use_rope_scaling = true;
  m.normalization = "RMSNorm";
  m.swiglu = true;
  m.ffn_hidden_size = 256;
  m.group_query_attention = true;
  m.num_query_groups = 1;
  m.untie_embeddings_and_output_weights = true;
  m.add_bias_linear = false;
}
// Qwen2 and Megatron's smaller options on the same shape: the Llama family with biases on q, k and
// v only, 96 channels per head (attention 192 wide in a 128-wide model: the tiled kernels at an
// odd head dimension), interleaved rotary pairs, RMSNorm applied as 1 + w, tied head.
void qwen(GPTConfig& m) {
  llama(m);
  m.add_qkv_bias = true;
  m.kv_channels = 96;
  m.rotary_interleaved = true;
  m.apply_layernorm_1p = true;
  m.untie_embeddings_and_output_weights = false;
}
// Qwen3 (issue 41): the Llama family with 96 channels per head and each query and key head
// RMS-normalized before RoPE (--qk-layernorm: copy_columns and the RMSNorm kernels over rows of
// 96); and Qwen3-MoE: those with a dense layer 0 and 4 SwiGLU experts of width 64 in layer 1.
void qwen3(GPTConfig& m) {
  llama(m);
  m.kv_channels = 96;
  m.qk_layernorm = true;
}
void qwen3_moe(GPTConfig& m) {
  qwen3(m);
  m.num_experts = 4;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 64;
  m.moe_layer_freq = "[0,1]";
  m.moe_aux_loss_coeff = 0.01;
}
// DeepSeek-V3 (issue 41) on the same width: multi-latent attention (latents of 48 and 32, heads
// of 32 + 16 RoPE features in interleaved pairs, values of 32: the generic attention kernels at
// head dim 48; YaRN), layer 1 with 8 experts in 4 groups routed by sigmoid + the expert bias (the
// router kernel's group limit), a shared expert, and one multi-token prediction layer.
void deepseek(GPTConfig& m) {
  llama(m);
  m.use_rope_scaling = false;
  m.group_query_attention = false;
  m.multi_latent_attention = true;
  m.q_lora_rank = 48;
  m.kv_lora_rank = 32;
  m.qk_head_dim = 32;
  m.qk_pos_emb_head_dim = 16;
  m.v_head_dim = 32;
  m.qk_layernorm = true;
  m.rotary_interleaved = true;
  m.rope_type = "yarn";
  m.rotary_scaling_factor = 4;
  m.original_max_position_embeddings = 32;
  m.mscale = m.mscale_all_dim = 0.707;
  m.num_experts = 8;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 64;
  m.moe_layer_freq = "[0,1]";
  m.moe_router_score_function = "sigmoid";
  m.moe_router_enable_expert_bias = true;
  m.moe_router_bias_update_rate = 0.01;
  m.moe_router_num_groups = 4;
  m.moe_router_group_topk = 2;
  m.moe_router_group_score_experts = 2;
  m.moe_router_topk_scaling_factor = 2.5;
  m.moe_shared_expert_intermediate_size = 64;
  m.moe_router_load_balancing_type = "seq_aux_loss";
  m.moe_aux_loss_coeff = 1e-4;
  m.mtp_num_layers = 1;
}
// GPT-2 with squared ReLU and LayerNorm applied as 1 + w.
void squared_relu(GPTConfig& m) {
  m.squared_relu = true;
  m.apply_layernorm_1p = true;
}
// Mixtral's MoE (4 SwiGLU experts, top 2) with the load-balancing and z losses; and GPT-2 with 3
// GELU experts, top 1 of the pre-softmax, a shared expert and capacity dropping.
void mixtral(GPTConfig& m) {
  llama(m);
  m.num_experts = 4;
  m.moe_router_topk = 2;
  m.moe_aux_loss_coeff = 0.01;
  m.moe_z_loss_coeff = 0.001;
}
void moe_gpt2(GPTConfig& m) {
  m.num_experts = 3;
  m.moe_router_topk = 1;
  m.moe_router_pre_softmax = true;
  m.moe_shared_expert_intermediate_size = 64;
  m.moe_expert_capacity_factor = 1.2;
}
Result train(Backend& be, DType d, int iters, const std::function<void(TrainConfig&)>& options = {},
             double dropout = 0, const std::function<void(GPTConfig&)>& model_options = {}) {
  GPTConfig m = model();
  m.attention_dropout = m.hidden_dropout = dropout;
  if (model_options) model_options(m);
  TrainConfig t;
  t.micro_batch_size = 2;
  t.global_batch_size = 4;
  t.train_iters = iters;
  t.lr = 3e-3;
  t.lr_warmup_iters = 2;
  t.log_interval = 1000;
  t.compute_dtype = d;
  if (options) options(t);
  auto data = make_mock_dataset(m.vocab_size, m.seq_length, 99);
  Trainer tr(m, t, be, *data);
  Result r;
  for (const StepStats& s : tr.train()) r.losses.push_back(s.loss);
  if (!tr.model().params().has_master()) return r;  // the distributed optimizer holds them
  Tensor& p = tr.model().params().flat_params();
  r.params.resize(static_cast<size_t>(p.numel()));
  be.copy_to_host(r.params.data(), p);
  return r;
}
class CudaTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
    cuda::set_device(0);
    cpu_ = make_cpu_backend();
    gpu_ = make_cuda_backend();
  }
  std::unique_ptr<Backend> cpu_, gpu_;
};
double worst_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double w = 0;
  for (size_t i = 0; i < a.size(); ++i) w = std::max(w, std::fabs(a[i] - b[i]) / std::fabs(a[i]));
  return w;
}
}  // namespace

TEST_F(CudaTrain, F32StepsMatchTheCpu) {
  const Result c = train(*cpu_, DType::F32, 5), g = train(*gpu_, DType::F32, 5);
  ASSERT_EQ(g.losses.size(), 5u);
  EXPECT_LT(worst_rel(c.losses, g.losses), 1e-5);
  double m = 0, d = 0;
  for (size_t i = 0; i < c.params.size(); ++i) {
    m = std::max(m, (double)std::fabs(c.params[i]));
    d = std::max(d, (double)std::fabs(c.params[i] - g.params[i]));
  }
  EXPECT_LT(d / m, 1e-4) << "weights after 5 AdamW steps";
}

// Dropout 0.1 (issue 14): the GPU draws the CPU's masks (hidden sites, and the attention
// probabilities in the one-thread-per-row kernels in f32 and the tensor-core kernels in bf16).
TEST_F(CudaTrain, DropoutMatchesTheCpu) {
  const Result c = train(*cpu_, DType::F32, 5, {}, 0.1), g = train(*gpu_, DType::F32, 5, {}, 0.1);
  const Result plain = train(*gpu_, DType::F32, 5);
  EXPECT_LT(worst_rel(c.losses, g.losses), 1e-5) << "f32";
  EXPECT_GT(worst_rel(plain.losses, g.losses), 1e-4) << "dropout changed nothing";
  const Result cb = train(*cpu_, DType::BF16, 10, {}, 0.1),
               gb = train(*gpu_, DType::BF16, 10, {}, 0.1);
  EXPECT_LT(worst_rel(cb.losses, gb.losses), 1e-2) << "bf16";
}

// The Llama family: f32 within 1e-5 of the CPU, bf16 (tensor-core attention with grouped K/V)
// within 1% of the CPU's bf16 run, and learning.
TEST_F(CudaTrain, LlamaFamilyMatchesTheCpu) {
  const Result c = train(*cpu_, DType::F32, 5, {}, 0, llama),
               g = train(*gpu_, DType::F32, 5, {}, 0, llama);
  ASSERT_EQ(g.losses.size(), 5u);
  EXPECT_LT(worst_rel(c.losses, g.losses), 1e-5) << "f32";
  const Result cb = train(*cpu_, DType::BF16, 20, {}, 0, llama),
               gb = train(*gpu_, DType::BF16, 20, {}, 0, llama);
  EXPECT_LT(worst_rel(cb.losses, gb.losses), 1e-2) << "bf16";
  EXPECT_LT(gb.losses.back(), gb.losses.front() - 0.5) << "bf16 Llama on the GPU learns";
}

// Qwen2's options, Qwen3 and squared ReLU: f32 within 1e-5 of the CPU, bf16 within 1% and
// learning.
TEST_F(CudaTrain, QwenAndSmallOptionsMatchTheCpu) {
  for (const auto& [name, options] :
       std::vector<std::pair<std::string, std::function<void(GPTConfig&)>>>{
           {"qwen", qwen}, {"qwen3", qwen3}, {"squared relu", squared_relu}}) {
    SCOPED_TRACE(name);
    const Result c = train(*cpu_, DType::F32, 5, {}, 0, options),
                 g = train(*gpu_, DType::F32, 5, {}, 0, options);
    ASSERT_EQ(g.losses.size(), 5u);
    EXPECT_LT(worst_rel(c.losses, g.losses), 1e-5) << "f32";
    const Result cb = train(*cpu_, DType::BF16, 20, {}, 0, options),
                 gb = train(*gpu_, DType::BF16, 20, {}, 0, options);
    EXPECT_LT(worst_rel(cb.losses, gb.losses), 1e-2) << "bf16";
    EXPECT_LT(gb.losses.back(), gb.losses.front() - 0.5) << "bf16 on the GPU learns";
  }
}

// MoE on the GPU (the router and permutation kernels of moe.cu, the experts' GEMMs on cuBLAS): f32
// within 1e-5 of the CPU, bf16 within 1% and learning.
TEST_F(CudaTrain, MoEMatchesTheCpu) {
  for (const auto& [name, options] :
       std::vector<std::pair<std::string, std::function<void(GPTConfig&)>>>{
           {"mixtral", mixtral},
           {"gpt2 moe", moe_gpt2},
           {"qwen3 moe", qwen3_moe},
           {"deepseek v3", deepseek}}) {
    SCOPED_TRACE(name);
    const Result c = train(*cpu_, DType::F32, 5, {}, 0, options),
                 g = train(*gpu_, DType::F32, 5, {}, 0, options);
    ASSERT_EQ(g.losses.size(), 5u);
    EXPECT_LT(worst_rel(c.losses, g.losses), 1e-5) << "f32";
    const Result cb = train(*cpu_, DType::BF16, 20, {}, 0, options),
                 gb = train(*gpu_, DType::BF16, 20, {}, 0, options);
    EXPECT_LT(worst_rel(cb.losses, gb.losses), 1e-2) << "bf16";
    EXPECT_LT(gb.losses.back(), gb.losses.front() - 0.5) << "bf16 on the GPU learns";
  }
}

TEST_F(CudaTrain, Bf16TracksTheCpuAndF32) {
  const Result c = train(*cpu_, DType::BF16, 20), g = train(*gpu_, DType::BF16, 20);
  const Result f = train(*gpu_, DType::F32, 20);
  EXPECT_LT(worst_rel(c.losses, g.losses), 1e-2) << "CUDA bf16 vs CPU bf16";
  EXPECT_LT(worst_rel(f.losses, g.losses), 1e-2) << "CUDA bf16 vs CUDA f32";
  EXPECT_LT(g.losses.back(), g.losses.front() - 0.5) << "bf16 on the GPU learns";
}

// FP8 on the GPU (cuBLASLt FP8 GEMMs, bf16 elsewhere) against FP8 emulated on the CPU in bf16
// (docs/training.md, "FP8"), both recipes, hybrid formats: the same quantization, so the runs agree
// to bf16's rounding and cuBLASLt's accumulation order; FP8 learns and is not the bf16 run.
TEST_F(CudaTrain, Fp8TracksTheCpuEmulation) {
  const Result plain = train(*gpu_, DType::BF16, 20);
  for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    auto fp8 = [r](TrainConfig& t) {
      t.fp8.enabled = true;
      t.fp8.hybrid = true;
      t.fp8.recipe = r;
      t.fp8.amax_history_len = 4;
    };
    const Result c = train(*cpu_, DType::BF16, 20, fp8), g = train(*gpu_, DType::BF16, 20, fp8);
    const char* what = r == Fp8Recipe::Delayed ? "delayed" : "tensorwise";
    EXPECT_LT(worst_rel(c.losses, g.losses), 1e-2) << "CUDA FP8 vs CPU FP8, " << what;
    EXPECT_LT(g.losses.back(), g.losses.front() - 0.5) << "FP8 on the GPU learns, " << what;
    EXPECT_GT(worst_rel(plain.losses, g.losses), 0.0) << "FP8 changed nothing, " << what;
  }
}

TEST_F(CudaTrain, Fp16WithDynamicScalingLearns) {
  const Result h = train(*gpu_, DType::F16, 40);
  for (double l : h.losses) ASSERT_TRUE(std::isfinite(l));
  EXPECT_LT(h.losses.back(), h.losses.front() - 0.5);
}

// Issue 13 on the GPU: recomputation re-runs the same kernels (cuBLAS, the tensor-core attention,
// the fused residual LayerNorm against the plain one) on the same inputs, so losses and weights
// are bitwise those of the stored run; the distributed optimizer at one rank matches the
// replicated one.
TEST_F(CudaTrain, RecomputationIsBitwise) {
  // cuDNN's attention (auto in bf16) adds dQ with atomics unless deterministic (docs/training.md).
  gpu_->set_attention_backend(AttentionBackend::Auto, /*deterministic=*/true);
  for (DType d : {DType::F32, DType::BF16}) {
    const Result ref = train(*gpu_, d, 4);
    for (RecomputeGranularity g : {RecomputeGranularity::Full, RecomputeGranularity::Selective}) {
      const Result got = train(*gpu_, d, 4, [&](TrainConfig& t) {
        t.recompute.granularity = g;
        t.recompute.num_layers = 2;
      });
      const std::string what =
          std::string(dtype_name(d)) + (g == RecomputeGranularity::Full ? " full" : " selective");
      ASSERT_EQ(got.losses.size(), ref.losses.size());
      for (size_t i = 0; i < ref.losses.size(); ++i)
        EXPECT_EQ(got.losses[i], ref.losses[i]) << what;
      EXPECT_EQ(std::memcmp(got.params.data(), ref.params.data(), 4 * ref.params.size()), 0)
          << what;
    }
  }
}

TEST_F(CudaTrain, DistributedOptimizerAtOneRankMatches) {
  for (DType d : {DType::F32, DType::BF16}) {
    const Result ref = train(*gpu_, d, 5);
    const Result got = train(*gpu_, d, 5, [](TrainConfig& t) {
      t.use_distributed_optimizer = true;
      t.overlap_param_gather = true;
      t.ddp_bucket_size = 20000;
    });
    EXPECT_LT(worst_rel(ref.losses, got.losses), 1e-6) << dtype_name(d);
  }
}

// Muon (issue 59) on the GPU: with f32 Newton-Schulz GEMMs (--muon-fp32-matmul-prec high) the
// CPU's trajectory; with bf16 GEMM inputs (the default, batched cuBLAS GEMMs over q, k, v and the
// layers' same-shaped matrices) within bf16's reach of it and learning; layer-wise over the
// distributed optimizer at one rank the replicated run's.
TEST_F(CudaTrain, MuonMatchesTheCpu) {
  auto muon = [](const char* prec) {
    return [prec](TrainConfig& t) {
      t.optimizer = "muon";
      t.lr = 0.01;
      t.muon.matmul_prec = prec;
    };
  };
  const Result c = train(*cpu_, DType::F32, 5, muon("high")),
               g = train(*gpu_, DType::F32, 5, muon("high"));
  ASSERT_EQ(g.losses.size(), 5u);
  EXPECT_LT(worst_rel(c.losses, g.losses), 1e-5) << "f32 GEMMs";
  const Result low = train(*gpu_, DType::F32, 20, muon("medium")),
               cl = train(*cpu_, DType::F32, 20, muon("medium"));
  EXPECT_LT(worst_rel(cl.losses, low.losses), 1e-2) << "bf16 GEMM inputs";
  EXPECT_GT(worst_rel(cl.losses, low.losses), 0.0) << "bf16 GEMM inputs changed nothing";
  EXPECT_LT(low.losses.back(), low.losses.front() - 0.3) << "Muon on the GPU learns";
  const Result dist = train(*gpu_, DType::F32, 5, [&](TrainConfig& t) {
    muon("high")(t);
    t.use_distributed_optimizer = true;
    t.ddp_bucket_size = 20000;
  });
  EXPECT_LT(worst_rel(g.losses, dist.losses), 1e-6) << "layer-wise at one rank";
}

// Generation on the GPU (issue 16) from the CPU model's weights, GPT-2, Qwen2's options, Qwen3 and
// the Llama family (RoPE, multi-query attention): greedy and seeded top-k sampling in f32 give the
// CPU's ids, with the decode steps replayed as CUDA graphs and op by op (set_graphs(false)); in
// bf16 (a 66-token prompt through the tensor-core prefill) graphs and op by op give the same ids.
// Per-prompt budgets shrink the batch (a graph per row count), and a second, longer batch on the
// same engines grows their buffers (the graphs dropped and captured again). Weights scaled by 4 so
// that the next-token distributions are sharp (no near-ties for rounding to flip).
TEST_F(CudaTrain, GenerationWithCudaGraphsMatchesTheCpu) {
  for (int kind : {0, 1, 2, 3}) {  // GPT-2, Llama, Qwen2's options, Qwen3
    const bool is_llama = kind == 1;
    GPTConfig m = model();
    if (kind == 1) llama(m);
    if (kind == 2) qwen(m);
    if (kind == 3) qwen3(m);
    ParallelContext ctx = ParallelContext::single();
    auto make = [&](Backend& be, DType dt) {
      auto g = std::make_unique<GPTModel>(m, model_shard_for(m, 1, 0, 1, 0), be, *ctx.tp, dt);
      g->init_parameters(5);
      for (const ParamSpec& s : g->params().specs()) {
        Tensor p = g->params().param(s);
        be.scale(p, 4.f);
      }
      g->sync_compute_weights();
      return g;
    };
    const std::vector<std::vector<std::vector<int32_t>>> batches{
        {{1, 2, 3, 4, 5}, std::vector<int32_t>(66, 7), {9}},
        {std::vector<int32_t>(70, 3), {4, 4}, {8, 1, 8}}};
    for (bool sampled : {false, true}) {
      std::vector<GenerationOptions> opts(3);
      for (int i = 0; i < 3; ++i) {
        opts[i].max_new_tokens = 24 - 7 * i;  // 24, 17, 10: the batch shrinks
        if (sampled) {
          opts[i].sampling.temperature = 0.8;
          opts[i].sampling.top_k = 20;
          opts[i].sampling.seed = 7;
        }
      }
      const std::string what = std::string(kind == 3   ? "qwen3 "
                                           : kind == 2 ? "qwen "
                                           : is_llama  ? "llama "
                                                       : "gpt ") +
                               (sampled ? "top-k sampling" : "greedy");
      auto mc = make(*cpu_, DType::F32), mg = make(*gpu_, DType::F32);
      auto mb = make(*gpu_, DType::BF16);
      InferenceEngine ec(*mc, ctx, 3, m.seq_length), eg(*mg, ctx, 3, m.seq_length),
          eo(*mg, ctx, 3, m.seq_length), bg(*mb, ctx, 3, m.seq_length),
          bo(*mb, ctx, 3, m.seq_length);
      eo.set_graphs(false);
      bo.set_graphs(false);
      for (const auto& prompts : batches) {
        const GenerationResult rc = generate(ec, ctx, prompts, opts);
        const GenerationResult rg = generate(eg, ctx, prompts, opts);
        const GenerationResult ro = generate(eo, ctx, prompts, opts);
        EXPECT_EQ(rg.completions, rc.completions) << what << ": GPU (graphs) against the CPU";
        EXPECT_EQ(ro.completions, rc.completions) << what << ": GPU (op by op) against the CPU";
        const GenerationResult rbg = generate(bg, ctx, prompts, opts);
        const GenerationResult rbo = generate(bo, ctx, prompts, opts);
        EXPECT_EQ(rbg.completions, rbo.completions) << what << ": bf16 graphs against op by op";
      }
      // Per batch: 3 row counts, each warmed once and captured at its second step.
      EXPECT_GT(eg.graph_replays(), 20) << what << ": the decode steps did not replay graphs";
      EXPECT_GT(bg.graph_replays(), 20) << what << " (bf16)";
      EXPECT_EQ(eo.graph_replays(), 0);
      EXPECT_EQ(bo.graph_replays(), 0);
    }
  }
}
