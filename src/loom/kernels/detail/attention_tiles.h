// Implementation detail of kernels/attention.cpp: tile sizes, the shapes of one call, the tile loads
// and workspaces both passes share, and the shape check the fast and reference kernels share. The
// algorithm is described at the top of attention.cpp. Not part of the kernels' public interface.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "loom/error.h"
#include "loom/kernels/attention.h"

namespace loom::kernels::attention_detail {

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
  int64_t tiles;    // ceil(T / kBlock): query tiles
  float scale;
  // The key/value side. Self-attention (make_dims): the keys are the queries' own tokens, in qkv, and
  // the mask is causal. A block (make_block_dims, context parallelism's ring): Tk keys of another
  // block in their own buffer [B, Tk, 2 KVH D] (K heads, then V heads), every key visible to every
  // query. Every kernel set runs both.
  int64_t Tk;              // keys per batch row
  int64_t ktiles;          // ceil(Tk / kBlock)
  bool causal = true;
  int64_t q_row;           // floats per token row of the queries (and of dq): qkv_row, or H D for a block
  int64_t kv_row;          // floats per token row of the keys and values (and of dkv)
  int64_t k_col, v_col;    // where key / value head 0 starts in such a row
  const float* kv = nullptr;  // forward: the keys' buffer (null: qkv)
  // Operands a kernel set packed once for the whole call (its pack step), or null: the bf16 forward
  // packs K and V of every kv head here (attention_bf16.cpp).
  const void* packed = nullptr;
};

inline Dims make_dims(const AttentionShape& s) {
  Dims d{};
  d.B = s.B, d.T = s.T, d.H = s.H, d.KVH = s.KVH, d.D = s.D;
  d.Dp = (s.D + kPad - 1) / kPad * kPad;
  d.group = s.H / s.KVH;
  d.qkv_row = (s.H + 2 * s.KVH) * s.D;
  d.out_row = s.H * s.D;
  d.tiles = (s.T + kBlock - 1) / kBlock;
  d.scale = s.scale;
  d.Tk = s.T, d.ktiles = d.tiles, d.causal = true;
  d.q_row = d.qkv_row, d.kv_row = d.qkv_row, d.k_col = s.H * s.D, d.v_col = (s.H + s.KVH) * s.D;
  return d;
}

// A block: s.T queries [B, T, H D] against Tk keys and values [B, Tk, 2 KVH D], no mask.
inline Dims make_block_dims(const AttentionShape& s, int64_t Tk) {
  Dims d = make_dims(s);
  d.qkv_row = d.q_row = s.H * s.D;
  d.Tk = Tk, d.ktiles = (Tk + kBlock - 1) / kBlock, d.causal = false;
  d.kv_row = 2 * s.KVH * s.D, d.k_col = 0, d.v_col = s.KVH * s.D;
  return d;
}

// Rows of qkv / out / dout are one head's D floats every (H + 2 KVH) D or H D floats: too far apart
// for the hardware prefetchers, so the loops that walk them ask for the row kPrefetchRows ahead
// (measured: ~10% of the bf16 backward at mini's shape was waiting on those loads). Prefetching past
// the end of a tensor is harmless (a hint; it never faults).
constexpr int64_t kPrefetchRows = 4;
LOOM_ATTN_INLINE void prefetch_row(const float* row, int64_t D, bool for_write = false) {
  for (int64_t d = 0; d < D; d += 16) {
    if (for_write)
      __builtin_prefetch(row + d, 1);
    else
      __builtin_prefetch(row + d, 0);
  }
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

// Self-attention: kv == qkv and dkv == dqkv (the key/value columns of the same rows). A block: the
// queries' side (qkv, dqkv: [B, T, H D]) and the keys' side (kv, dkv) are separate buffers.
struct BackwardArgs {
  float* dqkv;
  const float* dout;
  const float* out;
  const float* lse;
  const float* qkv;
  const float* kv;
  float* dkv;
};

// Tiles a backward item needs whatever the schedule. Kb, Qb, dOb are scratch for padded copies; the
// products read the operands through K, Q, dO (in place when D is a whole number of vectors).
struct BackwardTiles {
  float *Kt, *Vt, *Kb, *Qb, *dOb, *dKb, *dVb, *dQb, *P, *dS, *Di;
  Rows K, Q, dO;
};

constexpr int64_t backward_tile_floats(int64_t Dp) { return 8 * kBlock * Dp + 2 * kBlock * kBlock + kBlock; }

inline BackwardTiles carve_backward_tiles(float* ws, int64_t Dp) {
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
LOOM_ATTN_INLINE void load_key_tile(const Dims& s, BackwardTiles& w, const float* kv, int64_t b, int64_t g, int64_t k0,
                                    int64_t nk) {
  const float* tok = kv + (b * s.Tk + k0) * s.kv_row;
  const float* k = tok + s.k_col + g * s.D;
  const float* v = tok + s.v_col + g * s.D;
  transpose_rows(w.Kt, k, s.kv_row, nk, s.D);
  transpose_rows(w.Vt, v, s.kv_row, nk, s.D);
  w.K = tile_rows(w.Kb, s.Dp, k, s.kv_row, nk, s.D);
}

// Loads query tile (q0, nq) of head h: Q and dO rows.
LOOM_ATTN_INLINE void load_query_tile(const Dims& s, BackwardTiles& w, const BackwardArgs& a, int64_t b, int64_t h,
                                      int64_t q0, int64_t nq) {
  w.Q = tile_rows(w.Qb, s.Dp, a.qkv + (b * s.T + q0) * s.q_row + h * s.D, s.q_row, nq, s.D);
  w.dO = tile_rows(w.dOb, s.Dp, a.dout + (b * s.T + q0) * s.out_row + h * s.D, s.out_row, nq, s.D);
}

// The forward works on transposed scores St[c][r] = scale * k_c . q_r (key c, query r) so that the
// softmax statistics of the 64 query rows are whole vectors: the running max, sum and rescaling
// factors need no horizontal reductions, and each query tile is transposed once per item instead of
// each key tile once per tile pair.
constexpr int64_t forward_workspace_floats(int64_t Dp) {
  return 3 * kBlock * Dp + kBlock * kBlock + 3 * kBlock;  // Q^T, padded V, O; scores; m, l, alpha
}

inline void validate(const AttentionShape& s, const char* op) {
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

}  // namespace loom::kernels::attention_detail
