// Shared by the element-wise kernel tests (elementwise_*_test.cpp): the fixture with its logged random
// seed, closeness and finite-difference helpers, and float64 implementations of every kernel written
// from the math (not from the code under test). Rerun a failure with LOOM_TEST_SEED=<seed>.
#pragma once

#include <gtest/gtest.h>

#include "../test_support.h"
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "loom/core/bf16.h"
#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels::elementwise_test {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

inline uint32_t run_seed() { return static_cast<uint32_t>(loom::test::fresh_seed()); }

using Threads = loom::test::ScopedThreads;

class ElementwiseTest : public ::testing::Test {
 protected:
  ElementwiseTest()
      : rng_(run_seed()),
        trace_(__FILE__, __LINE__, "seed " + std::to_string(run_seed()) + " (rerun with LOOM_TEST_SEED)") {}

  Vec normal(size_t n, float mean = 0.0f, float stddev = 1.0f) {
    std::normal_distribution<float> d(mean, stddev);
    Vec v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }
  std::vector<int32_t> tokens(size_t n, int32_t vocab) {
    std::uniform_int_distribution<int32_t> d(0, vocab - 1);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = d(rng_);
    return t;
  }

  std::mt19937 rng_;
  ::testing::ScopedTrace trace_;
};

inline DVec to_double(const Vec& v) { return DVec(v.begin(), v.end()); }

// |got - want| <= rtol * (|want| + rms(want)) everywhere: relative where values are large, relative to
// the tensor's typical size near zero, where cancellation in float is expected.
inline ::testing::AssertionResult close_to(const Vec& got, const DVec& want, double rtol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  double ss = 0.0;
  for (double w : want) ss += w * w;
  const double rms = want.empty() ? 0.0 : std::sqrt(ss / static_cast<double>(want.size()));
  size_t bad = 0, first = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double tol = rtol * (std::fabs(want[i]) + rms);
    if (!(err <= tol)) {
      if (bad++ == 0) first = i;
    }
    if (tol > 0) worst = std::max(worst, err / tol);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements off; first [" << first
                                       << "] got " << got[first] << " want " << want[first]
                                       << "; worst error / tolerance " << worst;
}

inline bool bitwise_equal(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Central differences of a float64 scalar function at the given coordinates.
inline DVec finite_differences(const std::function<double(const DVec&)>& f, DVec x, const std::vector<size_t>& at) {
  DVec g(at.size());
  for (size_t k = 0; k < at.size(); ++k) {
    const size_t i = at[k];
    const double x0 = x[i];
    const double h = 1e-5 * std::max(1.0, std::fabs(x0));
    x[i] = x0 + h;
    const double up = f(x);
    x[i] = x0 - h;
    const double down = f(x);
    x[i] = x0;
    g[k] = (up - down) / (2.0 * h);
  }
  return g;
}

inline std::vector<size_t> all_indices(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

inline Vec pick(const Vec& v, const std::vector<size_t>& at) {
  Vec out;
  for (size_t i : at) out.push_back(v[i]);
  return out;
}

inline double dot(const DVec& a, const DVec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline const char* impl_name(bool fast) { return fast ? "fast" : "ref"; }

// ============================ float64 implementations from the math ============================

struct NormOut {
  DVec out, mean, rstd;
};

inline NormOut naive_layernorm(const DVec& x, const DVec& w, const DVec& b, int64_t N, int64_t C, double eps) {
  NormOut r{DVec(x.size()), DVec(N), DVec(N)};
  for (int64_t n = 0; n < N; ++n) {
    double m = 0.0, var = 0.0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int64_t c = 0; c < C; ++c) var += (x[n * C + c] - m) * (x[n * C + c] - m);
    var /= C;  // biased, as GPT-2 / PyTorch LayerNorm
    const double s = 1.0 / std::sqrt(var + eps);
    for (int64_t c = 0; c < C; ++c) r.out[n * C + c] = (x[n * C + c] - m) * s * w[c] + b[c];
    r.mean[n] = m;
    r.rstd[n] = s;
  }
  return r;
}

// Analytic gradients of sum(out * dout) for layernorm, written out from the chain rule.
inline void naive_layernorm_backward(DVec& dx, DVec& dw, DVec& db, const DVec& dy, const DVec& x, const DVec& w, int64_t N,
                              int64_t C, double eps) {
  NormOut f = naive_layernorm(x, w, DVec(C, 0.0), N, C, eps);
  for (int64_t n = 0; n < N; ++n) {
    double a = 0.0, b = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (x[n * C + c] - f.mean[n]) * f.rstd[n];
      a += w[c] * dy[n * C + c];
      b += w[c] * dy[n * C + c] * xhat;
    }
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (x[n * C + c] - f.mean[n]) * f.rstd[n];
      dx[n * C + c] += f.rstd[n] * (w[c] * dy[n * C + c] - a / C - xhat * b / C);
      dw[c] += xhat * dy[n * C + c];
      db[c] += dy[n * C + c];
    }
  }
}

inline NormOut naive_rmsnorm(const DVec& x, const DVec& w, int64_t N, int64_t C, double eps) {
  NormOut r{DVec(x.size()), DVec(N), DVec(N)};
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0.0;
    for (int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c];
    const double s = 1.0 / std::sqrt(ms / C + eps);
    for (int64_t c = 0; c < C; ++c) r.out[n * C + c] = x[n * C + c] * s * w[c];
    r.rstd[n] = s;
  }
  return r;
}

inline void naive_rmsnorm_backward(DVec& dx, DVec& dw, const DVec& dy, const DVec& x, const DVec& w, int64_t N, int64_t C,
                            double eps) {
  NormOut f = naive_rmsnorm(x, w, N, C, eps);
  for (int64_t n = 0; n < N; ++n) {
    double b = 0.0;
    for (int64_t c = 0; c < C; ++c) b += w[c] * dy[n * C + c] * x[n * C + c] * f.rstd[n];
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = x[n * C + c] * f.rstd[n];
      dx[n * C + c] += f.rstd[n] * (w[c] * dy[n * C + c] - xhat * b / C);
      dw[c] += xhat * dy[n * C + c];
    }
  }
}

inline double naive_gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}
inline double naive_gelu_grad(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double th = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

inline DVec naive_swiglu(const DVec& gu, int64_t N, int64_t F) {
  DVec out(N * F);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const double g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
      out[n * F + f] = g * sigmoid(g) * u;
    }
  return out;
}

// Hugging Face Llama rotate_half with angles straight from the definition (no tables).
inline DVec naive_rope(DVec qkv, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, double theta, double sign) {
  const int64_t row = (H + 2 * KVH) * D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H + KVH; ++h)
        for (int64_t i = 0; i < D / 2; ++i) {
          const double angle = sign * static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(i) / D);
          double* x = qkv.data() + (b * T + t) * row + h * D;
          const double x1 = x[i], x2 = x[i + D / 2];
          x[i] = x1 * std::cos(angle) - x2 * std::sin(angle);
          x[i + D / 2] = x2 * std::cos(angle) + x1 * std::sin(angle);
        }
  return qkv;
}

// Losses and gradient of grad_scale * sum_n loss_n.
inline void naive_cross_entropy(DVec& losses, DVec& dlogits, const DVec& logits, const std::vector<int32_t>& targets,
                         int64_t N, int64_t V, double grad_scale) {
  losses.assign(N, 0.0);
  dlogits.assign(N * V, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) m = std::max(m, logits[n * V + v]);
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[n * V + v] - m);
    losses[n] = std::log(sum) + m - logits[n * V + targets[n]];
    for (int64_t v = 0; v < V; ++v)
      dlogits[n * V + v] = grad_scale * (std::exp(logits[n * V + v] - m) / sum - (v == targets[n] ? 1.0 : 0.0));
  }
}

}  // namespace loom::kernels::elementwise_test
