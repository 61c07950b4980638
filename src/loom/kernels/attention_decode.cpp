#include "loom/kernels/attention_decode.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/error.h"

namespace loom::kernels {

// One (row, head) at a time: scores over the visible keys, a max-subtracted softmax, then the
// weighted sum of values. Decoding handles one row per token, so the O(T) work per head is small;
// parallelism comes from the heads.
void attention_decode(float* out, const float* q, const float* k_cache, const float* v_cache, const DecodeShape& s) {
  if (s.n <= 0 || s.start < 0 || s.H <= 0 || s.KVH <= 0 || s.D <= 0 || s.H % s.KVH != 0 || !(s.scale > 0))
    throw ShapeError("attention_decode: invalid shape (n, start, H, KVH, D, scale)");
  const int64_t group = s.H / s.KVH, qw = s.H * s.D, kw = s.KVH * s.D;
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(s.start + s.n));
#pragma omp for collapse(2) schedule(static)
    for (int64_t i = 0; i < s.n; ++i)
      for (int64_t h = 0; h < s.H; ++h) {
        const int64_t visible = s.start + i + 1;
        const float* qi = q + i * qw + h * s.D;
        const int64_t kvh = h / group;
        float mx = -INFINITY;
        for (int64_t t = 0; t < visible; ++t) {
          const float* kt = k_cache + t * kw + kvh * s.D;
          float dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < s.D; ++d) dot += qi[d] * kt[d];
          p[t] = dot * s.scale;
          mx = std::max(mx, p[t]);
        }
        float sum = 0;
        for (int64_t t = 0; t < visible; ++t) sum += (p[t] = std::exp(p[t] - mx));
        float* o = out + i * qw + h * s.D;
        std::fill(o, o + s.D, 0.0f);
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < visible; ++t) {
          const float* vt = v_cache + t * kw + kvh * s.D;
          const float w = p[t] * inv;
#pragma omp simd
          for (int64_t d = 0; d < s.D; ++d) o[d] += w * vt[d];
        }
      }
  }
}

KernelCost attention_decode_cost(const DecodeShape& s) {
  double pairs = static_cast<double>(s.n) * static_cast<double>(s.start) + 0.5 * s.n * (s.n + 1);
  return {4.0 * pairs * s.H * s.D, 4.0 * (2.0 * (s.start + s.n) * s.KVH * s.D + 2.0 * s.n * s.H * s.D)};
}

}  // namespace loom::kernels
