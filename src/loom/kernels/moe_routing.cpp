#include "loom/kernels/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace loom::kernels {

using spec::RouterScore;

void moe_route_forward(float* scores, int32_t* expert, float* weight, const float* bias, int64_t N, int64_t E,
                       int64_t k, RouterScore score, bool normalize) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* s = scores + t * E;
    if (score == RouterScore::Softmax) {
      float mx = s[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, s[e]);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(s[e] - mx));
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t e = 0; e < E; ++e) s[e] *= inv;
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-s[e]));
    }
    // k passes of an arg-max over the experts not yet taken: k and E are small, and the order (largest
    // first, ties to the lower index) is the same on every rank and thread count.
    int32_t* ex = expert + t * k;
    float* w = weight + t * k;
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      float best_v = 0;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= ex[i] == e;
        if (taken) continue;
        const float v = s[e] + (bias ? bias[e] : 0.0f);
        if (best < 0 || v > best_v) best = e, best_v = v;
      }
      ex[j] = static_cast<int32_t>(best);
      w[j] = s[best];
      chosen += s[best];
    }
    if (normalize) {
      const float inv = static_cast<float>(1.0 / chosen);
      for (int64_t j = 0; j < k; ++j) w[j] *= inv;
    }
  }
}

MoeAssignment moe_assign_rows(int32_t* row, int32_t* token_of_row, const int32_t* expert, int64_t N, int64_t E,
                              int64_t k, int64_t capacity) {
  MoeAssignment a;
  a.routed.assign(static_cast<size_t>(E), 0);
  std::vector<int64_t> kept(static_cast<size_t>(E), 0);
  // Slot by slot, token by token: which pairs fit (row = 0 marks kept for now).
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < N; ++t) {
      const auto e = static_cast<size_t>(expert[t * k + j]);
      ++a.routed[e];
      const bool fits = kept[e] < capacity;
      kept[e] += fits;
      a.dropped += !fits;
      row[t * k + j] = fits ? 0 : -1;
    }
  a.offsets.assign(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) a.offsets[static_cast<size_t>(e) + 1] = a.offsets[static_cast<size_t>(e)] + kept[static_cast<size_t>(e)];
  // Rows in token order within each expert.
  std::vector<int64_t> next(a.offsets.begin(), a.offsets.end() - 1);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t& r = row[t * k + j];
      if (r < 0) continue;
      const int64_t at = next[static_cast<size_t>(expert[t * k + j])]++;
      r = static_cast<int32_t>(at);
      token_of_row[at] = static_cast<int32_t>(t);
    }
  return a;
}

void moe_gather_rows(void* dst, const void* src, const int32_t* token_of_row, int64_t M, int64_t bytes_per_row) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const auto n = static_cast<size_t>(bytes_per_row);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < M; ++r) std::memcpy(d + r * bytes_per_row, s + token_of_row[r] * bytes_per_row, n);
}

void moe_combine_forward(float* out, const float* y, const int32_t* row, const float* weight, int64_t N, int64_t k,
                         int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* o = out + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row[t * k + j];
      if (r < 0) continue;
      const float w = weight[t * k + j];
      const float* yr = y + static_cast<int64_t>(r) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += w * yr[c];
    }
  }
}

void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const int32_t* row,
                          const float* weight, int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* g = dout + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row[t * k + j];
      if (r < 0) {
        dweight[t * k + j] = 0.0f;
        continue;
      }
      const float w = weight[t * k + j];
      const float* yr = y + static_cast<int64_t>(r) * C;
      float* d = dy + static_cast<int64_t>(r) * C;
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        d[c] = w * g[c];
        dot += static_cast<double>(g[c]) * yr[c];
      }
      dweight[t * k + j] = static_cast<float>(dot);
    }
  }
}

void moe_scatter_add_rows(float* dx, const float* dx_rows, const int32_t* row, int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* d = dx + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row[t * k + j];
      if (r < 0) continue;
      const float* s = dx_rows + static_cast<int64_t>(r) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) d[c] += s[c];
    }
  }
}

namespace {
// The probability the load-balancing loss reads: the softmax score, or the sigmoid score over the
// token's sum of them.
double score_sum(const float* s, int64_t E, RouterScore score) {
  if (score == RouterScore::Softmax) return 1.0;
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += s[e];
  return sum;
}
}  // namespace

double moe_aux_loss(const float* scores, const std::vector<int64_t>& routed, int64_t N, int64_t E, int64_t k,
                    RouterScore score) {
  std::vector<double> P(static_cast<size_t>(E), 0.0);
  for (int64_t t = 0; t < N; ++t) {
    const float* s = scores + t * E;
    const double inv = 1.0 / score_sum(s, E, score);
    for (int64_t e = 0; e < E; ++e) P[static_cast<size_t>(e)] += s[e] * inv;
  }
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) loss += static_cast<double>(routed[static_cast<size_t>(e)]) * P[static_cast<size_t>(e)];
  return loss * static_cast<double>(E) / (static_cast<double>(N) * static_cast<double>(N) * static_cast<double>(k));
}

void moe_route_backward(float* dlogits, const float* dweight, const float* scores, const int32_t* expert,
                        const float* weight, const std::vector<int64_t>& routed, double aux_scale, int64_t N, int64_t E,
                        int64_t k, RouterScore score, bool normalize) {
  // d(aux)/d(p[t, e]) = E routed_e / (N^2 k), the same for every token.
  std::vector<double> aux(static_cast<size_t>(E), 0.0);
  if (aux_scale != 0)
    for (int64_t e = 0; e < E; ++e)
      aux[static_cast<size_t>(e)] = aux_scale * static_cast<double>(E) * static_cast<double>(routed[static_cast<size_t>(e)]) /
                                    (static_cast<double>(N) * static_cast<double>(N) * static_cast<double>(k));
#pragma omp parallel
  {
  std::vector<double> ds(static_cast<size_t>(E));
#pragma omp for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* s = scores + t * E;
    const int32_t* ex = expert + t * k;
    const float* w = weight + t * k;
    const float* dw = dweight + t * k;
    std::fill(ds.begin(), ds.end(), 0.0);
    // weight = g / sum(g) (normalize) or g, g the chosen scores.
    double chosen = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) chosen += s[ex[j]], dot += static_cast<double>(dw[j]) * w[j];
    for (int64_t j = 0; j < k; ++j)
      ds[static_cast<size_t>(ex[j])] += normalize ? (dw[j] - dot) / chosen : static_cast<double>(dw[j]);
    if (aux_scale != 0) {
      // p = s (softmax) or s / sum(s) (sigmoid).
      const double sum = score_sum(s, E, score);
      double ap = 0;
      if (score == RouterScore::Sigmoid)
        for (int64_t e = 0; e < E; ++e) ap += aux[static_cast<size_t>(e)] * s[e] / sum;
      for (int64_t e = 0; e < E; ++e) ds[static_cast<size_t>(e)] += (aux[static_cast<size_t>(e)] - ap) / sum;
    }
    float* dl = dlogits + t * E;
    if (score == RouterScore::Softmax) {
      double inner = 0;
      for (int64_t e = 0; e < E; ++e) inner += ds[static_cast<size_t>(e)] * s[e];
      for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(s[e] * (ds[static_cast<size_t>(e)] - inner));
    } else {
      for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(ds[static_cast<size_t>(e)] * s[e] * (1.0 - s[e]));
    }
  }
  }
}

double moe_route_bytes(int64_t N, int64_t E, int64_t k) {
  return 4.0 * static_cast<double>(2 * N * E + 4 * N * k);
}

double moe_gather_bytes(int64_t M, int64_t bytes_per_row) { return 2.0 * static_cast<double>(M * bytes_per_row); }

double moe_combine_bytes(int64_t N, int64_t M, int64_t C, int64_t k) {
  return 4.0 * static_cast<double>(M * C + 2 * N * C + 2 * N * k);
}

double moe_combine_backward_bytes(int64_t N, int64_t M, int64_t C, int64_t k) {
  return 4.0 * static_cast<double>(N * C + 2 * M * C + 3 * N * k);
}

double moe_route_backward_bytes(int64_t N, int64_t M, int64_t C, int64_t E, int64_t k) {
  return 4.0 * static_cast<double>(M * C + 2 * N * C + 2 * N * E + 3 * N * k);
}

}  // namespace loom::kernels
