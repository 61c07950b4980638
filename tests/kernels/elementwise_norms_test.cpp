// Element-wise kernels (elementwise.h), part 1: the vectorised exp, embedding, LayerNorm and RMSNorm.
// Each family's reference (ref::) and fast version against float64 implementations from the math,
// every backward against finite differences, the gradient conventions (accumulate vs write) and
// determinism. Inputs are random from a logged seed; rerun a failure with LOOM_TEST_SEED=<seed>.
#include "elementwise_test_support.h"

namespace loom::kernels {
namespace {
using namespace elementwise_test;

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

}  // namespace
}  // namespace loom::kernels
