// Implementation detail of kernels/attention.cpp: every loop that touches vectors, as a template on
// the vector width W (floats), so attention.cpp can compile it once per ISA (AVX-512, AVX2, SSE2) and
// pick one at run time. The algorithm is described at the top of attention.cpp.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "loom/kernels/detail/attention_tiles.h"

// The vector helpers return vectors by value; they are always inlined, so GCC's warning that such
// returns have a different ABI without AVX / AVX-512 concerns no real call.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace loom::kernels::attention_detail {

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
      prefetch_row(o + kPrefetchRows * stride, D, /*for_write=*/true);
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
      prefetch_row(a + kPrefetchRows * stride, D);
      prefetch_row(o + kPrefetchRows * stride, D);
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
    const float* tok = qkv + b * s.T * s.q_row;                            // query token 0 of this batch row
    const float* keys = (s.kv ? s.kv : qkv) + b * s.Tk * s.kv_row;  // key token 0
    transpose_rows(Qt, tok + q0 * s.q_row + h * D, s.q_row, nq, D, s.scale);
    std::fill(Ob, Ob + kBlock * Dp, 0.0f);
    std::fill(m, m + kBlock, -std::numeric_limits<float>::infinity());
    std::fill(l, l + kBlock, 0.0f);

    // Causal: key tiles up to the diagonal; a block: all of them (a short last tile's missing keys are
    // never read: every loop below stops at nk).
    const int64_t j_last = s.causal ? i : s.ktiles - 1;
    for (int64_t j = 0; j <= j_last; ++j) {
      const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.Tk - k0);
      matmul_abt(St, keys + k0 * s.kv_row + s.k_col + g * D, s.kv_row, Qt, nk, D, 1.0f);
      V m_new[kRowVectors], sum[kRowVectors];
      for (int v = 0; v < kRowVectors; ++v) m_new[v] = load(m + v * W), sum[v] = V{};
      for (int64_t c = 0; c < nk; ++c)
        for (int v = 0; v < kRowVectors; ++v) {
          V x = load(St + c * kBlock + v * W);
          if (s.causal && j == i) {  // diagonal tile: key c is visible to queries r >= c only
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
      const Rows Vr = tile_rows(Vb, Dp, keys + k0 * s.kv_row + s.v_col + g * D, s.kv_row, nk, D);
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
      const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.Tk - k0);
      load_key_tile(s, w, a.kv, b, g, k0, nk);
      std::fill(w.dKb, w.dKb + kBlock * Dp, 0.0f);
      std::fill(w.dVb, w.dVb + kBlock * Dp, 0.0f);
      for (int64_t hh = 0; hh < s.group; ++hh) {
        const int64_t h = g * s.group + hh;
        for (int64_t i = s.causal ? j : 0; i < s.tiles; ++i) {
          const int64_t q0 = i * kBlock, nq = std::min(kBlock, s.T - q0);
          load_query_tile(s, w, a, b, h, q0, nq);
          const float* Di = w.Di;
          if (dQ != nullptr) {
            Di = Di_all + hh * s.T + q0;
          } else {
            const int64_t off = (b * s.T + q0) * s.out_row + h * D;
            row_dots(w.Di, a.dout + off, a.out + off, s.out_row, nq, D);
          }
          tile_probabilities(s, w, a.lse + (b * s.H + h) * s.T + q0, Di, nq, s.causal && i == j);
          matmul_ab(w.dVb, Dp, nullptr, w.P, 1, kBlock, w.dO.p, w.dO.ld, nk, nq, Dp);  // dV_j += P^T dO_i
          matmul_ab(w.dKb, Dp, nullptr, w.dS, 1, kBlock, w.Q.p, w.Q.ld, nk, nq, Dp);   // dK_j += dS^T Q_i
          if (dQ != nullptr)                                                           // dQ_i += dS K_j
            matmul_ab(dQ + (hh * s.T + q0) * Dp, Dp, nullptr, w.dS, kBlock, 1, w.K.p, w.K.ld, nq, nk, Dp);
        }
      }
      float* tok = a.dkv + (b * s.Tk + k0) * s.kv_row;
      write_rows(tok + s.k_col + g * D, s.kv_row, w.dKb, Dp, nk, D);
      write_rows(tok + s.v_col + g * D, s.kv_row, w.dVb, Dp, nk, D);
    }
    if (dQ != nullptr)
      for (int64_t hh = 0; hh < s.group; ++hh)
        write_rows(a.dqkv + b * s.T * s.q_row + (g * s.group + hh) * D, s.q_row, dQ + hh * s.T * Dp, Dp, s.T, D);
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
    const int64_t j_last = s.causal ? i : s.ktiles - 1;
    for (int64_t j = 0; j <= j_last; ++j) {
      const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.Tk - k0);
      load_key_tile(s, w, a.kv, b, g, k0, nk);
      tile_probabilities(s, w, a.lse + (b * s.H + h) * s.T + q0, w.Di, nq, s.causal && i == j);
      matmul_ab(w.dQb, Dp, nullptr, w.dS, kBlock, 1, w.K.p, w.K.ld, nq, nk, Dp);
    }
    write_rows(a.dqkv + (b * s.T + q0) * s.q_row + h * D, s.q_row, w.dQb, Dp, nq, D);
  }
};

}  // namespace loom::kernels::attention_detail
