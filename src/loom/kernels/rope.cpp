// Fast rotary position embedding, Hugging Face Llama convention (rotate_half: element i of a head
// pairs with element i + D/2). The reference with the formulas is in elementwise_ref.cpp.
//
// Rows (b, t) are independent; threads take static blocks of rows. Within a head the two halves and
// the cos/sin row are contiguous, so the loop over pairs vectorises directly. v heads are skipped:
// RoPE only rotates what enters the q.k dot product.
#include <cmath>

#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

constexpr int64_t kSerialElements = 1 << 14;

// direction +1 rotates by +angle (forward), -1 by -angle (backward: the transpose of a rotation).
LOOM_TARGET_CLONES
void rope_rows(float* __restrict qkv, const float* __restrict cos, const float* __restrict sin, int64_t r0, int64_t r1,
               int64_t T, int64_t H, int64_t KVH, int64_t D, float direction) {
  const int64_t row = (H + 2 * KVH) * D;
  const int64_t half = D / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r % T;
    const float* __restrict c = cos + t * half;
    const float* __restrict s = sin + t * half;
    for (int64_t h = 0; h < H + KVH; ++h) {
      float* __restrict x1 = qkv + r * row + h * D;
      float* __restrict x2 = x1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i];
        const float b = x2[i];
        const float si = direction * s[i];
        x1[i] = a * c[i] - b * si;
        x2[i] = b * c[i] + a * si;
      }
    }
  }
}

void rope_apply(float* qkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                int64_t D, float direction) {
  const int64_t per_row = (H + KVH) * D;
  detail::parallel_ranges(B * T, kSerialElements / (per_row > 0 ? per_row : 1) + 1, 1,
                          [&](int64_t r0, int64_t r1, int, int) {
                            rope_rows(qkv, cos, sin, r0, r1, T, H, KVH, D, direction);
                          });
}

}  // namespace

// The angles are computed in double and rounded once: at t ~ 2000 a float product t * inv_freq is
// already off by ~1e-4 rad. (Hugging Face computes them in float32, so parity tests against it see
// differences of that order at long positions.)
void rope_tables(float* cos, float* sin, int64_t T, int64_t D, float theta) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(D));
    for (int64_t t = 0; t < T; ++t) {
      const double angle = static_cast<double>(t) * inv_freq;
      cos[t * half + i] = static_cast<float>(std::cos(angle));
      sin[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

void rope_forward(float* qkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                  int64_t D) {
  rope_apply(qkv, cos, sin, B, T, H, KVH, D, 1.0f);
}

void rope_backward(float* dqkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                   int64_t D) {
  rope_apply(dqkv, cos, sin, B, T, H, KVH, D, -1.0f);
}

KernelCost rope_cost(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  // Each pair: 4 multiplies and 2 adds (the sign flip is free). q and k are read and written in place;
  // the cos/sin rows are read once per position (they are reused across heads and batch from cache).
  const double pairs = static_cast<double>(B * T * (H + KVH)) * static_cast<double>(D / 2);
  const double table = 2.0 * static_cast<double>(T) * static_cast<double>(D / 2);
  return {6.0 * pairs, 4.0 * (4.0 * pairs + table)};
}

}  // namespace loom::kernels
