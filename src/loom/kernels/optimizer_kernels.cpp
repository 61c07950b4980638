// Fast fused AdamW (reference with the formula in elementwise_ref.cpp).
//
// One pass over param, m, v, grad (and the bf16 copy): 16-18 bytes of traffic per parameter, where
// separate scale / moment / update / cast passes would move it several times. Purely element-wise, so
// threads take static contiguous chunks; the bias corrections are scalars computed once per call.
#include <array>
#include <cmath>

#include "loom/core/philox.h"

#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

constexpr int64_t kSerialElements = 1 << 14;

struct AdamScalars {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;
};

// The bf16 copy is written by a separate instantiation so that the common loop stays branch-free.
template <bool kWithBf16>
inline void adamw_loop(float* __restrict param, float* __restrict m, float* __restrict v, bf16* __restrict out16,
                       const float* __restrict grad, int64_t i0, int64_t i1, const AdamScalars& k) {
  const float one_minus_b1 = 1.0f - k.beta1;
  const float one_minus_b2 = 1.0f - k.beta2;
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) {
    const float g = grad[i] * k.grad_scale;
    const float mi = k.beta1 * m[i] + one_minus_b1 * g;
    const float vi = k.beta2 * v[i] + one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float m_hat = mi / k.bias_correction1;
    const float v_hat = vi / k.bias_correction2;
    const float p = param[i] - k.lr * (m_hat / (std::sqrt(v_hat) + k.eps) + k.weight_decay * param[i]);
    param[i] = p;
    if constexpr (kWithBf16) out16[i].bits = detail::f32_to_bf16_bits(p);
  }
}

LOOM_TARGET_CLONES
void adamw_range(float* __restrict param, float* __restrict m, float* __restrict v, bf16* __restrict out16,
                 const float* __restrict grad, int64_t i0, int64_t i1, const AdamScalars& k) {
  if (out16)
    adamw_loop<true>(param, m, v, out16, grad, i0, i1, k);
  else
    adamw_loop<false>(param, m, v, out16, grad, i0, i1, k);
}

// bf16 state, stochastic rounding: Philox blocks are drawn per 8 global elements and stream, as
// cast_f32_to_bf16_stochastic draws them, so a run cut anywhere rounds each element alike.
void adamw_bf16_range(bf16* __restrict param, bf16* __restrict m, bf16* __restrict v, const float* __restrict grad,
                      int64_t i0, int64_t i1, const AdamScalars& k, const StochasticRounding* sr) {
  const float one_minus_b1 = 1.0f - k.beta1;
  const float one_minus_b2 = 1.0f - k.beta2;
  std::array<uint32_t, 4> bp{}, bm{}, bv{};
  for (int64_t i = i0; i < i1; ++i) {
    const float g = grad[i] * k.grad_scale;
    const float p0 = bf16_to_f32(param[i]);
    const float mi = k.beta1 * bf16_to_f32(m[i]) + one_minus_b1 * g;
    const float vi = k.beta2 * bf16_to_f32(v[i]) + one_minus_b2 * g * g;
    const float p = p0 - k.lr * ((mi / k.bias_correction1) / (std::sqrt(vi / k.bias_correction2) + k.eps) + k.weight_decay * p0);
    if (!sr) {
      param[i] = f32_to_bf16(p), m[i] = f32_to_bf16(mi), v[i] = f32_to_bf16(vi);
      continue;
    }
    const auto gi = static_cast<uint64_t>(sr->first + i);
    if (i == i0 || gi % 8 == 0) {
      bp = Philox::block(sr->key, sr->stream, gi / 8);
      bm = Philox::block(sr->key, sr->stream ^ kMomentStream1, gi / 8);
      bv = Philox::block(sr->key, sr->stream ^ kMomentStream2, gi / 8);
    }
    const uint32_t lane = static_cast<uint32_t>(gi % 8), word = lane / 2, shift = 16 * (lane % 2);
    param[i] = f32_to_bf16_stochastic(p, bp[word] >> shift);
    m[i] = f32_to_bf16_stochastic(mi, bm[word] >> shift);
    // v >= 0 always: rounding up from the largest finite value is the only way to reach infinity.
    v[i] = f32_to_bf16_stochastic(vi, bv[word] >> shift);
  }
}

AdamScalars adam_scalars(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
                         float grad_scale) {
  // beta^step in double: for beta2 = 0.999 the correction is 1 - (a number close to 1) early on.
  return {lr, beta1, beta2, eps, weight_decay, grad_scale,
          static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), step)),
          static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), step))};
}

}  // namespace

void adamw_update_bf16(bf16* param, bf16* m, bf16* v, const float* grad, int64_t n, float lr, float beta1, float beta2,
                       float eps, float weight_decay, int64_t step, float grad_scale, const StochasticRounding* sr) {
  const AdamScalars k = adam_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  detail::parallel_ranges(n, kSerialElements, 32,
                          [&](int64_t i0, int64_t i1, int, int) { adamw_bf16_range(param, m, v, grad, i0, i1, k, sr); });
}

KernelCost adamw_bf16_cost(int64_t n) {
  const double e = static_cast<double>(n);
  return {17.0 * e, 16.0 * e};
}

void adamw_update(float* param, float* m, float* v, bf16* param_bf16, const float* grad, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t step, float grad_scale) {
  const AdamScalars k = adam_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  detail::parallel_ranges(n, kSerialElements, 16,
                          [&](int64_t i0, int64_t i1, int, int) { adamw_range(param, m, v, param_bf16, grad, i0, i1, k); });
}

KernelCost adamw_cost(int64_t n) {
  // Per parameter: scale 1, m 3, v 4, two bias divisions 2, sqrt + add + divide 3, decay 2, update 2
  // -> 17 flops. Bytes: read param, m, v, grad and write param, m, v (28), plus the bf16 copy (2),
  // counted since the training step uses it.
  const double e = static_cast<double>(n);
  return {17.0 * e, 30.0 * e};
}

}  // namespace loom::kernels
