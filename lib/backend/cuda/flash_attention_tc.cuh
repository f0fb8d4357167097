// flash_attention_tc.cuh: causal attention on tensor cores, bf16 or f16, head dims 64 and 128:
// the FlashAttention-2 algorithm (Dao, 2023) written against the warp primitives of mma.cuh, so
// that the same source runs on the GPU (flash_attention_tc.cu) and, without one, in the warp
// emulator of test_flash_emu.
//
// Layouts are those of backend.hpp: qkv (B, T, H + 2G, D) (H query heads, then G key heads, then
// G value heads; G = H is GPT-2's [3, H, D]), out and dout (B, T, H, D), lse (B, H, T) in f32
// (natural log), dqkv like qkv. Query head h reads key/value head h / (H / G) (grouped-query
// attention), in place: K and V are never repeated per query head.
//
// Forward (one block = one (b, h) and Br = 16 W query rows, each warp 16 rows): the Q tile is
// loaded once and kept as A fragments in registers; K/V tiles of 64 keys stream through shared
// memory, double-buffered with cp.async. S = Q K^T (mma), ALiBi's bias when on, causal mask on the
// tiles that cross the diagonal, online softmax in the exp2 domain (row max and sum across the
// quad of lanes that share a row), P rounded to T and fed straight from the accumulator registers
// as the A operand of O += P V (the m16n8k16 accumulator layout of two adjacent n8 tiles is the A
// layout of one k16 chunk).
// Key tiles past the diagonal are never loaded; a warp whose rows are all before a tile's first key
// skips it. Blocks with the most work (the last query rows) are launched first.
//
// Backward, deterministic, without atomics: two kernels that each recompute P from Q, K and the
// saved log-sum-exp, as the scalar kernels did.
//  - dK/dV: one block per (b, key/value head g, Bk = 16 W keys) (each warp 16 keys). For each of
//    the group's H / G query heads in turn, query tiles streamed from the diagonal to the end (one
//    flat, double-buffered sequence of tiles across the heads): S^T = K Q^T, dP^T = V dO^T,
//    P^T = exp(S^T * scale - lse), dS^T = P^T (dP^T - Drow), dV += P^T dO, dK += dS^T Q (times
//    scale at the end). The accumulators stay in registers across the group's heads, so the sum
//    over the group needs neither atomics nor per-query-head copies of dK and dV.
//  - dQ: one block per (b, query head h) and Br = 16 W queries, key tiles of head h / (H / G) up
//    to the diagonal: S, dP, dS as above and dQ += dS K (times scale).
// Each output element has exactly one owner thread and a fixed order of accumulation, so results
// are the same from run to run. The backward does 7 of the 5 matrix products FlashAttention-2 does
// with atomics (S and dP twice); docs/performance.md has the arithmetic.
//
// Shared-memory tiles have rows of D + 8 elements: the 16-byte row skew puts the 8 rows an ldmatrix
// phase reads in 8 different bank groups (no bank conflicts), and keeps rows 16-byte aligned.
#pragma once

#include <cstdint>

#include "backend/cuda/mma.cuh"
#include "core/alibi.hpp"
#include "core/dropout.hpp"

namespace tessera::tc {

constexpr float kLog2e = 1.4426950408889634f;

// Attention dropout (when drop.spec.active()): the probabilities P that weigh V are P o M, with M
// the mask of core/dropout.hpp (0 or 1/(1-p)); the softmax statistics are those of P. The
// backward: dV = (P o M)^T dO and dS = P o (M o dP - rowsum(dO o O)). The mask is drawn again
// in each kernel from (b, head, query, key), never stored.
//
// ALiBi (the bodies' template flag kAlibi; `alibi` is read only with it): the bias
// slope_h (key - query) of core/alibi.hpp joins each score where the raw accumulator S = Q K^T
// comes out of the mma, in S's own units (slope_h / scale, as every later use multiplies S by
// scale log2(e)), so the causal mask, the row max, the exponent and the log-sum-exp all see
// biased scores, and the backward recomputes the forward's P exactly as it recomputes S.
//
// Context parallelism's ring blocks (backend.hpp ring_block_*; kv non-null): queries are rows
// [q_off, q_off + Tq) of qkv (Tn rows per sample), keys and values rows [k_off, k_off + Tk) of
// kv (B, Tn, 2G, D: the block owner's G key heads, then its G value heads); `causal` masks a key
// after its query by local row (the diagonal block, q_off = k_off = 0, Tq = Tk = Tn: local order
// is global order), else no mask. The forward writes out (B, Tq, H, D) and lse (B, H, Tq); the
// backward reads dout and the final out's rowdot and lse at the query rows (B, ., Tn layouts) and
// adds dQ into dqkv's query rows and dK/dV into dkv's rows (read, add in f32, write: one owner per
// element). Without dropout and ALiBi (those blocks take the host path). The bodies' template flag
// kRing turns the mode on (kv must then be set); the kernels without it are the causal
// self-attention above, compiled as before.
//
// Documents inside the samples (key_begin non-null; core/documents.hpp): query row t of sample b
// sees keys key_begin[b * Tn + t] .. t only (--reset-attention-mask, --sft). In ring blocks the
// table holds each query row's first visible key as a key row of the block (rows relative to the
// block's first query and key: cp_block_key_begin), and a row may see none of the block's keys
// (out 0, lse -inf, as the host blocks give). Masked like the future keys; the forward and dQ
// blocks start at the key tile of their rows' smallest first key (the tiles before are never
// loaded), a warp skips every tile before its own rows' smallest, and a dK/dV warp skips every
// query tile none of whose rows sees its keys. A row may see no key of a whole tile, so its running
// max can still be -inf there (guarded). ALiBi's distances are by row index: inside one document
// they equal the reset positions'.
struct FlashRing {
  const void* kv = nullptr;
  void* dkv = nullptr;
  int q_off = 0, Tq = 0, k_off = 0, Tk = 0;
  bool causal = true;
};

// H query heads, G key/value heads (G >= 1 divides H); the dropout mask of query head h.
struct FlashFwdArgs {
  void* out;  // T (B, Tn, H, D)
  float* lse;
  const void* qkv;  // T (B, Tn, H + 2G, D)
  int Tn, H, G;
  AttentionDropout drop;
  AttentionAlibi alibi;
  FlashRing ring;
  const int32_t* key_begin = nullptr;  // documents (B, Tn) by row, or null (see above)
};
struct FlashBwdArgs {
  void* dqkv;  // T (B, Tn, H + 2G, D)
  const void* dout;
  const void* qkv;
  const float* lse;
  const float* rowdot;  // D[b, h, t] = dout[t] . out[t]
  int Tn, H, G;
  AttentionDropout drop;
  AttentionAlibi alibi;
  FlashRing ring;
  const int32_t* key_begin = nullptr;  // documents (B, Tn) by row, or null (see above)
};

template <int D>
constexpr int kLd = D + 8;  // shared-memory row stride in elements

// Configuration per kernel. W warps of 16 rows each; tiles of the streamed side.
template <int D>
struct FwdCfg {
  static constexpr int W = 8, Br = 16 * W, Bc = 64;
  static constexpr int smem_bytes() { return (Br + 4 * Bc) * kLd<D> * 2; }
};
template <int D>
struct BwdKvCfg {
  static constexpr int W = 8, Bk = 16 * W, Bq = D == 128 ? 32 : 64;
  static constexpr int smem_bytes() { return (2 * Bk + 4 * Bq) * kLd<D> * 2 + 6 * Bq * 4; }
};
template <int D>
struct BwdQCfg {
  static constexpr int W = 8, Br = 16 * W, Bc = D == 128 ? 32 : 64;
  static constexpr int smem_bytes() { return (2 * Br + 4 * Bc) * kLd<D> * 2; }
};

// Rows [r0, r0 + ROWS) of a (Tn x D) matrix whose row r starts at src + r * stride, into a
// shared-memory tile with rows of kLd<D> elements; rows at or past Tn are zero-filled.
template <typename T, int D, int ROWS, int NT>
TC_DEV void load_rows(T* dst, const T* src, int64_t stride, int r0, int Tn) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
  for (int i = thread_id(); i < ROWS * kChunks; i += NT) {
    const int r = i / kChunks, c = i % kChunks, row = r0 + r;
    const bool ok = row < Tn;
    cp_async16(dst + r * kLd<D> + c * 8, src + static_cast<int64_t>(ok ? row : 0) * stride + c * 8,
               ok);
  }
}

// A fragments (16 rows x 16 columns starting at column k0) of a row-major shared tile whose first
// row is `rows`.
template <int D, typename T>
TC_DEV void load_a(uint32_t (&a)[4], const T* rows, int k0, int lane) {
  ldsm_x4<false>(a, rows + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd<D> + k0 + (lane >> 4) * 8);
}
// B fragments for two n8 tiles, when the shared tile is stored [n][k] (keys x head dim for S = Q
// K^T): b[0], b[1] for rows n0..n0+7, b[2], b[3] for n0+8..n0+15; k from k0.
template <int D, typename T>
TC_DEV void load_b_nk(uint32_t (&b)[4], const T* rows_n0, int k0, int lane) {
  ldsm_x4<false>(b, rows_n0 + ((lane & 7) + (lane >> 4) * 8) * kLd<D> + k0 + ((lane >> 3) & 1) * 8);
}
// B fragments for two n8 tiles when the shared tile is stored [k][n] (keys x head dim for
// O = P V): k rows from the tile's first row `rows_k0`, n columns n0..n0+15 (transposed load).
template <int D, typename T>
TC_DEV void load_b_kn(uint32_t (&b)[4], const T* rows_k0, int n0, int lane) {
  ldsm_x4<true>(b, rows_k0 + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd<D> + n0 + (lane >> 4) * 8);
}
// The A fragment of k16 chunk kc from accumulator tiles acc[2 kc], acc[2 kc + 1], rounded to T.
template <typename T, int N>
TC_DEV void acc_to_a(uint32_t (&a)[4], const float (&acc)[N][4], int kc) {
  a[0] = pack2<T>(acc[2 * kc][0], acc[2 * kc][1]);
  a[1] = pack2<T>(acc[2 * kc][2], acc[2 * kc][3]);
  a[2] = pack2<T>(acc[2 * kc + 1][0], acc[2 * kc + 1][1]);
  a[3] = pack2<T>(acc[2 * kc + 1][2], acc[2 * kc + 1][3]);
}
// acc (16 x D) += A (16 x N, the warp's accumulator tiles `a`, rounded to T) . tile (N x D, shared,
// stored [n][d]): O += P V in the forward, dV += P^T dO, dK += dS^T Q, dQ += dS K in the backward.
template <typename T, int D, int N>
TC_DEV void acc_times_tile(float (&acc)[D / 8][4], const float (&a)[N / 8][4], const T* tile,
                           int lane) {
  TC_UNROLL
  for (int kc = 0; kc < N / 16; ++kc) {
    uint32_t af[4];
    acc_to_a<T>(af, a, kc);
    TC_UNROLL
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      load_b_kn<D>(b, tile + kc * 16 * kLd<D>, dp * 16, lane);
      mma<T>(acc[2 * dp], af, b[0], b[1]);
      mma<T>(acc[2 * dp + 1], af, b[2], b[3]);
    }
  }
}

// Writes a warp's 16 x D f32 accumulator, times `mul`, as T: staged through the warp's own 16
// rows of shared memory `stage` (nobody else reads them any more), then 16-byte stores of rows
// below Tn to dst + row * stride.
template <typename T, int D, bool kAccumulate = false>
TC_DEV void store_rows(T* stage, const float (&acc)[D / 8][4], float mul0, float mul1, T* dst,
                       int64_t stride, int row0, int Tn, int lane) {
  const int g = lane >> 2, t = lane & 3;
  sync_warp();
  TC_UNROLL
  for (int n = 0; n < D / 8; ++n) {
    *reinterpret_cast<uint32_t*>(stage + g * kLd<D> + n * 8 + 2 * t) =
        pack2<T>(acc[n][0] * mul0, acc[n][1] * mul0);
    *reinterpret_cast<uint32_t*>(stage + (g + 8) * kLd<D> + n * 8 + 2 * t) =
        pack2<T>(acc[n][2] * mul1, acc[n][3] * mul1);
  }
  sync_warp();
  constexpr int kChunks = D / 8;
  for (int i = lane; i < 16 * kChunks; i += 32) {
    const int r = i / kChunks, c = i % kChunks;
    if constexpr (!kAccumulate) {
      if (row0 + r < Tn)
        *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row0 + r) * stride + c * 8) =
            *reinterpret_cast<const uint4*>(stage + r * kLd<D> + c * 8);
    } else if (row0 + r < Tn) {  // ring blocks: add to what is there, in f32
      T* to = dst + static_cast<int64_t>(row0 + r) * stride + c * 8;
      const T* from = stage + r * kLd<D> + c * 8;
      uint4 cur = *reinterpret_cast<const uint4*>(to);
      T* e = reinterpret_cast<T*>(&cur);
      TC_UNROLL
      for (int k = 0; k < 8; ++k) e[k] = from_f32<T>(to_f32(e[k]) + to_f32(from[k]));
      *reinterpret_cast<uint4*>(to) = cur;
    }
  }
}

// Two products of the backward at once, over the head dimension: ax = X Y^T and ay = Z W^T,
// where X and Z are this warp's 16 rows of shared tiles (A operands) and Y, W are N rows of shared
// tiles stored [n][d] (B operands): (S, dP) in the dQ kernel, (S^T, dP^T) in the dK/dV kernel.
template <typename T, int D, int N>
TC_DEV void dual_products(float (&ax)[N / 8][4], float (&ay)[N / 8][4], const T* x_rows,
                          const T* z_rows, const T* y_tile, const T* w_tile, int lane) {
  TC_UNROLL
  for (int n = 0; n < N / 8; ++n) {
    TC_UNROLL
    for (int e = 0; e < 4; ++e) ax[n][e] = ay[n][e] = 0.f;
  }
  TC_UNROLL
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t xa[4], za[4];
    load_a<D>(xa, x_rows, kk * 16, lane);
    load_a<D>(za, z_rows, kk * 16, lane);
    TC_UNROLL
    for (int np = 0; np < N / 16; ++np) {
      uint32_t yb[4], wb[4];
      load_b_nk<D>(yb, y_tile + np * 16 * kLd<D>, kk * 16, lane);
      mma<T>(ax[2 * np], xa, yb[0], yb[1]);
      mma<T>(ax[2 * np + 1], xa, yb[2], yb[3]);
      load_b_nk<D>(wb, w_tile + np * 16 * kLd<D>, kk * 16, lane);
      mma<T>(ay[2 * np], za, wb[0], wb[1]);
      mma<T>(ay[2 * np + 1], za, wb[2], wb[3]);
    }
  }
}

// ALiBi on a warp's score tiles, in the units of the raw accumulator S = Q K^T: s += slope_s (key
// - query) with slope_s = slope_h / scale. Element e of n8 tile n is, in the forward and dQ layout
// (rows are queries), query row0 + g + 8 (e >> 1) and key k0 + 8 n + 2 t + (e & 1); in the dK/dV
// layout (kTransposed: rows are keys), key kw0 + g + 8 (e >> 1) and query q0 + 8 n + 2 t + (e & 1).
// `rel` is key - query of element (0, 0): k0 + 2 t - row0 - g, or kw0 + g - q0 - 2 t. The
// distances are small integers, exact in f32, so each element gets slope_s * float(key - query).
// The min and the max of v over the warp (exact for integers below 2^24).
TC_DEV float warp_min(float v) {
  TC_UNROLL
  for (int m = 1; m < 32; m <<= 1) v = fminf(v, shfl_xor(v, m));
  return v;
}
TC_DEV float warp_max(float v) {
  TC_UNROLL
  for (int m = 1; m < 32; m <<= 1) v = fmaxf(v, shfl_xor(v, m));
  return v;
}

// Documents: the first visible key of rows row0 + g and row0 + g + 8 (kNoKey past the last row,
// so rows past the end never lower a minimum), the smallest and largest over the warp's 16 rows,
// and the key tile of the block's smallest (W warps; `scratch` W floats of shared memory, free).
constexpr int kNoKey = 1 << 24;  // a first key past every key (exact as a float)
struct RowDocs {
  int kb[2] = {0, 0};
  int wmin = 0, wmax = 0, first_tile = 0;
};
template <int W, int Bc>
TC_DEV RowDocs row_docs(const int32_t* key_begin, int64_t base, int row0, int g, int Tq,
                        float* scratch) {
  RowDocs r;
  if (!key_begin) return r;
  TC_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + g + 8 * i;
    r.kb[i] = row < Tq ? key_begin[base + row] : kNoKey;
  }
  const float lo = warp_min(fminf(float(r.kb[0]), float(r.kb[1])));
  r.wmin = static_cast<int>(lo);
  r.wmax = static_cast<int>(warp_max(fmaxf(float(r.kb[0]), float(r.kb[1]))));
  const int warp = thread_id() / 32;
  if (thread_id() % 32 == 0) scratch[warp] = lo;
  sync_block();
  float m = scratch[0];
  TC_UNROLL
  for (int w = 1; w < W; ++w) m = fminf(m, scratch[w]);
  sync_block();  // the scratch is a tile buffer, filled next
  r.first_tile = static_cast<int>(m) / Bc;
  return r;
}

// -inf at the keys of an accumulator tile (key k0t + 8 n + (e & 1) of row e >> 1 of the thread:
// k0t = the tile's first key + 2 t) before `bound[row]` (kBefore) or at and after it.
template <int N, bool kBefore>
TC_DEV void mask_keys(float (&s)[N][4], int k0t, const int (&bound)[2]) {
  TC_UNROLL
  for (int n = 0; n < N; ++n) {
    TC_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int key = k0t + n * 8 + (e & 1);
      if (kBefore ? key < bound[e >> 1] : key >= bound[e >> 1]) s[n][e] = -INFINITY;
    }
  }
}

// The smallest and largest of the N first keys of a query tile in shared memory, over the warp.
template <int N>
TC_DEV void tile_docs(const int* kb, int lane, int& lo, int& hi) {
  float a = float(kb[lane % N]), z = a;
  if (N > 32) {
    a = fminf(a, float(kb[32 + lane % 32]));
    z = fmaxf(z, float(kb[32 + lane % 32]));
  }
  lo = static_cast<int>(warp_min(a));
  hi = static_cast<int>(warp_max(z));
}

template <bool kTransposed, int N>
TC_DEV void add_alibi(float (&s)[N][4], float slope_s, int rel) {
  const float r = static_cast<float>(rel);
  TC_UNROLL
  for (int n = 0; n < N; ++n) {
    TC_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int d = 8 * n + (e & 1) - 8 * (e >> 1);
      s[n][e] = fmaf(slope_s, r + static_cast<float>(kTransposed ? -d : d), s[n][e]);
    }
  }
}
// ALiBi's slope of query head h in the units of S (see add_alibi).
template <int D>
TC_DEV float alibi_slope_s(const AttentionAlibi& a, int h) {
  return a.slope(h) / rsqrtf(static_cast<float>(D));
}

// ---- forward ------------------------------------------------------------------------------------

template <typename T, int D, bool kAlibi = false, bool kRing = false>
TC_DEV void flash_fwd_body(const FlashFwdArgs& p, char* smem) {
  using Cfg = FwdCfg<D>;
  constexpr int W = Cfg::W, Br = Cfg::Br, Bc = Cfg::Bc, LD = kLd<D>, NT = 32 * W;
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + Br * LD;      // two buffers of Bc rows
  T* Vs = Ks + 2 * Bc * LD;  // two buffers of Bc rows
  const int Tn = p.Tn, H = p.H, G = p.G;
  // Query rows Tq and key rows Tk of this call (a ring block's, or Tn each); rows below are
  // relative to the block's first query / key row.
  constexpr bool ring = kRing;
  const bool causal = !kRing || p.ring.causal;
  const int Tq = ring ? p.ring.Tq : Tn, Tk = ring ? p.ring.Tk : Tn;
  const int nqb = (Tq + Br - 1) / Br;
  const int q0 = (nqb - 1 - block_x()) * Br;  // heaviest blocks first
  const int b = block_y() / H, h = block_y() % H, kvh = h / (H / G);
  const int64_t C = static_cast<int64_t>(H) * D, C3 = static_cast<int64_t>(H + 2 * G) * D;
  const int64_t KW = ring ? 2 * static_cast<int64_t>(G) * D : C3;  // K/V row stride
  const T* qkv_b = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * Tn * C3;
  const T* q_g = qkv_b + static_cast<int64_t>(ring ? p.ring.q_off : 0) * C3 + h * D;
  const T* k_g = ring ? static_cast<const T*>(p.ring.kv) + static_cast<int64_t>(b) * Tn * KW +
                            static_cast<int64_t>(p.ring.k_off) * KW + kvh * D
                      : qkv_b + C + kvh * D;
  const T* v_g = k_g + static_cast<int64_t>(G) * D;
  const int tid = thread_id(), warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int row0 = q0 + warp * 16;  // this warp's first query row
  const float sl2 = rsqrtf(static_cast<float>(D)) * kLog2e;
  const float slope_s = kAlibi ? alibi_slope_s<D>(p.alibi, h) : 0.f;

  // Keys [0, kend) matter (causal; else all Tk), from the tile of the rows' smallest first key.
  const bool docs = p.key_begin != nullptr;
  const RowDocs rd = row_docs<W, Bc>(p.key_begin, static_cast<int64_t>(b) * Tn, row0, g, Tq,
                                     reinterpret_cast<float*>(Ks));
  const int kend = !causal ? Tk : Tk < q0 + Br ? Tk : q0 + Br;
  const int ntiles = (kend + Bc - 1) / Bc, jbegin = rd.first_tile;
  load_rows<T, D, Br, NT>(Qs, q_g, C3, q0, Tq);
  load_rows<T, D, Bc, NT>(Ks, k_g, KW, jbegin * Bc, Tk);
  load_rows<T, D, Bc, NT>(Vs, v_g, KW, jbegin * Bc, Tk);
  cp_async_commit();

  float o[D / 8][4];
  TC_UNROLL
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qf[D / 16][4];

  for (int j = jbegin; j < ntiles; ++j) {
    const int buf = (j - jbegin) & 1;
    if (j + 1 < ntiles) {
      load_rows<T, D, Bc, NT>(Ks + (buf ^ 1) * Bc * LD, k_g, KW, (j + 1) * Bc, Tk);
      load_rows<T, D, Bc, NT>(Vs + (buf ^ 1) * Bc * LD, v_g, KW, (j + 1) * Bc, Tk);
    }
    cp_async_commit();
    cp_async_wait<1>();
    sync_block();
    if (j == jbegin) {
      TC_UNROLL
      for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qf[kk], Qs + warp * 16 * LD, kk * 16, lane);
    }
    const int k0 = j * Bc;
    // Some row of this warp sees some key of the tile.
    if ((!causal || k0 <= row0 + 15) && (!docs || k0 + Bc - 1 >= rd.wmin)) {
      const T* Kb = Ks + buf * Bc * LD;
      const T* Vb = Vs + buf * Bc * LD;
      float s[Bc / 8][4];
      TC_UNROLL
      for (int n = 0; n < Bc / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      TC_UNROLL
      for (int kk = 0; kk < D / 16; ++kk) {
        TC_UNROLL
        for (int np = 0; np < Bc / 16; ++np) {
          uint32_t kb[4];
          load_b_nk<D>(kb, Kb + np * 16 * LD, kk * 16, lane);
          mma<T>(s[2 * np], qf[kk], kb[0], kb[1]);
          mma<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
        }
      }
      if constexpr (kAlibi) add_alibi<false>(s, slope_s, k0 + 2 * t - row0 - g);
      if (causal && k0 + Bc - 1 > row0) {  // the tile crosses this warp's diagonal: mask keys
        TC_UNROLL                          // after the row
        for (int n = 0; n < Bc / 8; ++n) {
          TC_UNROLL
          for (int e = 0; e < 4; ++e)
            if (k0 + n * 8 + 2 * t + (e & 1) > row0 + g + (e >> 1) * 8) s[n][e] = -INFINITY;
        }
      } else if (!causal && k0 + Bc > Tk) {  // no mask, but keys past the block's last are none
        const int past[2] = {Tk, Tk};
        mask_keys<Bc / 8, false>(s, k0 + 2 * t, past);
      }
      if (docs && k0 < rd.wmax)  // some row's document starts after the tile's first key
        mask_keys<Bc / 8, true>(s, k0 + 2 * t, rd.kb);
      float mx[2] = {m[0], m[1]};
      TC_UNROLL
      for (int n = 0; n < Bc / 8; ++n) {
        mx[0] = fmaxf(mx[0], fmaxf(s[n][0], s[n][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[n][2], s[n][3]));
      }
      // With documents a row may have seen no key yet (mx -inf: nothing to correct, every p 0).
      float ms[2];
      TC_UNROLL
      for (int i = 0; i < 2; ++i) {
        mx[i] = quad_max(mx[i]);
        const float mref = docs && mx[i] == -INFINITY ? 0.f : mx[i];
        const float corr = ex2((m[i] - mref) * sl2);
        m[i] = mx[i];
        l[i] *= corr;
        ms[i] = mref * sl2;
        TC_UNROLL
        for (int n = 0; n < D / 8; ++n) {
          o[n][2 * i] *= corr;
          o[n][2 * i + 1] *= corr;
        }
      }
      TC_UNROLL
      for (int n = 0; n < Bc / 8; ++n) {
        TC_UNROLL
        for (int e = 0; e < 4; ++e) {
          s[n][e] = ex2(s[n][e] * sl2 - ms[e >> 1]);  // masked: exp2(-inf) = 0
          l[e >> 1] += s[n][e];
        }
      }
      if (p.drop.spec.active()) {  // after the row sums: the statistics are the softmax's
        TC_UNROLL
        for (int n = 0; n < Bc / 8; ++n) {
          TC_UNROLL
          for (int i = 0; i < 2; ++i) {
            float m0, m1;
            p.drop.multiplier2(b, h, row0 + g + 8 * i, k0 + n * 8 + 2 * t, Tn, m0, m1);
            s[n][2 * i] *= m0;
            s[n][2 * i + 1] *= m1;
          }
        }
      }
      acc_times_tile<T, D, Bc>(o, s, Vb, lane);
    }
    sync_block();  // the buffer just read is refilled by the next iteration's prefetch
  }
  const float sc = rsqrtf(static_cast<float>(D));
  float inv[2];
  TC_UNROLL
  for (int i = 0; i < 2; ++i) {
    l[i] = quad_sum(l[i]);
    const bool none = docs && l[i] == 0.f;  // a row that saw no key of a ring block: out 0
    inv[i] = none ? 0.f : 1.f / l[i];
    const int row = row0 + g + 8 * i;
    const float lse = none ? -INFINITY : m[i] * sc + logf(l[i]);
    if (t == 0 && row < Tq) p.lse[(static_cast<int64_t>(b) * H + h) * Tq + row] = lse;
  }
  T* out_g = static_cast<T*>(p.out) + static_cast<int64_t>(b) * Tq * C + h * D;
  store_rows<T, D>(Qs + warp * 16 * LD, o, inv[0], inv[1], out_g, C, row0, Tq, lane);
}

// ---- backward: dK and dV
// ----------------------------------------------------------------------------

template <typename T, int D, bool kAlibi = false, bool kRing = false>
TC_DEV void flash_bwd_kv_body(const FlashBwdArgs& p, char* smem) {
  using Cfg = BwdKvCfg<D>;
  constexpr int W = Cfg::W, Bk = Cfg::Bk, Bq = Cfg::Bq, LD = kLd<D>, NT = 32 * W;
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + Bk * LD;
  T* Qs = Vs + Bk * LD;                                    // two buffers of Bq rows
  T* Gs = Qs + 2 * Bq * LD;                                // dO, two buffers
  float* Ls = reinterpret_cast<float*>(Gs + 2 * Bq * LD);  // lse * log2(e), two buffers
  float* Ds = Ls + 2 * Bq;                                 // rowdot, two buffers
  int* KBs = reinterpret_cast<int*>(Ds + 2 * Bq);          // documents' first keys, two buffers
  const int Tn = p.Tn, H = p.H, G = p.G;
  // Ring blocks (p.ring.kv): query rows [q_off, q_off + Tq) of qkv, dout, lse and rowdot, key rows
  // [k_off, k_off + Tk) of kv; rows below are relative to those.
  constexpr bool ring = kRing;
  const bool causal = !kRing || p.ring.causal;
  const int Tq = ring ? p.ring.Tq : Tn, Tk = ring ? p.ring.Tk : Tn, qoff = ring ? p.ring.q_off : 0;
  const int k0 = block_x() * Bk;  // the first blocks have the most queries to visit
  const int b = block_y() / G, kvh = block_y() % G;
  const int64_t C = static_cast<int64_t>(H) * D, C3 = static_cast<int64_t>(H + 2 * G) * D;
  const int64_t KW = ring ? 2 * static_cast<int64_t>(G) * D : C3;
  const T* qkv_b = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * Tn * C3 +
                   static_cast<int64_t>(qoff) * C3;
  const T* dout_b = static_cast<const T*>(p.dout) + static_cast<int64_t>(b) * Tn * C +
                    static_cast<int64_t>(qoff) * C;
  const int tid = thread_id(), warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int kw0 = k0 + warp * 16;  // this warp's first key
  const float sl2 = rsqrtf(static_cast<float>(D)) * kLog2e;

  // Query tile (head qh, rows from q0): Q and dO rows into buffer `buf`.
  auto load_q_rows = [&](int buf, int qh, int q0) {
    load_rows<T, D, Bq, NT>(Qs + buf * Bq * LD, qkv_b + qh * D, C3, q0, Tq);
    load_rows<T, D, Bq, NT>(Gs + buf * Bq * LD, dout_b + qh * D, C, q0, Tq);
  };
  // lse (times log2 e), rowdot and (documents) the first visible key of query tile (qh, q0):
  // thread tid < Bq loads entry tid into registers, and stores them into a buffer later (after the
  // tile's work, so the global loads' latency is hidden behind it); 0 past the end (first key:
  // kNoKey).
  const bool docs = p.key_begin != nullptr;
  auto load_stats = [&](int qh, int q0, float& l, float& d, int& kb) {
    const bool ok = tid < Bq && q0 + tid < Tq;
    const int64_t at = (static_cast<int64_t>(b) * H + qh) * Tn + qoff + q0 + tid;
    l = ok ? p.lse[at] * kLog2e : 0.f;
    d = ok ? p.rowdot[at] : 0.f;
    kb = docs && ok ? p.key_begin[static_cast<int64_t>(b) * Tn + q0 + tid] : kNoKey;
  };
  auto store_stats = [&](int buf, float l, float d, int kb) {
    if (tid < Bq) {
      Ls[buf * Bq + tid] = l;
      Ds[buf * Bq + tid] = d;
      KBs[buf * Bq + tid] = kb;
    }
  };
  if constexpr (kRing) {
    const T* kv_b = static_cast<const T*>(p.ring.kv) + static_cast<int64_t>(b) * Tn * KW +
                    static_cast<int64_t>(p.ring.k_off) * KW;
    load_rows<T, D, Bk, NT>(Ks, kv_b + kvh * D, KW, k0, Tk);
    load_rows<T, D, Bk, NT>(Vs, kv_b + static_cast<int64_t>(G + kvh) * D, KW, k0, Tk);
  } else {
    load_rows<T, D, Bk, NT>(Ks, qkv_b + C + kvh * D, C3, k0, Tn);
    load_rows<T, D, Bk, NT>(Vs, qkv_b + C + static_cast<int64_t>(G + kvh) * D, C3, k0, Tn);
  }
  // The tiles: for each query head of the group (kvh R .. kvh R + R - 1, R = H / G), the query
  // rows from qbegin to the end, one flat sequence so the prefetch runs on across heads.
  const int qbegin = causal ? k0 : 0;  // causal: queries before the first key see none of it
  const int ntiles = (H / G) * ((Tq - qbegin + Bq - 1) / Bq);
  int h = kvh * (H / G), q0 = qbegin;                           // the current tile
  float slope_s = kAlibi ? alibi_slope_s<D>(p.alibi, h) : 0.f;  // ALiBi's, of head h
  load_q_rows(0, h, q0);
  {
    float l, d;
    int kb;
    load_stats(h, q0, l, d, kb);
    store_stats(0, l, d, kb);
  }
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
  TC_UNROLL
  for (int n = 0; n < D / 8; ++n) {
    TC_UNROLL
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
  }

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    const bool wrap = q0 + Bq >= Tq;  // the next tile starts the next head
    const int next_h = wrap ? h + 1 : h, next_q0 = wrap ? qbegin : q0 + Bq;
    float next_l = 0.f, next_d = 0.f;
    int next_kb = kNoKey;
    if (j + 1 < ntiles) {
      load_q_rows(buf ^ 1, next_h, next_q0);
      load_stats(next_h, next_q0, next_l, next_d, next_kb);
    }
    cp_async_commit();
    cp_async_wait<1>();
    sync_block();
    int tmin = 0, tmax = 0;  // documents: the tile's queries' smallest and largest first key
    if (docs) tile_docs<Bq>(KBs + buf * Bq, lane, tmin, tmax);
    // Some query of the tile sees some key of this warp.
    if ((!causal || q0 + Bq - 1 >= kw0) && (!docs || tmin <= kw0 + 15)) {
      const T* Qb = Qs + buf * Bq * LD;
      const T* Gb = Gs + buf * Bq * LD;
      float st[Bq / 8][4], dpt[Bq / 8][4];
      dual_products<T, D, Bq>(st, dpt, Ks + warp * 16 * LD, Vs + warp * 16 * LD, Qb, Gb, lane);
      if constexpr (kAlibi) add_alibi<true>(st, slope_s, kw0 + g - q0 - 2 * t);
      // Element (key kw0 + g + 8 (e >> 1), query q0 + 8 n + 2 t + (e & 1)). Only tiles that cross
      // this warp's diagonal or run past the sequence need the mask (warp-uniform test).
      // Without the causal mask (ring blocks): only rows past the block's queries or keys.
      const bool masked =
          (causal ? q0 < kw0 + 15 || q0 + Bq > Tq : q0 + Bq > Tq || kw0 + 16 > Tk) ||
          (docs && tmax > kw0);
      TC_UNROLL
      for (int n = 0; n < Bq / 8; ++n) {
        TC_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int qi = n * 8 + 2 * t + (e & 1), q = q0 + qi, key = kw0 + g + (e >> 1) * 8;
          const bool keep =
              !masked || ((causal ? key <= q && q < Tq : q < Tq && key < Tk) &&
                          (!docs || key >= KBs[buf * Bq + qi]));  // (causal: key < Tk)
          const float pr = keep ? ex2(st[n][e] * sl2 - Ls[buf * Bq + qi]) : 0.f;
          const float mul =
              p.drop.spec.active() && keep ? p.drop.multiplier(b, h, q, key, Tn) : 1.f;
          st[n][e] = pr * mul;
          dpt[n][e] = keep ? pr * (dpt[n][e] * mul - Ds[buf * Bq + qi]) : 0.f;
        }
      }
      acc_times_tile<T, D, Bq>(dv, st, Gb, lane);
      acc_times_tile<T, D, Bq>(dk, dpt, Qb, lane);
    }
    // The other buffer's last readers were in the previous iteration, behind its closing barrier.
    if (j + 1 < ntiles) store_stats(buf ^ 1, next_l, next_d, next_kb);
    if constexpr (kAlibi)
      if (next_h != h) slope_s = alibi_slope_s<D>(p.alibi, next_h);
    h = next_h;
    q0 = next_q0;
    sync_block();
  }
  const float sc = rsqrtf(static_cast<float>(D));
  T* dk_g = ring ? static_cast<T*>(p.ring.dkv) + static_cast<int64_t>(b) * Tn * KW +
                       static_cast<int64_t>(p.ring.k_off) * KW + kvh * D
                 : static_cast<T*>(p.dqkv) + static_cast<int64_t>(b) * Tn * C3 + C + kvh * D;
  store_rows<T, D, kRing>(Ks + warp * 16 * LD, dk, sc, sc, dk_g, KW, kw0, Tk, lane);
  store_rows<T, D, kRing>(Vs + warp * 16 * LD, dv, 1.f, 1.f, dk_g + static_cast<int64_t>(G) * D, KW,
                          kw0, Tk, lane);
}

// ---- backward: dQ
// -----------------------------------------------------------------------------------

template <typename T, int D, bool kAlibi = false, bool kRing = false>
TC_DEV void flash_bwd_q_body(const FlashBwdArgs& p, char* smem) {
  using Cfg = BwdQCfg<D>;
  constexpr int W = Cfg::W, Br = Cfg::Br, Bc = Cfg::Bc, LD = kLd<D>, NT = 32 * W;
  T* Qs = reinterpret_cast<T*>(smem);
  T* Gs = Qs + Br * LD;
  T* Ks = Gs + Br * LD;      // two buffers of Bc rows
  T* Vs = Ks + 2 * Bc * LD;  // two buffers of Bc rows
  const int Tn = p.Tn, H = p.H, G = p.G;
  constexpr bool ring = kRing;
  const bool causal = !kRing || p.ring.causal;  // as in the dK/dV body
  const int Tq = ring ? p.ring.Tq : Tn, Tk = ring ? p.ring.Tk : Tn, qoff = ring ? p.ring.q_off : 0;
  const int nqb = (Tq + Br - 1) / Br;
  const int q0 = (nqb - 1 - block_x()) * Br;  // heaviest blocks first
  const int b = block_y() / H, h = block_y() % H, kvh = h / (H / G);
  const int64_t C = static_cast<int64_t>(H) * D, C3 = static_cast<int64_t>(H + 2 * G) * D,
                bh = static_cast<int64_t>(b) * H + h;
  const int64_t KW = ring ? 2 * static_cast<int64_t>(G) * D : C3;
  const T* qkv_b = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * Tn * C3;
  const T* q_g = qkv_b + static_cast<int64_t>(qoff) * C3 + h * D;
  const T* k_g = ring ? static_cast<const T*>(p.ring.kv) + static_cast<int64_t>(b) * Tn * KW +
                            static_cast<int64_t>(p.ring.k_off) * KW + kvh * D
                      : qkv_b + C + kvh * D;
  const T* v_g = k_g + static_cast<int64_t>(G) * D;
  const T* g_g = static_cast<const T*>(p.dout) + static_cast<int64_t>(b) * Tn * C +
                 static_cast<int64_t>(qoff) * C + h * D;
  const int tid = thread_id(), warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int row0 = q0 + warp * 16;
  const float sl2 = rsqrtf(static_cast<float>(D)) * kLog2e;
  const float slope_s = kAlibi ? alibi_slope_s<D>(p.alibi, h) : 0.f;

  float L[2], Dr[2];  // per row g, g + 8: lse * log2(e) and the rowdot (0 past the end)
  TC_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + g + 8 * i;
    L[i] = row < Tq ? p.lse[bh * Tn + qoff + row] * kLog2e : 0.f;
    Dr[i] = row < Tq ? p.rowdot[bh * Tn + qoff + row] : 0.f;
  }
  const bool docs = p.key_begin != nullptr;  // as in the forward
  const RowDocs rd = row_docs<W, Bc>(p.key_begin, static_cast<int64_t>(b) * Tn, row0, g, Tq,
                                     reinterpret_cast<float*>(Ks));
  const int kend = !causal ? Tk : Tk < q0 + Br ? Tk : q0 + Br;
  const int ntiles = (kend + Bc - 1) / Bc, jbegin = rd.first_tile;
  load_rows<T, D, Br, NT>(Qs, q_g, C3, q0, Tq);
  load_rows<T, D, Br, NT>(Gs, g_g, C, q0, Tq);
  load_rows<T, D, Bc, NT>(Ks, k_g, KW, jbegin * Bc, Tk);
  load_rows<T, D, Bc, NT>(Vs, v_g, KW, jbegin * Bc, Tk);
  cp_async_commit();

  float dq[D / 8][4];
  TC_UNROLL
  for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;

  for (int j = jbegin; j < ntiles; ++j) {
    const int buf = (j - jbegin) & 1, k0 = j * Bc;
    if (j + 1 < ntiles) {
      load_rows<T, D, Bc, NT>(Ks + (buf ^ 1) * Bc * LD, k_g, KW, k0 + Bc, Tk);
      load_rows<T, D, Bc, NT>(Vs + (buf ^ 1) * Bc * LD, v_g, KW, k0 + Bc, Tk);
    }
    cp_async_commit();
    cp_async_wait<1>();
    sync_block();
    if ((!causal || k0 <= row0 + 15) && (!docs || k0 + Bc - 1 >= rd.wmin)) {
      const T* Kb = Ks + buf * Bc * LD;
      const T* Vb = Vs + buf * Bc * LD;
      float s[Bc / 8][4], dp[Bc / 8][4];
      dual_products<T, D, Bc>(s, dp, Qs + warp * 16 * LD, Gs + warp * 16 * LD, Kb, Vb, lane);
      if constexpr (kAlibi) add_alibi<false>(s, slope_s, k0 + 2 * t - row0 - g);
      // Element (query row0 + g + 8 (e >> 1), key k0 + 8 n + 2 t + (e & 1)); the mask only where
      // the tile crosses this warp's diagonal (keys past the end are past every stored row too).
      // Ring blocks without the causal mask: only the keys past the block's last.
      const bool masked = (causal ? k0 + Bc - 1 > row0 : k0 + Bc > Tk) || (docs && k0 < rd.wmax);
      const bool drop = p.drop.spec.active();
      TC_UNROLL
      for (int n = 0; n < Bc / 8; ++n) {
        float mul[4] = {1.f, 1.f, 1.f, 1.f};
        if (drop) {
          p.drop.multiplier2(b, h, row0 + g, k0 + n * 8 + 2 * t, Tn, mul[0], mul[1]);
          p.drop.multiplier2(b, h, row0 + g + 8, k0 + n * 8 + 2 * t, Tn, mul[2], mul[3]);
        }
        TC_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + n * 8 + 2 * t + (e & 1), row = row0 + g + (e >> 1) * 8;
          const bool keep =
              !masked || ((causal ? key <= row : key < Tk) && (!docs || key >= rd.kb[e >> 1]));
          dp[n][e] = keep ? ex2(s[n][e] * sl2 - L[e >> 1]) * (dp[n][e] * mul[e] - Dr[e >> 1]) : 0.f;
        }
      }
      acc_times_tile<T, D, Bc>(dq, dp, Kb, lane);
    }
    sync_block();
  }
  const float sc = rsqrtf(static_cast<float>(D));
  T* dq_g = static_cast<T*>(p.dqkv) + static_cast<int64_t>(b) * Tn * C3 +
            static_cast<int64_t>(qoff) * C3 + h * D;
  store_rows<T, D, kRing>(Qs + warp * 16 * LD, dq, sc, sc, dq_g, C3, row0, Tq, lane);
}

}  // namespace tessera::tc
