// Tests of the element-wise kernels (elementwise.h): every family's reference (ref::) and fast version
// against an independent float64 implementation written here from the math, every backward against
// finite differences of that float64 forward, the gradient conventions (accumulate vs write), and
// determinism. Inputs are random from a logged seed; rerun a failure with LOOM_TEST_SEED=<seed>.
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

namespace loom::kernels {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

uint32_t run_seed() { return static_cast<uint32_t>(loom::test::fresh_seed()); }

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

DVec to_double(const Vec& v) { return DVec(v.begin(), v.end()); }

// |got - want| <= rtol * (|want| + rms(want)) everywhere: relative where values are large, relative to
// the tensor's typical size near zero, where cancellation in float is expected.
::testing::AssertionResult close_to(const Vec& got, const DVec& want, double rtol) {
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

bool bitwise_equal(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Central differences of a float64 scalar function at the given coordinates.
DVec finite_differences(const std::function<double(const DVec&)>& f, DVec x, const std::vector<size_t>& at) {
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

std::vector<size_t> all_indices(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

Vec pick(const Vec& v, const std::vector<size_t>& at) {
  Vec out;
  for (size_t i : at) out.push_back(v[i]);
  return out;
}

double dot(const DVec& a, const DVec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

const char* impl_name(bool fast) { return fast ? "fast" : "ref"; }

// ============================ float64 implementations from the math ============================

struct NormOut {
  DVec out, mean, rstd;
};

NormOut naive_layernorm(const DVec& x, const DVec& w, const DVec& b, int64_t N, int64_t C, double eps) {
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
void naive_layernorm_backward(DVec& dx, DVec& dw, DVec& db, const DVec& dy, const DVec& x, const DVec& w, int64_t N,
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

NormOut naive_rmsnorm(const DVec& x, const DVec& w, int64_t N, int64_t C, double eps) {
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

void naive_rmsnorm_backward(DVec& dx, DVec& dw, const DVec& dy, const DVec& x, const DVec& w, int64_t N, int64_t C,
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

double naive_gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}
double naive_gelu_grad(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double th = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

DVec naive_swiglu(const DVec& gu, int64_t N, int64_t F) {
  DVec out(N * F);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const double g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
      out[n * F + f] = g * sigmoid(g) * u;
    }
  return out;
}

// Hugging Face Llama rotate_half with angles straight from the definition (no tables).
DVec naive_rope(DVec qkv, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, double theta, double sign) {
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
void naive_cross_entropy(DVec& losses, DVec& dlogits, const DVec& logits, const std::vector<int32_t>& targets,
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

// ============================ the vectorised exp behind GELU, SwiGLU and the loss ============================

TEST_F(ElementwiseTest, FastExpIsWithinTwoUlpInItsRangeAndFiniteOutside) {
  std::uniform_real_distribution<float> in_range(-86.5f, 88.3f);
  double worst = 0.0;
  for (int k = 0; k < 200000; ++k) {
    const float x = in_range(rng_);
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(detail::fast_exp(x) - want) / want);
  }
  EXPECT_LT(worst, 1.2e-7) << "worst relative error";  // 2 * 2^-24: two ulp (std::exp in float: one)
  EXPECT_EQ(detail::fast_exp(0.0f), 1.0f);
  // Outside the range: a tiny or huge finite value, never 0 or Inf, so that 1 / (1 + e) stays defined.
  EXPECT_GT(detail::fast_exp(-1000.0f), 0.0f);
  EXPECT_LT(detail::fast_exp(-1000.0f), 1e-37f);
  EXPECT_TRUE(std::isfinite(detail::fast_exp(1000.0f)));
  EXPECT_TRUE(std::isnan(detail::fast_exp(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_NEAR(detail::fast_sigmoid(-30.0f), std::exp(-30.0), 1e-6 * std::exp(-30.0));
}

// ============================ embedding ============================

TEST_F(ElementwiseTest, EmbeddingForwardAddsTokenAndPositionRows) {
  for (auto [B, T, C, V] : {std::array<int64_t, 4>{3, 5, 67, 11}, {8, 256, 384, 8192}}) {
    const auto tok = tokens(B * T, static_cast<int32_t>(V));
    const Vec wte = normal(V * C), wpe = normal(T * C);
    for (bool with_wpe : {true, false}) {
      DVec want(B * T * C);
      for (int64_t r = 0; r < B * T; ++r)
        for (int64_t c = 0; c < C; ++c)
          want[r * C + c] = static_cast<double>(wte[tok[r] * C + c]) + (with_wpe ? wpe[(r % T) * C + c] : 0.0);
      for (bool fast : {false, true}) {
        SCOPED_TRACE(impl_name(fast));
        Vec out(B * T * C, 7.0f);
        const float* p = with_wpe ? wpe.data() : nullptr;
        fast ? embedding_forward(out.data(), tok.data(), wte.data(), p, B, T, C)
             : ref::embedding_forward(out.data(), tok.data(), wte.data(), p, B, T, C);
        EXPECT_TRUE(close_to(out, want, 1e-7)) << "B=" << B << " C=" << C << " wpe=" << with_wpe;
      }
    }
  }
}

TEST_F(ElementwiseTest, EmbeddingBackwardScatterAddsIntoPrefilledDwteAndDwpe) {
  // A vocabulary of 11 over 15 positions: tokens repeat, so rows of dwte collect several rows of dout.
  for (auto [B, T, C, V] : {std::array<int64_t, 4>{3, 5, 67, 11}, {8, 256, 384, 8192}}) {
    const auto tok = tokens(B * T, static_cast<int32_t>(V));
    const Vec dout = normal(B * T * C), dwte0 = normal(V * C), dwpe0 = normal(T * C);
    DVec want_wte = to_double(dwte0), want_wpe = to_double(dwpe0);
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t c = 0; c < C; ++c) {
        want_wte[tok[r] * C + c] += dout[r * C + c];
        want_wpe[(r % T) * C + c] += dout[r * C + c];
      }
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec dwte = dwte0, dwpe = dwpe0;
      fast ? embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C)
           : ref::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
      EXPECT_TRUE(close_to(dwte, want_wte, 1e-6)) << "C=" << C;
      EXPECT_TRUE(close_to(dwpe, want_wpe, 1e-6)) << "C=" << C;
      Vec only_wte = dwte0;  // dwpe == nullptr (Llama: no learned positions)
      fast ? embedding_backward(only_wte.data(), nullptr, dout.data(), tok.data(), B, T, C)
           : ref::embedding_backward(only_wte.data(), nullptr, dout.data(), tok.data(), B, T, C);
      EXPECT_TRUE(bitwise_equal(only_wte, dwte));
    }
  }
}

TEST_F(ElementwiseTest, EmbeddingBackwardIsBitwiseTheReferenceForAnyThreadCount) {
  const int64_t B = 4, T = 64, C = 384, V = 50;
  const auto tok = tokens(B * T, V);
  const Vec dout = normal(B * T * C), dwte0 = normal(V * C), dwpe0 = normal(T * C);
  Vec ref_wte = dwte0, ref_wpe = dwpe0;
  ref::embedding_backward(ref_wte.data(), ref_wpe.data(), dout.data(), tok.data(), B, T, C);
  for (int threads : {1, 2, 3}) {
    Threads scope(threads);
    Vec dwte = dwte0, dwpe = dwpe0;
    embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
    EXPECT_TRUE(bitwise_equal(dwte, ref_wte)) << threads << " threads";
    EXPECT_TRUE(bitwise_equal(dwpe, ref_wpe)) << threads << " threads";
  }
}

TEST_F(ElementwiseTest, EmbeddingBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 3, C = 5, V = 4;
  const auto tok = tokens(B * T, V);
  const Vec wte = normal(V * C), wpe = normal(T * C), weights = normal(B * T * C);
  // L(wte, wpe) = sum(out * weights), the parameters packed in one vector for differencing.
  auto loss = [&](const DVec& p) {
    double L = 0.0;
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t c = 0; c < C; ++c) L += (p[tok[r] * C + c] + p[V * C + (r % T) * C + c]) * weights[r * C + c];
    return L;
  };
  DVec params = to_double(wte);
  params.insert(params.end(), wpe.begin(), wpe.end());
  const DVec fd = finite_differences(loss, params, all_indices(params.size()));
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
    fast ? embedding_backward(dwte.data(), dwpe.data(), weights.data(), tok.data(), B, T, C)
         : ref::embedding_backward(dwte.data(), dwpe.data(), weights.data(), tok.data(), B, T, C);
    Vec got = dwte;
    got.insert(got.end(), dwpe.begin(), dwpe.end());
    EXPECT_TRUE(close_to(got, fd, 1e-6));
  }
}

// ============================ LayerNorm ============================

struct NormShape {
  int64_t N, C;
};
// Odd and serial, odd and split unevenly over threads, and the mini model's (B*T, d_model).
constexpr NormShape kNormShapes[] = {{7, 67}, {301, 67}, {2048, 384}};

TEST_F(ElementwiseTest, LayerNormForwardMatchesFloat64) {
  for (auto [N, C] : kNormShapes) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    // An offset mean (3) as on the residual stream, where a one-pass variance would cancel.
    const Vec x = normal(N * C, 3.0f, 1.5f), w = normal(C, 1.0f, 0.3f), b = normal(C, 0.0f, 0.3f);
    const NormOut want = naive_layernorm(to_double(x), to_double(w), to_double(b), N, C, 1e-5);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec out(N * C), mean(N), rstd(N);
      fast ? layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f)
           : ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
      EXPECT_TRUE(close_to(out, want.out, 1e-5));
      EXPECT_TRUE(close_to(mean, want.mean, 1e-5));
      EXPECT_TRUE(close_to(rstd, want.rstd, 1e-5));
    }
  }
}

TEST_F(ElementwiseTest, LayerNormBackwardAccumulatesIntoDinpAndParameterGradients) {
  for (auto [N, C] : kNormShapes) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const Vec x = normal(N * C, 3.0f, 1.5f), w = normal(C, 1.0f, 0.3f), b = normal(C, 0.0f, 0.3f);
    const Vec dy = normal(N * C);
    const Vec dinp0 = normal(N * C), dw0 = normal(C), db0 = normal(C);  // what earlier branches left there
    DVec want_dx = to_double(dinp0), want_dw = to_double(dw0), want_db = to_double(db0);
    naive_layernorm_backward(want_dx, want_dw, want_db, to_double(dy), to_double(x), to_double(w), N, C, 1e-5);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec out(N * C), mean(N), rstd(N);
      ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
      Vec dinp = dinp0, dw = dw0, db = db0;
      fast ? layernorm_backward(dinp.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                                rstd.data(), N, C)
           : ref::layernorm_backward(dinp.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                                     rstd.data(), N, C);
      EXPECT_TRUE(close_to(dinp, want_dx, 1e-5));
      EXPECT_TRUE(close_to(dw, want_dw, 1e-5));
      EXPECT_TRUE(close_to(db, want_db, 1e-5));
    }
  }
}

TEST_F(ElementwiseTest, LayerNormBackwardMatchesFiniteDifferences) {
  const int64_t N = 7, C = 67;
  const Vec x = normal(N * C, 1.0f, 2.0f), w = normal(C, 1.0f, 0.3f), b = normal(C, 0.0f, 0.3f);
  const Vec weights = normal(N * C);
  // L(x, w, b) = sum(layernorm(x) * weights), in float64, all inputs packed in one vector.
  auto loss = [&](const DVec& p) {
    const DVec px(p.begin(), p.begin() + N * C), pw(p.begin() + N * C, p.begin() + N * C + C),
        pb(p.begin() + N * C + C, p.end());
    return dot(naive_layernorm(px, pw, pb, N, C, 1e-5).out, to_double(weights));
  };
  DVec packed = to_double(x);
  packed.insert(packed.end(), w.begin(), w.end());
  packed.insert(packed.end(), b.begin(), b.end());
  const DVec fd = finite_differences(loss, packed, all_indices(packed.size()));
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec out(N * C), mean(N), rstd(N);
    ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
    Vec dinp(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
    fast ? layernorm_backward(dinp.data(), dw.data(), db.data(), weights.data(), x.data(), w.data(), mean.data(),
                              rstd.data(), N, C)
         : ref::layernorm_backward(dinp.data(), dw.data(), db.data(), weights.data(), x.data(), w.data(),
                                   mean.data(), rstd.data(), N, C);
    Vec got = dinp;
    got.insert(got.end(), dw.begin(), dw.end());
    got.insert(got.end(), db.begin(), db.end());
    EXPECT_TRUE(close_to(got, fd, 1e-5));
  }
}

// ============================ RMSNorm ============================

TEST_F(ElementwiseTest, RmsNormForwardMatchesFloat64) {
  for (auto [N, C] : kNormShapes) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const Vec x = normal(N * C, 0.5f, 2.0f), w = normal(C, 1.0f, 0.3f);
    const NormOut want = naive_rmsnorm(to_double(x), to_double(w), N, C, 1e-6);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec out(N * C), rstd(N);
      fast ? rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f)
           : ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
      EXPECT_TRUE(close_to(out, want.out, 1e-5));
      EXPECT_TRUE(close_to(rstd, want.rstd, 1e-5));
    }
  }
}

TEST_F(ElementwiseTest, RmsNormBackwardAccumulatesIntoDinpAndDweight) {
  for (auto [N, C] : kNormShapes) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const Vec x = normal(N * C, 0.5f, 2.0f), w = normal(C, 1.0f, 0.3f), dy = normal(N * C);
    const Vec dinp0 = normal(N * C), dw0 = normal(C);
    DVec want_dx = to_double(dinp0), want_dw = to_double(dw0);
    naive_rmsnorm_backward(want_dx, want_dw, to_double(dy), to_double(x), to_double(w), N, C, 1e-6);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec out(N * C), rstd(N);
      ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
      Vec dinp = dinp0, dw = dw0;
      fast ? rmsnorm_backward(dinp.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C)
           : ref::rmsnorm_backward(dinp.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
      EXPECT_TRUE(close_to(dinp, want_dx, 1e-5));
      EXPECT_TRUE(close_to(dw, want_dw, 1e-5));
    }
  }
}

TEST_F(ElementwiseTest, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t N = 7, C = 67;
  const Vec x = normal(N * C, 0.5f, 2.0f), w = normal(C, 1.0f, 0.3f), weights = normal(N * C);
  auto loss = [&](const DVec& p) {
    const DVec px(p.begin(), p.begin() + N * C), pw(p.begin() + N * C, p.end());
    return dot(naive_rmsnorm(px, pw, N, C, 1e-6).out, to_double(weights));
  };
  DVec packed = to_double(x);
  packed.insert(packed.end(), w.begin(), w.end());
  const DVec fd = finite_differences(loss, packed, all_indices(packed.size()));
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec out(N * C), rstd(N);
    ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
    Vec dinp(N * C, 0.0f), dw(C, 0.0f);
    fast ? rmsnorm_backward(dinp.data(), dw.data(), weights.data(), x.data(), w.data(), rstd.data(), N, C)
         : ref::rmsnorm_backward(dinp.data(), dw.data(), weights.data(), x.data(), w.data(), rstd.data(), N, C);
    Vec got = dinp;
    got.insert(got.end(), dw.begin(), dw.end());
    EXPECT_TRUE(close_to(got, fd, 1e-5));
  }
}

// ============================ GELU ============================

// 1001 (odd, one thread), 40001 (odd, split) and 512 rows of the mini model's MLP activation (4 * d_model).
constexpr int64_t kGeluSizes[] = {1001, 40001, 512 * 1536};

TEST_F(ElementwiseTest, GeluForwardMatchesFloat64IncludingTails) {
  for (int64_t n : kGeluSizes) {
    Vec x = normal(n, 0.0f, 3.0f);
    const float special[] = {0.0f, -0.0f, 1e-20f, -1e-6f, 12.0f, -9.0f, -20.0f, 50.0f, -100.0f};
    std::copy(std::begin(special), std::end(special), x.begin());
    DVec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = naive_gelu(x[i]);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec out(n);
      fast ? gelu_forward(out.data(), x.data(), n) : ref::gelu_forward(out.data(), x.data(), n);
      EXPECT_TRUE(close_to(out, want, 1e-5)) << "n=" << n;
    }
  }
}

TEST_F(ElementwiseTest, GeluBackwardOverwritesDinp) {
  for (int64_t n : kGeluSizes) {
    const Vec x = normal(n, 0.0f, 3.0f), dy = normal(n);
    DVec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = naive_gelu_grad(x[i]) * dy[i];
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec dinp = normal(n, 5.0f);  // stale values that must not leak into the result
      fast ? gelu_backward(dinp.data(), x.data(), dy.data(), n) : ref::gelu_backward(dinp.data(), x.data(), dy.data(), n);
      EXPECT_TRUE(close_to(dinp, want, 1e-5)) << "n=" << n;
    }
  }
}

TEST_F(ElementwiseTest, GeluBackwardMatchesFiniteDifferences) {
  const int64_t n = 301;
  const Vec x = normal(n, 0.0f, 2.0f), weights = normal(n);
  auto loss = [&](const DVec& p) {
    double L = 0.0;
    for (int64_t i = 0; i < n; ++i) L += naive_gelu(p[i]) * weights[i];
    return L;
  };
  const DVec fd = finite_differences(loss, to_double(x), all_indices(n));
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec dinp(n);
    fast ? gelu_backward(dinp.data(), x.data(), weights.data(), n)
         : ref::gelu_backward(dinp.data(), x.data(), weights.data(), n);
    EXPECT_TRUE(close_to(dinp, fd, 1e-5));
  }
}

// ============================ SwiGLU ============================

struct SwigluShape {
  int64_t N, F;
};
constexpr SwigluShape kSwigluShapes[] = {{7, 67}, {301, 67}, {512, 1024}};  // last: 512 rows of llama-mini

TEST_F(ElementwiseTest, SwigluForwardMatchesFloat64) {
  for (auto [N, F] : kSwigluShapes) {
    Vec gu = normal(N * 2 * F, 0.0f, 3.0f);
    gu[0] = -100.0f, gu[1] = 100.0f, gu[2] = 0.0f;  // saturated gates
    const DVec want = naive_swiglu(to_double(gu), N, F);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec out(N * F);
      fast ? swiglu_forward(out.data(), gu.data(), N, F) : ref::swiglu_forward(out.data(), gu.data(), N, F);
      EXPECT_TRUE(close_to(out, want, 1e-5)) << "N=" << N << " F=" << F;
    }
  }
}

TEST_F(ElementwiseTest, SwigluBackwardOverwritesDgu) {
  for (auto [N, F] : kSwigluShapes) {
    const Vec gu = normal(N * 2 * F, 0.0f, 3.0f), dy = normal(N * F);
    DVec want(N * 2 * F);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t f = 0; f < F; ++f) {
        const double g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f], s = sigmoid(g);
        want[n * 2 * F + f] = dy[n * F + f] * u * (s + g * s * (1.0 - s));
        want[n * 2 * F + F + f] = dy[n * F + f] * g * s;
      }
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec dgu = normal(N * 2 * F, 5.0f);  // stale values that must not leak into the result
      fast ? swiglu_backward(dgu.data(), gu.data(), dy.data(), N, F)
           : ref::swiglu_backward(dgu.data(), gu.data(), dy.data(), N, F);
      EXPECT_TRUE(close_to(dgu, want, 1e-5)) << "N=" << N << " F=" << F;
    }
  }
}

TEST_F(ElementwiseTest, SwigluBackwardMatchesFiniteDifferences) {
  const int64_t N = 7, F = 67;
  const Vec gu = normal(N * 2 * F, 0.0f, 2.0f), weights = normal(N * F);
  auto loss = [&](const DVec& p) { return dot(naive_swiglu(p, N, F), to_double(weights)); };
  const DVec fd = finite_differences(loss, to_double(gu), all_indices(gu.size()));
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec dgu(N * 2 * F);
    fast ? swiglu_backward(dgu.data(), gu.data(), weights.data(), N, F)
         : ref::swiglu_backward(dgu.data(), gu.data(), weights.data(), N, F);
    EXPECT_TRUE(close_to(dgu, fd, 1e-5));
  }
}

// ============================ RoPE ============================

TEST_F(ElementwiseTest, RopeTablesHoldCosAndSinOfPositionTimesInverseFrequency) {
  const int64_t T = 300, D = 64;
  const double theta = 10000.0;
  Vec cos(T * D / 2), sin(T * D / 2);
  rope_tables(cos.data(), sin.data(), T, D, static_cast<float>(theta));
  DVec want_cos(T * D / 2), want_sin(T * D / 2);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double angle = static_cast<double>(t) / std::pow(theta, 2.0 * static_cast<double>(i) / D);
      want_cos[t * D / 2 + i] = std::cos(angle);
      want_sin[t * D / 2 + i] = std::sin(angle);
    }
  EXPECT_TRUE(close_to(cos, want_cos, 1e-6));
  EXPECT_TRUE(close_to(sin, want_sin, 1e-6));
}

struct RopeShape {
  int64_t B, T, H, KVH, D;
};
// Odd half-dimension and grouped KV heads, then llama-mini (d_model 384 / 6 heads, 2 KV heads).
constexpr RopeShape kRopeShapes[] = {{2, 5, 3, 1, 10}, {8, 256, 6, 2, 64}};

TEST_F(ElementwiseTest, RopeForwardRotatesQueryAndKeyHeadsAndLeavesValues) {
  for (auto [B, T, H, KVH, D] : kRopeShapes) {
    const int64_t row = (H + 2 * KVH) * D;
    Vec cos(T * D / 2), sin(T * D / 2);
    rope_tables(cos.data(), sin.data(), T, D, 10000.0f);
    const Vec qkv = normal(B * T * row);
    const DVec want = naive_rope(to_double(qkv), B, T, H, KVH, D, 10000.0, 1.0);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec x = qkv;
      fast ? rope_forward(x.data(), cos.data(), sin.data(), B, T, H, KVH, D)
           : ref::rope_forward(x.data(), cos.data(), sin.data(), B, T, H, KVH, D);
      EXPECT_TRUE(close_to(x, want, 1e-5)) << "D=" << D;
      bool v_untouched = true;
      for (int64_t r = 0; r < B * T; ++r)
        for (int64_t j = (H + KVH) * D; j < row; ++j) v_untouched &= (x[r * row + j] == qkv[r * row + j]);
      EXPECT_TRUE(v_untouched);
    }
  }
}

TEST_F(ElementwiseTest, RopeBackwardMatchesFiniteDifferences) {
  const int64_t B = kRopeShapes[0].B, T = kRopeShapes[0].T, H = kRopeShapes[0].H, KVH = kRopeShapes[0].KVH,
                D = kRopeShapes[0].D;
  const int64_t n = B * T * (H + 2 * KVH) * D;
  Vec cos(T * D / 2), sin(T * D / 2);
  rope_tables(cos.data(), sin.data(), T, D, 10000.0f);
  const Vec x = normal(n), weights = normal(n);
  auto loss = [&](const DVec& p) { return dot(naive_rope(p, B, T, H, KVH, D, 10000.0, 1.0), to_double(weights)); };
  const DVec fd = finite_differences(loss, to_double(x), all_indices(n));
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec g = weights;  // d loss / d out, turned in place into d loss / d qkv (v passes straight through)
    fast ? rope_backward(g.data(), cos.data(), sin.data(), B, T, H, KVH, D)
         : ref::rope_backward(g.data(), cos.data(), sin.data(), B, T, H, KVH, D);
    EXPECT_TRUE(close_to(g, fd, 1e-5));
  }
}

TEST_F(ElementwiseTest, RopeBackwardUndoesForward) {
  const auto [B, T, H, KVH, D] = kRopeShapes[1];
  const int64_t n = B * T * (H + 2 * KVH) * D;
  Vec cos(T * D / 2), sin(T * D / 2);
  rope_tables(cos.data(), sin.data(), T, D, 10000.0f);
  const Vec x0 = normal(n);
  Vec x = x0;
  rope_forward(x.data(), cos.data(), sin.data(), B, T, H, KVH, D);
  rope_backward(x.data(), cos.data(), sin.data(), B, T, H, KVH, D);
  EXPECT_TRUE(close_to(x, to_double(x0), 1e-6));
}

// ============================ softmax cross-entropy ============================

struct CeShape {
  int64_t N, V;
};
// Odd and serial, odd and split over threads, and 256 rows of the mini model's vocabulary.
constexpr CeShape kCeShapes[] = {{7, 1000}, {47, 1000}, {256, 8192}};

TEST_F(ElementwiseTest, SoftmaxCrossEntropyMatchesFloat64AndOverwritesLogits) {
  for (auto [N, V] : kCeShapes) {
    SCOPED_TRACE("N=" + std::to_string(N) + " V=" + std::to_string(V));
    Vec logits = normal(N * V, 0.0f, 3.0f);
    for (int64_t v = 0; v < V; ++v) logits[V + v] += 80.0f;  // a row far from 0: needs the max shift
    auto targets = tokens(N, static_cast<int32_t>(V));
    targets[2] = -1;  // an ignored (padding) position
    const float grad_scale = 1.0f / static_cast<float>(N);
    DVec want_loss, want_dlogits;
    naive_cross_entropy(want_loss, want_dlogits, to_double(logits), targets, N, V, grad_scale);
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      Vec losses(N, -1.0f), x = logits;
      fast ? softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, grad_scale)
           : ref::softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, grad_scale);
      EXPECT_TRUE(close_to(losses, want_loss, 1e-5));
      EXPECT_TRUE(close_to(x, want_dlogits, 1e-5));
    }
    Vec losses(N, -1.0f);
    cross_entropy_forward(losses.data(), logits.data(), targets.data(), N, V);
    EXPECT_TRUE(close_to(losses, want_loss, 1e-5)) << "cross_entropy_forward";
  }
}

TEST_F(ElementwiseTest, SoftmaxCrossEntropyIgnoresNegativeTargets) {
  const int64_t N = 5, V = 1000;
  const Vec logits = normal(N * V, 0.0f, 3.0f);
  const std::vector<int32_t> targets = {-1, 3, -100, 999, -1};
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec losses(N, 42.0f), x = logits;
    fast ? softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, 0.5f)
         : ref::softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, 0.5f);
    for (int64_t n : {0, 2, 4}) {
      EXPECT_EQ(losses[n], 0.0f) << "row " << n;
      EXPECT_TRUE(std::all_of(x.begin() + n * V, x.begin() + (n + 1) * V, [](float g) { return g == 0.0f; }))
          << "row " << n;
    }
    EXPECT_GT(losses[1], 0.0f);
    EXPECT_GT(losses[3], 0.0f);
  }
  Vec losses(N, 42.0f);
  cross_entropy_forward(losses.data(), logits.data(), targets.data(), N, V);
  EXPECT_EQ(losses[0], 0.0f);
  EXPECT_EQ(losses[2], 0.0f);
}

TEST_F(ElementwiseTest, SoftmaxCrossEntropyMatchesFiniteDifferences) {
  const int64_t N = 7, V = 1000;
  const float grad_scale = 0.25f;
  const Vec logits = normal(N * V, 0.0f, 2.0f);
  auto targets = tokens(N, static_cast<int32_t>(V));
  targets[4] = -1;
  // L = grad_scale * sum_n loss_n: the gradient the kernel writes over the logits.
  auto loss = [&](const DVec& p) {
    DVec l, d;
    naive_cross_entropy(l, d, p, targets, N, V, grad_scale);
    double s = 0.0;
    for (double v : l) s += v;
    return grad_scale * s;
  };
  // Every target entry (the -1 of the one-hot) plus 120 random others: differencing all 7000 would
  // take 14000 float64 passes.
  std::vector<size_t> at;
  for (int64_t n = 0; n < N; ++n)
    if (targets[n] >= 0) at.push_back(n * V + targets[n]);
  std::uniform_int_distribution<size_t> any(0, N * V - 1);
  for (int k = 0; k < 120; ++k) at.push_back(any(rng_));
  const DVec fd = finite_differences(loss, to_double(logits), at);
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec losses(N), x = logits;
    fast ? softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, grad_scale)
         : ref::softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, grad_scale);
    EXPECT_TRUE(close_to(pick(x, at), fd, 1e-5));
  }
}

TEST_F(ElementwiseTest, SoftmaxCrossEntropyKeepsLossAccurateForUnlikelyTargets) {
  // The target's logit sits 60-200 below the row max: its probability underflows float, yet the loss
  // (60-200) must come out to float precision, not inf or a rounded probability's log.
  const int64_t N = 4, V = 1000;
  Vec logits = normal(N * V);
  std::vector<int32_t> targets = {5, 17, 400, 999};
  const float drop[] = {60.0f, 100.0f, 150.0f, 200.0f};
  for (int64_t n = 0; n < N; ++n) logits[n * V + targets[n]] -= drop[n];
  DVec want_loss, want_dlogits;
  naive_cross_entropy(want_loss, want_dlogits, to_double(logits), targets, N, V, 1.0);
  for (bool fast : {false, true}) {
    SCOPED_TRACE(impl_name(fast));
    Vec losses(N), x = logits;
    fast ? softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, 1.0f)
         : ref::softmax_cross_entropy(losses.data(), x.data(), targets.data(), N, V, 1.0f);
    for (int64_t n = 0; n < N; ++n) EXPECT_NEAR(losses[n], want_loss[n], 1e-6 * want_loss[n]) << "row " << n;
    EXPECT_TRUE(close_to(x, want_dlogits, 1e-5));
  }
}

// ============================ bias gradient ============================

TEST_F(ElementwiseTest, BiasBackwardAccumulatesColumnSumsBitwiseLikeReferenceForAnyThreadCount) {
  struct Shape {
    int64_t N, OC;
  };
  for (auto [N, OC] : {Shape{7, 67}, Shape{301, 67}, Shape{2048, 1152}}) {
    const Vec dout = normal(N * OC), dbias0 = normal(OC);
    DVec want = to_double(dbias0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < OC; ++j) want[j] += dout[n * OC + j];
    Vec ref_db = dbias0;
    ref::bias_backward(ref_db.data(), dout.data(), N, OC);
    EXPECT_TRUE(close_to(ref_db, want, 1e-5)) << "ref N=" << N;
    for (int threads : {1, 2, 3}) {
      Threads scope(threads);
      Vec db = dbias0;
      bias_backward(db.data(), dout.data(), N, OC);
      EXPECT_TRUE(bitwise_equal(db, ref_db)) << "N=" << N << ", " << threads << " threads";
    }
  }
}

// ============================ AdamW ============================

TEST_F(ElementwiseTest, AdamWMatchesFloat64OverThreeStepsAndWritesRoundedBf16Copy) {
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.5f;
  for (int64_t n : {int64_t{1001}, int64_t{100003}}) {
    const Vec p0 = normal(n, 0.0f, 0.5f);
    std::vector<Vec> grads;
    for (int s = 0; s < 3; ++s) grads.push_back(normal(n, 0.0f, 2.0f));
    DVec want_p = to_double(p0), want_m(n, 0.0), want_v(n, 0.0);
    for (int64_t step = 1; step <= 3; ++step) {
      const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), step);
      const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), step);
      for (int64_t i = 0; i < n; ++i) {
        const double g = static_cast<double>(grads[step - 1][i]) * grad_scale;
        want_m[i] = beta1 * want_m[i] + (1.0 - beta1) * g;
        want_v[i] = beta2 * want_v[i] + (1.0 - beta2) * g * g;
        want_p[i] -= lr * ((want_m[i] / bc1) / (std::sqrt(want_v[i] / bc2) + eps) + wd * want_p[i]);
      }
    }
    for (bool fast : {false, true}) {
      SCOPED_TRACE(impl_name(fast));
      for (bool with_bf16 : {true, false}) {
        Vec p = p0, m(n, 0.0f), v(n, 0.0f);
        std::vector<bf16> copy(n, bf16{0x7fc0});
        for (int64_t step = 1; step <= 3; ++step) {
          bf16* c = with_bf16 ? copy.data() : nullptr;
          fast ? adamw_update(p.data(), m.data(), v.data(), c, grads[step - 1].data(), n, lr, beta1, beta2, eps, wd,
                              step, grad_scale)
               : ref::adamw_update(p.data(), m.data(), v.data(), c, grads[step - 1].data(), n, lr, beta1, beta2, eps,
                                   wd, step, grad_scale);
        }
        EXPECT_TRUE(close_to(p, want_p, 1e-6)) << "n=" << n;
        EXPECT_TRUE(close_to(m, want_m, 1e-6)) << "n=" << n;
        EXPECT_TRUE(close_to(v, want_v, 1e-6)) << "n=" << n;
        if (with_bf16) {
          int64_t mismatches = 0;
          for (int64_t i = 0; i < n; ++i) mismatches += copy[i].bits != f32_to_bf16(p[i]).bits;
          EXPECT_EQ(mismatches, 0) << "bf16 copy != f32_to_bf16(param), n=" << n;
        }
      }
    }
  }
}

// ============================ reductions, casts, add ============================

TEST_F(ElementwiseTest, SumSquaresMatchesFloat64AndIsDeterministic) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{1000003}}) {
    const Vec x = normal(n, 0.1f, 3.0f);
    double want = 0.0;
    for (float v : x) want += static_cast<double>(v) * v;
    Threads scope(3);
    const double got = sum_squares(x.data(), n);
    EXPECT_NEAR(got, want, 1e-12 * want) << "n=" << n;
    const double again = sum_squares(x.data(), n);
    EXPECT_EQ(std::memcmp(&got, &again, sizeof(double)), 0) << "n=" << n;
  }
}

TEST_F(ElementwiseTest, FindNonFiniteReturnsLowestIndexOrMinusOne) {
  const int64_t n = 1000003;
  const Vec clean = normal(n, 0.0f, 1e30f);  // huge but finite
  Threads scope(3);
  EXPECT_EQ(find_non_finite(clean.data(), n), -1);
  EXPECT_EQ(find_non_finite(clean.data(), 0), -1);
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN()};
  std::uniform_int_distribution<int64_t> anywhere(0, n - 1);
  for (float b : bad) {
    for (int trial = 0; trial < 4; ++trial) {
      Vec x = clean;
      // Plant several; the lowest must win even when a later thread's chunk also holds one.
      int64_t lowest = n;
      for (int k = 0; k < 3; ++k) {
        const int64_t i = trial == 0 && k == 0 ? n - 1 : anywhere(rng_);
        x[i] = b;
        lowest = std::min(lowest, i);
      }
      EXPECT_EQ(find_non_finite(x.data(), n), lowest) << "planted " << b;
    }
  }
  Vec first = clean;
  first[0] = bad[0];
  EXPECT_EQ(find_non_finite(first.data(), n), 0);
}

TEST_F(ElementwiseTest, CastToBf16RoundsToNearestEvenBitwiseLikeScalarHelper) {
  const int64_t n = 100003;
  Vec x = normal(n, 0.0f, 10.0f);
  // Exact ties (low 16 bits 0x8000) both ways, carries into the exponent, specials, denormals.
  const uint32_t bits[] = {0x3f808000u, 0x3f818000u, 0x3f7fffffu, 0x7f7fffffu, 0x7f800000u, 0xff800000u,
                           0x7fc00000u, 0x7f800001u, 0xffbfffffu, 0x00000001u, 0x80008000u, 0x00000000u};
  for (size_t i = 0; i < std::size(bits); ++i) std::memcpy(&x[i], &bits[i], 4);
  std::vector<bf16> out(n, bf16{0x1234});
  cast_f32_to_bf16(out.data(), x.data(), n);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) mismatches += out[i].bits != f32_to_bf16(x[i]).bits;
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(out[0].bits, 0x3f80);  // 1.00390625 is halfway: ties to the even 0x3f80
  EXPECT_EQ(out[1].bits, 0x3f82);  // halfway again: ties to the even 0x3f82
  EXPECT_EQ(out[4].bits, 0x7f80);  // +Inf stays Inf
  EXPECT_TRUE(std::isnan(bf16_to_f32(out[7])));  // a signalling NaN stays NaN, not Inf

  Vec back(n);
  cast_bf16_to_f32(back.data(), out.data(), n);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want = bf16_to_f32(out[i]);
    wrong += std::memcmp(&back[i], &want, 4) != 0;
  }
  EXPECT_EQ(wrong, 0);

  Vec rounded = x;
  round_to_bf16_inplace(rounded.data(), n);
  EXPECT_EQ(std::memcmp(rounded.data(), back.data(), n * sizeof(float)), 0);
}

TEST_F(ElementwiseTest, AddSumsElementwiseAlsoInPlace) {
  const int64_t n = 100003;
  const Vec a = normal(n), b = normal(n);
  DVec want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = static_cast<double>(a[i]) + b[i];
  Vec out(n);
  add(out.data(), a.data(), b.data(), n);
  EXPECT_TRUE(close_to(out, want, 1e-7));
  Vec residual = a;  // the residual stream is updated in place
  add(residual.data(), residual.data(), b.data(), n);
  EXPECT_TRUE(bitwise_equal(residual, out));
}

// ============================ determinism and costs ============================

TEST_F(ElementwiseTest, FastKernelsAreBitwiseDeterministicForAThreadCount) {
  Threads scope(3);
  const int64_t N = 301, C = 384, V = 1000;
  const Vec x = normal(N * C, 1.0f), w = normal(C, 1.0f, 0.3f), b = normal(C), dy = normal(N * C);
  const Vec logits = normal(N * V, 0.0f, 3.0f);
  const auto targets = tokens(N, static_cast<int32_t>(V));
  auto run = [&] {
    std::vector<Vec> r;
    Vec out(N * C), mean(N), rstd(N), dinp(N * C, 0.5f), dw(C, 0.25f), db(C, 0.125f);
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
    layernorm_backward(dinp.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N,
                       C);
    r.insert(r.end(), {out, mean, rstd, dinp, dw, db});
    Vec rdinp(N * C, 0.5f), rdw(C, 0.25f);
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
    rmsnorm_backward(rdinp.data(), rdw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    r.insert(r.end(), {out, rstd, rdinp, rdw});
    Vec losses(N), dl = logits;
    softmax_cross_entropy(losses.data(), dl.data(), targets.data(), N, V, 1.0f / N);
    r.insert(r.end(), {losses, dl});
    Vec dbias(C, 1.0f);
    bias_backward(dbias.data(), dy.data(), N, C);
    r.push_back(dbias);
    const double ss = sum_squares(dl.data(), N * V);
    r.push_back(Vec{static_cast<float>(ss), static_cast<float>(ss - static_cast<float>(ss))});
    return r;
  };
  const auto first = run();
  const auto second = run();
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(bitwise_equal(first[i], second[i])) << "output " << i;
}

TEST_F(ElementwiseTest, CostsCountAtLeastTheCompulsoryTraffic) {
  const int64_t N = 2048, C = 384, V = 8192, F = 1536;
  const double nc = static_cast<double>(N * C);
  EXPECT_GE(layernorm_cost(N, C, false).bytes, 4.0 * 2 * nc);  // read x, write out
  EXPECT_GE(layernorm_cost(N, C, true).bytes, 4.0 * 4 * nc);   // read dout, x, dinp; write dinp
  EXPECT_GT(layernorm_cost(N, C, true).flops, layernorm_cost(N, C, false).flops);
  EXPECT_GE(rmsnorm_cost(N, C, false).bytes, 4.0 * 2 * nc);
  EXPECT_GE(rmsnorm_cost(N, C, true).bytes, 4.0 * 4 * nc);
  EXPECT_GE(gelu_cost(N * F, false).bytes, 8.0 * N * F);
  EXPECT_GE(gelu_cost(N * F, true).bytes, 12.0 * N * F);
  EXPECT_GE(swiglu_cost(N, F, false).bytes, 12.0 * N * F);
  EXPECT_GE(swiglu_cost(N, F, true).bytes, 20.0 * N * F);
  EXPECT_GE(softmax_cross_entropy_cost(N, V).bytes, 8.0 * N * V);
  EXPECT_GE(softmax_cross_entropy_cost(N, V).flops, 3.0 * N * V);
  EXPECT_GE(rope_cost(8, 256, 6, 2, 64).bytes, 8.0 * 8 * 256 * 8 * 64);
  EXPECT_GE(adamw_cost(1000).bytes, 28.0 * 1000);
  EXPECT_GE(embedding_cost(N, C).bytes, 8.0 * nc);
  EXPECT_GE(bias_backward_cost(N, C).bytes, 4.0 * nc);
  EXPECT_GE(cast_cost(1000).bytes, 6.0 * 1000);
  for (KernelCost c : {layernorm_cost(N, C, true), gelu_cost(N * F, false), swiglu_cost(N, F, true),
                       softmax_cross_entropy_cost(N, V), rope_cost(8, 256, 6, 2, 64), adamw_cost(1000),
                       embedding_cost(N, C), bias_backward_cost(N, C)})
    EXPECT_GT(c.flops, 0.0);
}

}  // namespace
}  // namespace loom::kernels
