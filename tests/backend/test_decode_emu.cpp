// test_decode_emu.cpp: the flash-decoding kernels (lib/backend/cuda/flash_decode.cuh), their exact
// source, run by the warp emulator (warp_emu.hpp) on the host against the CPU reference
// (backend/cpu/kv_attention.hpp): bf16, f16 and f32 caches; head dims on the 16-byte path (64,
// 128) and on the element path (7, 80, 256); one split and many, with splits that hold no position
// of a short sequence; decode rows beside a prefill segment; grouped-query attention; ALiBi; the
// decode step's cache store inside the kernel. The
// output starts as NaN and must be fully written. Tolerances relative to the largest reference
// value: bf16 2e-2, f16 4e-3, f32 1e-5. On a GPU, test_cuda_ops runs the same kernels on the
// device.
#define TESSERA_WARP_EMU 1
#include "backend/warp_emu.hpp"
// (warp_emu.hpp first: mma.cuh's emulated primitives use it.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/kv_attention.hpp"
#include "backend/cuda/flash_decode.cuh"

using namespace tessera;

namespace {

struct Case {
  int H, G, hd, Tmax, slots;
  std::vector<cpu::KvSegment> segs;  // rows in order
  int target_blocks;                 // plan_splits' goal (fewer: fewer splits)
  bool alibi = false;
  // Segments the kernels do not see (prefills kv_attention.cu gives the tensor-core kernel): their
  // rows of out must stay as they were.
  std::vector<size_t> left_out = {};
  // A decode step whose kernel stores the rows' keys and values itself (kv_decode): the cache at
  // the new positions starts as NaN bytes, and must end holding them, bit for bit.
  bool fused_store = false;
};

template <typename T>
float widen(T v) {
  return decode::to_f32(v);
}

// max |got - want| <= tol * max |want|, every value finite.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const std::string& what) {
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

// Runs the case's rows through the kernels after `steps_before` earlier decode steps filled the
// caches (random keys and values up to each sequence's pos0), and returns the number of splits.
template <typename T>
int run_case(const Case& c, double tol, const std::string& what, bool expect_vec) {
  const int H = c.H, G = c.G, hd = c.hd;
  auto listed = [&](size_t k) {
    return std::find(c.left_out.begin(), c.left_out.end(), k) == c.left_out.end();
  };
  int nrows = 0, listed_rows = 0, max_len = 0;
  for (size_t k = 0; k < c.segs.size(); ++k) {
    const auto& s = c.segs[k];
    nrows += static_cast<int>(s.count);
    if (!listed(k)) continue;
    listed_rows += static_cast<int>(s.count);
    max_len = std::max(max_len, static_cast<int>(s.pos0 + s.count));
  }
  std::mt19937 rng(1234 + hd + H);
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t cache_n = static_cast<size_t>(c.slots) * G * c.Tmax * hd;
  // Caches hold earlier positions (as T), zeros elsewhere; qkv the new rows (as T).
  std::vector<T> kc(cache_n, decode::from_f32<T>(0.f)), vc = kc;
  for (const auto& s : c.segs)
    for (int g = 0; g < G; ++g)
      for (int64_t j = 0; j < s.pos0; ++j)
        for (int d = 0; d < hd; ++d) {
          const size_t at = ((s.slot * G + g) * c.Tmax + j) * hd + d;
          kc[at] = decode::from_f32<T>(nd(rng));
          vc[at] = decode::from_f32<T>(nd(rng));
        }
  const int C3 = (H + 2 * G) * hd;
  std::vector<T> qkv(static_cast<size_t>(nrows) * C3);
  for (T& v : qkv) v = decode::from_f32<T>(nd(rng));
  // The reference, in f32 over the same (rounded) values; it also stores the new keys/values.
  std::vector<float> qkv_f(qkv.size()), kc_f(cache_n), vc_f(cache_n);
  for (size_t i = 0; i < qkv.size(); ++i) qkv_f[i] = widen(qkv[i]);
  for (size_t i = 0; i < cache_n; ++i) kc_f[i] = widen(kc[i]), vc_f[i] = widen(vc[i]);
  std::vector<float> want(static_cast<size_t>(nrows) * H * hd);
  const AttentionAlibi al{H, 2 * H};  // the local heads are heads [H, 2H) of 2H: rank 1 of 2
  cpu::kv_attention(want.data(), qkv_f.data(), kc_f.data(), vc_f.data(), c.segs, H, hd, c.Tmax, G,
                    c.alibi ? &al : nullptr);
  // kv_store_kernel's work (a plain copy; test_cuda_ops checks the kernel on a GPU), and the
  // table of the listed rows: (slot, position, row). With the fused store the copy is what the
  // cache must hold afterwards, and the kernel starts from NaN there instead.
  std::vector<T> kc_want, vc_want;
  std::vector<int32_t> table;
  for (size_t k = 0; k < c.segs.size(); ++k) {
    const auto& s = c.segs[k];
    for (int64_t t = 0; t < s.count; ++t) {
      if (listed(k)) {
        table.push_back(static_cast<int32_t>(s.slot));
        table.push_back(static_cast<int32_t>(s.pos0 + t));
        table.push_back(static_cast<int32_t>(s.row0 + t));
      }
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < hd; ++d) {
          const size_t at = ((s.slot * G + g) * c.Tmax + s.pos0 + t) * hd + d;
          kc[at] = qkv[(s.row0 + t) * C3 + H * hd + g * hd + d];
          vc[at] = qkv[(s.row0 + t) * C3 + (H + G) * hd + g * hd + d];
        }
    }
  }
  if (c.fused_store) {
    kc_want = kc;
    vc_want = vc;
    for (const auto& s : c.segs)
      for (int g = 0; g < G; ++g)
        for (int64_t t = 0; t < s.count; ++t) {
          const size_t at = ((s.slot * G + g) * c.Tmax + s.pos0 + t) * hd;
          std::memset(static_cast<void*>(&kc[at]), 0xff, hd * sizeof(T));
          std::memset(static_cast<void*>(&vc[at]), 0xff, hd * sizeof(T));
        }
  }
  std::vector<T> out(want.size());
  std::memset(static_cast<void*>(out.data()), 0xff, out.size() * sizeof(T));  // NaN
  const decode::LaneSplit ls = decode::lane_split(hd, sizeof(T));
  EXPECT_GT(ls.F, 0) << what;
  EXPECT_EQ(ls.vec, expect_vec) << what;
  decode::Params p{};
  p.qkv = qkv.data();
  p.k_cache = kc.data();
  p.v_cache = vc.data();
  p.out = out.data();
  p.rows = table.data();
  p.H = H;
  p.G = G;
  p.hd = hd;
  p.Tmax = c.Tmax;
  p.nrows = listed_rows;
  p.L = ls.L;
  p.F = ls.F;
  p.scale_log2 = 1.4426950408889634f / std::sqrt(static_cast<float>(hd));
  p.alibi = c.alibi;
  p.store = c.fused_store;
  p.slopes = al;
  decode::plan_splits(p, max_len, c.target_blocks);
  const int rh = listed_rows * H;
  std::vector<float> part(static_cast<size_t>(p.splits) * rh * (hd + 2),
                          std::numeric_limits<float>::quiet_NaN());
  p.part_o = part.data();
  p.part_ml = part.data() + static_cast<size_t>(p.splits) * rh * hd;
  std::vector<unsigned> counters(static_cast<size_t>(rh), 0u);
  p.counters = counters.data();
  // The blocks of the splits `which` accepts (all: a whole launch).
  auto run = [&](bool reverse, const std::function<bool(int)>& which) {
    tc::emu::launch(
        rh, p.splits, decode::kThreads, decode::smem_bytes(p),
        [&](char* smem) {
          if (!which(tc::block_y())) return;
          if (ls.vec)
            decode::partial_body<T, true>(p, smem);
          else
            decode::partial_body<T, false>(p, smem);
        },
        reverse);
  };
  auto all = [](int) { return true; };
  if (p.splits > 1) {
    // Every split but one: no head may be merged yet (its row of out untouched) and each count
    // stands at splits - 1; then the missing split merges every head and resets the counts.
    run(false, [&](int split) { return split != 1; });
    for (size_t i = 0; i < out.size(); ++i) {
      const auto* b = reinterpret_cast<const unsigned char*>(&out[i]);
      bool untouched = true;
      for (size_t j = 0; j < sizeof(T); ++j) untouched = untouched && b[j] == 0xff;
      if (!untouched) {
        ADD_FAILURE() << what << ": element " << i << " merged before its last split finished";
        break;
      }
    }
    EXPECT_EQ(std::count(counters.begin(), counters.end(), static_cast<unsigned>(p.splits - 1)), rh)
        << what;
    run(false, [&](int split) { return split == 1; });
    EXPECT_EQ(std::count(counters.begin(), counters.end(), 0u), rh) << what << ": counts left";
    std::memset(static_cast<void*>(out.data()), 0xff, out.size() * sizeof(T));
  }
  // Blocks in the reverse order: another block merges each head (the last split to finish is
  // split 0 there), with the same bits as in order, which the checks below then see.
  run(true, all);
  EXPECT_EQ(std::count(counters.begin(), counters.end(), 0u), rh) << what << ": counts left";
  const std::vector<T> out_reversed = out;
  std::memset(static_cast<void*>(out.data()), 0xff, out.size() * sizeof(T));
  run(false, all);
  EXPECT_EQ(std::count(counters.begin(), counters.end(), 0u), rh) << what << ": counts left";
  EXPECT_EQ(std::memcmp(out.data(), out_reversed.data(), out.size() * sizeof(T)), 0)
      << what << ": the merge depends on which split finished last";
  // The listed rows against the reference; the others untouched (still the 0xff bytes).
  std::vector<float> got, want_listed;
  for (size_t k = 0; k < c.segs.size(); ++k) {
    const auto& s = c.segs[k];
    const size_t begin = static_cast<size_t>(s.row0) * H * hd, n = s.count * H * hd;
    for (size_t i = begin; i < begin + n; ++i) {
      if (listed(k)) {
        got.push_back(widen(out[i]));
        want_listed.push_back(want[i]);
      } else {
        const auto* b = reinterpret_cast<const unsigned char*>(&out[i]);
        bool untouched = true;
        for (size_t j = 0; j < sizeof(T); ++j) untouched = untouched && b[j] == 0xff;
        if (!untouched) {
          ADD_FAILURE() << what << ": element " << i << " of a left-out row was written";
          return p.splits;
        }
      }
    }
  }
  if (c.fused_store) {
    EXPECT_EQ(std::memcmp(kc.data(), kc_want.data(), kc.size() * sizeof(T)), 0)
        << what << ": the k cache after the fused store";
    EXPECT_EQ(std::memcmp(vc.data(), vc_want.data(), vc.size() * sizeof(T)), 0)
        << what << ": the v cache after the fused store";
  }
  want = want_listed;
  expect_close(
      got, want, tol,
      what + " (" + std::to_string(p.splits) + " splits of " + std::to_string(p.chunk) + ")");
  return p.splits;
}

// Three sequences in one decode step, contexts 1, 37 and 300: with 64 target blocks over 12
// (row, head) pairs, 6 splits of 50 positions, five of them empty for the two short sequences.
Case decode_case(int hd, int H, int G) {
  Case c{H, G, hd, 320, 3, {{0, 0, 1, 0}, {2, 36, 1, 1}, {1, 299, 1, 2}}, 64};
  return c;
}

TEST(DecodeEmu, Bf16Head64ManySplitsMatchesCpu) {
  EXPECT_EQ(run_case<__nv_bfloat16>(decode_case(64, 4, 4), 2e-2, "bf16 hd 64", true), 6);
}

TEST(DecodeEmu, F16Head128GqaAlibiMatchesCpu) {
  Case c = decode_case(128, 4, 2);
  c.alibi = true;
  EXPECT_GT(run_case<__half>(c, 4e-3, "f16 hd 128 GQA ALiBi", true), 1);
}

TEST(DecodeEmu, F32OneSplitAndManyMatchCpu) {
  Case one = decode_case(64, 2, 1);
  one.target_blocks = 1;
  EXPECT_EQ(run_case<float>(one, 1e-5, "f32 hd 64 one split", true), 1);
  EXPECT_GT(run_case<float>(decode_case(64, 2, 1), 1e-5, "f32 hd 64 MQA", true), 1);
}

// A prefill of 9 tokens (causal within the segment) beside two decode rows, with GQA and ALiBi.
TEST(DecodeEmu, PrefillBesideDecodeRowsMatchesCpu) {
  Case c{6, 2, 64, 96, 3, {{1, 0, 9, 0}, {0, 40, 1, 9}, {2, 90, 1, 10}}, 64, true};
  run_case<__nv_bfloat16>(c, 2e-2, "bf16 prefill + decode", true);
}

// A 70-token prefill that kv_attention.cu gives the tensor-core kernel, beside two decode rows
// (rows 70 and 71): the decode kernels see only those two, as entries 0 and 1 of their table, and
// write exactly their rows of out, merged by the last split's block (many splits) and without a
// merge (one).
TEST(DecodeEmu, RowsLeftToThePrefillKernelAreUntouched) {
  Case c{6, 2, 64, 96, 3, {{1, 0, 70, 0}, {0, 40, 1, 70}, {2, 90, 1, 71}}, 64, true, {0}};
  EXPECT_GT(run_case<__nv_bfloat16>(c, 2e-2, "bf16 decode rows beside a prefill", true), 1);
  c.target_blocks = 1;
  EXPECT_EQ(run_case<__half>(c, 4e-3, "f16 decode rows beside a prefill, one split", true), 1);
}

// Head dims off the 16-byte path: 7 (one lane per position), 80 (16 lanes of 5), 256 in f32 (32
// lanes of 8).
TEST(DecodeEmu, ElementPathHeadDimsMatchCpu) {
  run_case<float>(decode_case(7, 2, 2), 1e-5, "f32 hd 7", false);
  run_case<__nv_bfloat16>(decode_case(80, 2, 1), 2e-2, "bf16 hd 80", false);
  Case c = decode_case(256, 1, 1);
  c.alibi = true;
  run_case<float>(c, 1e-5, "f32 hd 256 ALiBi", false);
}

// kv_decode's step: the kernel stores each row's key and value itself (one block per row and
// key/value head) and reads the row's own position from qkv, the cache starting as NaN there:
// many splits (the store in the split holding the position, the last one for the 300-token
// context) and one, GQA (the group's first query head stores), MQA, and the element path.
TEST(DecodeEmu, FusedCacheStoreMatchesCpu) {
  Case c = decode_case(64, 4, 2);
  c.fused_store = true;
  EXPECT_EQ(run_case<__nv_bfloat16>(c, 2e-2, "bf16 hd 64 GQA, fused store", true), 6);
  c.target_blocks = 1;
  EXPECT_EQ(run_case<__half>(c, 4e-3, "f16 hd 64 GQA, fused store, one split", true), 1);
  Case m = decode_case(128, 4, 1);
  m.fused_store = true;
  m.alibi = true;
  EXPECT_GT(run_case<float>(m, 1e-5, "f32 hd 128 MQA ALiBi, fused store", true), 1);
  Case e = decode_case(80, 2, 2);
  e.fused_store = true;
  run_case<__nv_bfloat16>(e, 2e-2, "bf16 hd 80, fused store", false);
}

TEST(DecodeEmu, LaneSplitAndPlan) {
  const decode::LaneSplit a = decode::lane_split(64, 2), b = decode::lane_split(80, 2),
                          c = decode::lane_split(128, 4), d = decode::lane_split(1000, 2);
  EXPECT_TRUE(a.vec && a.L == 8 && a.F == 8);
  EXPECT_TRUE(!b.vec && b.L == 16 && b.F == 5);
  EXPECT_TRUE(c.vec && c.L == 32 && c.F == 4);
  EXPECT_EQ(d.F, 0);  // 8 lanes of 125: more than kMaxF features per lane
  // GPT-2 124M on an H100 (132 SMs, 264 target blocks), one sequence, 12 heads: a 1024-token
  // context in 22 splits of 47 positions; a 64-token context in 2 splits.
  decode::Params p{};
  p.nrows = 1;
  p.H = 12;
  decode::plan_splits(p, 1024, 264);
  EXPECT_EQ(p.splits, 22);
  EXPECT_EQ(p.chunk, 47);
  decode::plan_splits(p, 64, 264);
  EXPECT_EQ(p.splits, 2);
  p.nrows = 64;  // batch 64: the heads alone fill the GPU
  decode::plan_splits(p, 1024, 264);
  EXPECT_EQ(p.splits, 1);
}

}  // namespace
