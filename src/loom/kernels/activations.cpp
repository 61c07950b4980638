// Fast GELU (tanh approximation) and SwiGLU (references with the plain formulas in elementwise_ref.cpp).
//
// Both need exp or tanh per element, which std:: functions do not vectorise without -ffast-math, so
// they are rewritten with the polynomial detail::fast_exp through two exact identities:
//   0.5 (1 + tanh(u)) = sigmoid(2u)             so  gelu(x) = x * sigmoid(2u),
//   1 - tanh(u)^2     = 4 sigmoid(2u) (1 - sigmoid(2u)),
// with sigmoid(z) = 1 / (1 + exp(-z)) and 1 - sigmoid(z) = exp(-z) * sigmoid(z). Neither tail of
// either curve cancels, so the relative error stays near fast_exp's ~1e-7 for all x.
// The work is split into static contiguous chunks per thread (cache-line aligned), so results are
// bitwise deterministic for a given thread count.
#include "loom/kernels/detail/elementwise_avx512.h"
#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

using detail::bits;
using detail::fast_exp;
using detail::fast_sigmoid;

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
// Elements below which one thread does everything (the fork/join would cost more than the work).
constexpr int64_t kSerialElements = 1 << 14;

// The math of each element, shared by the f32 kernels and the ones fused with the bf16 cast (precision
// bf16).
inline float gelu_value(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return x * fast_sigmoid(2.0f * u);
}

inline float gelu_grad(float x, float dy) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  const float e = fast_exp(-2.0f * u);
  const float s = 1.0f / (1.0f + e);  // 0.5 (1 + tanh u)
  const float du_dx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
  // 0.5 x (1 - tanh^2 u) du/dx = 2 x s (1 - s) du/dx, with 1 - s = e * s
  return (s + 2.0f * x * s * (e * s) * du_dx) * dy;
}

inline float swiglu_value(float g, float u) { return g * fast_sigmoid(g) * u; }

// d/dgate and d/dup of silu(g) u, times dy.
struct SwigluGrad {
  float dg, du;
};
inline SwigluGrad swiglu_grad(float g, float u, float dy) {
  const float e = fast_exp(-g);
  const float sig = 1.0f / (1.0f + e);
  // d silu / dg = sig (1 + g (1 - sig)), with 1 - sig = e * sig
  return {dy * u * sig * (1.0f + g * (e * sig)), dy * g * sig};
}

// The f32 loops, inlined into the clones below.
[[gnu::always_inline]] inline void gelu_forward_loop(float* __restrict out, const float* __restrict inp, int64_t n) {
  if (detail::elementwise_avx512()) return detail::gelu_forward_avx512(out, inp, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_value(inp[i]);
}

[[gnu::always_inline]] inline void gelu_backward_loop(float* __restrict dinp, const float* __restrict inp,
                                                      const float* __restrict dout, int64_t n) {
  if (detail::elementwise_avx512()) return detail::gelu_backward_avx512(dinp, inp, dout, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dinp[i] = gelu_grad(inp[i], dout[i]);
}

[[gnu::always_inline]] inline void swiglu_forward_loop(float* __restrict y, const float* __restrict g,
                                                       const float* __restrict u, int64_t n) {
  if (detail::elementwise_avx512()) return detail::swiglu_forward_avx512(y, g, u, n);
#pragma omp simd
  for (int64_t f = 0; f < n; ++f) y[f] = swiglu_value(g[f], u[f]);
}

[[gnu::always_inline]] inline void swiglu_backward_loop(float* __restrict dg, float* __restrict du,
                                                        const float* __restrict g, const float* __restrict u,
                                                        const float* __restrict dy, int64_t n) {
  if (detail::elementwise_avx512()) return detail::swiglu_backward_avx512(dg, du, g, u, dy, n);
#pragma omp simd
  for (int64_t f = 0; f < n; ++f) {
    const SwigluGrad d = swiglu_grad(g[f], u[f], dy[f]);
    dg[f] = d.dg, du[f] = d.du;
  }
}

[[gnu::always_inline]] inline void round_loop(bf16* __restrict out, const float* __restrict in, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i].bits = detail::f32_to_bf16_bits(in[i]);
}

// The kernels fused with the bf16 cast compute kChunk values at a time in f32 into a tile on the stack,
// then round the tile into the output while it is in L1: the same memory traffic as one fused loop,
// and each loop vectorised at full width (one loop doing both mixes 16- and 32-bit lanes, which GCC
// vectorises at half width without AVX512-BW, and the activations then run compute-bound).
constexpr int64_t kChunk = 512;

LOOM_TARGET_CLONES
void gelu_forward_range(float* __restrict out, const float* __restrict inp, int64_t i0, int64_t i1) {
  gelu_forward_loop(out + i0, inp + i0, i1 - i0);
}

LOOM_TARGET_CLONES
void gelu_forward_range(bf16* __restrict out, const float* __restrict inp, int64_t i0, int64_t i1) {
  if (detail::elementwise_avx512()) return detail::gelu_forward_avx512(bits(out + i0), inp + i0, i1 - i0);
  alignas(64) float tile[kChunk];
  for (int64_t b = i0; b < i1; b += kChunk) {
    const int64_t n = std::min(kChunk, i1 - b);
    gelu_forward_loop(tile, inp + b, n);
    round_loop(out + b, tile, n);
  }
}

LOOM_TARGET_CLONES
void gelu_backward_range(float* __restrict dinp, const float* __restrict inp, const float* __restrict dout, int64_t i0,
                         int64_t i1) {
  gelu_backward_loop(dinp + i0, inp + i0, dout + i0, i1 - i0);
}

LOOM_TARGET_CLONES
void gelu_backward_range(bf16* __restrict dinp, const float* __restrict inp, const float* __restrict dout, int64_t i0,
                         int64_t i1) {
  if (detail::elementwise_avx512())
    return detail::gelu_backward_avx512(bits(dinp + i0), nullptr, inp + i0, dout + i0, i1 - i0);
  alignas(64) float tile[kChunk];
  for (int64_t b = i0; b < i1; b += kChunk) {
    const int64_t n = std::min(kChunk, i1 - b);
    gelu_backward_loop(tile, inp + b, dout + b, n);
    round_loop(dinp + b, tile, n);
  }
}

// GELU backward into bf16 for rows [n0, n1), each row also added into its block's partial column sums
// (detail::blocked_column_sums: the bias gradient of the linear before it, summed as bias_backward sums).
LOOM_TARGET_CLONES
void gelu_backward_bias_rows(bf16* __restrict dinp, float* __restrict partial, const float* __restrict inp,
                             const float* __restrict dout, int64_t n0, int64_t n1, int64_t F) {
  if (detail::elementwise_avx512()) {
    for (int64_t n = n0; n < n1; ++n)
      detail::gelu_backward_avx512(bits(dinp + n * F), partial, inp + n * F, dout + n * F, F);
    return;
  }
  alignas(64) float tile[kChunk];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < F; b += kChunk) {
      const int64_t w = std::min(kChunk, F - b), at = n * F + b;
      gelu_backward_loop(tile, inp + at, dout + at, w);
      round_loop(dinp + at, tile, w);
      float* __restrict sums = partial + b;
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) sums[j] += tile[j];
    }
}

LOOM_TARGET_CLONES
void swiglu_forward_rows(float* __restrict out, const float* __restrict gu, int64_t n0, int64_t n1, int64_t F) {
  for (int64_t n = n0; n < n1; ++n) swiglu_forward_loop(out + n * F, gu + n * 2 * F, gu + n * 2 * F + F, F);
}

LOOM_TARGET_CLONES
void swiglu_forward_rows(bf16* __restrict out, const float* __restrict gu, int64_t n0, int64_t n1, int64_t F) {
  if (detail::elementwise_avx512()) {
    for (int64_t n = n0; n < n1; ++n)
      detail::swiglu_forward_avx512(bits(out + n * F), gu + n * 2 * F, gu + n * 2 * F + F, F);
    return;
  }
  alignas(64) float tile[kChunk];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < F; b += kChunk) {
      const int64_t w = std::min(kChunk, F - b);
      swiglu_forward_loop(tile, gu + n * 2 * F + b, gu + n * 2 * F + F + b, w);
      round_loop(out + n * F + b, tile, w);
    }
}

LOOM_TARGET_CLONES
void swiglu_backward_rows(float* __restrict dgu, const float* __restrict gu, const float* __restrict dout, int64_t n0,
                          int64_t n1, int64_t F) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* g = gu + n * 2 * F;
    float* dg = dgu + n * 2 * F;
    swiglu_backward_loop(dg, dg + F, g, g + F, dout + n * F, F);
  }
}

LOOM_TARGET_CLONES
void swiglu_backward_rows(bf16* __restrict dgu, const float* __restrict gu, const float* __restrict dout, int64_t n0,
                          int64_t n1, int64_t F) {
  if (detail::elementwise_avx512()) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* g = gu + n * 2 * F;
      detail::swiglu_backward_avx512(bits(dgu + n * 2 * F), bits(dgu + n * 2 * F + F), g, g + F, dout + n * F, F);
    }
    return;
  }
  alignas(64) float tile_g[kChunk], tile_u[kChunk];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < F; b += kChunk) {
      const int64_t w = std::min(kChunk, F - b);
      const float* g = gu + n * 2 * F + b;
      swiglu_backward_loop(tile_g, tile_u, g, g + F, dout + n * F + b, w);
      round_loop(dgu + n * 2 * F + b, tile_g, w);
      round_loop(dgu + n * 2 * F + F + b, tile_u, w);
    }
}

template <class Out>
void gelu_forward_any(Out* out, const float* inp, int64_t n) {
  detail::parallel_ranges(n, kSerialElements, 32,
                          [&](int64_t i0, int64_t i1, int, int) { gelu_forward_range(out, inp, i0, i1); });
}

template <class Out>
void gelu_backward_any(Out* dinp, const float* inp, const float* dout, int64_t n) {
  detail::parallel_ranges(n, kSerialElements, 32,
                          [&](int64_t i0, int64_t i1, int, int) { gelu_backward_range(dinp, inp, dout, i0, i1); });
}

template <class Out>
void swiglu_forward_any(Out* out, const float* gu, int64_t N, int64_t F) {
  detail::parallel_ranges(N, kSerialElements / (F > 0 ? F : 1) + 1, 1,
                          [&](int64_t n0, int64_t n1, int, int) { swiglu_forward_rows(out, gu, n0, n1, F); });
}

template <class Out>
void swiglu_backward_any(Out* dgu, const float* gu, const float* dout, int64_t N, int64_t F) {
  detail::parallel_ranges(N, kSerialElements / (F > 0 ? F : 1) + 1, 1,
                          [&](int64_t n0, int64_t n1, int, int) { swiglu_backward_rows(dgu, gu, dout, n0, n1, F); });
}

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) { gelu_forward_any(out, inp, n); }
void gelu_forward(bf16* out, const float* inp, int64_t n) { gelu_forward_any(out, inp, n); }

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) { gelu_backward_any(dinp, inp, dout, n); }

void gelu_backward(bf16* dinp, float* dbias, const float* inp, const float* dout, int64_t N, int64_t F) {
  if (!dbias) return gelu_backward_any(dinp, inp, dout, N * F);
  detail::blocked_column_sums(dbias, N, F, kSerialElements, [&](int64_t n0, int64_t n1, float* partial) {
    gelu_backward_bias_rows(dinp, partial, inp, dout, n0, n1, F);
  });
}

KernelCost gelu_cost(int64_t n, bool backward) {
  const double e = static_cast<double>(n);
  // Forward: cubic and scale 5, sigmoid (exp ~ 15 flops as evaluated, add, divide) 17, product 1.
  // Backward: the same u and exp, derivative terms ~10 more, times dout.
  // Bytes: forward reads inp and writes out; backward reads inp and dout and writes dinp.
  if (!backward) return {23.0 * e, 8.0 * e};
  return {33.0 * e, 12.0 * e};
}

KernelCost gelu_bf16_cost(int64_t N, int64_t F, bool backward, bool bias) {
  const double e = static_cast<double>(N) * static_cast<double>(F);
  // As gelu_cost, with the output written in bf16 (2 bytes, not 4); backward with the bias gradient
  // adds an add per element and reads and writes dbias once.
  if (!backward) return {23.0 * e, 6.0 * e};
  if (!bias) return {33.0 * e, 10.0 * e};
  return {34.0 * e, 10.0 * e + 8.0 * static_cast<double>(F)};
}

void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F) { swiglu_forward_any(out, gu, N, F); }
void swiglu_forward(bf16* out, const float* gu, int64_t N, int64_t F) { swiglu_forward_any(out, gu, N, F); }

void swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t F) {
  swiglu_backward_any(dgu, gu, dout, N, F);
}
void swiglu_backward(bf16* dgu, const float* gu, const float* dout, int64_t N, int64_t F) {
  swiglu_backward_any(dgu, gu, dout, N, F);
}

KernelCost swiglu_cost(int64_t N, int64_t F, bool backward) {
  const double e = static_cast<double>(N) * static_cast<double>(F);
  // Forward: exp ~15, sigmoid add+divide 2, two products 2; reads gate and up, writes out.
  // Backward: exp and sigmoid 17, the two derivatives ~9; reads gate, up, dout, writes dgate, dup.
  if (!backward) return {19.0 * e, 12.0 * e};
  return {26.0 * e, 20.0 * e};
}

KernelCost swiglu_bf16_cost(int64_t N, int64_t F, bool backward) {
  const double e = static_cast<double>(N) * static_cast<double>(F);
  // As swiglu_cost, with the output (forward) or both gradients (backward) written in bf16.
  if (!backward) return {19.0 * e, 10.0 * e};
  return {26.0 * e, 16.0 * e};
}

}  // namespace loom::kernels
