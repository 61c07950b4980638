// The plain fp32 reference of causal self-attention (multi-head and grouped-query): one row of scores
// at a time, the math of the notation at the top of attention.cpp written out. Tests check the fast
// kernels against it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loom/kernels/attention.h"
#include "loom/kernels/detail/attention_tiles.h"

namespace loom::kernels {

using attention_detail::validate;

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
