// Fast fused softmax + cross-entropy (reference with the formulas in elementwise_ref.cpp).
//
// The hottest memory-bound kernel of a step: N*V logits (2048 x 8192 = 64 MiB for the mini model)
// are read once from memory and written once. Per row, three passes over data that by then sits in
// L1/L2 (one row of 8192 floats is 32 KiB):
//   1. max            (so that exp never overflows),
//   2. e = exp(x - max), stored over the logits, and its sum,
//   3. dlogits = e * (grad_scale / sum), then the target entry minus grad_scale.
// exp is evaluated once per logit with the vectorised polynomial detail::fast_exp (~2 ulp). The loss
// itself is log(sum) - (x_target - max), combined in double; it never goes through the rounded
// probability of the target, so it stays accurate when that probability is tiny.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

using detail::fast_exp;

constexpr int64_t kSerialElements = 1 << 15;
// Logits per exp-pass chunk: 1 KiB, 16 cache lines of the next row prefetched per chunk. Timed on the
// 2-core EPYC dev machine (N = 2048, V = 8192, one thread, best of 60): no prefetch 7.8 ms; chunks of
// 64 / 256 / 1024 / 8192 logits 6.8 / 6.5 / 6.6 / 7.7 ms.
constexpr int64_t kPrefetchChunk = 256;

LOOM_TARGET_CLONES
float row_max(const float* __restrict x, int64_t V) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) m = x[v] > m ? x[v] : m;
  return m;
}

LOOM_TARGET_CLONES
float row_exp_sum_inplace(float* __restrict x, int64_t V, float maxv) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) {
    const float e = fast_exp(x[v] - maxv);
    x[v] = e;
    sum += e;
  }
  return sum;
}

LOOM_TARGET_CLONES
float row_exp_sum(const float* __restrict x, int64_t V, float maxv) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) sum += fast_exp(x[v] - maxv);
  return sum;
}

LOOM_TARGET_CLONES
void row_scale(float* __restrict x, int64_t V, float scale) {
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) x[v] *= scale;
}

// -log softmax(x)[target] = log(sum_v exp(x_v - max)) - (x_target - max)
float row_loss(float sum, float maxv, float x_target) {
  return static_cast<float>(std::log(static_cast<double>(sum)) -
                            (static_cast<double>(x_target) - static_cast<double>(maxv)));
}

}  // namespace

void softmax_cross_entropy(float* losses, float* logits_to_dlogits, const int32_t* targets, int64_t N, int64_t V,
                           float grad_scale) {
  detail::parallel_ranges(N, kSerialElements / (V > 0 ? V : 1) + 1, 1, [&](int64_t n0, int64_t n1, int, int) {
    for (int64_t n = n0; n < n1; ++n) {
      float* x = logits_to_dlogits + n * V;
      const int32_t target = targets[n];
      if (target < 0) {  // ignored position: no loss, no gradient
        losses[n] = 0.0f;
        std::memset(x, 0, static_cast<size_t>(V) * sizeof(float));
        continue;
      }
      const float maxv = row_max(x, V);
      const float x_target = x[target];
      // The exp pass is the compute-heavy one: interleave it with prefetches of the next row, so that
      // the next row's max pass finds its data in cache instead of waiting on memory.
      float* next = n + 1 < n1 ? x + V : nullptr;
      float sum = 0.0f;
      for (int64_t v0 = 0; v0 < V; v0 += kPrefetchChunk) {
        const int64_t len = std::min(kPrefetchChunk, V - v0);
        if (next)
          for (int64_t i = 0; i < len; i += 16) __builtin_prefetch(next + v0 + i, 1, 3);
        sum += row_exp_sum_inplace(x + v0, len, maxv);
      }
      losses[n] = row_loss(sum, maxv, x_target);
      row_scale(x, V, grad_scale / sum);
      x[target] -= grad_scale;
    }
  });
}

void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int64_t V) {
  detail::parallel_ranges(N, kSerialElements / (V > 0 ? V : 1) + 1, 1, [&](int64_t n0, int64_t n1, int, int) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* x = logits + n * V;
      const int32_t target = targets[n];
      if (target < 0) {
        losses[n] = 0.0f;
        continue;
      }
      const float maxv = row_max(x, V);
      losses[n] = row_loss(row_exp_sum(x, V, maxv), maxv, x[target]);
    }
  });
}

void vocab_shard_partials(float* partials, float* logits, const int32_t* targets, int64_t N, int64_t V,
                          int64_t vocab_begin, int64_t vocab_size, bool keep_exp) {
  const int64_t valid = std::clamp<int64_t>(vocab_size - vocab_begin, 0, V);
  detail::parallel_ranges(N, kSerialElements / (V > 0 ? V : 1) + 1, 1, [&](int64_t n0, int64_t n1, int, int) {
    for (int64_t n = n0; n < n1; ++n) {
      float* x = logits + n * V;
      float* p = partials + 3 * n;
      const int64_t local = static_cast<int64_t>(targets[n]) - vocab_begin;
      if (targets[n] < 0 || valid == 0) {  // ignored row, or a shard of padding only
        p[0] = -INFINITY, p[1] = 0.0f, p[2] = 0.0f;
        continue;
      }
      const float maxv = row_max(x, valid);
      p[0] = maxv;
      p[2] = local >= 0 && local < valid ? x[local] : 0.0f;
      p[1] = keep_exp ? row_exp_sum_inplace(x, valid, maxv) : row_exp_sum(x, valid, maxv);
    }
  });
}

void vocab_shard_finish(float* losses, float* dlogits, const int32_t* targets, const float* gathered, int ranks,
                        int rank, int64_t N, int64_t V, int64_t vocab_size, float grad_scale) {
  const int64_t begin = rank * V, valid = std::clamp<int64_t>(vocab_size - begin, 0, V);
  detail::parallel_ranges(N, kSerialElements / (V > 0 ? V : 1) + 1, 1, [&](int64_t n0, int64_t n1, int, int) {
    for (int64_t n = n0; n < n1; ++n) {
      float* x = dlogits ? dlogits + n * V : nullptr;
      const int32_t target = targets[n];
      if (target < 0) {
        losses[n] = 0.0f;
        if (x) std::memset(x, 0, static_cast<size_t>(V) * sizeof(float));
        continue;
      }
      // The global max and sum of exp(x - max), rescaling each rank's sum to the global max.
      float maxv = -INFINITY;
      for (int r = 0; r < ranks; ++r) maxv = std::max(maxv, gathered[(r * N + n) * 3]);
      double sum = 0;
      for (int r = 0; r < ranks; ++r) {
        const float* p = gathered + (r * N + n) * 3;
        if (p[1] > 0) sum += static_cast<double>(p[1]) * std::exp(static_cast<double>(p[0]) - maxv);
      }
      const float x_target = gathered[(static_cast<int64_t>(target / V) * N + n) * 3 + 2];
      losses[n] = static_cast<float>(std::log(sum) - (static_cast<double>(x_target) - static_cast<double>(maxv)));
      if (!x) continue;
      const float* mine = gathered + (static_cast<int64_t>(rank) * N + n) * 3;
      if (valid > 0) row_scale(x, valid, static_cast<float>(grad_scale * std::exp(static_cast<double>(mine[0]) - maxv) / sum));
      if (valid < V) std::memset(x + valid, 0, static_cast<size_t>(V - valid) * sizeof(float));
      const int64_t local = target - begin;
      if (local >= 0 && local < valid) x[local] -= grad_scale;
    }
  });
}

KernelCost softmax_cross_entropy_cost(int64_t N, int64_t V) {
  // Per logit: max 1, subtract 1, exp ~15 (polynomial and range reduction as evaluated), sum 1,
  // scale 1 -> 19 flops. Bytes: the logits read once and dlogits written once from/to memory (the
  // later passes over a row hit cache), plus targets read and losses written.
  const double nv = static_cast<double>(N) * static_cast<double>(V);
  const double n = static_cast<double>(N);
  return {19.0 * nv, 8.0 * nv + 8.0 * n};
}

}  // namespace loom::kernels
