// The CPU attention with documents inside a sample (core/documents.hpp): a row sees only the keys
// of its own document, and ALiBi measures distance by position ids that restart per document.
// Checked against the same attention run on each document alone, as a sample of its own.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/attention.hpp"

using namespace tessera;

namespace {

using Vec = std::vector<double>;

Vec random_values(size_t n, std::mt19937_64& gen) {
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  Vec v(n);
  for (double& x : v) x = d(gen);
  return v;
}

}  // namespace

TEST(CpuAttention, DocumentsEqualEachDocumentAlone) {
  // Two samples of 80 rows (past one 64-row block), 4 query heads over 2 key/value heads.
  const int64_t B = 2, T = 80, H = 4, G = 2, hd = 8, Cg = (H + 2 * G) * hd, C = H * hd;
  const std::vector<std::vector<int64_t>> starts = {{0, 20, 21, 70}, {0, 50}};  // a 1-row document
  std::mt19937_64 gen(5);
  const Vec qkv = random_values(B * T * Cg, gen), dout = random_values(B * T * C, gen);
  std::vector<int32_t> key_begin(B * T), positions(B * T);
  for (int64_t b = 0; b < B; ++b)
    for (size_t d = 0; d < starts[b].size(); ++d) {
      const int64_t s = starts[b][d], e = d + 1 < starts[b].size() ? starts[b][d + 1] : T;
      for (int64_t t = s; t < e; ++t) {
        key_begin[b * T + t] = static_cast<int32_t>(s);
        positions[b * T + t] = static_cast<int32_t>(t - s);
      }
    }
  for (const bool alibi_on : {false, true}) {
    SCOPED_TRACE(alibi_on ? "ALiBi" : "no ALiBi");
    const AttentionAlibi alibi{0, H};
    const AttentionAlibi* al = alibi_on ? &alibi : nullptr;
    Vec out(B * T * C), lse(B * H * T), dqkv(qkv.size(), 99.0);
    Vec scratch(cpu::attention_scratch_elems(T));
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, hd, scratch.data(), nullptr,
                           G, al, key_begin.data(), positions.data());
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H,
                            hd, scratch.data(), nullptr, G, al, key_begin.data(), positions.data());
    Vec plain(B * T * C), plain_lse(B * H * T);
    cpu::attention_forward(plain.data(), plain_lse.data(), qkv.data(), B, T, H, hd, scratch.data(),
                           nullptr, G, al);
    double moved = 0;
    int checked = 0;
    for (int64_t b = 0; b < B; ++b)
      for (size_t d = 0; d < starts[b].size(); ++d) {
        const int64_t s = starts[b][d], L = (d + 1 < starts[b].size() ? starts[b][d + 1] : T) - s;
        // The document as a sample of its own.
        const Vec q1(qkv.begin() + (b * T + s) * Cg, qkv.begin() + (b * T + s + L) * Cg);
        const Vec do1(dout.begin() + (b * T + s) * C, dout.begin() + (b * T + s + L) * C);
        Vec o1(L * C), l1(H * L), dq1(q1.size());
        Vec s1(cpu::attention_scratch_elems(L));
        cpu::attention_forward(o1.data(), l1.data(), q1.data(), 1, L, H, hd, s1.data(), nullptr, G,
                               al);
        cpu::attention_backward(dq1.data(), do1.data(), q1.data(), o1.data(), l1.data(), 1, L, H,
                                hd, s1.data(), nullptr, G, al);
        for (int64_t t = 0; t < L; ++t) {
          for (int64_t c = 0; c < C; ++c) {
            const double got = out[(b * T + s + t) * C + c];
            ASSERT_NEAR(got, o1[t * C + c], 1e-12) << "out b" << b << " t" << s + t;
            moved = std::max(moved, std::fabs(got - plain[(b * T + s + t) * C + c]));
          }
          for (int64_t h = 0; h < H; ++h)
            ASSERT_NEAR(lse[(b * H + h) * T + s + t], l1[h * L + t], 1e-12);
          for (int64_t c = 0; c < Cg; ++c)
            ASSERT_NEAR(dqkv[(b * T + s + t) * Cg + c], dq1[t * Cg + c], 1e-12)
                << "dqkv b" << b << " t" << s + t << " c" << c;
          ++checked;
        }
      }
    EXPECT_EQ(checked, B * T);
    EXPECT_GT(moved, 1e-3) << "the documents changed nothing";
  }
}
