// test_gpt.cpp: the GPT-2 model against an independent double-precision reference: loss,
// whole-model gradients by finite differences, initialization by global index, and vocabulary
// padding.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/gpt.hpp"
#include "model/moe.hpp"
#include "model/mtp.hpp"
#include "model/part_services.hpp"
#include "model/parts.hpp"
#include "reference_gpt.hpp"

using namespace tessera;
using tessera::testing::RefDocuments;
using tessera::testing::reference_loss;
using tessera::testing::RefParams;

namespace {

GPTConfig tiny_config() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 12;
  c.num_attention_heads = 3;
  c.seq_length = 7;
  c.max_position_embeddings = 9;
  c.vocab_size = 50;
  c.make_vocab_size_divisible_by = 64;  // padded to 64: 14 padding rows
  return c;
}

ModelShard whole(const GPTConfig& c) {
  return model_shard_for(c, 1, 0, 1, 0);
}

struct Batch {
  std::vector<int> ids, targets;
};

Batch random_batch(int B, int T, int vocab, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int> d(0, vocab - 1);
  Batch b;
  for (int i = 0; i < B * T; ++i) {
    b.ids.push_back(d(g));
    b.targets.push_back(d(g));
  }
  return b;
}

void load(Activations& a, const Batch& b) {
  for (size_t i = 0; i < b.ids.size(); ++i) {
    a.ids.i32()[i] = b.ids[i];
    a.targets.i32()[i] = b.targets[i];
  }
}

RefParams to_reference(const GPTModel& m) {
  RefParams r;
  for (const ParamSpec& s : m.params().specs()) {
    const Tensor t = m.params().param(s);
    r[s.name] = std::vector<double>(t.f32(), t.f32() + t.numel());
  }
  const GPTConfig& c = m.config();
  if (c.moe_router_enable_expert_bias)  // the routers' biases: state, not parameters
    for (int l = 0; l < c.num_layers; ++l)
      if (c.is_moe_layer(l)) {
        const std::vector<float>& b = m.mlp_part(l).router()->expert_bias();
        r["layers." + std::to_string(l) + ".mlp.router.expert_bias"] =
            std::vector<double>(b.begin(), b.end());
      }
  return r;
}

// Expert biases of a few tenths, by layer and expert, so that they change some tokens' choice.
void set_expert_biases(GPTModel& m) {
  const GPTConfig& c = m.config();
  if (!c.moe_router_enable_expert_bias) return;
  for (int l = 0; l < c.num_layers; ++l)
    if (c.is_moe_layer(l)) {
      std::vector<float> b(static_cast<size_t>(c.num_experts));
      for (int e = 0; e < c.num_experts; ++e) b[e] = 0.3f * std::sin(1.7f * e + 0.9f * l);
      m.mlp_part(l).router()->set_expert_bias(b.data());
    }
}

// Perturb every parameter a little away from init so LayerNorm weights, biases and padding
// directions are all exercised (init has zero biases and unit LN weights).
void perturb(GPTModel& m, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.f, 0.05f);
  for (const ParamSpec& s : m.params().specs()) {
    Tensor t = m.params().param(s);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if ((s.name == "wte" || s.name == "lm_head") &&
          i / m.config().hidden_size >= m.config().vocab_size)
        continue;
      t.f32()[i] += n(g);
    }
  }
}

// The tests' starting point: the weights drawn (seed 7), perturbed (seed 3), the experts' biases
// set.
void prepare(GPTModel& m) {
  m.init_parameters(7);
  perturb(m, 3);
  set_expert_biases(m);
}

// The Llama family's options on the tiny model: RoPE (all or half of each head's features, Llama
// 3 scaling), ALiBi, no position embedding, RMSNorm, SwiGLU, grouped-query attention (2 groups of
// 2 heads, 3 of 2, or multi-query), an untied head and no biases, together and in mixes with
// GPT-2's parts.
GPTConfig llama_config(int variant) {
  GPTConfig c = tiny_config();
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 20;
  c.position_embedding_type = "rope";
  c.rotary_base = 10000;
  c.normalization = "RMSNorm";
  c.swiglu = true;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  if (variant == 1) {  // multi-query, half the features rotate, biases, LayerNorm, tied
    c.num_query_groups = 1;
    c.rotary_percent = 0.5;
    c.add_bias_linear = true;
    c.normalization = "LayerNorm";
    c.untie_embeddings_and_output_weights = false;
  } else if (variant == 2) {  // GPT-2 attention and MLP with RoPE (Llama 3 scaled) and RMSNorm
    c.group_query_attention = false;
    c.swiglu = false;
    c.rotary_base = 100;  // wavelengths 6.3 (kept) and 63 (blended) for an original context 64
    c.use_rope_scaling = true;
    c.rope_scaling_factor = 8;
    c.rope_scaling_original_max_positions = 64;
  } else if (variant == 3) {  // no position embedding, GPT-2's LayerNorm and GELU, 2 groups
    c.position_embedding_type = "none";
    c.normalization = "LayerNorm";
    c.swiglu = false;
    c.add_bias_linear = true;
  } else if (variant == 4) {  // ALiBi over 6 heads (slopes past the power of two), 3 groups
    c.position_embedding_type = "alibi";
    c.hidden_size = 24;
    c.num_attention_heads = 6;
    c.num_query_groups = 3;
  }
  return c;
}

// Qwen2 and Megatron's smaller options on the tiny model. 0: Qwen2 (RoPE base 1e6, RMSNorm eps
// 1e-6, SwiGLU, 2 query groups of 2 heads, biases on Q, K, V only, tied head). 1: --kv-channels 6
// with 4 heads of a 16-wide model (attention 24 wide), interleaved RoPE, LayerNorm (1 + w), GELU,
// QKV biases only. 2: --kv-channels 4 with 2 heads of 12 (attention 8 wide, fused QKV), half the
// features rotating in interleaved pairs, RMSNorm (1 + w), squared ReLU, untied head. 3: GPT-2
// with squared ReLU and LayerNorm (1 + w), all biases and --add-qkv-bias (no effect with them).
GPTConfig qwen_config(int variant) {
  GPTConfig c = llama_config(0);
  c.rotary_base = 1e6;
  c.layernorm_epsilon = 1e-6;
  c.add_qkv_bias = true;
  c.untie_embeddings_and_output_weights = false;
  if (variant == 1) {
    c.kv_channels = 6;
    c.rotary_interleaved = true;
    c.normalization = "LayerNorm";
    c.apply_layernorm_1p = true;
    c.swiglu = false;
  } else if (variant == 2) {
    c.hidden_size = 12;
    c.num_attention_heads = 2;
    c.kv_channels = 4;
    c.group_query_attention = false;
    c.rotary_interleaved = true;
    c.rotary_percent = 0.5;
    c.apply_layernorm_1p = true;
    c.swiglu = false;
    c.squared_relu = true;
    c.untie_embeddings_and_output_weights = true;
  } else if (variant == 3) {
    c = tiny_config();
    c.squared_relu = true;
    c.apply_layernorm_1p = true;
    c.add_qkv_bias = true;
  }
  return c;
}

// Qwen3 (--qk-layernorm) on the tiny model. 0: Qwen3 (RoPE base 1e6, RMSNorm eps 1e-6, SwiGLU, 2
// query groups of 2 heads, --kv-channels 6 so the attention is 24 wide in a 16-wide model, no
// biases, untied head, each query and key head RMS-normalized before RoPE). 1: the q/k norms as
// LayerNorm (weights and biases) applied as (1 + w), fused QKV with all biases, GELU, half the
// features rotating. 2: Qwen3-MoE (the norms of 0, MoE in layer 1 only: 4 SwiGLU experts of
// width 10, top 2, softmax over the top-k logits, i.e. norm_topk_prob, dense layer 0 of width 20).
// 3: Qwen3-MoE without norm_topk_prob (the top 2 of the softmax over all experts, not
// renormalized).
GPTConfig qwen3_config(int variant) {
  GPTConfig c = llama_config(0);
  c.rotary_base = 1e6;
  c.layernorm_epsilon = 1e-6;
  c.kv_channels = 6;
  c.qk_layernorm = true;
  if (variant == 1) {
    c.normalization = "LayerNorm";
    c.apply_layernorm_1p = true;
    c.group_query_attention = false;
    c.add_bias_linear = true;
    c.swiglu = false;
    c.rotary_percent = 0.5;
  } else if (variant >= 2) {
    c.num_experts = 4;
    c.moe_router_topk = 2;
    c.moe_ffn_hidden_size = 10;
    c.moe_layer_freq = "[0,1]";
    c.moe_aux_loss_coeff = 0.01;
    c.moe_router_pre_softmax = variant == 3;
  }
  return c;
}

// Mixture of Experts on the tiny models, with large loss coefficients so the load-balancing and
// z losses weigh in the gradients. 0: Mixtral's (Llama with 4 SwiGLU experts of width 12, top 2,
// softmax over the top-k logits), aux_loss and z-loss. 1: GPT-2 with MoE in layer 1 only
// ([0,1]), 3 GELU experts with biases, top 1 of the softmax over all (pre-softmax) scaled by 2.5,
// a shared expert of width 8, seq_aux_loss. 2: sigmoid scores over 4 experts, top 3, capacity
// factor 0.8 keeping the highest weights (some copies dropped). 3: top-k = E = 3, capacity 0.6
// keeping the earliest tokens, every layer ("1").
GPTConfig moe_config(int variant) {
  GPTConfig c = llama_config(0);
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 12;
  c.moe_aux_loss_coeff = 0.1;
  c.moe_z_loss_coeff = 0.01;
  if (variant == 1) {
    c = tiny_config();
    c.num_experts = 3;
    c.moe_router_topk = 1;
    c.moe_layer_freq = "[0,1]";
    c.moe_router_pre_softmax = true;
    c.moe_router_topk_scaling_factor = 2.5;
    c.moe_shared_expert_intermediate_size = 8;
    c.moe_router_load_balancing_type = "seq_aux_loss";
    c.moe_aux_loss_coeff = 0.2;
  } else if (variant == 2) {
    c.moe_router_score_function = "sigmoid";
    c.moe_router_topk = 3;
    c.moe_expert_capacity_factor = 0.8;
  } else if (variant == 3) {
    c.num_experts = 3;
    c.moe_router_topk = 3;
    c.moe_expert_capacity_factor = 0.6;
    c.moe_token_drop_policy = "position";
    c.moe_layer_freq = "1";
  }
  return c;
}

// DeepSeek-V3's router on the tiny Llama: sigmoid scores over 12 SwiGLU experts of width 8 in 4
// groups of 3, each token's top 3 within its best group (so the group limit binds), weights
// renormalized and scaled by 2.5, a shared expert of width 12, layer 0 dense, the sequence-wise
// aux loss. 0: the expert bias (set_expert_biases) and Hugging Face's group score (the sum of a
// group's top 2). 1: Megatron's group score (its top topk / group-topk = 3), no bias. 2: the bias
// without groups.
GPTConfig deepseek_router_config(int variant) {
  GPTConfig c = llama_config(0);
  c.num_experts = 12;
  c.moe_router_topk = 3;
  c.moe_ffn_hidden_size = 8;
  c.moe_layer_freq = "[0,1]";
  c.moe_router_score_function = "sigmoid";
  c.moe_router_topk_scaling_factor = 2.5;
  c.moe_shared_expert_intermediate_size = 12;
  c.moe_router_load_balancing_type = "seq_aux_loss";
  c.moe_aux_loss_coeff = 0.05;
  c.moe_router_num_groups = 4;
  c.moe_router_group_topk = 1;
  c.moe_router_group_score_experts = 2;
  c.moe_router_enable_expert_bias = true;
  if (variant == 1) {
    c.moe_router_group_score_experts = 0;
    c.moe_router_enable_expert_bias = false;
  } else if (variant == 2) {
    c.moe_router_num_groups = c.moe_router_group_topk = c.moe_router_group_score_experts = 0;
  }
  c.validate();
  return c;
}

// Multi-latent attention on the tiny Llama (4 heads in a 16-wide model). 0: DeepSeek-V3's (a query
// latent of 6, a key/value latent of 5, both RMS-normalized; heads of 4 + 2 RoPE features in
// interleaved pairs, values of 3; YaRN x4 over 4 original positions with mscale 0.707, so the
// frequencies ramp and the softmax scale grows). 1: queries straight from the hidden state, no
// latent norms, plain RoPE on 4 of 8 features in halves, values of 6. 2: 0's attention with
// LayerNorm latents applied as 1 + w, and DeepSeek-V3's router (deepseek_router_config) in layer 1.
GPTConfig mla_config(int variant) {
  GPTConfig c = variant == 2 ? deepseek_router_config(0) : llama_config(0);
  c.group_query_attention = false;
  c.multi_latent_attention = true;
  c.q_lora_rank = 6;
  c.kv_lora_rank = 5;
  c.qk_head_dim = 4;
  c.qk_pos_emb_head_dim = 2;
  c.v_head_dim = 3;
  c.qk_layernorm = true;
  c.rotary_interleaved = true;
  c.rope_type = "yarn";
  c.rotary_scaling_factor = 4;
  c.original_max_position_embeddings = 4;
  c.mscale = c.mscale_all_dim = 0.707;
  if (variant == 1) {
    c.q_lora_rank = 0;
    c.qk_layernorm = false;
    c.qk_pos_emb_head_dim = 4;
    c.v_head_dim = 6;
    c.rotary_interleaved = false;
    c.rope_type = "rope";
  } else if (variant == 2) {
    c.normalization = "LayerNorm";
    c.apply_layernorm_1p = true;
  }
  c.validate();
  return c;
}

// Documents inside the samples: end-of-document tokens (id kEod) at 1 and 4 of sample 0 and at 3
// and 6 (the last) of sample 1, and the tables Megatron's rules give for them, written out here
// by hand: positions restart after each EOD, keys start at the token after the last EOD before.
constexpr int kEod = 13;
struct DocCase {
  bool positions = false, mask = false;
};
void add_documents(Batch& batch, const DocCase& c, RefDocuments& d) {
  for (int i : {1, 4, 7 + 3, 7 + 6}) batch.ids[i] = kEod;
  for (size_t i = 0; i < batch.ids.size(); ++i)
    if (batch.ids[i] == kEod && (i != 1 && i != 4 && i != 10 && i != 13)) batch.ids[i] = 14;
  const std::vector<int> pos = {0, 1, 0, 1, 2, 0, 1, /**/ 0, 1, 2, 3, 0, 1, 2};
  const std::vector<int> key = {0, 0, 2, 2, 2, 5, 5, /**/ 0, 0, 0, 0, 4, 4, 4};
  d.positions = c.positions ? pos : std::vector<int>{};
  d.key_begin = c.mask ? key : std::vector<int>{};
}
void set_model_documents(GPTModel& model, Activations& a, const RefDocuments& d) {
  static std::vector<int32_t> pos, key;
  pos.assign(d.positions.begin(), d.positions.end());
  key.assign(d.key_begin.begin(), d.key_begin.end());
  model.set_documents(a, pos.empty() ? nullptr : pos.data(), key.empty() ? nullptr : key.data());
}

double model_loss(const GPTConfig& cfg, double* ref_out, const DocCase* docs = nullptr,
                  double* ref_plain = nullptr) {
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel model(cfg, whole(cfg), *be, tp);
  prepare(model);
  const int B = 2, T = 7;
  Batch batch = random_batch(B, T, 50, 11);
  batch.targets[3] = -1;  // a position without loss
  RefDocuments d;
  if (docs) add_documents(batch, *docs, d);
  Activations a = model.make_activations(B, T);
  load(a, batch);
  a.dropout.training = cfg.mtp();  // multi-token prediction runs in training (no dropout here)
  if (docs) set_model_documents(model, a, d);
  const double loss = model.forward(a, 1.0f / (B * T - 1)) / (B * T - 1);
  *ref_out = reference_loss(cfg, to_reference(model), batch.ids, batch.targets, B, T, &d);
  if (ref_plain)
    *ref_plain = reference_loss(cfg, to_reference(model), batch.ids, batch.targets, B, T);
  return loss;
}

// Every parameter's gradient, at 6 elements each, against central differences of the reference.
void check_gradients(const GPTConfig& cfg, const DocCase* docs = nullptr) {
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel model(cfg, whole(cfg), *be, tp);
  model.init_parameters(5);
  perturb(model, 9);
  set_expert_biases(model);
  const int B = 2, T = 7, N = B * T;
  Batch batch = random_batch(B, T, 50, 21);
  RefDocuments d;
  if (docs) add_documents(batch, *docs, d);
  Activations a = model.make_activations(B, T);
  load(a, batch);
  a.dropout.training = cfg.mtp();  // multi-token prediction's loss joins the gradient
  if (docs) set_model_documents(model, a, d);
  model.zero_grads();
  model.forward(a, 1.0f / N);
  model.backward(a);

  RefParams ref = to_reference(model);
  std::mt19937 g(1);
  int checked = 0;
  double max_grad = 0;
  for (const ParamSpec& s : model.params().specs()) {
    const Tensor gr = model.params().grad(s);
    for (int64_t i = 0; i < gr.numel(); ++i)
      max_grad = std::max(max_grad, (double)std::fabs(gr.f32()[i]));
  }
  ASSERT_GT(max_grad, 1e-3);
  for (const ParamSpec& s : model.params().specs()) {
    const Tensor gr = model.params().grad(s);
    const bool vocab = s.name == "wte" || s.name == "lm_head";
    std::uniform_int_distribution<int64_t> pick(0, s.numel() - 1);
    for (int k = 0; k < 6; ++k) {
      int64_t i = pick(g);
      if (vocab && k == 0) i = 55 * cfg.hidden_size + 3;  // a padding row: gradient 0
      const bool padding = vocab && i / cfg.hidden_size >= cfg.vocab_size;
      std::vector<double>& p = ref[s.name];
      const double orig = p[i], eps = 1e-5;
      p[i] = orig + eps;
      const double lp = reference_loss(cfg, ref, batch.ids, batch.targets, B, T, &d);
      p[i] = orig - eps;
      const double lm = reference_loss(cfg, ref, batch.ids, batch.targets, B, T, &d);
      p[i] = orig;
      const double fd = padding ? 0.0 : (lp - lm) / (2 * eps);
      const double got = gr.f32()[i];
      EXPECT_NEAR(got, fd, 2e-4 * max_grad + 2e-3 * std::fabs(fd)) << s.name << "[" << i << "]";
      if (padding) {
        EXPECT_EQ(got, 0.0f) << "padding row of " << s.name << " got a gradient";
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6 * static_cast<int>(model.params().specs().size()));
}

}  // namespace

TEST(GPT, LossMatchesIndependentReference) {
  double ref = 0;
  const double loss = model_loss(tiny_config(), &ref);
  EXPECT_GT(ref, 1.0);
  EXPECT_NEAR(loss, ref, 1e-5 * ref);
}

TEST(GPT, WholeModelGradientsMatchFiniteDifferences) {
  check_gradients(tiny_config());
}

// Megatron's --reset-position-ids and --reset-attention-mask (model/documents.cpp) against the
// reference given the documents' tables: learned positions, RoPE (also scaled), no position
// embedding and ALiBi, each option alone and both; the loss and every parameter's gradient.
TEST(GPT, DocumentsMatchTheIndependentReference) {
  const std::vector<DocCase> cases = {{true, false}, {false, true}, {true, true}};
  std::vector<GPTConfig> configs = {tiny_config()};
  for (int v = 0; v < 5; ++v) configs.push_back(llama_config(v));
  for (size_t k = 0; k < configs.size(); ++k)
    for (const DocCase& c : cases) {
      SCOPED_TRACE("config " + std::to_string(k) + " positions " + std::to_string(c.positions) +
                   " mask " + std::to_string(c.mask));
      const bool positional = configs[k].position_embedding_type != "none";
      if (!positional && !c.mask) continue;  // nothing reads the positions
      double ref = 0, plain = 0;
      const double loss = model_loss(configs[k], &ref, &c, &plain);
      EXPECT_GT(ref, 1.0);
      EXPECT_NEAR(loss, ref, 1e-5 * ref);
      EXPECT_GT(std::fabs(ref - plain), 1e-6) << "the documents changed nothing";
    }
  const DocCase both{true, true};
  {  // The mutation: one row attends one key of the document before; the reference notices.
    setenv("TESSERA_FAULT_DOC_MASK", "leak", 1);
    double ref = 0;
    const double loss = model_loss(tiny_config(), &ref, &both);
    unsetenv("TESSERA_FAULT_DOC_MASK");
    EXPECT_GT(std::fabs(loss - ref), 1e-5 * ref) << "one cross-document attention went unnoticed";
  }
  check_gradients(tiny_config(), &both);
  for (int v : {0, 4}) {  // RoPE with grouped-query attention; ALiBi
    SCOPED_TRACE("variant " + std::to_string(v));
    check_gradients(llama_config(v), &both);
  }
}

TEST(GPT, LlamaFamilyLossMatchesIndependentReference) {
  for (int variant = 0; variant < 5; ++variant) {
    double ref = 0;
    const double loss = model_loss(llama_config(variant), &ref);
    EXPECT_GT(ref, 1.0) << "variant " << variant;
    EXPECT_NEAR(loss, ref, 1e-5 * ref) << "variant " << variant;
  }
}

TEST(GPT, LlamaFamilyGradientsMatchFiniteDifferences) {
  for (int variant = 0; variant < 5; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    check_gradients(llama_config(variant));
  }
}

TEST(GPT, QwenAndSmallOptionsLossMatchesIndependentReference) {
  for (int variant = 0; variant < 4; ++variant) {
    double ref = 0;
    const double loss = model_loss(qwen_config(variant), &ref);
    EXPECT_GT(ref, 1.0) << "variant " << variant;
    EXPECT_NEAR(loss, ref, 1e-5 * ref) << "variant " << variant;
  }
}

TEST(GPT, QwenAndSmallOptionsGradientsMatchFiniteDifferences) {
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    check_gradients(qwen_config(variant));
  }
}

TEST(GPT, Qwen3LossMatchesIndependentReference) {
  for (int variant = 0; variant < 4; ++variant) {
    GPTConfig cfg = qwen3_config(variant);
    cfg.moe_aux_loss_coeff = 0;  // model_loss's loss is the LM loss alone
    double ref = 0;
    const double loss = model_loss(cfg, &ref);
    EXPECT_GT(ref, 1.0) << "variant " << variant;
    EXPECT_NEAR(loss, ref, 1e-5 * ref) << "variant " << variant;
  }
}

TEST(GPT, Qwen3GradientsMatchFiniteDifferences) {
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE("Qwen3 variant " + std::to_string(variant));
    check_gradients(qwen3_config(variant));
  }
}

// --qk-layernorm changes the loss (a reference that skipped the norms would agree with a model
// that skipped them too), in the model and in the reference alike, and the norms' weights are in
// play: the model's loss moves when one q_norm and one k_norm weight move.
TEST(GPT, QkLayernormChangesTheLoss) {
  for (int variant = 0; variant < 2; ++variant) {
    GPTConfig with = qwen3_config(variant), without = with;
    without.qk_layernorm = false;
    double ref_with = 0, ref_without = 0;
    const double loss_with = model_loss(with, &ref_with);
    const double loss_without = model_loss(without, &ref_without);
    EXPECT_GT(std::fabs(loss_with - loss_without), 1e-3 * loss_with) << "variant " << variant;
    EXPECT_NEAR(loss_without, ref_without, 1e-5 * ref_without) << "variant " << variant;
  }
}

// The norms' parameters (head_dim wide, replicated over TP, ones or zeros with 1 + w, no weight
// decay) and the count num_parameters() reports, dense and MoE.
TEST(GPT, Qwen3Parameters) {
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  for (int variant = 0; variant < 3; ++variant) {
    const GPTConfig cfg = qwen3_config(variant);
    GPTModel m(cfg, whole(cfg), *be, tp);
    const ParamStore& ps = m.params();
    for (const char* n : {"layers.1.attn.q_norm.weight", "layers.1.attn.k_norm.weight"}) {
      EXPECT_EQ(ps.spec(n).global_shape, (Shape{6})) << n;
      EXPECT_EQ(ps.spec(n).split_axis, -1) << n;
      EXPECT_FALSE(ps.spec(n).weight_decay) << n;
      EXPECT_EQ(ps.spec(n).init, variant == 1 ? ParamInit::Zeros : ParamInit::Ones) << n;
    }
    EXPECT_EQ(ps.has("layers.0.attn.q_norm.bias"), variant == 1);
    int64_t total = 0;
    for (const ParamSpec& s : ps.specs()) total += s.numel();
    const int64_t padding = (m.padded_vocab() - cfg.vocab_size) * cfg.hidden_size;
    EXPECT_EQ(total - padding * (cfg.tied_head() ? 1 : 2), cfg.num_parameters())
        << "variant " << variant;
  }
}

TEST(GPT, MoELossMatchesIndependentReference) {
  for (int variant = 0; variant < 4; ++variant) {
    double ref = 0;
    const double loss = model_loss(moe_config(variant), &ref);
    // model_loss's loss is the LM loss alone; the MoE losses are in the reference's.
    GPTConfig lm_only = moe_config(variant);
    lm_only.moe_aux_loss_coeff = lm_only.moe_z_loss_coeff = 0;
    double ref_lm = 0;
    const double loss_lm = model_loss(lm_only, &ref_lm);
    EXPECT_GT(ref_lm, 1.0) << "variant " << variant;
    EXPECT_NEAR(loss_lm, ref_lm, 1e-5 * ref_lm) << "variant " << variant;
    EXPECT_NEAR(loss, loss_lm, 1e-12) << "variant " << variant;
    EXPECT_GT(ref - ref_lm, 1e-3) << "variant " << variant << ": the MoE losses weigh";
  }
}

TEST(GPT, MoEGradientsMatchFiniteDifferences) {
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE("MoE variant " + std::to_string(variant));
    check_gradients(moe_config(variant));
  }
}

TEST(GPT, DeepSeekRouterLossMatchesIndependentReference) {
  for (int variant = 0; variant < 3; ++variant) {
    GPTConfig cfg = deepseek_router_config(variant);
    double ref = 0;
    const double loss = model_loss(cfg, &ref);
    cfg.moe_aux_loss_coeff = 0;
    double ref_lm = 0;
    const double loss_lm = model_loss(cfg, &ref_lm);
    EXPECT_GT(ref_lm, 1.0) << "variant " << variant;
    EXPECT_NEAR(loss_lm, ref_lm, 1e-5 * ref_lm) << "variant " << variant;
    EXPECT_NEAR(loss, loss_lm, 1e-12) << "variant " << variant;
    EXPECT_GT(ref - ref_lm, 1e-4) << "variant " << variant << ": the sequence aux loss weighs";
  }
}

TEST(GPT, DeepSeekRouterGradientsMatchFiniteDifferences) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("DeepSeek router variant " + std::to_string(variant));
    check_gradients(deepseek_router_config(variant));
  }
}

// Each part of the router changes the choice (so a model that ignored one would fail the tests
// above): the same parameters through the reference with the bias zeroed, without groups, and
// with the other group score rule give other losses.
TEST(GPT, EachRouterPartChangesTheLoss) {
  const GPTConfig base = deepseek_router_config(0);
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel model(base, whole(base), *be, tp);
  prepare(model);
  const Batch batch = random_batch(2, 7, 50, 11);
  RefParams p = to_reference(model);
  for (auto& [name, v] : p)  // louder experts, so that each choice shows in the loss
    if (name.find("mlp.experts.") != std::string::npos)
      for (double& e : v) e *= 4;
  const double with = reference_loss(base, p, batch.ids, batch.targets, 2, 7);
  for (int k = 0; k < 3; ++k) {
    GPTConfig other = base;
    RefParams q = p;
    if (k == 0)
      for (double& b : q["layers.1.mlp.router.expert_bias"]) b = 0;
    if (k == 1) other.moe_router_num_groups = other.moe_router_group_topk = 0;
    if (k == 2) other.moe_router_group_score_experts = 1;
    const double without = reference_loss(other, q, batch.ids, batch.targets, 2, 7);
    EXPECT_GT(std::fabs(with - without), 1e-4 * with) << "part " << k;
  }
}

TEST(GPT, MlaLossMatchesIndependentReference) {
  for (int variant = 0; variant < 3; ++variant) {
    GPTConfig cfg = mla_config(variant);
    cfg.moe_aux_loss_coeff = 0;
    double ref = 0;
    const double loss = model_loss(cfg, &ref);
    EXPECT_GT(ref, 1.0) << "variant " << variant;
    EXPECT_NEAR(loss, ref, 1e-5 * ref) << "variant " << variant;
  }
}

TEST(GPT, MlaGradientsMatchFiniteDifferences) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("MLA variant " + std::to_string(variant));
    check_gradients(mla_config(variant));
  }
}

// YaRN and the latent norms change the loss (the reference implements each from its definition,
// so a model that skipped one would miss it), and the parameters' shapes and count.
TEST(GPT, MlaPartsChangeTheLossAndCountAsHuggingFace) {
  const GPTConfig base = mla_config(0);
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel model(base, whole(base), *be, tp);
  model.init_parameters(7);
  perturb(model, 3);
  const Batch batch = random_batch(2, 7, 50, 11);
  RefParams p = to_reference(model);
  for (auto& [name, v] : p)  // sharper attention, so that the positions show
    if (name.find("attn.") != std::string::npos && name.find("proj") == std::string::npos)
      for (double& e : v) e *= 4;
  const double with = reference_loss(base, p, batch.ids, batch.targets, 2, 7);
  for (int k = 0; k < 2; ++k) {
    GPTConfig other = base;
    if (k == 0) other.rope_type = "rope";
    if (k == 1) other.mscale_all_dim = other.mscale = 0;  // the softmax scale without mscale
    const double without = reference_loss(other, p, batch.ids, batch.targets, 2, 7);
    EXPECT_GT(std::fabs(with - without), 1e-4 * with) << "part " << k;
  }
  const ParamStore& ps = model.params();
  EXPECT_EQ(ps.spec("layers.0.attn.q_down.weight").global_shape, (Shape{6, 16}));
  EXPECT_EQ(ps.spec("layers.0.attn.q_up.weight").global_shape, (Shape{4, 6, 6}));
  EXPECT_EQ(ps.spec("layers.0.attn.kv_down.weight").global_shape, (Shape{5 + 2, 16}));
  EXPECT_EQ(ps.spec("layers.0.attn.kv_up.weight").global_shape, (Shape{4, 4 + 3, 5}));
  EXPECT_EQ(ps.spec("layers.0.attn.proj.weight").global_shape, (Shape{16, 4 * 3}));
  EXPECT_EQ(ps.spec("layers.0.attn.kv_down_norm.weight").global_shape, (Shape{5}));
  EXPECT_EQ(ps.spec("layers.0.attn.q_up.weight").split_axis, 0);
  EXPECT_EQ(ps.spec("layers.0.attn.q_down.weight").split_axis, -1);
  int64_t total = 0;
  for (const ParamSpec& sp : ps.specs()) total += sp.numel();
  EXPECT_EQ(total - (model.padded_vocab() - base.vocab_size) * 16 * 2, base.num_parameters());
}

// Multi-token prediction. 0: two depths on the tiny Llama (dense, untied), factor 0.3. 1: one
// depth on DeepSeek-V3's attention and router (mla_config(2): its MTP layer is MoE, as the last).
GPTConfig mtp_config(int variant) {
  GPTConfig c = variant == 0 ? llama_config(0) : mla_config(2);
  c.mtp_num_layers = variant == 0 ? 2 : 1;
  c.mtp_loss_scaling_factor = 0.3;
  c.validate();
  return c;
}

// The main loss is the model's without MTP; the objective's MTP part equals the reference's
// (each depth's summed token losses, from the model's log); the gradients match the reference's
// objective by finite differences, MTP's layers, norms and projection included.
TEST(GPT, MtpMatchesIndependentReference) {
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE("MTP variant " + std::to_string(variant));
    GPTConfig cfg = mtp_config(variant);
    cfg.moe_aux_loss_coeff = 0;
    auto be = make_cpu_backend();
    LocalCommunicator tp;
    GPTModel model(cfg, whole(cfg), *be, tp);
    prepare(model);
    const int B = 2, T = 7, N = B * T;
    const Batch batch = random_batch(B, T, 50, 11);
    Activations a = model.make_activations(B, T);
    load(a, batch);
    a.dropout.training = true;
    model.mtp()->begin_attempt(false);
    const double loss = model.forward(a, 1.0f / N) / N;
    const RefParams p = to_reference(model);
    GPTConfig lm = cfg;
    lm.mtp_loss_scaling_factor = 0;
    const double ref_lm = reference_loss(lm, p, batch.ids, batch.targets, B, T);
    const double ref = reference_loss(cfg, p, batch.ids, batch.targets, B, T);
    EXPECT_NEAR(loss, ref_lm, 1e-5 * ref_lm);
    double mtp_sum = 0, tokens = 0;
    for (const MtpHead::Loss& m : model.mtp()->losses()) {
      mtp_sum += m.sum;
      tokens += m.tokens;
    }
    // Depth k has a target at the positions t + k + 1 < T: B (T - 1) + B (T - 2) tokens for two.
    EXPECT_EQ(tokens, variant == 0 ? B * (T - 1) + B * (T - 2) : B * (T - 1));
    const double ref_mtp = (ref - ref_lm) * N * cfg.mtp_num_layers / cfg.mtp_loss_scaling_factor;
    EXPECT_GT(ref_mtp, 1.0);
    EXPECT_NEAR(mtp_sum, ref_mtp, 1e-5 * ref_mtp);
    check_gradients(cfg);
  }
}

// The mutations of TESSERA_FAULT_ROUTER (the bias in the weights too; the group limit ignored)
// move the model's loss away from the float64 reference: the tests above would catch them.
TEST(GPT, RouterMutationsMissTheReference) {
  for (const char* fault : {"bias-in-weights", "no-group-limit"}) {
    setenv("TESSERA_FAULT_ROUTER", fault, 1);
    GPTConfig cfg = deepseek_router_config(0);
    cfg.moe_aux_loss_coeff = 0;
    double ref = 0;
    const double loss = model_loss(cfg, &ref);
    unsetenv("TESSERA_FAULT_ROUTER");
    EXPECT_GT(std::fabs(loss - ref), 1e-4 * ref) << fault;
  }
}

// --moe-grouped-gemm (the experts' GEMMs through Backend::grouped_matmul_*, the activation over
// all experts' rows at once): the same loss to the bit and gradients that match the reference,
// in the bias-free variants (the option requires --disable-bias-linear).
TEST(GPT, MoEGroupedGemmMatchesTheReference) {
  for (int variant : {0, 2, 3}) {
    SCOPED_TRACE("MoE variant " + std::to_string(variant));
    GPTConfig cfg = moe_config(variant);
    ASSERT_FALSE(cfg.add_bias_linear);
    double ref = 0, ref_grouped = 0;
    const double loss = model_loss(cfg, &ref);
    cfg.moe_grouped_gemm = true;
    cfg.validate_moe();
    EXPECT_EQ(model_loss(cfg, &ref_grouped), loss);
    check_gradients(cfg);
  }
}

// Token dropping happens in the variants that ask for it (else their gradient check would not
// cover it), and every expert of the Mixtral-shaped variant receives tokens.
TEST(GPT, MoERoutingDropsWhereAskedAndReachesEveryExpert) {
  for (int variant = 0; variant < 4; ++variant) {
    const GPTConfig cfg = moe_config(variant);
    auto be = make_cpu_backend();
    LocalCommunicator tp;
    GPTModel model(cfg, whole(cfg), *be, tp);
    model.init_parameters(5);
    perturb(model, 9);
    Activations a = model.make_activations(2, 7);
    load(a, random_batch(2, 7, 50, 21));
    model.forward(a, 1.0f / 14);
    const int l = cfg.num_layers - 1;  // an MoE layer in every variant
    const MoeBuffers& mb = a.layers[static_cast<size_t>(l)].parts.get<MoeBuffers>();
    int dropped = 0;
    for (int64_t i = 0; i < mb.expert.numel(); ++i) dropped += mb.expert.i32()[i] < 0;
    int64_t rows = 0;
    for (int64_t r : mb.rows) rows += r;
    EXPECT_EQ(rows + dropped, 14 * cfg.moe_router_topk) << "variant " << variant;
    if (cfg.moe_dropless()) {
      EXPECT_EQ(dropped, 0) << "variant " << variant;
    } else {
      EXPECT_GT(dropped, 0) << "variant " << variant;
    }
    if (variant == 0) {
      for (int64_t r : mb.rows) EXPECT_GT(r, 0);
    }
  }
}

// Each option changes the loss (a reference that ignored one would still agree with a model that
// ignored it too): the same parameters with the option off give another loss, by far more than
// the 1e-5 the model and the reference are held to (at least 1e-4 relative).
TEST(GPT, EachSmallOptionChangesTheLoss) {
  const GPTConfig base = qwen_config(1);
  for (int k = 0; k < 3; ++k) {
    GPTConfig off = base;
    if (k == 0) off.rotary_interleaved = false;
    if (k == 1) off.apply_layernorm_1p = false;
    if (k == 2) off.squared_relu = true;
    auto be = make_cpu_backend();
    LocalCommunicator tp;
    GPTModel model(base, whole(base), *be, tp);
    model.init_parameters(7);
    perturb(model, 3);
    const Batch batch = random_batch(2, 7, 50, 11);
    RefParams p = to_reference(model);
    for (auto& [name, v] : p)  // sharper attention, so the rotary pairing shows
      if (name.find("attn.q.") != std::string::npos || name.find("attn.kv.") != std::string::npos)
        for (double& e : v) e *= 8;
    const double with = reference_loss(base, p, batch.ids, batch.targets, 2, 7);
    const double without = reference_loss(off, p, batch.ids, batch.targets, 2, 7);
    EXPECT_GT(std::fabs(with - without), 1e-4 * with) << "option " << k;
  }
}

// The parameters Qwen2's options add or reshape, and the count num_parameters() reports.
TEST(GPT, QwenAndSmallOptionsParameters) {
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  {
    const GPTConfig cfg = qwen_config(1);  // 4 heads x 6 channels, 2 groups, QKV biases only
    GPTModel m(cfg, whole(cfg), *be, tp);
    const ParamStore& ps = m.params();
    EXPECT_EQ(ps.spec("layers.0.attn.q.weight").global_shape, (Shape{4, 6, 16}));
    EXPECT_EQ(ps.spec("layers.0.attn.q.bias").global_shape, (Shape{4, 6}));
    EXPECT_EQ(ps.spec("layers.0.attn.kv.bias").global_shape, (Shape{2, 2, 6}));
    EXPECT_EQ(ps.spec("layers.0.attn.proj.weight").global_shape, (Shape{16, 24}));
    EXPECT_FALSE(ps.has("layers.0.attn.proj.bias"));
    EXPECT_FALSE(ps.has("layers.0.mlp.fc1.bias"));
    EXPECT_EQ(ps.spec("layers.0.ln1.weight").init, ParamInit::Zeros);  // (1 + w) with w = 0
    int64_t total = 0;
    for (const ParamSpec& s : ps.specs()) total += s.numel();
    EXPECT_EQ(total - 14 * 16, cfg.num_parameters());
  }
  {
    const GPTConfig cfg = qwen_config(2);  // fused QKV of 2 heads x 4 channels in a 12-wide model
    GPTModel m(cfg, whole(cfg), *be, tp);
    const ParamStore& ps = m.params();
    EXPECT_EQ(ps.spec("layers.0.attn.qkv.weight").global_shape, (Shape{3, 2, 4, 12}));
    EXPECT_EQ(ps.spec("layers.0.attn.qkv.bias").global_shape, (Shape{3, 2, 4}));
    EXPECT_EQ(ps.spec("layers.0.attn.proj.weight").global_shape, (Shape{12, 8}));
    int64_t total = 0;
    for (const ParamSpec& s : ps.specs()) total += s.numel();
    EXPECT_EQ(total - 2 * 14 * 12, cfg.num_parameters());
  }
}

// Grouped-query attention's q and kv (and their biases) are read by one GEMM as one weight: for
// every bucket size and 1-3 data-parallel shards, each glued pair shares a bucket with nothing
// (no bucket end, no padding) between them.
TEST(GPT, GluedParametersStayAdjacentInEveryBucketLayout) {
  GPTConfig cfg = llama_config(0);
  cfg.add_bias_linear = true;
  std::vector<ParamSpec> specs = build_param_specs(cfg, whole(cfg));
  int64_t total = 0, glued = 0;
  for (const ParamSpec& s : specs) {
    total += s.numel();
    glued += s.glue_next ? 1 : 0;
  }
  ASSERT_EQ(glued, 2 * cfg.num_layers);  // weight and bias per layer
  int layouts = 0;
  for (int shards = 1; shards <= 3; ++shards)
    for (int64_t bucket = 1; bucket <= total; bucket += 7) {
      FlatLayout l;
      l.bucket_elems = bucket;
      l.shards = shards;
      const std::vector<FlatBucket> buckets = layout_flat_buffer(specs, l);
      std::vector<int> bucket_of(specs.size(), -1);
      for (size_t b = 0; b < buckets.size(); ++b)
        for (int p = buckets[b].first_param; p < buckets[b].end_param; ++p)
          bucket_of[static_cast<size_t>(p)] = static_cast<int>(b);
      for (size_t i = 0; i + 1 < specs.size(); ++i)
        if (specs[i].glue_next) {
          ASSERT_EQ(bucket_of[i], bucket_of[i + 1]) << specs[i].name << " bucket " << bucket;
          ASSERT_EQ(specs[i].flat_offset + specs[i].numel(), specs[i + 1].flat_offset)
              << specs[i].name << " bucket " << bucket << " shards " << shards;
        }
      ++layouts;
    }
  EXPECT_GT(layouts, 100);
}

// The parameters each option adds or removes, by name and global shape.
TEST(GPT, LlamaFamilyParameters) {
  const GPTConfig cfg = llama_config(0);
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel m(cfg, whole(cfg), *be, tp);
  const ParamStore& ps = m.params();
  EXPECT_FALSE(ps.has("wpe"));
  EXPECT_FALSE(ps.has("layers.0.ln1.bias"));
  EXPECT_FALSE(ps.has("layers.0.attn.qkv.weight"));
  EXPECT_FALSE(ps.has("layers.0.mlp.fc2.bias"));
  EXPECT_EQ(ps.spec("layers.0.attn.q.weight").global_shape, (Shape{4, 4, 16}));
  EXPECT_EQ(ps.spec("layers.0.attn.kv.weight").global_shape, (Shape{2, 2, 4, 16}));
  EXPECT_EQ(ps.spec("layers.0.mlp.fc1.weight").global_shape, (Shape{2, 20, 16}));
  EXPECT_EQ(ps.spec("lm_head").global_shape, (Shape{64, 16}));
  int64_t total = 0;
  for (const ParamSpec& s : ps.specs()) total += s.numel();
  // The count without vocabulary padding (2 tables of 14 padding rows).
  EXPECT_EQ(total - 2 * 14 * 16, cfg.num_parameters());
}

// Dropout (0.3 on the attention probabilities, the embedding and both residual branches): the
// gradient against the model's own forward with the masks held, along the gradient itself:
// (L(w + e u) - L(w - e u)) / 2e = |g| for u = g / |g|. A backward that skipped a mask, or drew
// another one, is off by far more than the 0.2% allowed.
TEST(GPT, DropoutGradientMatchesDirectionalDifference) {
  GPTConfig cfg = tiny_config();
  cfg.attention_dropout = cfg.hidden_dropout = 0.3;
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel model(cfg, whole(cfg), *be, tp);
  model.init_parameters(5);
  perturb(model, 9);
  const int B = 2, T = 7, N = B * T;
  const Batch batch = random_batch(B, T, 50, 21);
  Activations a = model.make_activations(B, T);
  load(a, batch);
  a.dropout = DropoutContext{true, 99, 4, 12};
  model.zero_grads();
  const double loss = model.forward(a, 1.0f / N) / N;
  model.backward(a);
  Activations plain = model.make_activations(B, T);
  load(plain, batch);
  EXPECT_GT(std::fabs(loss - model.forward(plain, 1.0f / N) / N), 1e-3) << "dropout did nothing";

  Tensor w = model.params().flat_params(), g = model.params().flat_grads();
  const std::vector<float> w0(w.f32(), w.f32() + w.numel()), g0(g.f32(), g.f32() + g.numel());
  double norm = 0;
  for (float x : g0) norm += double(x) * x;
  norm = std::sqrt(norm);
  ASSERT_GT(norm, 1e-2);
  auto loss_at = [&](double e) {
    for (size_t i = 0; i < w0.size(); ++i)
      w.f32()[i] = w0[i] + static_cast<float>(e * g0[i] / norm);
    return model.forward(a, 1.0f / N) / N;
  };
  const double eps = 1e-3, fd = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
  EXPECT_NEAR(fd, norm, 2e-3 * norm);  // measured 3.5e-5; one branch without its mask: 1.8e-2
}

TEST(GPT, InitIsKeyedByGlobalIndexAndFollowsGpt2) {
  GPTConfig cfg = tiny_config();
  cfg.num_layers = 4;
  cfg.hidden_size = 64;
  cfg.num_attention_heads = 4;
  auto be = make_cpu_backend();
  LocalCommunicator tp;
  GPTModel m(cfg, whole(cfg), *be, tp);
  m.init_parameters(1234);
  // Statistics: std 0.02, residual projections 0.02/sqrt(2L), LayerNorm ones, biases zero.
  auto stdev = [&](const std::string& n) {
    const Tensor t = m.params().param(n);
    double s = 0;
    for (int64_t i = 0; i < t.numel(); ++i) s += double(t.f32()[i]) * t.f32()[i];
    return std::sqrt(s / t.numel());
  };
  EXPECT_NEAR(stdev("layers.1.attn.qkv.weight"), 0.02, 0.001);
  EXPECT_NEAR(stdev("layers.1.mlp.fc1.weight"), 0.02, 0.001);
  EXPECT_NEAR(stdev("layers.2.mlp.fc2.weight"), 0.02 / std::sqrt(8.0), 0.0005);
  EXPECT_NEAR(stdev("layers.2.attn.proj.weight"), 0.02 / std::sqrt(8.0), 0.0007);
  EXPECT_EQ(m.params().param("layers.0.ln1.weight").f32()[5], 1.0f);
  EXPECT_EQ(m.params().param("layers.0.attn.qkv.bias").f32()[5], 0.0f);
  const Tensor wte = m.params().param("wte");
  for (int64_t i = cfg.vocab_size * cfg.hidden_size; i < wte.numel(); ++i)
    ASSERT_EQ(wte.f32()[i], 0.f);

  // A tensor-parallel shard draws exactly its slice of the global tensor.
  for (const ParamSpec& full : m.params().specs()) {
    if (full.split_axis < 0) continue;
    ModelShard sh = whole(cfg);
    sh.tp_size = 2;
    sh.tp_rank = 1;
    for (const ParamSpec& part : build_param_specs(cfg, sh)) {
      if (part.name != full.name) continue;
      std::vector<float> vals(part.numel());
      init_param(part, 1234, vals.data());
      const float* g = m.params().param(full).f32();
      if (full.name == "wte") continue;  // padded size differs with TP; rows checked below
      for (int64_t i = 0; i < part.numel(); ++i)
        ASSERT_EQ(vals[i], g[global_element_index(part, i)]) << part.name << " " << i;
    }
  }
  // wte rows are the same values whatever the padding (TP changes the padded size).
  ModelShard sh2 = whole(cfg);
  sh2.tp_size = 2;
  sh2.tp_rank = 0;
  for (const ParamSpec& part : build_param_specs(cfg, sh2)) {
    if (part.name != "wte") continue;
    std::vector<float> vals(part.numel());
    init_param(part, 1234, vals.data());
    for (int64_t i = 0; i < std::min<int64_t>(part.numel(), cfg.vocab_size * cfg.hidden_size); ++i)
      ASSERT_EQ(vals[i], wte.f32()[i]);
  }
}

TEST(GPT, VocabPaddingChangesNothing) {
  // The same model padded to 50 (no padding), 64 and 128 rows: same loss, same gradients.
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  for (int divisible : {1, 64, 128}) {
    GPTConfig cfg = tiny_config();
    cfg.make_vocab_size_divisible_by = divisible;
    auto be = make_cpu_backend();
    LocalCommunicator tp;
    GPTModel m(cfg, whole(cfg), *be, tp);
    m.init_parameters(99);
    EXPECT_EQ(m.padded_vocab(), divisible == 1 ? 50 : divisible);
    const Batch batch = random_batch(2, 7, 50, 5);
    Activations a = m.make_activations(2, 7);
    load(a, batch);
    m.zero_grads();
    losses.push_back(m.forward(a, 1.0f / 14) / 14);
    m.backward(a);
    std::vector<float> g;
    for (const ParamSpec& s : m.params().specs()) {
      const Tensor t = m.params().grad(s);
      const int64_t n = s.name == "wte" ? 50 * cfg.hidden_size : t.numel();
      g.insert(g.end(), t.f32(), t.f32() + n);
    }
    grads.push_back(std::move(g));
  }
  for (int k = 1; k < 3; ++k) {
    EXPECT_NEAR(losses[k], losses[0], 1e-6 * losses[0]);
    ASSERT_EQ(grads[k].size(), grads[0].size());
    for (size_t i = 0; i < grads[0].size(); ++i)
      ASSERT_NEAR(grads[k][i], grads[0][i], 1e-6 + 1e-5 * std::fabs(grads[0][i])) << i;
  }
}

// Zero-bubble's split backward (model/weight_grads.hpp): two micro-batches' B passes, then their W
// passes oldest first, leave every gradient bitwise what two whole backwards leave, for GPT-2
// (biases, fused GELU backward, tied: the embedding's scatter joins W), Llama (SwiGLU, GQA,
// untied), Mixtral's MoE (grouped and one-by-one expert GEMMs), DeepSeek-V3's MLA with MTP (its
// router, shared expert, output layer) and a tied model with two MTP depths; each B
// pass holds exactly the bytes weight_pass_bytes counts for --dry-run, and the pieces' gradients
// are announced (grads_ready) only by the W pass.
TEST(GPT, ZeroBubbleSplitBackwardIsBitwiseTheWholeOne) {
  struct Case {
    const char* name;
    GPTConfig cfg;
  };
  GPTConfig grouped = moe_config(0), one_by_one = moe_config(0), tied_mtp = mtp_config(0);
  grouped.moe_grouped_gemm = true;
  tied_mtp.untie_embeddings_and_output_weights = false;  // the table takes the embedding's
  tied_mtp.validate();                                   // scatters in W too
  std::vector<Case> cases = {{"gpt2", tiny_config()},
                             {"llama", llama_config(0)},
                             {"mixtral grouped", grouped},
                             {"mixtral one by one", one_by_one},
                             {"deepseek mla + mtp", mtp_config(1)},
                             {"llama tied + 2 mtp depths", tied_mtp}};
  struct Ready final : PassObserver {
    std::vector<int> pieces;
    void grads_ready(int piece) override { pieces.push_back(piece); }
  };
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    const GPTConfig& cfg = c.cfg;
    const int B = 2, T = 7;
    auto run = [&](bool split, double* pass_bytes, std::vector<int>* ready_in_b,
                   std::vector<int>* ready_in_w) {
      auto be = make_cpu_backend();
      LocalCommunicator tp;
      GPTModel model(cfg, whole(cfg), *be, tp);
      prepare(model);
      Ready ready;
      model.add_observer(&ready);
      std::vector<Activations> slots = model.make_activation_slots(B, T, 2);
      for (int k = 0; k < 2; ++k) {
        load(slots[k], random_batch(B, T, 50, 11 + k));
        slots[k].dropout = DropoutContext{true, 5, 1, int64_t(k) * B};
      }
      model.zero_grads();
      if (model.mtp()) model.mtp()->begin_attempt(false);
      for (Activations& a : slots) model.forward(a, 1.0f / (2 * B * T));
      for (Activations& a : slots) model.backward(a, split);
      if (split) {
        EXPECT_EQ(model.services().weight_grads().pending(), 2);
        if (pass_bytes) *pass_bytes = model.services().weight_grads().oldest_bytes();
        // The store's buffers: the two passes' operands (an empty expert block takes one element;
        // an expert block's buffer a quarter more room).
        const double held = model.services().weight_grads().held_bytes(),
                     pending = model.services().weight_grads().pending_bytes();
        EXPECT_GE(held, pending);
        EXPECT_LE(held, 1.25 * pending + 1024);
        if (!cfg.moe()) EXPECT_NEAR(held, pending, 1024);
        if (ready_in_b) *ready_in_b = ready.pieces;
        ready.pieces.clear();
        model.weight_backward();
        model.weight_backward();
        EXPECT_EQ(model.services().weight_grads().pending(), 0);
        if (ready_in_w) *ready_in_w = ready.pieces;
      }
      model.remove_observer(&ready);
      const Tensor g = model.params().flat_grads();
      return std::vector<char>(static_cast<const char*>(g.raw()),
                               static_cast<const char*>(g.raw()) + g.nbytes());
    };
    double bytes = 0;
    std::vector<int> in_b, in_w;
    const std::vector<char> whole_grads = run(false, nullptr, nullptr, nullptr);
    const std::vector<char> split_grads = run(true, &bytes, &in_b, &in_w);
    EXPECT_TRUE(whole_grads == split_grads) << "the split backward's gradients differ";
    EXPECT_TRUE(in_b.empty()) << "a B pass announced complete gradients";
    // Each W pass announces the pieces in the backward's order: head, layers last first, embedding.
    const int pieces = cfg.num_layers + 2;
    ASSERT_EQ(static_cast<int>(in_w.size()), 2 * pieces);
    EXPECT_EQ(in_w.front(), kHeadPiece);
    EXPECT_EQ(in_w[static_cast<size_t>(pieces - 1)], kEmbedPiece);
    const double counted = weight_pass_bytes(cfg, whole(cfg), B, T, DType::F32, /*chunk=*/0);
    EXPECT_GT(bytes, 0);
    EXPECT_EQ(bytes, counted) << "what a B pass holds and what --dry-run counts";
  }
}
