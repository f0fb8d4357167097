// test_flash_emu.cpp: the tensor-core attention kernels (lib/backend/cuda/flash_attention_tc.cuh),
// their exact source, run by the warp emulator (warp_emu.hpp) on the host against the CPU
// reference attention, forward and backward, bf16 and f16, head dims 64 and 128, sequence lengths
// that are and are not multiples of the tiles, multi-head and grouped-query (G < H key/value
// heads, down to one), with ALiBi (alone, with grouped-query attention, with dropout), and with
// documents that do not see each other (alone, with GQA, ALiBi and dropout). Outputs start as NaN
// and must be fully written. Tolerances, relative to the largest reference value: bf16 2e-2, f16
// 4e-3 (the CUDA op tests'), lse 1e-4 absolute (the device's exp2 is MUFU's approximation; the
// emulator's is exact). On a GPU, test_cuda_ops runs the same kernels on the device at T 1024/2048.
#define TESSERA_WARP_EMU 1
#include "backend/warp_emu.hpp"
// (warp_emu.hpp first: mma.cuh's emulated primitives use it.)
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/attention.hpp"
#include "backend/cuda/flash_attention_tc.cuh"

using namespace tessera;

namespace {

struct Shape {
  int B, Tn, H, D;
  int G = 0;  // key/value heads; 0: H (multi-head attention)
};

template <typename T>
std::vector<T> to_t(const std::vector<float>& f) {
  std::vector<T> t(f.size());
  for (size_t i = 0; i < f.size(); ++i) t[i] = T(f[i]);
  return t;
}
template <typename T>
std::vector<float> widen(const std::vector<T>& t) {
  std::vector<float> f(t.size());
  for (size_t i = 0; i < t.size(); ++i) f[i] = static_cast<float>(t[i]);
  return f;
}
template <typename T>
std::vector<T> nan_filled(size_t n) {
  std::vector<T> t(n);
  std::memset(static_cast<void*>(t.data()), 0xff, n * sizeof(T));
  return t;
}

// max |got - want| <= tol * max |want|, every value finite.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double m = 0, err = 0;
  for (float w : want) m = std::max(m, static_cast<double>(std::fabs(w)));
  ASSERT_GT(m, 0) << what;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << ": element " << i << " not written";
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (e > err) err = e, worst = i;
  }
  EXPECT_LE(err, tol * m) << what << ": worst element " << worst << " got " << got[worst]
                          << " want " << want[worst] << " (max |ref| " << m << ")";
}

// `drop_p` > 0: attention dropout, the same mask in the reference and the kernels (heads offset as
// on tensor-parallel rank 1 of 2). `al` with heads_total > 0: ALiBi, the local heads being global
// heads [al.head_begin, al.head_begin + H) of al.heads_total, in the reference and the kernels'
// ALiBi instances.
// `docs` > 0: documents inside the samples (--reset-attention-mask, --sft): lengths drawn from 1
// to `docs` tokens, each row's first visible key to the kernels; the reference gets the same
// table and, with ALiBi, the reset position ids (inside a document their distances are the
// rows').
template <typename T, int D>
void run_case(Shape s, double tol, double drop_p = 0, AttentionAlibi al = {}, int docs = 0) {
  using namespace tessera::tc;
  ASSERT_EQ(s.D, D);
  const int G = s.G > 0 ? s.G : s.H;
  ASSERT_EQ(s.H % G, 0);
  const int64_t C = int64_t(s.H) * D, C3 = int64_t(s.H + 2 * G) * D,
                n_qkv = int64_t(s.B) * s.Tn * C3, n_o = int64_t(s.B) * s.Tn * C,
                n_l = int64_t(s.B) * s.H * s.Tn;
  std::mt19937 gen(1234 + s.Tn + D);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> qkv_f(n_qkv), dout_f(n_o);
  for (float& x : qkv_f) x = nd(gen);
  for (float& x : dout_f) x = nd(gen);
  const std::vector<T> qkv = to_t<T>(qkv_f), dout = to_t<T>(dout_f);
  qkv_f = widen(qkv);  // the reference sees exactly the rounded inputs
  dout_f = widen(dout);

  // Reference, f32.
  AttentionDropout drop;
  if (drop_p > 0) {
    drop.spec = make_dropout_spec(drop_p, 77, 5, 3, DropoutKind::Attention, 1000);
    drop.head_begin = s.H;
    drop.heads_total = 2 * s.H;
  }
  const AttentionDropout* dp = drop_p > 0 ? &drop : nullptr;
  const bool alibi = al.heads_total > 0;
  const AttentionAlibi* ap = alibi ? &al : nullptr;
  std::vector<int32_t> key_begin, positions;
  if (docs > 0) {
    for (int b = 0; b < s.B; ++b)
      for (int t = 0, start = 0, len = 1 + int(gen() % docs); t < s.Tn; ++t) {
        if (t - start == len) {
          start = t;
          len = 1 + int(gen() % docs);
        }
        key_begin.push_back(start);
        positions.push_back(t - start);
      }
  }
  const int32_t* kb = docs > 0 ? key_begin.data() : nullptr;
  const int32_t* pos = docs > 0 && alibi ? positions.data() : nullptr;
  std::vector<float> scratch(cpu::attention_scratch_elems(s.Tn));
  std::vector<float> out_ref(n_o), lse_ref(n_l), dqkv_ref(n_qkv);
  cpu::attention_forward(out_ref.data(), lse_ref.data(), qkv_f.data(), s.B, s.Tn, s.H, D,
                         scratch.data(), dp, G, ap, kb, pos);
  cpu::attention_backward(dqkv_ref.data(), dout_f.data(), qkv_f.data(), out_ref.data(),
                          lse_ref.data(), s.B, s.Tn, s.H, D, scratch.data(), dp, G, ap, kb, pos);

  // Forward on the emulator.
  std::vector<T> out = nan_filled<T>(n_o);
  std::vector<float> lse(n_l, NAN);
  {
    using Cfg = FwdCfg<D>;
    const FlashFwdArgs a{out.data(), lse.data(), qkv.data(), s.Tn, s.H, G, drop, al, {}, kb};
    emu::launch((s.Tn + Cfg::Br - 1) / Cfg::Br, s.B * s.H, Cfg::W * 32, Cfg::smem_bytes(),
                [&](char* smem) {
                  if (alibi)
                    flash_fwd_body<T, D, true>(a, smem);
                  else
                    flash_fwd_body<T, D, false>(a, smem);
                });
  }
  expect_close(widen(out), out_ref, tol, "attention forward: out");
  for (int64_t i = 0; i < n_l; ++i) ASSERT_NEAR(lse[i], lse_ref[i], 1e-4) << "lse " << i;

  // Backward on the emulator, from its own forward (as in training).
  std::vector<float> rowdot(n_l);
  for (int b = 0; b < s.B; ++b)
    for (int t = 0; t < s.Tn; ++t)
      for (int h = 0; h < s.H; ++h) {
        float acc = 0.f;
        for (int d = 0; d < D; ++d) {
          const int64_t i = (int64_t(b) * s.Tn + t) * C + h * D + d;
          acc += dout_f[i] * static_cast<float>(out[i]);
        }
        rowdot[(int64_t(b) * s.H + h) * s.Tn + t] = acc;
      }
  std::vector<T> dqkv = nan_filled<T>(n_qkv);
  const FlashBwdArgs a{dqkv.data(),   dout.data(), qkv.data(), lse.data(),
                       rowdot.data(), s.Tn,        s.H,        G,
                       drop,          al,          {},         kb};
  {  // one block per (b, key/value head, key tile)
    using Cfg = BwdKvCfg<D>;
    emu::launch((s.Tn + Cfg::Bk - 1) / Cfg::Bk, s.B * G, Cfg::W * 32, Cfg::smem_bytes(),
                [&](char* smem) {
                  if (alibi)
                    flash_bwd_kv_body<T, D, true>(a, smem);
                  else
                    flash_bwd_kv_body<T, D, false>(a, smem);
                });
  }
  {
    using Cfg = BwdQCfg<D>;
    emu::launch((s.Tn + Cfg::Br - 1) / Cfg::Br, s.B * s.H, Cfg::W * 32, Cfg::smem_bytes(),
                [&](char* smem) {
                  if (alibi)
                    flash_bwd_q_body<T, D, true>(a, smem);
                  else
                    flash_bwd_q_body<T, D, false>(a, smem);
                });
  }
  // dq, dk and dv separately: each has its own scale. Columns [begin, end) of each row.
  const std::vector<float> got = widen(dqkv);
  const int64_t cuts[4] = {0, C, C + int64_t(G) * D, C3};
  for (int part = 0; part < 3; ++part) {
    std::vector<float> g, w;
    for (int64_t r = 0; r < int64_t(s.B) * s.Tn; ++r)
      for (int64_t c = cuts[part]; c < cuts[part + 1]; ++c) {
        g.push_back(got[r * C3 + c]);
        w.push_back(dqkv_ref[r * C3 + c]);
      }
    expect_close(g, w, tol, part == 0 ? "attention backward: dq" : part == 1 ? "dk" : "dv");
  }
}

// Sequence lengths: one partial tile; several tiles with a ragged end; exact multiples. Batch and
// heads above 1 in one case, so the (b, h) offsets are exercised.
TEST(FlashEmu, Bf16HeadDim64) {
  run_case<__nv_bfloat16, 64>({1, 200, 1, 64}, 2e-2);
}
TEST(FlashEmu, Bf16HeadDim64SeveralBatchesAndHeads) {
  run_case<__nv_bfloat16, 64>({2, 150, 3, 64}, 2e-2);
}
TEST(FlashEmu, Bf16HeadDim128) {
  run_case<__nv_bfloat16, 128>({1, 160, 1, 128}, 2e-2);
}
TEST(FlashEmu, F16HeadDim64) {
  run_case<__half, 64>({1, 256, 1, 64}, 4e-3);
}
TEST(FlashEmu, F16HeadDim128ShortSequence) {
  run_case<__half, 128>({1, 37, 1, 128}, 4e-3);
}
// Attention dropout 0.1: the kernels draw the reference's mask (a wrong element, or the pair
// shortcut taking the wrong word, moves outputs by whole probabilities, far past the tolerance).
TEST(FlashEmu, Bf16HeadDim64Dropout) {
  run_case<__nv_bfloat16, 64>({1, 150, 2, 64}, 2e-2, 0.1);
}
TEST(FlashEmu, F16HeadDim128DropoutOddLength) {
  run_case<__half, 128>({1, 77, 1, 128}, 4e-3, 0.1);
}

// Grouped-query attention: H = 4 query heads over G = 2 and G = 1 (multi-query) key/value heads.
// The dK/dV blocks loop over the group's query heads, so a head boundary falls inside their flat
// tile sequence (the lengths leave a ragged last tile per head); batch 2 checks the (b, g)
// offsets of the narrower rows.
TEST(FlashEmu, Bf16HeadDim64Gqa2) {
  run_case<__nv_bfloat16, 64>({2, 150, 4, 64, 2}, 2e-2);
}
TEST(FlashEmu, F16HeadDim64Mqa) {
  run_case<__half, 64>({1, 200, 4, 64, 1}, 4e-3);
}
TEST(FlashEmu, F16HeadDim128Gqa2) {
  run_case<__half, 128>({1, 100, 4, 128, 2}, 4e-3);
}
// With dropout: the mask of each query head (its own h, the global head via head_begin) inside the
// dK/dV blocks' loop over the group.
TEST(FlashEmu, Bf16HeadDim64GqaDropout) {
  run_case<__nv_bfloat16, 64>({1, 150, 4, 64, 2}, 2e-2, 0.1);
}
TEST(FlashEmu, Bf16HeadDim128MqaDropout) {
  run_case<__nv_bfloat16, 128>({1, 70, 4, 128, 1}, 2e-2, 0.1);
}

// ALiBi with the heads of a tensor-parallel rank past the first (head_begin > 0), so the slopes
// are not those of the first heads: rank 1 of 2 of 8 heads (slopes 2^-5 .. 2^-8), and rank 2 of 3
// of 12 heads (12 is no power of two: slopes 2^-0.5 .. 2^-3.5, the interleaved terms, steep enough
// that each row sees mostly its nearest keys). The bias joins S in the kernels' own units before
// the mask, the row max and the exponent; lse (1e-4) checks it exactly, a per-row shift included,
// and the backward kernels must recompute the same P (the dK/dV blocks switch query head, and so
// slope, inside their tile sequence). Lengths are not multiples of the tiles.
TEST(FlashEmu, Bf16HeadDim64AlibiGqa2) {
  run_case<__nv_bfloat16, 64>({2, 150, 4, 64, 2}, 2e-2, 0, AttentionAlibi{4, 8});
}
TEST(FlashEmu, F16HeadDim128AlibiDropout) {
  run_case<__half, 128>({1, 77, 4, 128}, 4e-3, 0.1, AttentionAlibi{8, 12});
}
TEST(FlashEmu, F16HeadDim64AlibiMqaDropout) {
  run_case<__half, 64>({1, 100, 4, 64, 1}, 4e-3, 0.1, AttentionAlibi{8, 12});
}

// Documents (--reset-attention-mask, --sft): lengths up to 40 tokens (many inside one 64-key tile,
// rows whose whole tile is another document's), up to 300 (documents spanning the 128-row blocks,
// so the blocks start at a later key tile and whole warps skip tiles); with grouped-query
// attention, ALiBi (by the reset positions in the reference) and dropout, at both head dims.
TEST(FlashEmu, Bf16HeadDim64Documents) {
  run_case<__nv_bfloat16, 64>({2, 300, 2, 64}, 2e-2, 0, {}, 40);
}
TEST(FlashEmu, F16HeadDim64LongDocumentsGqa) {
  run_case<__half, 64>({1, 520, 4, 64, 2}, 4e-3, 0, {}, 300);
}
TEST(FlashEmu, F16HeadDim128DocumentsAlibiDropout) {
  run_case<__half, 128>({1, 333, 4, 128, 1}, 4e-3, 0.1, AttentionAlibi{4, 8}, 150);
}
TEST(FlashEmu, Bf16HeadDim128ShortDocuments) {
  run_case<__nv_bfloat16, 128>({2, 129, 2, 128}, 2e-2, 0, {}, 7);
}

}  // namespace
