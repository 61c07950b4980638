// Fast LayerNorm and RMSNorm (the references are in elementwise_ref.cpp, with the math).
//
// Each row is independent, so threads take static contiguous blocks of rows; a row (C = 384 .. 4096
// floats) stays in L1 between the statistics pass and the output pass. The parameter gradients
// dweight/dbias are sums over all rows: each thread accumulates its rows into a private partial
// buffer, then the partials are added in thread order, column by column. No atomics, so the result
// depends only on the inputs and the thread count.
#include <cmath>
#include <vector>

#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

using detail::parallel_ranges;

// Rows in total below which one thread does all the work of a norm (fork/join costs a few us).
constexpr int64_t kSerialElements = 1 << 14;

int64_t serial_rows(int64_t C) { return kSerialElements / (C > 0 ? C : 1) + 1; }

// Floats per thread in a partial-gradient buffer, rounded to a cache line so that threads never
// write the same line.
int64_t padded(int64_t count) { return (count + 15) / 16 * 16; }

// dst[c] += sum over threads of partials[t * stride + c], threads in order (the deterministic part).
void combine_partials(float* __restrict dst, const float* __restrict partials, int nth, int64_t stride,
                      int64_t begin, int64_t end) {
  for (int64_t c = begin; c < end; ++c) {
    float s = 0.0f;
    for (int t = 0; t < nth; ++t) s += partials[t * stride + c];
    dst[c] += s;
  }
}

LOOM_TARGET_CLONES
void layernorm_forward_rows(float* __restrict out, float* __restrict mean, float* __restrict rstd,
                            const float* __restrict inp, const float* __restrict weight,
                            const float* __restrict bias, int64_t n0, int64_t n1, int64_t C, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict x = inp + n * C;
    float* __restrict y = out + n * C;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < C; ++c) sum += x[c];
    const float m = sum * inv_c;
    // Two passes (mean first, then squared deviations) rather than E[x^2] - mean^2, which cancels
    // badly when |mean| >> std, as happens on the residual stream.
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int64_t c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    const float s = 1.0f / std::sqrt(var * inv_c + eps);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

LOOM_TARGET_CLONES
void layernorm_backward_rows(float* __restrict dinp, float* __restrict dweight_part, float* __restrict dbias_part,
                             const float* __restrict dout, const float* __restrict inp,
                             const float* __restrict weight, const float* __restrict mean,
                             const float* __restrict rstd, int64_t n0, int64_t n1, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict x = inp + n * C;
    const float* __restrict dy = dout + n * C;
    float* __restrict dx = dinp + n * C;
    const float m = mean[n];
    const float s = rstd[n];
    float dnorm_sum = 0.0f;
    float dnorm_norm_sum = 0.0f;
#pragma omp simd reduction(+ : dnorm_sum, dnorm_norm_sum)
    for (int64_t c = 0; c < C; ++c) {
      const float dnorm = weight[c] * dy[c];
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * ((x[c] - m) * s);
    }
    const float dnorm_mean = dnorm_sum * inv_c;
    const float dnorm_norm_mean = dnorm_norm_sum * inv_c;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      dbias_part[c] += dy[c];
      dweight_part[c] += norm * dy[c];
      dx[c] += (weight[c] * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

LOOM_TARGET_CLONES
void rmsnorm_forward_rows(float* __restrict out, float* __restrict rstd, const float* __restrict inp,
                          const float* __restrict weight, int64_t n0, int64_t n1, int64_t C, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict x = inp + n * C;
    float* __restrict y = out + n * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
    const float s = 1.0f / std::sqrt(ss * inv_c + eps);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * s * weight[c];
    rstd[n] = s;
  }
}

LOOM_TARGET_CLONES
void rmsnorm_backward_rows(float* __restrict dinp, float* __restrict dweight_part, const float* __restrict dout,
                           const float* __restrict inp, const float* __restrict weight, const float* __restrict rstd,
                           int64_t n0, int64_t n1, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict x = inp + n * C;
    const float* __restrict dy = dout + n * C;
    float* __restrict dx = dinp + n * C;
    const float s = rstd[n];
    float dnorm_norm_sum = 0.0f;
#pragma omp simd reduction(+ : dnorm_norm_sum)
    for (int64_t c = 0; c < C; ++c) dnorm_norm_sum += weight[c] * dy[c] * x[c];
    // sum(dnorm * x) * s / C == mean(dnorm * norm): one multiply per row instead of per element.
    const float dnorm_norm_mean = dnorm_norm_sum * s * inv_c;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const float norm = x[c] * s;
      dweight_part[c] += norm * dy[c];
      dx[c] += (weight[c] * dy[c] - norm * dnorm_norm_mean) * s;
    }
  }
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps) {
  parallel_ranges(N, serial_rows(C), 1, [&](int64_t n0, int64_t n1, int, int) {
    layernorm_forward_rows(out, mean, rstd, inp, weight, bias, n0, n1, C, eps);
  });
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  // Per thread: [dweight partial | dbias partial], each padded to a cache line.
  const int64_t stride = 2 * padded(C);
  std::vector<float> partials(static_cast<size_t>(omp_get_max_threads() * stride), 0.0f);
  float* part = partials.data();
#pragma omp parallel if (N >= serial_rows(C))
  {
    const int tid = omp_get_thread_num();
    const int nth = omp_get_num_threads();
    const detail::Range rows = detail::thread_range(N, tid, nth);
    float* mine = part + tid * stride;
    if (rows.begin < rows.end)
      layernorm_backward_rows(dinp, mine, mine + padded(C), dout, inp, weight, mean, rstd, rows.begin, rows.end, C);
#pragma omp barrier
    const detail::Range cols = detail::thread_range(C, tid, nth, 16);
    combine_partials(dweight, part, nth, stride, cols.begin, cols.end);
    combine_partials(dbias, part + padded(C), nth, stride, cols.begin, cols.end);
  }
}

KernelCost layernorm_cost(int64_t N, int64_t C, bool backward) {
  const double nc = static_cast<double>(N) * static_cast<double>(C);
  const double n = static_cast<double>(N);
  const double c = static_cast<double>(C);
  if (!backward) {
    // per element: mean add; deviation, square, add; (x-m)*s*w+b = 4  -> 8 flops.
    // bytes: read x, write out; weight and bias once; write mean and rstd per row.
    return {8.0 * nc, 4.0 * (2.0 * nc + 2.0 * c + 2.0 * n)};
  }
  // per element: norm 2, dnorm 1, two row sums 3, dbias 1, dweight 2, dinp 5  -> 14 flops.
  // bytes: read dout, x, dinp and write dinp; weight read, dweight and dbias read+written once
  // (the per-thread partials stay in cache); mean and rstd read per row.
  return {14.0 * nc, 4.0 * (4.0 * nc + 5.0 * c + 2.0 * n)};
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
  parallel_ranges(N, serial_rows(C), 1,
                  [&](int64_t n0, int64_t n1, int, int) { rmsnorm_forward_rows(out, rstd, inp, weight, n0, n1, C, eps); });
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const int64_t stride = padded(C);
  std::vector<float> partials(static_cast<size_t>(omp_get_max_threads() * stride), 0.0f);
  float* part = partials.data();
#pragma omp parallel if (N >= serial_rows(C))
  {
    const int tid = omp_get_thread_num();
    const int nth = omp_get_num_threads();
    const detail::Range rows = detail::thread_range(N, tid, nth);
    if (rows.begin < rows.end)
      rmsnorm_backward_rows(dinp, part + tid * stride, dout, inp, weight, rstd, rows.begin, rows.end, C);
#pragma omp barrier
    const detail::Range cols = detail::thread_range(C, tid, nth, 16);
    combine_partials(dweight, part, nth, stride, cols.begin, cols.end);
  }
}

KernelCost rmsnorm_cost(int64_t N, int64_t C, bool backward) {
  const double nc = static_cast<double>(N) * static_cast<double>(C);
  const double n = static_cast<double>(N);
  const double c = static_cast<double>(C);
  if (!backward) {
    // per element: square + add, x*s*w  -> 4 flops. bytes: read x, write out, weight once, rstd per row.
    return {4.0 * nc, 4.0 * (2.0 * nc + c + n)};
  }
  // per element: row sum 3, norm 1, dweight 2, dinp 4  -> 10 flops.
  // bytes: read dout, x, dinp, write dinp; weight read and dweight read+written once; rstd per row.
  return {10.0 * nc, 4.0 * (4.0 * nc + 3.0 * c + n)};
}

}  // namespace loom::kernels
