// Causal self-attention (multi-head and grouped-query): a plain fp32 reference and a blocked,
// FlashAttention-2 style fast version.
//
// Notation (per batch row b and query head h; g = h / (H/KVH) is its key/value head):
//   S[t,t'] = scale * q_t . k_t'            for t' <= t (causal), -inf otherwise
//   P[t,:]  = softmax(S[t,:]),  out_t = sum_t' P[t,t'] v_t',  lse_t = log sum_t' exp(S[t,t'])
// Backward (dO = dout):
//   D_t = dO_t . out_t  (= sum_t' P dP),   dP[t,t'] = dO_t . v_t',   dS = P * (dP - D_t)
//   dq_t = scale * sum_t' dS[t,t'] k_t',  dk_t' = scale * sum_t dS[t,t'] q_t,  dv_t' = sum_t P[t,t'] dO_t
//
// Fast forward. The sequence is cut into tiles of kBlock = 64 queries and 64 keys. One work item is
// (b, h, query tile i); it walks key tiles j = 0..i and keeps, per query row, the running maximum m,
// the running sum l of exp(S - m) and the unnormalised output O (the online softmax): when a new
// tile raises the maximum from m to m', the old l and O are rescaled by exp(m - m'). Only the
// 64 x 64 tile of scores exists at any time, so memory is O(block x (block + D)) per thread whatever
// T is. Tiles above the diagonal are skipped; the diagonal tile masks t' > t. At the end
// out = O / l and lse = m + log(l), which is all backward needs.
//
// Fast backward recomputes P tile by tile from lse (P = exp(S - lse)), so nothing T x T is stored:
//   dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = scale * P * (dP - D_i),  dK_j += dS^T Q_i,  dQ_i += dS K_j
// (five 64 x 64 x D matrix products per tile pair; the forward has two). Every query head of a GQA
// group adds into the same dK/dV head, so work is split so that each output element has exactly one
// owner and a fixed summation order -- no atomics, bitwise reproducible results:
//   * by (b, kv head): one item owns dK/dV of its kv head and dQ of the query heads in its group; it
//     walks key tiles j (outer), the group's heads, then query tiles i >= j, accumulating dQ in a
//     T x D workspace per head. No work is repeated. This needs B*KVH items to keep threads busy.
//   * when B*KVH is too small for the thread count, two passes instead: items (b, kv head, key tile)
//     own dK_j/dV_j; then items (b, h, query tile) recompute S, P, dP and own dQ_i. That repeats two
//     of the five products (7/5 of the work) but scales to any thread count.
// Both schedules visit tile pairs in the same order for every output element (dK/dV: heads of the
// group, then query tiles ascending; dQ: key tiles ascending) with identical arithmetic, so they give
// bitwise identical results: the result does not depend on the thread count.
//
// Inner loops. Operands are read in place from qkv / dout when D is a whole number of 16-float
// vectors; otherwise through copies padded to Dp = D rounded up to 16. Operands that must be read
// across rows (Q in the forward, K and V in the backward) are transposed into D x 64 tiles. Then
// every product is a register-blocked outer-product loop on GCC vector types: a few rows x 4
// vectors of accumulators, one broadcast scalar times one loaded vector per FMA. The code is a
// template on the vector width, instantiated for AVX-512 (16 floats), AVX2 + FMA (8) and SSE2 (4)
// and picked once at run time (the build has no -march flag; one width for all would not do: GCC
// lowers 64-byte vectors on AVX2 through memory, 30x slower). exp is a polynomial (Cephes expf,
// ~2 ulp) on whole vectors.
#include "loom/kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "loom/error.h"

// The vector helpers return vectors by value; they are always inlined, so GCC's warning that such
// returns have a different ABI without AVX / AVX-512 concerns no real call.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace loom::kernels {
namespace {

// Queries and keys per tile. 64 keys make a row of scores four AVX-512 registers, and a tile of
// scores (16 KiB) plus the Q, K, V tiles (16 KiB each at D = 64) stays in L1/L2.
constexpr int64_t kBlock = 64;
// Head dimension padding (floats): a whole vector of the widest ISA, so that workspace layout does not
// depend on the ISA chosen.
constexpr int64_t kPad = 16;

#define LOOM_ATTN_INLINE inline __attribute__((always_inline))

// Shapes and strides of one call, derived once.
struct Dims {
  int64_t B, T, H, KVH, D;
  int64_t Dp;       // D rounded up to kPad
  int64_t group;    // query heads per kv head
  int64_t qkv_row;  // floats per token row of qkv: (H + 2 KVH) D
  int64_t out_row;  // floats per token row of out / dout: H D
  int64_t tiles;    // ceil(T / kBlock)
  float scale;
};

Dims make_dims(const AttentionShape& s) {
  Dims d{};
  d.B = s.B, d.T = s.T, d.H = s.H, d.KVH = s.KVH, d.D = s.D;
  d.Dp = (s.D + kPad - 1) / kPad * kPad;
  d.group = s.H / s.KVH;
  d.qkv_row = (s.H + 2 * s.KVH) * s.D;
  d.out_row = s.H * s.D;
  d.tiles = (s.T + kBlock - 1) / kBlock;
  d.scale = s.scale;
  return d;
}

// n rows of D floats (source row stride `stride`) into rows of Dp floats, zero padded.
LOOM_ATTN_INLINE void copy_rows(float* dst, int64_t Dp, const float* src, int64_t stride, int64_t n, int64_t D) {
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(dst + r * Dp, src + r * stride, static_cast<size_t>(D) * sizeof(float));
    std::fill(dst + r * Dp + D, dst + (r + 1) * Dp, 0.0f);
  }
}

// n rows of D floats into dst[d*64 + r] = scale * src[r][d] (D x 64), columns n..63 zeroed.
LOOM_ATTN_INLINE void transpose_rows(float* dst, const float* src, int64_t stride, int64_t n, int64_t D,
                                     float scale = 1.0f) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[d * kBlock + r] = src[r * stride + d] * scale;
  if (n < kBlock)
    for (int64_t d = 0; d < D; ++d) std::fill(dst + d * kBlock + n, dst + (d + 1) * kBlock, 0.0f);
}

// A tile operand: n rows of D floats, used in place when D is a whole number of vectors (the
// products read full vectors), else through a zero-padded copy in `scratch`.
struct Rows {
  const float* p;
  int64_t ld;
};
LOOM_ATTN_INLINE Rows tile_rows(float* scratch, int64_t Dp, const float* src, int64_t stride, int64_t n, int64_t D) {
  if (D == Dp) return {src, stride};
  copy_rows(scratch, Dp, src, stride, n, D);
  return {scratch, Dp};
}

struct BackwardArgs {
  float* dqkv;
  const float* dout;
  const float* out;
  const float* lse;
  const float* qkv;
};

// Tiles a backward item needs whatever the schedule. Kb, Qb, dOb are scratch for padded copies; the
// products read the operands through K, Q, dO (in place when D is a whole number of vectors).
struct BackwardTiles {
  float *Kt, *Vt, *Kb, *Qb, *dOb, *dKb, *dVb, *dQb, *P, *dS, *Di;
  Rows K, Q, dO;
};

constexpr int64_t backward_tile_floats(int64_t Dp) { return 8 * kBlock * Dp + 2 * kBlock * kBlock + kBlock; }

BackwardTiles carve_backward_tiles(float* ws, int64_t Dp) {
  BackwardTiles t{};
  float* p = ws;
  for (float** slot : {&t.Kt, &t.Vt, &t.Kb, &t.Qb, &t.dOb, &t.dKb, &t.dVb, &t.dQb}) {
    *slot = p;
    p += kBlock * Dp;
  }
  t.P = p;
  t.dS = p + kBlock * kBlock;
  t.Di = p + 2 * kBlock * kBlock;
  return t;
}

// Loads key tile (k0, nk) of kv head g: K^T and V^T for the score products, K rows for dQ += dS K.
LOOM_ATTN_INLINE void load_key_tile(const Dims& s, BackwardTiles& w, const float* qkv, int64_t b, int64_t g, int64_t k0,
                                    int64_t nk) {
  const float* tok = qkv + (b * s.T + k0) * s.qkv_row;
  const float* k = tok + (s.H + g) * s.D;
  const float* v = tok + (s.H + s.KVH + g) * s.D;
  transpose_rows(w.Kt, k, s.qkv_row, nk, s.D);
  transpose_rows(w.Vt, v, s.qkv_row, nk, s.D);
  w.K = tile_rows(w.Kb, s.Dp, k, s.qkv_row, nk, s.D);
}

// Loads query tile (q0, nq) of head h: Q and dO rows.
LOOM_ATTN_INLINE void load_query_tile(const Dims& s, BackwardTiles& w, const BackwardArgs& a, int64_t b, int64_t h,
                                      int64_t q0, int64_t nq) {
  w.Q = tile_rows(w.Qb, s.Dp, a.qkv + (b * s.T + q0) * s.qkv_row + h * s.D, s.qkv_row, nq, s.D);
  w.dO = tile_rows(w.dOb, s.Dp, a.dout + (b * s.T + q0) * s.out_row + h * s.D, s.out_row, nq, s.D);
}

// The forward works on transposed scores St[c][r] = scale * k_c . q_r (key c, query r) so that the
// softmax statistics of the 64 query rows are whole vectors: the running max, sum and rescaling
// factors need no horizontal reductions, and each query tile is transposed once per item instead of
// each key tile once per tile pair.
constexpr int64_t forward_workspace_floats(int64_t Dp) {
  return 3 * kBlock * Dp + kBlock * kBlock + 3 * kBlock;  // Q^T, padded V, O; scores; m, l, alpha
}

// Everything that touches vectors, for vectors of W floats.
template <int W>
struct Simd {
  typedef float V __attribute__((vector_size(4 * W)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
  static constexpr int kTileVectors = 4;  // accumulator columns per register tile
  // Accumulator rows per register tile: 4 x 4 of AVX-512's 32 registers, 2 x 4 of AVX2's 16.
  static constexpr int kTileRows = W == 16 ? 4 : 2;
  static constexpr int kRowVectors = kBlock / W;  // vectors per 64-float tile row

  static LOOM_ATTN_INLINE V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static LOOM_ATTN_INLINE void store(float* p, const V& v) { std::memcpy(p, &v, sizeof v); }
  // All lanes = x, built in the integer domain: neither V{x, x, ...} (GCC assembles it lane by lane)
  // nor V{} + x (adding 0.0f is not an identity for x = -0.0, so a scalar add stays) is a plain
  // broadcast. The hot loops multiply a scalar by a vector instead, which broadcasts directly.
  static LOOM_ATTN_INLINE V splat(float x) { return (V)(I{} + std::bit_cast<int32_t>(x)); }
  static LOOM_ATTN_INLINE V vmax(const V& a, const V& b) { return a > b ? a : b; }
  // (Lanes are set through memory: GCC does not subscript a vector type that depends on W.)
  static LOOM_ATTN_INLINE I iota() {
    int32_t lanes[W];
    for (int k = 0; k < W; ++k) lanes[k] = k;
    I v;
    std::memcpy(&v, lanes, sizeof v);
    return v;
  }
  static LOOM_ATTN_INLINE float sum_lanes(const V& v) {
    float lanes[W];
    std::memcpy(lanes, &v, sizeof v);
    float sum = 0;
    for (int k = 0; k < W; ++k) sum += lanes[k];
    return sum;
  }

  // exp, Cephes expf (~2 ulp): x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, and
  // 2^n written straight into the exponent bits. Inputs below -87.3 (including the -inf of masked
  // scores) give exactly 0; clamping keeps 2^n a normal float. Callers only pass x <= ~0.
  static LOOM_ATTN_INLINE V vexp(const V& x) {
    const V lo = splat(-87.3f);
    const V hi = splat(88.3f);
    const V magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
    V xc = x < lo ? lo : x;
    xc = xc > hi ? hi : xc;
    const V t = xc * 1.44269504088896341f + magic;
    const V n = t - magic;
    V r = xc - n * 0.693359375f;  // ln2 split in two (Cody-Waite) so that n*ln2 is exact enough
    r = r - n * -2.12194440e-4f;
    V p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const I ni = (I)t - (I)magic;  // n as an integer: the low mantissa bits of t
    const V pow2n = (V)((ni + 127) << 23);
    return x < lo ? V{} : p * pow2n;
  }

  // Diagonal tile, scores as S[r][c] (query row r): only keys c <= r are visible.
  static LOOM_ATTN_INLINE V mask_above(const V& x, int v, int64_t r) {
    const I col = iota() + v * W;
    return col > static_cast<int32_t>(r) ? splat(-std::numeric_limits<float>::infinity()) : x;
  }
  // Diagonal tile, scores as St[c][r] (key row c): only queries r >= c see key c.
  static LOOM_ATTN_INLINE V mask_before(const V& x, int v, int64_t c) {
    const I col = iota() + v * W;
    return col < static_cast<int32_t>(c) ? splat(-std::numeric_limits<float>::infinity()) : x;
  }

  // C[r][cols] = scale * sum_{d<D} A[r*lda + d] * Bt[d*64 + cols] for R rows, 4 vectors of columns.
  template <int R>
  static LOOM_ATTN_INLINE void tile_abt(float* C, const float* A, int64_t lda, const float* Bt, int64_t D,
                                        float scale) {
    V acc[R][kTileVectors];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kTileVectors; ++v) acc[r][v] = V{};
    for (int64_t d = 0; d < D; ++d) {
      V b[kTileVectors];
      for (int v = 0; v < kTileVectors; ++v) b[v] = load(Bt + d * kBlock + v * W);
      for (int r = 0; r < R; ++r) {
        const float a = A[r * lda + d];
        for (int v = 0; v < kTileVectors; ++v) acc[r][v] += a * b[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kTileVectors; ++v) store(C + r * kBlock + v * W, acc[r][v] * scale);
  }

  // C (nr x 64, row stride 64) = scale * A (nr x D, row stride lda) * Bt (D x 64), i.e. A B^T.
  static LOOM_ATTN_INLINE void matmul_abt(float* C, const float* A, int64_t lda, const float* Bt, int64_t nr, int64_t D,
                                          float scale) {
    for (int64_t c0 = 0; c0 < kBlock; c0 += kTileVectors * W) {
      int64_t r = 0;
      for (; r + kTileRows <= nr; r += kTileRows)
        tile_abt<kTileRows>(C + r * kBlock + c0, A + r * lda, lda, Bt + c0, D, scale);
      for (; r < nr; ++r) tile_abt<1>(C + r * kBlock + c0, A + r * lda, lda, Bt + c0, D, scale);
    }
  }

  // C[r][cols] = alpha[r] * C[r][cols] + sum_{k<K} A[r*ars + k*aks] * B[k*ldb + cols] for R rows and
  // NV vectors of columns (alpha == nullptr means 1).
  template <int R, int NV>
  static LOOM_ATTN_INLINE void tile_ab(float* C, int64_t ldc, const float* alpha, const float* A, int64_t ars,
                                       int64_t aks, const float* B, int64_t ldb, int64_t K) {
    V acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = load(C + r * ldc + v * W);
    if (alpha != nullptr)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] *= alpha[r];
    for (int64_t k = 0; k < K; ++k) {
      V b[NV];
      for (int v = 0; v < NV; ++v) b[v] = load(B + k * ldb + v * W);
      for (int r = 0; r < R; ++r) {
        const float a = A[r * ars + k * aks];
        for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) store(C + r * ldc + v * W, acc[r][v]);
  }

  template <int NV>
  static LOOM_ATTN_INLINE void matmul_ab_cols(float* C, int64_t ldc, const float* alpha, const float* A, int64_t ars,
                                              int64_t aks, const float* B, int64_t ldb, int64_t nr, int64_t K) {
    int64_t r = 0;
    for (; r + kTileRows <= nr; r += kTileRows)
      tile_ab<kTileRows, NV>(C + r * ldc, ldc, alpha ? alpha + r : nullptr, A + r * ars, ars, aks, B, ldb, K);
    for (; r < nr; ++r) tile_ab<1, NV>(C + r * ldc, ldc, alpha ? alpha + r : nullptr, A + r * ars, ars, aks, B, ldb, K);
  }

  // C (nr x Dp) = diag(alpha) C + A (nr x K, element (r,k) at A[r*ars + k*aks]) * B (K x Dp).
  // Dp is a multiple of 16; columns go in chunks of up to 4 vectors so accumulators stay in registers.
  static LOOM_ATTN_INLINE void matmul_ab(float* C, int64_t ldc, const float* alpha, const float* A, int64_t ars,
                                         int64_t aks, const float* B, int64_t ldb, int64_t nr, int64_t K, int64_t Dp) {
    for (int64_t c0 = 0; c0 < Dp; c0 += kTileVectors * W) {
      switch (std::min<int64_t>(kTileVectors, (Dp - c0) / W)) {
        case 4:
          matmul_ab_cols<4>(C + c0, ldc, alpha, A, ars, aks, B + c0, ldb, nr, K);
          break;
        case 3:
          matmul_ab_cols<3>(C + c0, ldc, alpha, A, ars, aks, B + c0, ldb, nr, K);
          break;
        case 2:
          matmul_ab_cols<2>(C + c0, ldc, alpha, A, ars, aks, B + c0, ldb, nr, K);
          break;
        default:
          matmul_ab_cols<1>(C + c0, ldc, alpha, A, ars, aks, B + c0, ldb, nr, K);
          break;
      }
    }
  }

  // dst rows (stride `stride`, D floats) = src rows (stride Dp).
  static LOOM_ATTN_INLINE void write_rows(float* dst, int64_t stride, const float* src, int64_t Dp, int64_t n,
                                          int64_t D) {
    for (int64_t r = 0; r < n; ++r) {
      float* o = dst + r * stride;
      const float* x = src + r * Dp;
      int64_t d = 0;
      for (; d + W <= D; d += W) store(o + d, load(x + d));
      for (; d < D; ++d) o[d] = x[d];
    }
  }

  // D_t = dO_t . out_t for n rows, in a fixed order (lane partial sums, lanes in order, the tail).
  static LOOM_ATTN_INLINE void row_dots(float* Di, const float* dout, const float* out, int64_t stride, int64_t n,
                                        int64_t D) {
    for (int64_t r = 0; r < n; ++r) {
      const float* a = dout + r * stride;
      const float* o = out + r * stride;
      V acc = V{};
      int64_t d = 0;
      for (; d + W <= D; d += W) acc += load(a + d) * load(o + d);
      float sum = sum_lanes(acc);
      for (; d < D; ++d) sum += a[d] * o[d];
      Di[r] = sum;
    }
  }

  // ---- forward: one (b, h, query tile i) ----
  static LOOM_ATTN_INLINE void forward_query_tile(const Dims& s, float* out, float* lse, const float* qkv, int64_t b,
                                                  int64_t h, int64_t i, float* ws) {
    const int64_t D = s.D, Dp = s.Dp, g = h / s.group;
    float* Qt = ws;
    float* Vb = Qt + kBlock * Dp;
    float* Ob = Vb + kBlock * Dp;
    float* St = Ob + kBlock * Dp;
    float* m = St + kBlock * kBlock;  // running max of each query row's scores
    float* l = m + kBlock;            // running sum of exp(score - m)
    float* alpha = l + kBlock;        // this tile's rescaling of O and l: exp(m_old - m_new)

    const int64_t q0 = i * kBlock, nq = std::min(kBlock, s.T - q0);
    const float* tok = qkv + b * s.T * s.qkv_row;  // token 0 of this batch row
    transpose_rows(Qt, tok + q0 * s.qkv_row + h * D, s.qkv_row, nq, D, s.scale);
    std::fill(Ob, Ob + kBlock * Dp, 0.0f);
    std::fill(m, m + kBlock, -std::numeric_limits<float>::infinity());
    std::fill(l, l + kBlock, 0.0f);

    for (int64_t j = 0; j <= i; ++j) {
      const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.T - k0);
      matmul_abt(St, tok + k0 * s.qkv_row + (s.H + g) * D, s.qkv_row, Qt, nk, D, 1.0f);
      V m_new[kRowVectors], sum[kRowVectors];
      for (int v = 0; v < kRowVectors; ++v) m_new[v] = load(m + v * W), sum[v] = V{};
      for (int64_t c = 0; c < nk; ++c)
        for (int v = 0; v < kRowVectors; ++v) {
          V x = load(St + c * kBlock + v * W);
          if (j == i) {  // diagonal tile: key c is visible to queries r >= c only
            x = mask_before(x, v, c);
            store(St + c * kBlock + v * W, x);
          }
          m_new[v] = vmax(m_new[v], x);
        }
      for (int64_t c = 0; c < nk; ++c)
        for (int v = 0; v < kRowVectors; ++v) {
          const V p = vexp(load(St + c * kBlock + v * W) - m_new[v]);
          store(St + c * kBlock + v * W, p);
          sum[v] += p;
        }
      for (int v = 0; v < kRowVectors; ++v) {
        const V a = vexp(load(m + v * W) - m_new[v]);  // 0 on the first tile (m = -inf)
        store(alpha + v * W, a);
        store(l + v * W, load(l + v * W) * a + sum[v]);
        store(m + v * W, m_new[v]);
      }
      // O[r] = alpha[r] O[r] + sum_c P[r][c] v_c, with P[r][c] = St[c][r].
      const Rows Vr = tile_rows(Vb, Dp, tok + k0 * s.qkv_row + (s.H + s.KVH + g) * D, s.qkv_row, nk, D);
      matmul_ab(Ob, Dp, alpha, St, 1, kBlock, Vr.p, Vr.ld, nq, nk, Dp);
    }

    float* out_tile = out + (b * s.T + q0) * s.out_row + h * D;
    float* lse_tile = lse + (b * s.H + h) * s.T + q0;
    for (int64_t r = 0; r < nq; ++r) {
      const float inv = 1.0f / l[r];
      float* o = out_tile + r * s.out_row;
      const float* x = Ob + r * Dp;
      int64_t d = 0;
      for (; d + W <= D; d += W) store(o + d, load(x + d) * inv);
      for (; d < D; ++d) o[d] = x[d] * inv;
      lse_tile[r] = m[r] + std::log(l[r]);
    }
  }

  // ---- backward ----

  // For the loaded query and key tiles: P = exp(scale Q K^T - lse) (masked on the diagonal tile) and
  // dS = scale * P * (dO V^T - D).
  static LOOM_ATTN_INLINE void tile_probabilities(const Dims& s, const BackwardTiles& w, const float* lse_rows,
                                                  const float* Di, int64_t nq, bool diag) {
    matmul_abt(w.P, w.Q.p, w.Q.ld, w.Kt, nq, s.D, s.scale);
    matmul_abt(w.dS, w.dO.p, w.dO.ld, w.Vt, nq, s.D, 1.0f);
    for (int64_t r = 0; r < nq; ++r) {
      float* prow = w.P + r * kBlock;
      float* dsrow = w.dS + r * kBlock;
      for (int v = 0; v < kRowVectors; ++v) {
        V x = load(prow + v * W) - lse_rows[r];
        if (diag) x = mask_above(x, v, r);
        const V p = vexp(x);
        store(prow + v * W, p);
        store(dsrow + v * W, p * (load(dsrow + v * W) - Di[r]) * s.scale);
      }
    }
  }

  // dK and dV of key tiles [j_begin, j_end) of kv head g, summed over the group's query heads and
  // query tiles i >= j. When dQ is not null (the by-kv-head schedule, j covering all tiles) it also
  // accumulates dQ of the group's heads into dQ[head_in_group][t][Dp] (zeroed here), with Di_all
  // holding D_t for those heads ([head_in_group][t]); otherwise D_t is computed per tile.
  static LOOM_ATTN_INLINE void backward_key_tiles(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g,
                                                  int64_t j_begin, int64_t j_end, float* dQ, float* Di_all, float* ws) {
    BackwardTiles w = carve_backward_tiles(ws, s.Dp);
    const int64_t D = s.D, Dp = s.Dp;
    if (dQ != nullptr) {
      std::fill(dQ, dQ + s.group * s.T * Dp, 0.0f);
      for (int64_t hh = 0; hh < s.group; ++hh) {
        const int64_t off = (b * s.T) * s.out_row + (g * s.group + hh) * D;
        row_dots(Di_all + hh * s.T, a.dout + off, a.out + off, s.out_row, s.T, D);
      }
    }
    for (int64_t j = j_begin; j < j_end; ++j) {
      const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.T - k0);
      load_key_tile(s, w, a.qkv, b, g, k0, nk);
      std::fill(w.dKb, w.dKb + kBlock * Dp, 0.0f);
      std::fill(w.dVb, w.dVb + kBlock * Dp, 0.0f);
      for (int64_t hh = 0; hh < s.group; ++hh) {
        const int64_t h = g * s.group + hh;
        for (int64_t i = j; i < s.tiles; ++i) {
          const int64_t q0 = i * kBlock, nq = std::min(kBlock, s.T - q0);
          load_query_tile(s, w, a, b, h, q0, nq);
          const float* Di = w.Di;
          if (dQ != nullptr) {
            Di = Di_all + hh * s.T + q0;
          } else {
            const int64_t off = (b * s.T + q0) * s.out_row + h * D;
            row_dots(w.Di, a.dout + off, a.out + off, s.out_row, nq, D);
          }
          tile_probabilities(s, w, a.lse + (b * s.H + h) * s.T + q0, Di, nq, i == j);
          matmul_ab(w.dVb, Dp, nullptr, w.P, 1, kBlock, w.dO.p, w.dO.ld, nk, nq, Dp);  // dV_j += P^T dO_i
          matmul_ab(w.dKb, Dp, nullptr, w.dS, 1, kBlock, w.Q.p, w.Q.ld, nk, nq, Dp);   // dK_j += dS^T Q_i
          if (dQ != nullptr)                                                           // dQ_i += dS K_j
            matmul_ab(dQ + (hh * s.T + q0) * Dp, Dp, nullptr, w.dS, kBlock, 1, w.K.p, w.K.ld, nq, nk, Dp);
        }
      }
      float* tok = a.dqkv + (b * s.T + k0) * s.qkv_row;
      write_rows(tok + (s.H + g) * D, s.qkv_row, w.dKb, Dp, nk, D);
      write_rows(tok + (s.H + s.KVH + g) * D, s.qkv_row, w.dVb, Dp, nk, D);
    }
    if (dQ != nullptr)
      for (int64_t hh = 0; hh < s.group; ++hh)
        write_rows(a.dqkv + b * s.T * s.qkv_row + (g * s.group + hh) * D, s.qkv_row, dQ + hh * s.T * Dp, Dp, s.T, D);
  }

  // dQ of query tile i of head h (second pass of the two-pass schedule): key tiles j = 0..i ascending.
  static LOOM_ATTN_INLINE void backward_query_tile(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h,
                                                   int64_t i, float* ws) {
    BackwardTiles w = carve_backward_tiles(ws, s.Dp);
    const int64_t D = s.D, Dp = s.Dp, g = h / s.group;
    const int64_t q0 = i * kBlock, nq = std::min(kBlock, s.T - q0);
    load_query_tile(s, w, a, b, h, q0, nq);
    const int64_t off = (b * s.T + q0) * s.out_row + h * D;
    row_dots(w.Di, a.dout + off, a.out + off, s.out_row, nq, D);
    std::fill(w.dQb, w.dQb + kBlock * Dp, 0.0f);
    for (int64_t j = 0; j <= i; ++j) {
      const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.T - k0);
      load_key_tile(s, w, a.qkv, b, g, k0, nk);
      tile_probabilities(s, w, a.lse + (b * s.H + h) * s.T + q0, w.Di, nq, i == j);
      matmul_ab(w.dQb, Dp, nullptr, w.dS, kBlock, 1, w.K.p, w.K.ld, nq, nk, Dp);
    }
    write_rows(a.dqkv + (b * s.T + q0) * s.qkv_row + h * D, s.qkv_row, w.dQb, Dp, nq, D);
  }
};

// One set of entry points per ISA; each compiles Simd<W> for its target. Called once per work item
// through the table picked below (a pointer call per item costs nothing next to the item).
struct KernelSet {
  void (*forward_query_tile)(const Dims&, float*, float*, const float*, int64_t, int64_t, int64_t, float*);
  void (*backward_key_tiles)(const Dims&, const BackwardArgs&, int64_t, int64_t, int64_t, int64_t, float*, float*,
                             float*);
  void (*backward_query_tile)(const Dims&, const BackwardArgs&, int64_t, int64_t, int64_t, float*);
};

#define LOOM_ATTN_KERNEL_SET(name, target_attr, W)                                                                   \
  target_attr void name##_forward_query_tile(const Dims& s, float* out, float* lse, const float* qkv, int64_t b,     \
                                             int64_t h, int64_t i, float* ws) {                                      \
    Simd<W>::forward_query_tile(s, out, lse, qkv, b, h, i, ws);                                                      \
  }                                                                                                                  \
  target_attr void name##_backward_key_tiles(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g,             \
                                             int64_t j_begin, int64_t j_end, float* dQ, float* Di, float* ws) {      \
    Simd<W>::backward_key_tiles(s, a, b, g, j_begin, j_end, dQ, Di, ws);                                             \
  }                                                                                                                  \
  target_attr void name##_backward_query_tile(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h, int64_t i, \
                                              float* ws) {                                                           \
    Simd<W>::backward_query_tile(s, a, b, h, i, ws);                                                                 \
  }                                                                                                                  \
  constexpr KernelSet name##_kernels{name##_forward_query_tile, name##_backward_key_tiles, name##_backward_query_tile};

LOOM_ATTN_KERNEL_SET(avx512, __attribute__((target("avx512f,fma"))), 16)
LOOM_ATTN_KERNEL_SET(avx2, __attribute__((target("avx2,fma"))), 8)
LOOM_ATTN_KERNEL_SET(sse2, , 4)

const KernelSet& kernels() {
  static const KernelSet& chosen = []() -> const KernelSet& {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return avx512_kernels;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2_kernels;
    return sse2_kernels;
  }();
  return chosen;
}

// The by-kv-head schedule keeps dQ of a whole group (group x T x D floats) per thread. Past this size
// (e.g. T = 32K, D = 128, group 4) the two-pass schedule, whose workspace does not grow with T, is
// used instead: very long sequences pay 2/5 more work rather than a workspace the size of the
// activations per thread.
constexpr int64_t kMaxDqWorkspaceBytes = int64_t{64} << 20;

// Chooses the by-kv-head schedule unless too few items would leave threads idle for longer than the
// two-pass schedule's extra 2/5 of work costs (compare ceil(items/threads) against 7/5 *
// items/threads), or its dQ workspace would be too large.
bool backward_by_kv_head(int64_t items, int64_t threads, int64_t dq_bytes) {
  const int64_t rounds = (items + threads - 1) / threads;
  return 5 * rounds * threads <= 7 * items && dq_bytes <= kMaxDqWorkspaceBytes;
}

constexpr int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

void validate(const AttentionShape& s, const char* op) {
  auto fail = [&](const std::string& why) {
    throw ShapeError(std::string(op) + ": " + why + " (B=" + std::to_string(s.B) + ", T=" + std::to_string(s.T) +
                     ", H=" + std::to_string(s.H) + ", KVH=" + std::to_string(s.KVH) + ", D=" + std::to_string(s.D) +
                     ", scale=" + std::to_string(s.scale) + ")");
  };
  if (s.B <= 0 || s.T <= 0 || s.H <= 0 || s.KVH <= 0 || s.D <= 0) fail("every dimension must be positive");
  if (s.H % s.KVH != 0) fail("H must be a multiple of KVH");
  // scale defaults to 0 in AttentionShape; a forgotten scale would silently give uniform attention.
  if (!(s.scale > 0) || !std::isfinite(s.scale)) fail("scale must be positive and finite, usually 1/sqrt(D)");
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, const AttentionShape& shape, Allocator& alloc) {
  validate(shape, "attention_forward");
  const Dims s = make_dims(shape);
  const KernelSet& kern = kernels();
  const int threads = std::max(1, omp_get_max_threads());
  const int64_t per_thread = forward_workspace_floats(s.Dp);
  Buffer ws(alloc, static_cast<size_t>(threads * per_thread) * sizeof(float), MemCategory::Workspace);
  float* ws_base = static_cast<float*>(ws.data());
  const int64_t heads = s.B * s.H, items = heads * s.tiles;
  // Item k = (query tile, b*h) with the last (longest: i+1 key tiles) query tiles first, handed out
  // one at a time, so the causal triangle's uneven rows do not leave a thread idle at the end.
#pragma omp parallel num_threads(threads)
  {
    float* mine = ws_base + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < items; ++k) {
      const int64_t i = s.tiles - 1 - k / heads, bh = k % heads;
      kern.forward_query_tile(s, out, lse, qkv, bh / s.H, bh % s.H, i, mine);
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        const AttentionShape& shape, Allocator& alloc) {
  validate(shape, "attention_backward");
  const Dims s = make_dims(shape);
  const KernelSet& kern = kernels();
  const BackwardArgs a{dqkv, dout, out, lse, qkv};
  const int threads = std::max(1, omp_get_max_threads());
  const int64_t kv_heads = s.B * s.KVH;
  const bool by_kv_head =
      backward_by_kv_head(kv_heads, threads, s.group * s.T * s.Dp * static_cast<int64_t>(sizeof(float)));
  const int64_t dq_floats = by_kv_head ? s.group * s.T * s.Dp : 0;
  const int64_t di_floats = by_kv_head ? round_up(s.group * s.T, kPad) : 0;
  const int64_t per_thread = backward_tile_floats(s.Dp) + dq_floats + di_floats;
  Buffer ws(alloc, static_cast<size_t>(threads * per_thread) * sizeof(float), MemCategory::Workspace);
  float* ws_base = static_cast<float*>(ws.data());

  if (by_kv_head) {
#pragma omp parallel num_threads(threads)
    {
      float* mine = ws_base + omp_get_thread_num() * per_thread;
      float* dQ = mine + backward_tile_floats(s.Dp);
      float* Di = dQ + dq_floats;
#pragma omp for schedule(dynamic, 1)
      for (int64_t k = 0; k < kv_heads; ++k)
        kern.backward_key_tiles(s, a, k / s.KVH, k % s.KVH, 0, s.tiles, dQ, Di, mine);
    }
    return;
  }
  // Two passes. Item k of the first = (key tile j, b*kv head), smallest j (most query tiles) first;
  // of the second = (query tile i, b*h), largest i (most key tiles) first. The passes write disjoint
  // columns (dK, dV vs dQ) from the same inputs, so threads go on to the second without a barrier.
  const int64_t heads = s.B * s.H;
#pragma omp parallel num_threads(threads)
  {
    float* mine = ws_base + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t k = 0; k < kv_heads * s.tiles; ++k) {
      const int64_t j = k / kv_heads, bg = k % kv_heads;
      kern.backward_key_tiles(s, a, bg / s.KVH, bg % s.KVH, j, j + 1, nullptr, nullptr, mine);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < heads * s.tiles; ++k) {
      const int64_t i = s.tiles - 1 - k / heads, bh = k % heads;
      kern.backward_query_tile(s, a, bh / s.H, bh % s.H, i, mine);
    }
  }
}

// FLOPs count multiply and add as 2 and only the causal pairs t' <= t, T(T+1)/2 per (b, h):
//   forward  = S = Q K^T and O = P V:                  2 products * 2 D flops per pair = 4 D
//   backward = S (recomputed), dP = dO V^T, dV = P^T dO,
//              dK = dS^T Q, dQ = dS K:                 5 products * 2 D flops per pair = 10 D
// so backward = 2.5 x forward. The exp, max and scaling work (O(pairs), not O(pairs * D)) is left
// out, as is the 2/5 extra recompute of the two-pass backward schedule (used only when B*KVH is small
// next to the thread count, or T very long). Bytes: each tensor read or written once (tiles re-read
// from cache are not counted).
KernelCost attention_cost(const AttentionShape& s, bool backward) {
  const double pairs = static_cast<double>(s.T) * static_cast<double>(s.T + 1) / 2.0;
  const double heads = static_cast<double>(s.B) * static_cast<double>(s.H);
  const double forward_flops = heads * pairs * static_cast<double>(s.D) * 4.0;
  const double tokens = static_cast<double>(s.B) * static_cast<double>(s.T);
  const double qkv_bytes = tokens * static_cast<double>((s.H + 2 * s.KVH) * s.D) * sizeof(float);
  const double out_bytes = tokens * static_cast<double>(s.H * s.D) * sizeof(float);
  const double lse_bytes = heads * static_cast<double>(s.T) * sizeof(float);
  KernelCost c;
  if (!backward) {
    c.flops = forward_flops;
    c.bytes = qkv_bytes + out_bytes + lse_bytes;  // read qkv; write out, lse
  } else {
    c.flops = 2.5 * forward_flops;
    c.bytes = 2 * qkv_bytes + 2 * out_bytes + lse_bytes;  // read qkv, out, dout, lse; write dqkv
  }
  return c;
}

namespace ref {

// Shapes: qkv [B, T, (H + 2 KVH) D], out [B, T, H D], lse [B, H, T]. One row of scores at a time.
void attention_forward(float* out, float* lse, const float* qkv, const AttentionShape& s) {
  validate(s, "ref::attention_forward");
  const int64_t C = (s.H + 2 * s.KVH) * s.D, group = s.H / s.KVH;
  std::vector<float> p(static_cast<size_t>(s.T));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t g = h / group;
        const float* q = qkv + (b * s.T + t) * C + h * s.D;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t u = 0; u <= t; ++u) {  // causal: keys u <= t
          const float* k = qkv + (b * s.T + u) * C + (s.H + g) * s.D;
          float dot = 0;
          for (int64_t d = 0; d < s.D; ++d) dot += q[d] * k[d];
          p[u] = dot * s.scale;
          mx = std::max(mx, p[u]);
        }
        float sum = 0;
        for (int64_t u = 0; u <= t; ++u) {
          p[u] = std::exp(p[u] - mx);
          sum += p[u];
        }
        float* o = out + (b * s.T + t) * s.H * s.D + h * s.D;
        for (int64_t d = 0; d < s.D; ++d) o[d] = 0;
        for (int64_t u = 0; u <= t; ++u) {
          const float* v = qkv + (b * s.T + u) * C + (s.H + s.KVH + g) * s.D;
          for (int64_t d = 0; d < s.D; ++d) o[d] += p[u] / sum * v[d];
        }
        lse[(b * s.H + h) * s.T + t] = mx + std::log(sum);
      }
}

void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        const AttentionShape& s) {
  validate(s, "ref::attention_backward");
  const int64_t C = (s.H + 2 * s.KVH) * s.D, group = s.H / s.KVH;
  std::fill(dqkv, dqkv + s.B * s.T * C, 0.0f);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t g = h / group;
        const float* q = qkv + (b * s.T + t) * C + h * s.D;
        float* dq = dqkv + (b * s.T + t) * C + h * s.D;
        const float* o = out + (b * s.T + t) * s.H * s.D + h * s.D;
        const float* dO = dout + (b * s.T + t) * s.H * s.D + h * s.D;
        const float L = lse[(b * s.H + h) * s.T + t];
        float Di = 0;  // dO . out = sum_u P[u] dP[u]
        for (int64_t d = 0; d < s.D; ++d) Di += dO[d] * o[d];
        for (int64_t u = 0; u <= t; ++u) {
          const float* k = qkv + (b * s.T + u) * C + (s.H + g) * s.D;
          const float* v = qkv + (b * s.T + u) * C + (s.H + s.KVH + g) * s.D;
          float* dk = dqkv + (b * s.T + u) * C + (s.H + g) * s.D;
          float* dv = dqkv + (b * s.T + u) * C + (s.H + s.KVH + g) * s.D;
          float dot = 0, dp = 0;
          for (int64_t d = 0; d < s.D; ++d) {
            dot += q[d] * k[d];
            dp += dO[d] * v[d];
          }
          const float p = std::exp(dot * s.scale - L);
          const float ds = p * (dp - Di);
          for (int64_t d = 0; d < s.D; ++d) {
            dq[d] += s.scale * ds * k[d];
            dk[d] += s.scale * ds * q[d];
            dv[d] += p * dO[d];
          }
        }
      }
}

}  // namespace ref

}  // namespace loom::kernels
