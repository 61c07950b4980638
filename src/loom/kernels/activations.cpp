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
#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

using detail::fast_exp;
using detail::fast_sigmoid;

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
// Elements below which one thread does everything (the fork/join would cost more than the work).
constexpr int64_t kSerialElements = 1 << 14;

LOOM_TARGET_CLONES
void gelu_forward_range(float* __restrict out, const float* __restrict inp, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    out[i] = x * fast_sigmoid(2.0f * u);
  }
}

LOOM_TARGET_CLONES
void gelu_backward_range(float* __restrict dinp, const float* __restrict inp, const float* __restrict dout,
                         int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    const float e = fast_exp(-2.0f * u);
    const float s = 1.0f / (1.0f + e);  // 0.5 (1 + tanh u)
    const float du_dx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    // 0.5 x (1 - tanh^2 u) du/dx = 2 x s (1 - s) du/dx, with 1 - s = e * s
    dinp[i] = (s + 2.0f * x * s * (e * s) * du_dx) * dout[i];
  }
}

LOOM_TARGET_CLONES
void swiglu_forward_rows(float* __restrict out, const float* __restrict gu, int64_t n0, int64_t n1, int64_t F) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict g = gu + n * 2 * F;
    const float* __restrict u = g + F;
    float* __restrict y = out + n * F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) y[f] = g[f] * fast_sigmoid(g[f]) * u[f];
  }
}

LOOM_TARGET_CLONES
void swiglu_backward_rows(float* __restrict dgu, const float* __restrict gu, const float* __restrict dout, int64_t n0,
                          int64_t n1, int64_t F) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict g = gu + n * 2 * F;
    const float* __restrict u = g + F;
    const float* __restrict dy = dout + n * F;
    float* __restrict dg = dgu + n * 2 * F;
    float* __restrict du = dg + F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const float e = fast_exp(-g[f]);
      const float sig = 1.0f / (1.0f + e);
      // d silu / dg = sig (1 + g (1 - sig)), with 1 - sig = e * sig
      dg[f] = dy[f] * u[f] * sig * (1.0f + g[f] * (e * sig));
      du[f] = dy[f] * g[f] * sig;
    }
  }
}

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
  detail::parallel_ranges(n, kSerialElements, 16,
                          [&](int64_t i0, int64_t i1, int, int) { gelu_forward_range(out, inp, i0, i1); });
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  detail::parallel_ranges(n, kSerialElements, 16,
                          [&](int64_t i0, int64_t i1, int, int) { gelu_backward_range(dinp, inp, dout, i0, i1); });
}

KernelCost gelu_cost(int64_t n, bool backward) {
  const double e = static_cast<double>(n);
  // Forward: cubic and scale 5, sigmoid (exp ~ 15 flops as evaluated, add, divide) 17, product 1.
  // Backward: the same u and exp, derivative terms ~10 more, times dout.
  // Bytes: forward reads inp and writes out; backward reads inp and dout and writes dinp.
  if (!backward) return {23.0 * e, 8.0 * e};
  return {33.0 * e, 12.0 * e};
}

void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F) {
  detail::parallel_ranges(N, kSerialElements / (F > 0 ? F : 1) + 1, 1,
                          [&](int64_t n0, int64_t n1, int, int) { swiglu_forward_rows(out, gu, n0, n1, F); });
}

void swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t F) {
  detail::parallel_ranges(N, kSerialElements / (F > 0 ? F : 1) + 1, 1,
                          [&](int64_t n0, int64_t n1, int, int) { swiglu_backward_rows(dgu, gu, dout, n0, n1, F); });
}

KernelCost swiglu_cost(int64_t N, int64_t F, bool backward) {
  const double e = static_cast<double>(N) * static_cast<double>(F);
  // Forward: exp ~15, sigmoid add+divide 2, two products 2; reads gate and up, writes out.
  // Backward: exp and sigmoid 17, the two derivatives ~9; reads gate, up, dout, writes dgate, dup.
  if (!backward) return {19.0 * e, 12.0 * e};
  return {26.0 * e, 20.0 * e};
}

}  // namespace loom::kernels
