// Fast fused AdamW (reference with the formula in elementwise_ref.cpp).
//
// One pass over param, m, v, grad (and the bf16 copy): 16-18 bytes of traffic per parameter, where
// separate scale / moment / update / cast passes would move it several times. Purely element-wise, so
// threads take static contiguous chunks; the bias corrections are scalars computed once per call.
#include <algorithm>
#include <cmath>


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

// Philox-4x32-10 (core/philox.h) for kLanes consecutive counters at once, lanes as arrays so that the
// rounds vectorise (32x32->64-bit multiplies): what Philox::block gives counter `first + l`, word w,
// lands in words[w][l].
constexpr int kLanes = 16;
LOOM_TARGET_CLONES
void philox_lanes(uint64_t seed, uint64_t stream, uint64_t first, uint32_t (&words)[4][kLanes]) {
  uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const uint64_t index = first + static_cast<uint64_t>(l);
    c0[l] = static_cast<uint32_t>(index), c1[l] = static_cast<uint32_t>(index >> 32);
    c2[l] = static_cast<uint32_t>(stream), c3[l] = static_cast<uint32_t>(stream >> 32);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0[l];
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2[l];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = static_cast<uint32_t>(p1), c3[l] = static_cast<uint32_t>(p0);
      c0[l] = n0, c2[l] = n2;
    }
    k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
  }
  for (int l = 0; l < kLanes; ++l) words[0][l] = c0[l], words[1][l] = c1[l], words[2][l] = c2[l], words[3][l] = c3[l];
}

// bf16 state, stochastic rounding: Philox blocks are drawn per 8 global elements and stream, as
// cast_f32_to_bf16_stochastic draws them, so a run cut anywhere rounds each element alike. They are
// drawn 16 blocks (128 elements) at a time per stream, vectorised.
void adamw_bf16_range(bf16* __restrict param, bf16* __restrict m, bf16* __restrict v, const float* __restrict grad,
                      int64_t i0, int64_t i1, const AdamScalars& k, const StochasticRounding* sr) {
  const float one_minus_b1 = 1.0f - k.beta1;
  const float one_minus_b2 = 1.0f - k.beta2;
  auto update = [&](int64_t i, float& p, float& mi, float& vi) {
    const float g = grad[i] * k.grad_scale;
    const float p0 = bf16_to_f32(param[i]);
    mi = k.beta1 * bf16_to_f32(m[i]) + one_minus_b1 * g;
    vi = k.beta2 * bf16_to_f32(v[i]) + one_minus_b2 * g * g;
    p = p0 - k.lr * ((mi / k.bias_correction1) / (std::sqrt(vi / k.bias_correction2) + k.eps) + k.weight_decay * p0);
  };
  if (!sr) {
    for (int64_t i = i0; i < i1; ++i) {
      float p, mi, vi;
      update(i, p, mi, vi);
      param[i] = f32_to_bf16(p), m[i] = f32_to_bf16(mi), v[i] = f32_to_bf16(vi);
    }
    return;
  }
  uint32_t wp[4][kLanes], wm[4][kLanes], wv[4][kLanes];
  for (int64_t i = i0; i < i1;) {
    // One chunk: the elements whose blocks are the 16 from the block of element i on.
    const uint64_t base = static_cast<uint64_t>(sr->first + i) / 8;
    philox_lanes(sr->key, sr->stream, base, wp);
    philox_lanes(sr->key, sr->stream ^ kMomentStream1, base, wm);
    philox_lanes(sr->key, sr->stream ^ kMomentStream2, base, wv);
    const int64_t end = std::min(i1, static_cast<int64_t>((base + kLanes) * 8) - sr->first);
    for (; i < end; ++i) {
      float p, mi, vi;
      update(i, p, mi, vi);
      const auto gi = static_cast<uint64_t>(sr->first + i);
      const auto lane = static_cast<int>(gi / 8 - base);
      const uint32_t slot = static_cast<uint32_t>(gi % 8), word = slot / 2, shift = 16 * (slot % 2);
      param[i] = f32_to_bf16_stochastic(p, wp[word][lane] >> shift);
      m[i] = f32_to_bf16_stochastic(mi, wm[word][lane] >> shift);
      // v >= 0 always: rounding up from the largest finite value is the only way to reach infinity.
      v[i] = f32_to_bf16_stochastic(vi, wv[word][lane] >> shift);
    }
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
