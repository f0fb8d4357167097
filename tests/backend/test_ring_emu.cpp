// test_ring_emu.cpp: context parallelism's kernels (lib/backend/cuda/ring.cuh), their exact
// source, run by the warp emulator (warp_emu.hpp) on the host against the host reference
// (backend/cpu/ring_attention.hpp): the log-sum-exp merge of a ring block's partial attention into
// the running output, in f32 and bf16, at a query offset inside the rank's rows, with head dims
// above and below one pass of the warp (64 and 40), rows whose block saw no key (part lse -inf:
// unchanged) and rows with nothing merged yet (running lse -inf: the part as it is); and the
// column copy that takes the K/V heads out of qkv and puts dK/dV back; the tensor-core ring blocks
// (flash_attention_tc.cuh's ring mode) against the host blocks, also with documents that span the
// chunks (each query row's first visible key of the block, rows that see none of its keys).
// Outputs the kernels must not touch are checked unchanged. On a GPU, test_cuda_ops runs them
// through the backend.
#define TESSERA_WARP_EMU 1
#include "backend/warp_emu.hpp"
// (warp_emu.hpp first: mma.cuh's emulated primitives use it.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cpu/ring_attention.hpp"
#include "backend/cuda/flash_attention_tc.cuh"
#include "backend/cuda/ring.cuh"
#include "runtime/select.hpp"

using namespace tessera;
namespace rk = tessera::ring_kernels;

namespace {

int blocks(int64_t items) {
  return static_cast<int>((items + rk::kWarps - 1) / rk::kWarps);
}

template <typename T>
void check_merge(int64_t B, int64_t Tn, int64_t H, int64_t hd, int64_t q0, int64_t nq, float tol) {
  SCOPED_TRACE(testing::Message() << "B " << B << " T " << Tn << " H " << H << " hd " << hd
                                  << " rows [" << q0 << ", " << q0 + nq << ")");
  std::mt19937 gen(static_cast<unsigned>(7 + hd + q0));
  std::normal_distribution<float> nd(0.f, 1.f);
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<T> out(static_cast<size_t>(B * Tn * H * hd)),
      part(static_cast<size_t>(B * nq * H * hd));
  std::vector<double> ref_out(out.size()), ref_part(part.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = tc::from_f32<T>(nd(gen));
    ref_out[i] = tc::to_f32(out[i]);
  }
  for (size_t i = 0; i < part.size(); ++i) {
    part[i] = tc::from_f32<T>(nd(gen));
    ref_part[i] = tc::to_f32(part[i]);
  }
  std::vector<float> lse(static_cast<size_t>(B * H * Tn)),
      part_lse(static_cast<size_t>(B * H * nq));
  for (float& v : lse) v = 3.f * nd(gen);
  for (float& v : part_lse) v = 3.f * nd(gen);
  part_lse[1] = ninf;                    // the block saw no key for this row
  lse[q0 + 2] = ninf;                    // nothing merged yet into this one (head 0, sample 0)
  part_lse[part_lse.size() - 1] = 40.f;  // a part that dominates
  std::vector<double> ref_lse(lse.begin(), lse.end()), ref_plse(part_lse.begin(), part_lse.end());
  const std::vector<T> out_before = out;
  const std::vector<float> lse_before = lse;
  cpu::ring::merge_block(ref_out.data(), ref_lse.data(), ref_part.data(), ref_plse.data(), B, Tn, H,
                         hd, q0, nq);
  tc::emu::launch(blocks(B * nq * H), 1, rk::kThreads, 0, [&](char*) {
    rk::merge(out.data(), lse.data(), part.data(), part_lse.data(), B, Tn, H, hd, q0, nq);
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const size_t l = static_cast<size_t>((b * H + h) * Tn + t);
        if (std::isinf(ref_lse[l]))
          ASSERT_TRUE(std::isinf(lse[l]) && lse[l] < 0) << "lse " << b << " " << t << " " << h;
        else
          ASSERT_NEAR(lse[l], ref_lse[l], 1e-5 * (1 + std::fabs(ref_lse[l])))
              << "lse " << b << " " << t << " " << h;
        const bool inside = t >= q0 && t < q0 + nq;
        for (int64_t d = 0; d < hd; ++d) {
          const size_t o = static_cast<size_t>(((b * Tn + t) * H + h) * hd + d);
          if (!inside) {  // rows outside the block stay as they were, bit for bit
            ASSERT_EQ(tc::to_f32(out[o]), tc::to_f32(out_before[o])) << "row " << t;
            continue;
          }
          ASSERT_NEAR(tc::to_f32(out[o]), ref_out[o], tol * (1 + std::fabs(ref_out[o])))
              << "out " << b << " " << t << " " << h << " " << d;
        }
      }
  // The row whose part saw no key (sample 0, head 0, block row 1) kept its lse and values.
  EXPECT_EQ(lse[q0 + 1], lse_before[q0 + 1]);
  for (int64_t d = 0; d < hd; ++d)
    ASSERT_EQ(tc::to_f32(out[(q0 + 1) * H * hd + d]),
              tc::to_f32(out_before[(q0 + 1) * H * hd + d]));
}

}  // namespace

TEST(RingEmu, MergeF32) {
  check_merge<float>(2, 8, 3, 64, 4, 4, 1e-6f);
  check_merge<float>(1, 6, 2, 40, 0, 6, 1e-6f);
}

TEST(RingEmu, MergeBf16) {
  check_merge<__nv_bfloat16>(2, 8, 3, 64, 4, 4, 1e-2f);
  check_merge<__nv_bfloat16>(1, 6, 2, 40, 0, 6, 1e-2f);
}

TEST(RingEmu, CopyColumnsTakesTheKeyValueHeadsAndPutsTheirGradientsBack) {
  // qkv rows of (H + 2G) * hd with H 4, G 2, hd 8: the K/V heads are columns [32, 64).
  const int64_t rows = 11, W = 64, KW = 32;
  std::vector<float> qkv(static_cast<size_t>(rows * W)), kv(static_cast<size_t>(rows * KW), -1.f);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>(i);
  tc::emu::launch(blocks(rows), 1, rk::kThreads, 0,
                  [&](char*) { rk::copy_columns(kv.data(), KW, 0, qkv.data(), W, 32, rows, KW); });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < KW; ++c)
      ASSERT_EQ(kv[r * KW + c], qkv[r * W + 32 + c]) << r << " " << c;
  // Back into a zeroed dqkv: the query columns stay 0.
  std::vector<float> dqkv(qkv.size(), 0.f);
  tc::emu::launch(blocks(rows), 1, rk::kThreads, 0,
                  [&](char*) { rk::copy_columns(dqkv.data(), W, 32, kv.data(), KW, 0, rows, KW); });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < W; ++c)
      ASSERT_EQ(dqkv[r * W + c], c < 32 ? 0.f : qkv[r * W + c]) << r << " " << c;
}

// copy_column_blocks in one launch against the default's loop of copy_columns (the CPU backend):
// MLA's assembly of per-head values (4 blocks of 24 columns into heads 32 wide, a broadcast
// block with src stride 0) and its reverse, bf16 rows, the other columns untouched.
TEST(RingEmu, CopyColumnBlocksEqualsTheLoopOfCopies) {
  using T = __nv_bfloat16;
  auto cpu = make_cpu_backend();
  const int64_t rows = 19, W = 4 * 24 + 8, DW = 4 * 32;
  Tensor src({rows, W}, DType::BF16), dst({rows, DW}, DType::BF16);
  for (int64_t i = 0; i < src.numel(); ++i)
    src.data<T>()[i] = tc::from_f32<T>(static_cast<float>(i % 1000) * 0.25f);
  struct Copy {
    int64_t dst_col, dst_stride, src_col, src_stride, cols, blocks;
  };
  for (const Copy& k :
       {Copy{0, 32, 0, 24, 24, 4}, Copy{24, 32, 96, 0, 8, 4}, Copy{5, 0, 3, 0, 7, 1}}) {
    SCOPED_TRACE(testing::Message()
                 << "dst " << k.dst_col << "+" << k.dst_stride << " src " << k.src_col << "+"
                 << k.src_stride << " cols " << k.cols << " blocks " << k.blocks);
    for (int64_t i = 0; i < dst.numel(); ++i) dst.data<T>()[i] = tc::from_f32<T>(-1.f);
    Tensor ref({rows, DW}, DType::BF16);
    std::memcpy(ref.raw(), dst.raw(), dst.nbytes());
    cpu->copy_column_blocks(ref, k.dst_col, k.dst_stride, src, k.src_col, k.src_stride, k.cols,
                            k.blocks);
    tc::emu::launch(blocks(rows), 1, rk::kThreads, 0, [&](char*) {
      rk::copy_column_blocks(dst.data<T>(), DW, k.dst_col, k.dst_stride, src.data<T>(), W,
                             k.src_col, k.src_stride, rows, k.cols, k.blocks);
    });
    EXPECT_EQ(std::memcmp(dst.raw(), ref.raw(), dst.nbytes()), 0);
    int64_t written = 0;  // every copied element, and nothing else (src holds no -1)
    for (int64_t i = 0; i < dst.numel(); ++i) written += tc::to_f32(dst.data<T>()[i]) != -1.f;
    EXPECT_EQ(written, rows * k.cols * k.blocks);
  }
}

namespace {

// One ring block on the tensor-core bodies (ring mode) against cpu::ring in f32 on the same
// bf16-rounded inputs: forward out and lse, then the backward from a final out and lse, added to
// dq and dkv buffers that start non-zero. `docs` > 0: documents of 1 to `docs` tokens spanning
// the chunks (the whole sequence's first visible keys to the host blocks, each query row's first
// key of the block, cp_block_key_begin, to the kernels).
template <int D>
void check_flash_ring(int cp, int rank, int step, int64_t c, int docs = 0) {
  using T = __nv_bfloat16;
  SCOPED_TRACE(testing::Message() << "CP " << cp << " rank " << rank << " step " << step << " c "
                                  << c << " D " << D << " documents " << docs);
  const int64_t B = 1, Tn = 2 * c, H = 4, G = 2, W = (H + 2 * G) * D, KW = 2 * G * D, OW = H * D;
  std::mt19937 gen(static_cast<unsigned>(11 + step + rank));
  std::normal_distribution<float> nd(0.f, 1.f);
  auto rounded = [&](int64_t n, std::vector<T>& t, std::vector<float>& f) {
    t.resize(static_cast<size_t>(n));
    f.resize(t.size());
    for (size_t i = 0; i < t.size(); ++i) {
      t[i] = tc::from_f32<T>(nd(gen));
      f[i] = tc::to_f32(t[i]);
    }
  };
  std::vector<T> qkv, kv, dout, dq0, dk0;
  std::vector<float> qkv_f, kv_f, dout_f, dq_f, dk_f;
  rounded(B * Tn * W, qkv, qkv_f);
  rounded(B * Tn * KW, kv, kv_f);
  rounded(B * Tn * OW, dout, dout_f);
  rounded(B * Tn * W, dq0, dq_f);
  rounded(B * Tn * KW, dk0, dk_f);
  const CpStepBlock sb = cp_step_block(rank, cp, step, c);
  const RingBlockSpec b = ring_block_spec(sb, rank, cp, H, G);
  std::vector<int32_t> whole(static_cast<size_t>(B * cp * Tn)), block(static_cast<size_t>(B * Tn));
  cpu::ring::RingDocs hd;
  const int32_t* kb = nullptr;
  if (docs > 0) {
    for (int64_t t = 0, start = 0, len = 1 + int64_t(gen() % docs); t < cp * Tn; ++t) {
      if (t - start == len) start = t, len = 1 + int64_t(gen() % docs);
      whole[static_cast<size_t>(t)] = static_cast<int32_t>(start);
    }
    for (int64_t i = 0; i < b.nq; ++i)
      block[static_cast<size_t>(i)] =
          cp_block_key_begin(whole.data(), rank, sb.owner, cp, c, b.q0, b.k0, b.nk, i);
    hd.key_begin = whole.data();
    kb = block.data();
  }
  // Forward.
  std::vector<float> out_ref(static_cast<size_t>(B * b.nq * OW)),
      lse_ref(static_cast<size_t>(B * H * b.nq));
  cpu::ring::ring_block_forward(out_ref.data(), lse_ref.data(), qkv_f.data(), kv_f.data(), B, Tn, D,
                                b, hd);
  std::vector<T> out(out_ref.size());
  std::memset(static_cast<void*>(out.data()), 0xff, out.size() * sizeof(T));
  std::vector<float> lse(lse_ref.size(), NAN);
  tc::FlashRing ring;
  ring.kv = kv.data();
  ring.q_off = static_cast<int>(b.q0);
  ring.Tq = static_cast<int>(b.nq);
  ring.k_off = static_cast<int>(b.k0);
  ring.Tk = static_cast<int>(b.nk);
  ring.causal = b.causal;
  {
    using Cfg = tc::FwdCfg<D>;
    const tc::FlashFwdArgs a{out.data(),
                             lse.data(),
                             qkv.data(),
                             static_cast<int>(Tn),
                             static_cast<int>(H),
                             static_cast<int>(G),
                             AttentionDropout{},
                             AttentionAlibi{},
                             ring,
                             kb};
    tc::emu::launch(static_cast<int>((b.nq + Cfg::Br - 1) / Cfg::Br), static_cast<int>(B * H),
                    Cfg::W * 32, Cfg::smem_bytes(),
                    [&](char* smem) { tc::flash_fwd_body<T, D, false, true>(a, smem); });
  }
  double m = 0;
  for (float v : out_ref) m = std::max(m, double(std::fabs(v)));
  if (docs == 0) ASSERT_GT(m, 0.0);  // with documents a block may be masked whole: out exactly 0
  for (size_t i = 0; i < out.size(); ++i)
    ASSERT_NEAR(tc::to_f32(out[i]), out_ref[i], 2e-2 * m) << "out " << i;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse_ref[i])) {  // a row that sees no key of the block
      ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "lse " << i << ": " << lse[i];
      continue;
    }
    ASSERT_NEAR(lse[i], lse_ref[i], 1e-3 * (1 + std::fabs(lse_ref[i]))) << "lse " << i;
  }
  // Backward from a final out and lse of all Tn rows (the diagonal block's, in f32 and rounded).
  const RingBlockSpec diag = ring_block_spec(cp_step_block(rank, cp, 0, c), rank, cp, H, G);
  std::vector<float> gout_f(static_cast<size_t>(B * Tn * OW)),
      glse(static_cast<size_t>(B * H * Tn));
  cpu::ring::ring_block_forward(gout_f.data(), glse.data(), qkv_f.data(), kv_f.data(), B, Tn, D,
                                diag, hd);
  std::vector<T> gout(gout_f.size());
  for (size_t i = 0; i < gout.size(); ++i) {
    gout[i] = tc::from_f32<T>(gout_f[i]);
    gout_f[i] = tc::to_f32(gout[i]);
  }
  std::vector<float> rowdot(glse.size());
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0;
      for (int64_t d = 0; d < D; ++d)
        acc += dout_f[(t * H + h) * D + d] * gout_f[(t * H + h) * D + d];
      rowdot[h * Tn + t] = acc;
    }
  std::vector<float> dq_ref = dq_f, dk_ref = dk_f;
  cpu::ring::ring_block_backward(dq_ref.data(), dk_ref.data(), dout_f.data(), qkv_f.data(),
                                 kv_f.data(), gout_f.data(), glse.data(), B, Tn, D, b, hd);
  std::vector<T> dq = dq0, dk = dk0;
  ring.dkv = dk.data();
  const tc::FlashBwdArgs a{dq.data(),
                           dout.data(),
                           qkv.data(),
                           glse.data(),
                           rowdot.data(),
                           static_cast<int>(Tn),
                           static_cast<int>(H),
                           static_cast<int>(G),
                           AttentionDropout{},
                           AttentionAlibi{},
                           ring,
                           kb};
  {
    using Cfg = tc::BwdKvCfg<D>;
    tc::emu::launch(static_cast<int>((b.nk + Cfg::Bk - 1) / Cfg::Bk), static_cast<int>(B * G),
                    Cfg::W * 32, Cfg::smem_bytes(),
                    [&](char* smem) { tc::flash_bwd_kv_body<T, D, false, true>(a, smem); });
  }
  {
    using Cfg = tc::BwdQCfg<D>;
    tc::emu::launch(static_cast<int>((b.nq + Cfg::Br - 1) / Cfg::Br), static_cast<int>(B * H),
                    Cfg::W * 32, Cfg::smem_bytes(),
                    [&](char* smem) { tc::flash_bwd_q_body<T, D, false, true>(a, smem); });
  }
  // The contributions (reference minus what the buffers held) against the kernels'.
  double mq = 0, mk = 0;
  for (size_t i = 0; i < dq_ref.size(); ++i)
    mq = std::max(mq, double(std::fabs(dq_ref[i] - dq_f[i])));
  for (size_t i = 0; i < dk_ref.size(); ++i)
    mk = std::max(mk, double(std::fabs(dk_ref[i] - dk_f[i])));
  if (docs == 0) {  // (with documents a block masked whole adds nothing: the buffers unchanged)
    ASSERT_GT(mq, 0.0);
    ASSERT_GT(mk, 0.0);
  }
  for (size_t i = 0; i < dq.size(); ++i)
    ASSERT_NEAR(tc::to_f32(dq[i]), dq_ref[i], 3e-2 * (mq + std::fabs(dq_f[i]))) << "dqkv " << i;
  for (size_t i = 0; i < dk.size(); ++i)
    ASSERT_NEAR(tc::to_f32(dk[i]), dk_ref[i], 3e-2 * (mk + std::fabs(dk_f[i]))) << "dkv " << i;
}

}  // namespace

TEST(RingEmu, TensorCoreRingBlocksMatchTheHostBlocks) {
  check_flash_ring<64>(2, 1, 0, 40);   // the causal diagonal, chunks of 40 (not a tile multiple)
  check_flash_ring<64>(2, 1, 1, 40);   // an earlier owner: 80 queries x its first 40 keys
  check_flash_ring<64>(2, 0, 1, 40);   // a later owner: the second 40 queries x its 80 keys
  check_flash_ring<128>(4, 2, 3, 24);  // head dim 128: a later owner at CP 4
}

// Documents spanning the chunks and ranks (--sft, --reset-attention-mask under CP): in every
// block kind some query rows see none of the block's keys (out 0, lse -inf), some part of them;
// with short documents a block may be masked whole (its output exactly 0, nothing added).
TEST(RingEmu, TensorCoreRingBlocksMaskDocuments) {
  check_flash_ring<64>(2, 1, 0, 40, 30);   // the diagonal
  check_flash_ring<64>(2, 1, 1, 40, 30);   // an earlier owner
  check_flash_ring<64>(2, 0, 1, 40, 50);   // a later owner
  check_flash_ring<128>(4, 2, 3, 24, 20);  // head dim 128 at CP 4
  check_flash_ring<64>(4, 2, 1, 72, 9);    // short documents: the earlier owner's adjacent chunk
  check_flash_ring<64>(4, 1, 2, 72, 9);    // a later owner none of whose keys any row sees
}
