// bf16 attention tiles on AVX512-BF16: the same algorithm, work items and schedules as the f32 kernels
// (described at the top of attention.cpp), with every matrix product done by VDPBF16PS, which
// multiplies pairs of bf16 and adds both products into an f32 lane: acc[i] += a[2i] b[2i] +
// a[2i+1] b[2i+1]. That is twice the multiply-adds of an f32 FMA per instruction, on operands half
// the size.
//
// Packing. A product C[r][cols] += sum_k A[r][k] B[k][cols] runs as the f32 kernels' register-blocked
// outer product, with k taken two at a time: one 32-bit word of A -- the pair (A[r][k], A[r][k'])
// -- broadcast to all lanes, times a vector of B whose lane c holds the pair (B[k][c], B[k'][c]).
// Any pairing of the reduction index works if A and B agree; two are used:
//   * along a row (k' = k + 1): a bf16 row already is a row of pairs (`convert_rows`);
//   * across two rows (the same column of rows k and k + 1): `pack_row_pairs` interleaves two
//     rounded f32 rows lane by lane.
// Operands whose pairs run along a row but whose lanes must run across rows (K and V for the
// backward's score products, Q for the forward's) are converted to bf16 rows and then transposed as
// 32-bit words. Each product's operands, with r query rows, c key rows and d head columns:
//   forward  St[c][r] = K[c][.] . Q[r][.]   A = K rows (pairs along d), B = Q words transposed
//            O[r][d] += P[r][.] V[.][d]      A = P as pairs of keys (from St rows c, c+1), B = V row pairs
//   backward P, dP    = Q K^T, dO V^T        A = Q / dO rows, B = K / V words transposed
//            dV[c][d] += P^T dO, dK += dS^T Q A = P / dS as pairs of queries, B = dO / Q row pairs
//            dQ[r][d] += dS K                A = dS rows (pairs along keys), B = K row pairs
// Rounding is to nearest even (VCVTNE(2)PS2BF16), once per packed element: Q, K, V and dO as they are
// packed, P and dS after the f32 softmax arithmetic -- where FlashAttention-2 rounds them on a GPU.
// Every pair whose second member lies past the tile's last row is given a zero, so a partial tile
// never multiplies stale workspace.
//
// When packing happens. The products are cheap enough here that packing per tile pair cost as much
// as they did (rounding and strided reads of qkv); so the forward packs K rows and V row pairs of
// every kv head once per call (a shared workspace a third of qkv's size at most, filled in parallel
// before any query tile), and each by-kv-head backward item packs all of its kv head's and its query
// heads' tiles once up front (per thread, O(T)); only the two-pass backward schedule, whose items see
// a tile once or twice, still packs per tile pair. The softmax runs in base 2 (see exp2_ps).
//
// AMX (the amx_ / soft_amx_ entry points, detail/tile_unit.h). The same kernels on 16 x 16 x 32 tile
// products. A tile's A operand must hold its pairs along a row, so the three products whose A is P or
// dS as pairs across rows are issued transposed into transposed accumulators:
//            O^T[d][r] += V^T[d][.] P^T[.][r]   A = V packed transposed, B = P as pairs of keys
//            dV^T[d][c] += dO^T[d][.] P[.][c], dK^T[d][c] += Q^T[d][.] dS[.][c]
//                                               A = dO / Q packed transposed, B = P / dS pairs of queries
// and the accumulators are written out by columns. A tile reduces over all 32 pairs of a key or query
// tile, so the pairs past a partial tile's last row are zeroed in both operands; the diagonal tile's
// causal halves are computed, not skipped (a 16-row tile straddles the diagonal).
//
// The file is compiled for AVX512-BF16 through a target pragma (GCC's, or clang's attribute push)
// that starts after the includes, so
// that only the functions defined here (all internal, plus the entry points) carry that target; the
// f32 helpers of attention_simd.h are inlined into them.
#include "loom/kernels/detail/attention_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "loom/kernels/detail/attention_simd.h"
#include "loom/kernels/detail/exp2_avx512.h"
#include "loom/kernels/detail/attention_tiles.h"
#include "loom/kernels/detail/tile_unit.h"

// GCC 12 warns that the undefined vector behind a zeroing intrinsic may be used uninitialized (a
// known false positive of its headers).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if defined(__clang__)  // (the fuzz and sanitizer builds): clang spells the same region this way
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,amx-tile,amx-bf16"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")
#endif

namespace loom::kernels::attention_detail {
namespace {

using S = Simd<16>;                     // the f32 vector helpers: exp, masks, row dots, write-back
constexpr int64_t kPairs = kBlock / 2;  // pairs of rows in a tile
constexpr int kTileRows = 4;            // accumulator rows x 4 vectors: 16 of the 32 registers

LOOM_ATTN_INLINE __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// Rounding is VCVTNE2PS2BF16, 32 floats per instruction: on Zen it costs what the 16-float
// VCVTNEPS2BF16 does, and both beat rounding with integer adds (measured: 0.030, 0.055 and 0.054 ns
// per element).
LOOM_ATTN_INLINE __m512i round_32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

// n rows of D floats (row stride `stride`) as bf16 rows of Dp/2 words (zero past D), rows n..63 zero.
LOOM_ATTN_INLINE void convert_rows(uint32_t* dst, int64_t Dp, const float* src, int64_t stride, int64_t n, int64_t D) {
  const int64_t words = Dp / 2;
  for (int64_t r = 0; r < n; ++r) {
    const float* x = src + r * stride;
    prefetch_row(src + (r + kPrefetchRows) * stride, D);
    uint32_t* y = dst + r * words;
    int64_t d = 0;
    for (; d + 32 <= Dp; d += 32)
      _mm512_storeu_si512(y + d / 2, round_32(_mm512_maskz_loadu_ps(first_lanes(D - d), x + d),
                                              _mm512_maskz_loadu_ps(first_lanes(D - d - 16), x + d + 16)));
    if (d < Dp)  // a last 16 (Dp is a multiple of 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d / 2),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first_lanes(D - d), x + d)));
  }
  std::memset(dst + n * words, 0, static_cast<size_t>((kBlock - n) * words) * sizeof(uint32_t));
}

// The 16 x 16 transpose of 32-bit words: unpack pairs, then quads, then 128-bit lanes twice.
LOOM_ATTN_INLINE void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
  }
  for (int k = 0; k < 16; k += 4) {
    r[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(r[k], r[k + 4], 0x88);
    t[k + 4] = _mm512_shuffle_i32x4(r[k], r[k + 4], 0xdd);
    t[k + 8] = _mm512_shuffle_i32x4(r[k + 8], r[k + 12], 0x88);
    t[k + 12] = _mm512_shuffle_i32x4(r[k + 8], r[k + 12], 0xdd);
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
}

// dst[p][c] = src[c][p] for 64 rows c of `words` 32-bit words (a multiple of 8): 16 x 16 blocks in
// registers, a last 8 columns word by word.
LOOM_ATTN_INLINE void transpose_words(uint32_t* dst, const uint32_t* src, int64_t words) {
  for (int64_t c0 = 0; c0 < kBlock; c0 += 16) {
    int64_t p0 = 0;
    for (; p0 + 16 <= words; p0 += 16) {
      __m512i r[16];
      for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(src + (c0 + k) * words + p0);
      transpose_16x16(r);
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(dst + (p0 + k) * kBlock + c0, r[k]);
    }
    for (int64_t c = c0; c < c0 + 16; ++c)
      for (int64_t p = p0; p < words; ++p) dst[p * kBlock + c] = src[c * words + p];
  }
}

// Lane c of the result = (bf16(lo[c]), bf16(hi[c])): both rounded by one instruction (lo's 16 values
// then hi's), then interleaved by one word permutation.
LOOM_ATTN_INLINE __m512i interleave_rounded(__m512 lo, __m512 hi) {
  const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(zip, round_32(lo, hi));
}

// The softmax runs in base 2 (scores carry log2(e), exp becomes exp2: detail/exp2_avx512.h), and
// VSCALEFPS takes any very negative power to exactly 0 -- so masked scores are a large finite negative
// (kMasked), never -inf (whose f = -inf - -inf would be NaN).
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
constexpr float kMasked = -1e30f;

LOOM_ATTN_INLINE __m512 exp2_ps(__m512 x) { return detail::exp2_avx512(x); }

LOOM_ATTN_INLINE __m512i lane_index(int v) {
  return _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                          _mm512_set1_epi32(16 * v));
}
// Diagonal tile, scores S[r][c] (lanes: keys c): only keys c <= r are visible.
LOOM_ATTN_INLINE __m512 mask_keys_after(__m512 x, int v, int64_t r) {
  const __mmask16 hidden = _mm512_cmpgt_epi32_mask(lane_index(v), _mm512_set1_epi32(static_cast<int>(r)));
  return _mm512_mask_blend_ps(hidden, x, _mm512_set1_ps(kMasked));
}
LOOM_ATTN_INLINE __m512 zero_keys_after(__m512 x, int v, int64_t r) {
  const __mmask16 hidden = _mm512_cmpgt_epi32_mask(lane_index(v), _mm512_set1_epi32(static_cast<int>(r)));
  return _mm512_mask_blend_ps(hidden, x, _mm512_setzero_ps());
}
// Diagonal tile, scores St[c][r] (lanes: queries r): key c is visible to queries r >= c only.
LOOM_ATTN_INLINE __m512 mask_queries_before(__m512 x, int v, int64_t c) {
  const __mmask16 hidden = _mm512_cmplt_epi32_mask(lane_index(v), _mm512_set1_epi32(static_cast<int>(c)));
  return _mm512_mask_blend_ps(hidden, x, _mm512_set1_ps(kMasked));
}

// Rows 2p and 2p+1 of n rows (D floats each, row stride `stride`) interleaved into dst[p][0..Dp)
// (row stride `ldd` words), for p < ceil(n/2); a missing row 2p+1 and columns past D are zero.
LOOM_ATTN_INLINE void pack_row_pairs(uint32_t* dst, int64_t ldd, const float* src, int64_t stride, int64_t n,
                                     int64_t D, int64_t Dp) {
  for (int64_t p = 0; p < (n + 1) / 2; ++p) {
    const float* lo = src + 2 * p * stride;
    prefetch_row(lo + kPrefetchRows * stride, D);
    prefetch_row(lo + (kPrefetchRows + 1) * stride, D);
    const bool has_hi = 2 * p + 1 < n;
    for (int64_t d = 0; d < Dp; d += 16) {
      const __mmask16 m = first_lanes(D - d);
      const __m512 a = _mm512_maskz_loadu_ps(m, lo + d);
      const __m512 b = has_hi ? _mm512_maskz_loadu_ps(m, lo + stride + d) : _mm512_setzero_ps();
      _mm512_storeu_si512(dst + p * ldd + d, interleave_rounded(a, b));
    }
  }
}

// The tile kernels' form of a pack_row_pairs tile: transposed, dst[d][p] (row stride kPairs words) for
// every d < Dp and all kPairs pairs, zero for pairs past ceil(n/2), so a product over a whole tile's
// pairs never reads stale workspace. `scratch` holds kPairs x Dp words.
LOOM_ATTN_INLINE void pack_pairs_transposed(uint32_t* dst, uint32_t* scratch, const float* src, int64_t stride,
                                            int64_t n, int64_t D, int64_t Dp) {
  std::memset(scratch, 0, static_cast<size_t>(kPairs * Dp) * sizeof(uint32_t));
  pack_row_pairs(scratch, Dp, src, stride, n, D, Dp);
  for (int64_t p0 = 0; p0 < kPairs; p0 += 16)
    for (int64_t d0 = 0; d0 < Dp; d0 += 16) {
      __m512i r[16];
      for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(scratch + (p0 + k) * Dp + d0);
      transpose_16x16(r);
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(dst + (d0 + k) * kPairs + p0, r[k]);
    }
}

// C[r][v-th 16 columns] (f32, row stride ldc) = (accumulate ? alpha[r] C : 0) + scale * sum over
// `pairs` of A's word (r, p) at A[r * ars + p * aps] times B's words B[p * ldb + 16 v ..], for R rows
// and NV vectors (alpha == nullptr means 1; the scale applies to the sum only when not accumulating).
template <int R, int NV>
LOOM_ATTN_INLINE void dp_tile(float* C, int64_t ldc, const float* alpha, bool accumulate, float scale,
                              const uint32_t* A, int64_t ars, int64_t aps, const uint32_t* B, int64_t ldb,
                              int64_t pairs) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + v * 16) : _mm512_setzero_ps();
      if (accumulate && alpha != nullptr) acc[r][v] = _mm512_mul_ps(acc[r][v], _mm512_set1_ps(alpha[r]));
    }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(B + p * ldb + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(A[r * ars + p * aps]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a, (__m512bh)b[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(C + r * ldc + v * 16, accumulate || scale == 1.0f ? acc[r][v] : _mm512_mul_ps(acc[r][v], sc));
}

// On a diagonal tile (query tile = key tile) half of every product is causally masked: a row block
// needs only the columns or the reduction pairs on its side of the diagonal. Skipping the rest adds
// exactly what the masked zeros would have (nothing), so results are unchanged; what is skipped is
// left stale, and every reader masks it by selection (mask_*), never by arithmetic on it.
enum class Causal {
  None,
  ColsFromRow,   // rows keys c, columns queries r: only r >= c
  ColsToRow,     // rows queries r, columns keys c: only c <= r
  PairsToRow,    // rows queries r, reduction over keys c: only c <= r
  PairsFromRow,  // rows keys c, reduction over queries r: only r >= c
};

template <int R>
LOOM_ATTN_INLINE void dp_rows(float* C, int64_t ldc, const float* alpha, bool accumulate, float scale,
                              const uint32_t* A, int64_t ars, int64_t aps, const uint32_t* B, int64_t ldb, int64_t r,
                              int64_t pairs, int64_t cols, Causal causal) {
  int64_t v_begin = 0, v_end = cols / 16, p_begin = 0, p_end = pairs;
  switch (causal) {
    case Causal::None: break;
    case Causal::ColsFromRow: v_begin = r / 16; break;
    case Causal::ColsToRow: v_end = std::min(v_end, (r + R - 1) / 16 + 1); break;
    case Causal::PairsToRow: p_end = std::min(pairs, (r + R + 1) / 2); break;
    case Causal::PairsFromRow: p_begin = std::min(pairs, r / 2); break;
  }
  float* c = C + r * ldc;
  const float* al = alpha ? alpha + r : nullptr;
  const uint32_t* a = A + r * ars + p_begin * aps;
  const uint32_t* b = B + p_begin * ldb;
  const int64_t n = p_end - p_begin;
  for (int64_t v = v_begin; v < v_end; v += 4) {
    switch (std::min<int64_t>(4, v_end - v)) {
      case 4: dp_tile<R, 4>(c + v * 16, ldc, al, accumulate, scale, a, ars, aps, b + v * 16, ldb, n); break;
      case 3: dp_tile<R, 3>(c + v * 16, ldc, al, accumulate, scale, a, ars, aps, b + v * 16, ldb, n); break;
      case 2: dp_tile<R, 2>(c + v * 16, ldc, al, accumulate, scale, a, ars, aps, b + v * 16, ldb, n); break;
      default: dp_tile<R, 1>(c + v * 16, ldc, al, accumulate, scale, a, ars, aps, b + v * 16, ldb, n); break;
    }
  }
}

// ---- the same product on a tile unit (detail/tile_unit.h): 16 rows at a time, columns in chunks of
// up to 4 C tiles (0..3), A in tile 4 and each B block in tile 5 ----
using tile_detail::NoTiles;
constexpr int64_t kUnitRows = tile_detail::kTileRows;  // 16
constexpr int64_t kUnitPairs = 16;                     // pairs in one tile row (64 bytes)

template <class U, int T>
LOOM_ATTN_INLINE void unit_start(float* c, int64_t ldc, bool accumulate) {
  if (accumulate) U::template load<T>(c + T * 16, ldc * 4);
  else U::template zero<T>();
}
template <class U, int T>
LOOM_ATTN_INLINE void unit_product(const uint32_t* b, int64_t ldb) {
  U::template load<5>(b + T * 16, ldb * 4);
  U::template dp<T, 4, 5>();
}
template <class U, int T>
LOOM_ATTN_INLINE void unit_finish(float* c, int64_t ldc) {
  U::template store<T>(c + T * 16, ldc * 4);
}
// C[16 rows][NT x 16 columns] (+)= A[16 rows][pairs] . B[pairs][NT x 16], pairs a multiple of 16.
template <class U, int NT>
LOOM_ATTN_INLINE void unit_block(float* c, int64_t ldc, bool accumulate, const uint32_t* A, int64_t ars,
                                 const uint32_t* B, int64_t ldb, int64_t pairs) {
  unit_start<U, 0>(c, ldc, accumulate);
  if constexpr (NT > 1) unit_start<U, 1>(c, ldc, accumulate);
  if constexpr (NT > 2) unit_start<U, 2>(c, ldc, accumulate);
  if constexpr (NT > 3) unit_start<U, 3>(c, ldc, accumulate);
  for (int64_t k = 0; k < pairs; k += kUnitPairs) {
    U::template load<4>(A + k, ars * 4);
    const uint32_t* b = B + k * ldb;
    unit_product<U, 0>(b, ldb);
    if constexpr (NT > 1) unit_product<U, 1>(b, ldb);
    if constexpr (NT > 2) unit_product<U, 2>(b, ldb);
    if constexpr (NT > 3) unit_product<U, 3>(b, ldb);
  }
  unit_finish<U, 0>(c, ldc);
  if constexpr (NT > 1) unit_finish<U, 1>(c, ldc);
  if constexpr (NT > 2) unit_finish<U, 2>(c, ldc);
  if constexpr (NT > 3) unit_finish<U, 3>(c, ldc);
}

// dp_tile's contract for 16 rows, A's pairs contiguous (aps = 1), `pairs` a multiple of 16. The
// causal half of a diagonal tile is computed too: a tile is 16 rows, the skipped parts are at most a
// fraction of one, and computing them is always allowed (their operands are written: zeros where
// masked, see dp_rows).
template <class U>
LOOM_ATTN_INLINE void unit_rows(float* C, int64_t ldc, const float* alpha, bool accumulate, float scale,
                                const uint32_t* A, int64_t ars, const uint32_t* B, int64_t ldb, int64_t pairs,
                                int64_t cols) {
  if (accumulate && alpha != nullptr)
    for (int64_t r = 0; r < kUnitRows; ++r)
      for (int64_t v = 0; v < cols; v += 16)
        _mm512_storeu_ps(C + r * ldc + v, _mm512_mul_ps(_mm512_loadu_ps(C + r * ldc + v), _mm512_set1_ps(alpha[r])));
  for (int64_t c0 = 0; c0 < cols; c0 += 64) {
    float* c = C + c0;
    const uint32_t* b = B + c0;
    switch (std::min<int64_t>(4, (cols - c0) / 16)) {
      case 4: unit_block<U, 4>(c, ldc, accumulate, A, ars, b, ldb, pairs); break;
      case 3: unit_block<U, 3>(c, ldc, accumulate, A, ars, b, ldb, pairs); break;
      case 2: unit_block<U, 2>(c, ldc, accumulate, A, ars, b, ldb, pairs); break;
      default: unit_block<U, 1>(c, ldc, accumulate, A, ars, b, ldb, pairs); break;
    }
  }
  if (!accumulate && scale != 1.0f)
    for (int64_t r = 0; r < kUnitRows; ++r)
      for (int64_t v = 0; v < cols; v += 16)
        _mm512_storeu_ps(C + r * ldc + v, _mm512_mul_ps(_mm512_loadu_ps(C + r * ldc + v), _mm512_set1_ps(scale)));
}

// The product above for nr rows and `cols` columns (a multiple of 16): blocks of kTileRows rows, each
// in chunks of 4 vectors of columns. With a tile unit U, whole 16-row blocks of products whose A
// pairs are contiguous (aps = 1) and whose reduction is whole tiles run on it; the rest (a partial
// block's last rows, a head size whose pairs are not a multiple of 16) stays on dot products. The
// tile kernels issue no product with aps != 1: they compute P V, P^T dO and dS^T Q transposed.
template <class U = NoTiles>
LOOM_ATTN_INLINE void dp_matmul(float* C, int64_t ldc, const float* alpha, bool accumulate, float scale,
                                const uint32_t* A, int64_t ars, int64_t aps, const uint32_t* B, int64_t ldb,
                                int64_t nr, int64_t pairs, int64_t cols, Causal causal = Causal::None) {
  int64_t r = 0;
  if constexpr (U::kTiles) {
    if (aps == 1 && pairs % kUnitPairs == 0)
      for (; r + kUnitRows <= nr; r += kUnitRows)
        unit_rows<U>(C + r * ldc, ldc, alpha ? alpha + r : nullptr, accumulate, scale, A + r * ars, ars, B, ldb, pairs,
                     cols);
  }
  for (; r + kTileRows <= nr; r += kTileRows)
    dp_rows<kTileRows>(C, ldc, alpha, accumulate, scale, A, ars, aps, B, ldb, r, pairs, cols, causal);
  for (; r < nr; ++r) dp_rows<1>(C, ldc, alpha, accumulate, scale, A, ars, aps, B, ldb, r, pairs, cols, causal);
}

// ---- forward: per-thread tiles (Q rows, Q words transposed, P as key pairs, O, scores, m, l,
// alpha); K rows and V row pairs of every kv head are packed once per call (bf16_forward_pack) ----
struct ForwardTiles {
  uint32_t *Qb, *Qt, *Pp;
  float *O, *St, *m, *l, *alpha;
};

constexpr int64_t forward_floats(int64_t Dp) {
  return 2 * kBlock * (Dp / 2) + kPairs * kBlock + kBlock * Dp + kBlock * kBlock + 3 * kBlock;
}

ForwardTiles carve_forward(float* ws, int64_t Dp) {
  ForwardTiles t{};
  auto* w = reinterpret_cast<uint32_t*>(ws);
  t.Qb = w, t.Qt = t.Qb + kBlock * (Dp / 2), t.Pp = t.Qt + kBlock * (Dp / 2);
  t.O = reinterpret_cast<float*>(t.Pp + kPairs * kBlock);
  t.St = t.O + kBlock * Dp;
  t.m = t.St + kBlock * kBlock, t.l = t.m + kBlock, t.alpha = t.l + kBlock;
  return t;
}

// The shared forward pack: K rows [b, g][Tp][Dp/2], then V row pairs [b, g][Tp/2][Dp] (Tp = key tiles x 64).
struct ForwardPacked {
  uint32_t *K, *V;
  int64_t per_head;  // words of one kv head's K (and of its V)
};
LOOM_ATTN_INLINE ForwardPacked forward_packed(const Dims& s, const void* base) {
  const int64_t per_head = s.ktiles * kBlock * (s.Dp / 2);
  auto* w = static_cast<uint32_t*>(const_cast<void*>(base));
  return {w, w + s.B * s.KVH * per_head, per_head};
}

// ---- backward ----
// Packed operands of one key tile and one query tile, wherever they were packed.
struct KeyTile {
  uint32_t *Kt, *Vt, *Kp;  // K and V words transposed (for P and dP), K row pairs (for dQ)
};
struct QueryTile {
  uint32_t *Qb, *dOb, *Qp, *dOp;  // Q and dO rows (for P and dP), row pairs (for dK and dV; tiles: transposed)
};

// Per thread: one key and one query tile packed (the two-pass schedule packs them per tile pair),
// P and dS in their layouts, f32 accumulators; then, for the by-kv-head schedule, every tile of its
// item's kv head and of its group's query heads, packed once up front.
struct Bf16BackwardTiles {
  uint32_t* Kb;  // K or V rows, before their transpose
  KeyTile key;
  QueryTile query;
  uint32_t *Pp, *dSp, *dSb;  // P and dS as pairs of queries, dS rows
  float *dK, *dV, *dQ, *P, *dS, *Di;
  uint32_t* item;  // by-kv-head: the item's packed tiles (item_pack_floats)
};

constexpr int64_t backward_floats(int64_t Dp) {
  return 5 * kBlock * (Dp / 2) + 3 * kPairs * Dp + 2 * kPairs * kBlock + kBlock * kPairs + 3 * kBlock * Dp +
         2 * kBlock * kBlock + kBlock;
}

// K^T and V^T of every key tile (ktiles x Dp/2 x 64 words each), K row pairs (Tkp/2 x Dp), and per
// query head of the group Q and dO rows (Tp x Dp/2 each) and row pairs (Tp/2 x Dp each); Tkp and Tp are
// the key and query tiles x 64 (the same in self-attention).
int64_t item_pack_floats(const Dims& s) {
  const int64_t Tp = s.tiles * kBlock, Tkp = s.ktiles * kBlock;
  return Tkp * s.Dp + Tkp / 2 * s.Dp + s.group * 2 * Tp * s.Dp;
}

Bf16BackwardTiles carve_backward(float* ws, int64_t Dp) {
  Bf16BackwardTiles t{};
  auto* w = reinterpret_cast<uint32_t*>(ws);
  const int64_t row_words = kBlock * (Dp / 2);
  t.Kb = w, t.key.Kt = t.Kb + row_words, t.key.Vt = t.key.Kt + row_words;
  t.query.Qb = t.key.Vt + row_words, t.query.dOb = t.query.Qb + row_words;
  t.key.Kp = t.query.dOb + row_words, t.query.Qp = t.key.Kp + kPairs * Dp, t.query.dOp = t.query.Qp + kPairs * Dp;
  t.Pp = t.query.dOp + kPairs * Dp, t.dSp = t.Pp + kPairs * kBlock, t.dSb = t.dSp + kPairs * kBlock;
  t.dK = reinterpret_cast<float*>(t.dSb + kBlock * kPairs);
  t.dV = t.dK + kBlock * Dp, t.dQ = t.dV + kBlock * Dp, t.P = t.dQ + kBlock * Dp, t.dS = t.P + kBlock * kBlock;
  t.Di = t.dS + kBlock * kBlock;
  t.item = reinterpret_cast<uint32_t*>(t.Di + kBlock);
  return t;
}

// Packs key tile (k0, nk) of kv head g of the keys' buffer `kv` into `dst` (Kb is scratch).
LOOM_ATTN_INLINE void pack_key_tile(const Dims& s, uint32_t* Kb, const KeyTile& dst, const float* kv, int64_t b,
                                    int64_t g, int64_t k0, int64_t nk) {
  const float* tok = kv + (b * s.Tk + k0) * s.kv_row;
  const float* k = tok + s.k_col + g * s.D;
  const float* v = tok + s.v_col + g * s.D;
  convert_rows(Kb, s.Dp, k, s.kv_row, nk, s.D);
  transpose_words(dst.Kt, Kb, s.Dp / 2);
  convert_rows(Kb, s.Dp, v, s.kv_row, nk, s.D);
  transpose_words(dst.Vt, Kb, s.Dp / 2);
  pack_row_pairs(dst.Kp, s.Dp, k, s.kv_row, nk, s.D, s.Dp);
}

// Packs query tile (q0, nq) of head h into `dst`. With a tile unit the pairs are packed transposed
// (pack_pairs_transposed; `scratch` holds kPairs x Dp words): the tile kernels' dV and dK products read
// dO and Q as A operands, pairs of queries along each row.
template <class U>
LOOM_ATTN_INLINE void pack_query_tile(const Dims& s, const QueryTile& dst, const BackwardArgs& a, int64_t b, int64_t h,
                                      int64_t q0, int64_t nq, uint32_t* scratch) {
  const float* q = a.qkv + (b * s.T + q0) * s.q_row + h * s.D;
  const float* dout = a.dout + (b * s.T + q0) * s.out_row + h * s.D;
  convert_rows(dst.Qb, s.Dp, q, s.q_row, nq, s.D);
  convert_rows(dst.dOb, s.Dp, dout, s.out_row, nq, s.D);
  if constexpr (U::kTiles) {
    pack_pairs_transposed(dst.Qp, scratch, q, s.q_row, nq, s.D, s.Dp);
    pack_pairs_transposed(dst.dOp, scratch, dout, s.out_row, nq, s.D, s.Dp);
  } else {
    pack_row_pairs(dst.Qp, s.Dp, q, s.q_row, nq, s.D, s.Dp);
    pack_row_pairs(dst.dOp, s.Dp, dout, s.out_row, nq, s.D, s.Dp);
  }
}

// Where tile j's / head hh's tile i's operands sit in the by-kv-head item pack.
LOOM_ATTN_INLINE KeyTile item_key_tile(const Dims& s, uint32_t* item, int64_t j) {
  const int64_t tile_words = kBlock * (s.Dp / 2), Tkp = s.ktiles * kBlock;
  return {item + j * tile_words, item + s.ktiles * tile_words + j * tile_words, item + Tkp * s.Dp + j * kPairs * s.Dp};
}
LOOM_ATTN_INLINE QueryTile item_query_tile(const Dims& s, uint32_t* item, int64_t hh, int64_t i) {
  const int64_t Tp = s.tiles * kBlock, Tkp = s.ktiles * kBlock;
  uint32_t* head = item + Tkp * s.Dp + Tkp / 2 * s.Dp + hh * 2 * Tp * s.Dp;
  const int64_t rows = i * kBlock * (s.Dp / 2), pairs = i * kPairs * s.Dp;
  return {head + rows, head + Tp * (s.Dp / 2) + rows, head + Tp * s.Dp + pairs, head + Tp * s.Dp + Tp / 2 * s.Dp + pairs};
}

// P = exp(scale Q K^T - lse) (masked on the diagonal tile, and past the last of nk keys: a block's
// partial key tile is not diagonal, and its pairs reach one key past nk) and dS = scale P (dO V^T - D) in f32, two
// query rows at a time, written straight into the layouts their products read: pairs of queries
// (dV, dK) and, when dQ is wanted, bf16 rows (dQ). The scores come out of their product in base 2.
template <class U>
LOOM_ATTN_INLINE void tile_probabilities(const Dims& s, Bf16BackwardTiles& w, const KeyTile& key,
                                         const QueryTile& query, const float* lse_rows, const float* Di, int64_t nq,
                                         int64_t nk, bool diag, bool want_dq) {
  const int64_t words = s.Dp / 2;
  const Causal half = diag ? Causal::ColsToRow : Causal::None;
  dp_matmul<U>(w.P, kBlock, nullptr, false, s.scale * kLog2e, query.Qb, words, 1, key.Kt, kBlock, nq, words, kBlock, half);
  dp_matmul<U>(w.dS, kBlock, nullptr, false, 1.0f, query.dOb, words, 1, key.Vt, kBlock, nq, words, kBlock, half);
  const __m512 scale = _mm512_set1_ps(s.scale);
  auto row = [&](int64_t r, int v, __m512& p, __m512& ds) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(w.P + r * kBlock + v * 16), _mm512_set1_ps(lse_rows[r] * kLog2e));
    __m512 dp = _mm512_sub_ps(_mm512_loadu_ps(w.dS + r * kBlock + v * 16), _mm512_set1_ps(Di[r]));
    if (diag) x = mask_keys_after(x, v, r), dp = zero_keys_after(dp, v, r);  // both may be stale there
    else if (nk < kBlock) x = mask_keys_after(x, v, nk - 1);  // P = 0 there, so dS = 0
    p = exp2_ps(x);
    ds = _mm512_mul_ps(_mm512_mul_ps(p, dp), scale);
  };
  for (int64_t r = 0; r < nq; r += 2) {
    const bool pair = r + 1 < nq;
    for (int v = 0; v < S::kRowVectors; ++v) {
      __m512 p0, ds0, p1 = _mm512_setzero_ps(), ds1 = _mm512_setzero_ps();
      row(r, v, p0, ds0);
      if (pair) row(r + 1, v, p1, ds1);
      _mm512_storeu_si512(w.Pp + (r / 2) * kBlock + v * 16, interleave_rounded(p0, p1));
      _mm512_storeu_si512(w.dSp + (r / 2) * kBlock + v * 16, interleave_rounded(ds0, ds1));
      if (want_dq) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.dSb + r * kPairs + v * 8), (__m256i)_mm512_cvtneps_pbh(ds0));
        if (pair)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.dSb + (r + 1) * kPairs + v * 8),
                              (__m256i)_mm512_cvtneps_pbh(ds1));
      }
    }
  }
  // The tile kernels reduce over all kPairs pairs of queries: those past a partial tile's are zero.
  if constexpr (U::kTiles) {
    const int64_t from = (nq + 1) / 2;
    std::memset(w.Pp + from * kBlock, 0, static_cast<size_t>((kPairs - from) * kBlock) * sizeof(uint32_t));
    std::memset(w.dSp + from * kBlock, 0, static_cast<size_t>((kPairs - from) * kBlock) * sizeof(uint32_t));
  }
}

}  // namespace

int64_t bf16_forward_workspace_floats(int64_t Dp) { return forward_floats(Dp); }
int64_t bf16_backward_tile_floats(const Dims& s, bool by_kv_head) {
  return backward_floats(s.Dp) + (by_kv_head ? item_pack_floats(s) : 0);
}

int64_t bf16_forward_packed_floats(const Dims& s) { return 2 * s.B * s.KVH * s.ktiles * kBlock * (s.Dp / 2); }
int64_t bf16_forward_pack_tasks(const Dims& s) { return s.B * s.KVH * s.ktiles; }

// V goes in as row pairs for the dot products' P V, or transposed for the tile kernels' V^T P^T (the
// same words, kPairs x Dp a tile, either way).
template <bool kTiles>
void forward_pack(const Dims& s, const float* qkv, float* packed, int64_t task) {
  const ForwardPacked p = forward_packed(s, packed);
  const int64_t j = task % s.ktiles, bg = task / s.ktiles, b = bg / s.KVH, g = bg % s.KVH;
  const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.Tk - k0);
  const float* tok = (s.kv ? s.kv : qkv) + (b * s.Tk + k0) * s.kv_row;
  convert_rows(p.K + bg * p.per_head + k0 * (s.Dp / 2), s.Dp, tok + s.k_col + g * s.D, s.kv_row, nk, s.D);
  uint32_t* v = p.V + bg * p.per_head + (k0 / 2) * s.Dp;
  if constexpr (kTiles) {
    thread_local std::vector<uint32_t> scratch;
    scratch.resize(static_cast<size_t>(kPairs * s.Dp));
    pack_pairs_transposed(v, scratch.data(), tok + s.v_col + g * s.D, s.kv_row, nk, s.D, s.Dp);
  } else {
    pack_row_pairs(v, s.Dp, tok + s.v_col + g * s.D, s.kv_row, nk, s.D, s.Dp);
  }
}
void bf16_forward_pack(const Dims& s, const float* qkv, float* packed, int64_t task) {
  forward_pack<false>(s, qkv, packed, task);
}
void tiles_forward_pack(const Dims& s, const float* qkv, float* packed, int64_t task) {
  forward_pack<true>(s, qkv, packed, task);
}

template <class U>
void forward_query_tile_on(const Dims& s, float* out, float* lse, const float* qkv, int64_t b, int64_t h, int64_t i,
                             float* ws) {
  const int64_t D = s.D, Dp = s.Dp, words = Dp / 2, g = h / s.group;
  ForwardTiles w = carve_forward(ws, Dp);
  const int64_t q0 = i * kBlock, nq = std::min(kBlock, s.T - q0);
  const float* tok = qkv + b * s.T * s.q_row;  // query token 0 of this batch row
  const ForwardPacked packed = forward_packed(s, s.packed);
  const uint32_t* K = packed.K + (b * s.KVH + g) * packed.per_head;  // bf16 rows
  const uint32_t* V = packed.V + (b * s.KVH + g) * packed.per_head;  // row pairs (tiles: transposed)
  convert_rows(w.Qb, Dp, tok + q0 * s.q_row + h * D, s.q_row, nq, D);
  transpose_words(w.Qt, w.Qb, words);
  std::fill(w.O, w.O + kBlock * Dp, 0.0f);
  std::fill(w.m, w.m + kBlock, kMasked);
  std::fill(w.l, w.l + kBlock, 0.0f);

  const int64_t j_last = s.causal ? i : s.ktiles - 1;
  for (int64_t j = 0; j <= j_last; ++j) {
    const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.Tk - k0);
    const bool diag = s.causal && j == i;
    dp_matmul<U>(w.St, kBlock, nullptr, false, s.scale * kLog2e, K + k0 * words, words, 1, w.Qt, kBlock, nk, words,
              kBlock, diag ? Causal::ColsFromRow : Causal::None);
    // The online softmax over this tile's keys (base 2), as the f32 forward does it: the new running
    // maximum first, then exp2 of each pair of key rows, summed in key order and written straight
    // into the pairs-of-keys layout the P V product reads.
    auto score = [&](int64_t c, int v) {
      const __m512 x = _mm512_loadu_ps(w.St + c * kBlock + v * 16);
      return diag ? mask_queries_before(x, v, c) : x;
    };
    __m512 m_new[S::kRowVectors], sum[S::kRowVectors];
    for (int v = 0; v < S::kRowVectors; ++v) m_new[v] = _mm512_loadu_ps(w.m + v * 16), sum[v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nk; ++c)
      for (int v = 0; v < S::kRowVectors; ++v) m_new[v] = _mm512_max_ps(m_new[v], score(c, v));
    for (int64_t c = 0; c < nk; c += 2)
      for (int v = 0; v < S::kRowVectors; ++v) {
        const __m512 p0 = exp2_ps(_mm512_sub_ps(score(c, v), m_new[v]));
        const __m512 p1 = c + 1 < nk ? exp2_ps(_mm512_sub_ps(score(c + 1, v), m_new[v])) : _mm512_setzero_ps();
        sum[v] = _mm512_add_ps(_mm512_add_ps(sum[v], p0), p1);
        _mm512_storeu_si512(w.Pp + (c / 2) * kBlock + v * 16, interleave_rounded(p0, p1));
      }
    for (int v = 0; v < S::kRowVectors; ++v) {
      const __m512 m_old = _mm512_loadu_ps(w.m + v * 16);
      const __m512 a = exp2_ps(_mm512_sub_ps(m_old, m_new[v]));  // 0 on the first tile (m = kMasked)
      _mm512_storeu_ps(w.alpha + v * 16, a);
      _mm512_storeu_ps(w.l + v * 16, _mm512_fmadd_ps(_mm512_loadu_ps(w.l + v * 16), a, sum[v]));
      _mm512_storeu_ps(w.m + v * 16, m_new[v]);
    }
    if constexpr (U::kTiles) {
      // O^T[d][r] = alpha[r] O^T[d][r] + sum over key pairs of V^T[d][pair] P^T[pair][r]: A is V
      // transposed (packed so), B the pairs-of-keys P as it is; all kPairs pairs (zero past nk).
      const int64_t from = (nk + 1) / 2;
      std::memset(w.Pp + from * kBlock, 0, static_cast<size_t>((kPairs - from) * kBlock) * sizeof(uint32_t));
      for (int64_t d = 0; d < Dp; ++d)
        for (int v = 0; v < S::kRowVectors; ++v)
          _mm512_storeu_ps(w.O + d * kBlock + v * 16, _mm512_mul_ps(_mm512_loadu_ps(w.O + d * kBlock + v * 16),
                                                                     _mm512_loadu_ps(w.alpha + v * 16)));
      dp_matmul<U>(w.O, kBlock, nullptr, true, 1.0f, V + (k0 / 2) * Dp, kPairs, 1, w.Pp, kBlock, Dp, kPairs, kBlock);
    } else {
      // O[r] = alpha[r] O[r] + sum_c P[r][c] v_c, V as row pairs.
      dp_matmul<U>(w.O, Dp, w.alpha, true, 1.0f, w.Pp, 1, kBlock, V + (k0 / 2) * Dp, Dp, nq, (nk + 1) / 2, Dp,
                   diag ? Causal::PairsToRow : Causal::None);
    }
  }

  float* out_tile = out + (b * s.T + q0) * s.out_row + h * D;
  float* lse_tile = lse + (b * s.H + h) * s.T + q0;
  for (int64_t r = 0; r < nq; ++r) {
    const float inv = 1.0f / w.l[r];
    float* o = out_tile + r * s.out_row;
    if constexpr (U::kTiles) {  // O^T: column r
      for (int64_t d = 0; d < D; ++d) o[d] = w.O[d * kBlock + r] * inv;
      lse_tile[r] = w.m[r] * kLn2 + std::log(w.l[r]);
      continue;
    }
    const float* x = w.O + r * Dp;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = first_lanes(D - d);
      _mm512_mask_storeu_ps(o + d, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d), _mm512_set1_ps(inv)));
    }
    lse_tile[r] = w.m[r] * kLn2 + std::log(w.l[r]);
  }
}

template <class U>
void backward_key_tiles_on(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g, int64_t j_begin, int64_t j_end,
                             float* dQ, float* Di_all, float* ws) {
  Bf16BackwardTiles w = carve_backward(ws, s.Dp);
  const int64_t D = s.D, Dp = s.Dp;
  // By kv head (dQ given, every key tile): every tile this item reads is packed once, here. Two
  // passes: each tile pair packs its own (no item sees a tile twice often enough to pay for more).
  const bool packed = dQ != nullptr;
  if (packed) {
    std::fill(dQ, dQ + s.group * s.T * Dp, 0.0f);
    for (int64_t hh = 0; hh < s.group; ++hh) {
      const int64_t off = (b * s.T) * s.out_row + (g * s.group + hh) * D;
      S::row_dots(Di_all + hh * s.T, a.dout + off, a.out + off, s.out_row, s.T, D);
    }
    for (int64_t j = 0; j < s.ktiles; ++j) {
      const int64_t k0 = j * kBlock;
      pack_key_tile(s, w.Kb, item_key_tile(s, w.item, j), a.kv, b, g, k0, std::min(kBlock, s.Tk - k0));
    }
    for (int64_t i = 0; i < s.tiles; ++i) {
      const int64_t q0 = i * kBlock;
      for (int64_t hh = 0; hh < s.group; ++hh)
        pack_query_tile<U>(s, item_query_tile(s, w.item, hh, i), a, b, g * s.group + hh, q0,
                           std::min(kBlock, s.T - q0), w.Kb);
    }
  }
  for (int64_t j = j_begin; j < j_end; ++j) {
    const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.Tk - k0);
    const KeyTile key = packed ? item_key_tile(s, w.item, j) : w.key;
    if (!packed) pack_key_tile(s, w.Kb, key, a.kv, b, g, k0, nk);
    std::fill(w.dK, w.dK + kBlock * Dp, 0.0f);
    std::fill(w.dV, w.dV + kBlock * Dp, 0.0f);
    for (int64_t hh = 0; hh < s.group; ++hh) {
      const int64_t h = g * s.group + hh;
      for (int64_t i = s.causal ? j : 0; i < s.tiles; ++i) {
        const int64_t q0 = i * kBlock, nq = std::min(kBlock, s.T - q0);
        const bool diag = s.causal && i == j;
        const QueryTile query = packed ? item_query_tile(s, w.item, hh, i) : w.query;
        if (!packed) pack_query_tile<U>(s, query, a, b, h, q0, nq, w.Kb);
        const float* Di = w.Di;
        if (packed) {
          Di = Di_all + hh * s.T + q0;
        } else {
          const int64_t off = (b * s.T + q0) * s.out_row + h * D;
          S::row_dots(w.Di, a.dout + off, a.out + off, s.out_row, nq, D);
        }
        tile_probabilities<U>(s, w, key, query, a.lse + (b * s.H + h) * s.T + q0, Di, nq, nk, diag, packed);
        const int64_t query_pairs = (nq + 1) / 2;
        const Causal from = diag ? Causal::PairsFromRow : Causal::None, to = diag ? Causal::PairsToRow : Causal::None;
        if constexpr (U::kTiles) {  // dV^T += dO^T P, dK^T += Q^T dS: A packed transposed, all kPairs pairs
          dp_matmul<U>(w.dV, kBlock, nullptr, true, 1.0f, query.dOp, kPairs, 1, w.Pp, kBlock, Dp, kPairs, kBlock);
          dp_matmul<U>(w.dK, kBlock, nullptr, true, 1.0f, query.Qp, kPairs, 1, w.dSp, kBlock, Dp, kPairs, kBlock);
        } else {
          dp_matmul<U>(w.dV, Dp, nullptr, true, 1.0f, w.Pp, 1, kBlock, query.dOp, Dp, nk, query_pairs, Dp, from);  // P^T dO
          dp_matmul<U>(w.dK, Dp, nullptr, true, 1.0f, w.dSp, 1, kBlock, query.Qp, Dp, nk, query_pairs, Dp, from);  // dS^T Q
        }
        if (packed)  // dQ_i += dS K_j
          dp_matmul<U>(dQ + (hh * s.T + q0) * Dp, Dp, nullptr, true, 1.0f, w.dSb, kPairs, 1, key.Kp, Dp, nq, (nk + 1) / 2,
                    Dp, to);
      }
    }
    float* tok = a.dkv + (b * s.Tk + k0) * s.kv_row;
    if constexpr (U::kTiles) {  // dK^T, dV^T: column c is key c
      for (int64_t c = 0; c < nk; ++c)
        for (int64_t d = 0; d < D; ++d) {
          tok[c * s.kv_row + s.k_col + g * D + d] = w.dK[d * kBlock + c];
          tok[c * s.kv_row + s.v_col + g * D + d] = w.dV[d * kBlock + c];
        }
    } else {
      S::write_rows(tok + s.k_col + g * D, s.kv_row, w.dK, Dp, nk, D);
      S::write_rows(tok + s.v_col + g * D, s.kv_row, w.dV, Dp, nk, D);
    }
  }
  if (packed)
    for (int64_t hh = 0; hh < s.group; ++hh)
      S::write_rows(a.dqkv + b * s.T * s.q_row + (g * s.group + hh) * D, s.q_row, dQ + hh * s.T * Dp, Dp, s.T, D);
}

template <class U>
void backward_query_tile_on(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h, int64_t i, float* ws) {
  Bf16BackwardTiles w = carve_backward(ws, s.Dp);
  const int64_t D = s.D, Dp = s.Dp, g = h / s.group;
  const int64_t q0 = i * kBlock, nq = std::min(kBlock, s.T - q0);
  pack_query_tile<U>(s, w.query, a, b, h, q0, nq, w.Kb);
  const int64_t off = (b * s.T + q0) * s.out_row + h * D;
  S::row_dots(w.Di, a.dout + off, a.out + off, s.out_row, nq, D);
  std::fill(w.dQ, w.dQ + kBlock * Dp, 0.0f);
  const int64_t j_last = s.causal ? i : s.ktiles - 1;
  for (int64_t j = 0; j <= j_last; ++j) {
    const int64_t k0 = j * kBlock, nk = std::min(kBlock, s.Tk - k0);
    const bool diag = s.causal && i == j;
    pack_key_tile(s, w.Kb, w.key, a.kv, b, g, k0, nk);
    tile_probabilities<U>(s, w, w.key, w.query, a.lse + (b * s.H + h) * s.T + q0, w.Di, nq, nk, diag, true);
    dp_matmul<U>(w.dQ, Dp, nullptr, true, 1.0f, w.dSb, kPairs, 1, w.key.Kp, Dp, nq, (nk + 1) / 2, Dp,
              diag ? Causal::PairsToRow : Causal::None);
  }
  S::write_rows(a.dqkv + (b * s.T + q0) * s.q_row + h * D, s.q_row, w.dQ, Dp, nq, D);
}

// The entry points: one instantiation per product engine, each holding the tile unit's configuration
// for the length of one work item.
#define LOOM_BF16_ENTRY_POINTS(prefix, U)                                                                         \
  void prefix##_forward_query_tile(const Dims& s, float* out, float* lse, const float* qkv, int64_t b, int64_t h, \
                                   int64_t i, float* ws) {                                                        \
    tile_detail::TileScope<U> tiles;                                                                             \
    forward_query_tile_on<U>(s, out, lse, qkv, b, h, i, ws);                                                     \
  }                                                                                                              \
  void prefix##_backward_key_tiles(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g, int64_t j_begin,    \
                                   int64_t j_end, float* dQ, float* Di_all, float* ws) {                          \
    tile_detail::TileScope<U> tiles;                                                                             \
    backward_key_tiles_on<U>(s, a, b, g, j_begin, j_end, dQ, Di_all, ws);                                        \
  }                                                                                                              \
  void prefix##_backward_query_tile(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h, int64_t i,         \
                                    float* ws) {                                                                 \
    tile_detail::TileScope<U> tiles;                                                                             \
    backward_query_tile_on<U>(s, a, b, h, i, ws);                                                                \
  }
LOOM_BF16_ENTRY_POINTS(bf16, tile_detail::NoTiles)
LOOM_BF16_ENTRY_POINTS(amx, tile_detail::HardwareTiles)
LOOM_BF16_ENTRY_POINTS(soft_amx, tile_detail::SoftwareTiles)
#undef LOOM_BF16_ENTRY_POINTS

}  // namespace loom::kernels::attention_detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
