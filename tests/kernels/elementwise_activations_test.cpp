// Element-wise kernels (elementwise.h), part 2: GELU, SwiGLU and RoPE, against float64
// implementations from the math and finite differences. Rerun a failure with LOOM_TEST_SEED=<seed>.
#include "elementwise_test_support.h"

namespace loom::kernels {
namespace {
using namespace elementwise_test;

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

// ============================ fused with the bf16 cast (issue 15 item 2) ============================

// The fused kernels against the unfused ones they replace (the f32 activation, then the cast, then the
// bias gradient of its f32 result), at 1-3 threads, on odd and mini-sized shapes. Not bit for bit: GCC
// contracts the activations' arithmetic into FMAs in the vector body but not always in a peeled or tail
// iteration, and an element's place relative to those differs between the fused (per row) and the
// unfused (flat) loops; so an element may differ by an f32 ulp, its bf16 rounding by one bf16 step.
std::vector<bf16> cast_all(const Vec& v) {
  std::vector<bf16> out(v.size());
  cast_f32_to_bf16(out.data(), v.data(), static_cast<int64_t>(v.size()));
  return out;
}
::testing::AssertionResult within_one_bf16_step(const std::vector<bf16>& got, const std::vector<bf16>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  size_t bad = 0, off = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int d = std::abs(static_cast<int>(got[i].bits) - static_cast<int>(want[i].bits));
    off += d != 0;
    if (d > 1 && bad++ == 0)
      return ::testing::AssertionFailure() << "[" << i << "] got " << bf16_to_f32(got[i]) << " want " << bf16_to_f32(want[i]);
  }
  // A step apart only where the f32 values straddle a rounding boundary: rare.
  if (off * 100 > got.size()) return ::testing::AssertionFailure() << off << " of " << got.size() << " differ";
  return ::testing::AssertionSuccess();
}

// ============================ each instruction path ============================

// Every path this CPU can run (the portable loops always; AVX-512 where it has AVX-512F), forced in
// turn, against float64 -- tails, signed zeros, infinities and NaN included -- and against each other.
std::vector<ElementwisePath> runnable_paths() {
  std::vector<ElementwisePath> out{ElementwisePath::Portable};
  try {
    force_elementwise_path(ElementwisePath::Avx512);
    out.push_back(ElementwisePath::Avx512);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs AVX-512F"), std::string::npos) << e.what();
  }
  force_elementwise_path(std::nullopt);
  return out;
}

struct ForcedPath {
  explicit ForcedPath(ElementwisePath p) { force_elementwise_path(p); }
  ~ForcedPath() { force_elementwise_path(std::nullopt); }
};

TEST_F(ElementwiseTest, EveryActivationPathMatchesFloat64) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t N = 37, F = 67, n = N * F;  // odd: every loop's masked or scalar tail runs
  Vec x = normal(n, 0.0f, 3.0f), gu = normal(2 * n, 0.0f, 3.0f);
  const Vec dy = normal(n, 0.0f, 2.0f);
  const float special[] = {0.0f, -0.0f, 1e-20f, -1e-6f, 12.0f, -9.0f, -20.0f, 50.0f, -100.0f, -1e4f, 1e4f};
  std::copy(std::begin(special), std::end(special), x.begin());
  std::copy(std::begin(special), std::end(special), gu.begin());  // gates
  DVec gelu(n), gelu_grad(n), swiglu_grad(2 * n);
  for (int64_t i = 0; i < n; ++i) gelu[i] = naive_gelu(x[i]), gelu_grad[i] = naive_gelu_grad(x[i]) * dy[i];
  const DVec swiglu = naive_swiglu(to_double(gu), N, F);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t f = 0; f < F; ++f) {
      const double g = gu[r * 2 * F + f], u = gu[r * 2 * F + F + f], s = sigmoid(g), d = dy[r * F + f];
      swiglu_grad[r * 2 * F + f] = d * u * (s + g * s * (1.0 - s));
      swiglu_grad[r * 2 * F + F + f] = d * g * s;
    }
  std::vector<Vec> first;
  for (ElementwisePath p : runnable_paths()) {
    SCOPED_TRACE(elementwise_path_name(p));
    ForcedPath forced(p);
    EXPECT_EQ(elementwise_path(), p);
    Vec y(n), dx(n), sy(n), dgu(2 * n);
    gelu_forward(y.data(), x.data(), n);
    gelu_backward(dx.data(), x.data(), dy.data(), n);
    swiglu_forward(sy.data(), gu.data(), N, F);
    swiglu_backward(dgu.data(), gu.data(), dy.data(), N, F);
    EXPECT_TRUE(close_to(y, gelu, 1e-5));
    EXPECT_TRUE(close_to(dx, gelu_grad, 1e-5));
    EXPECT_TRUE(close_to(sy, swiglu, 1e-5));
    EXPECT_TRUE(close_to(dgu, swiglu_grad, 1e-5));
    EXPECT_EQ(y[0], 0.0f);
    EXPECT_EQ(y[1], 0.0f);                            // gelu(-0) = -0 * 1/2
    EXPECT_EQ(y[10], 1e4f);                           // saturated: exactly x
    EXPECT_LT(std::fabs(y[9]), 1e-30f);               // -1e4 sigmoid(-huge): as good as 0
    // +inf and NaN: gelu(+inf) = +inf, NaN stays NaN; no NaN from a finite input. (-inf gives -inf on
    // both paths, x times a sigmoid clamped above 0: no finite pre-activation reaches it.)
    const float odd[] = {inf, -inf, std::numeric_limits<float>::quiet_NaN()};
    float out[3], grad[3];
    const float ones[3] = {1.0f, 1.0f, 1.0f};
    gelu_forward(out, odd, 3);
    gelu_backward(grad, odd, ones, 3);
    EXPECT_EQ(out[0], inf);
    EXPECT_FALSE(std::isnan(out[1]));
    EXPECT_TRUE(std::isnan(out[2]));
    EXPECT_TRUE(std::isnan(grad[2]));
    bf16 odd_bf16[3];
    gelu_forward(odd_bf16, odd, 3);
    EXPECT_EQ(odd_bf16[0].bits, 0x7f80);                    // +inf
    EXPECT_EQ(odd_bf16[2].bits & 0x7fc0, 0x7fc0);           // a quiet NaN
    for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(dx[i]) && std::isfinite(y[i])) << i;
    // The fused bf16 casts: the cast of the f32 results (within a step), the bias sums as bias_backward's.
    std::vector<bf16> yb(n), dxb(n), syb(n), dgub(2 * n);
    Vec db(F, 0.5f), want_db(F, 0.5f);
    gelu_forward(yb.data(), x.data(), n);
    gelu_backward(dxb.data(), db.data(), x.data(), dy.data(), N, F);
    swiglu_forward(syb.data(), gu.data(), N, F);
    swiglu_backward(dgub.data(), gu.data(), dy.data(), N, F);
    bias_backward(want_db.data(), dx.data(), N, F);
    EXPECT_TRUE(within_one_bf16_step(yb, cast_all(y)));
    EXPECT_TRUE(within_one_bf16_step(dxb, cast_all(dx)));
    EXPECT_TRUE(within_one_bf16_step(syb, cast_all(sy)));
    EXPECT_TRUE(within_one_bf16_step(dgub, cast_all(dgu)));
    EXPECT_TRUE(close_to(db, to_double(want_db), 1e-6));
    // The casts are bit for bit the reference rounding on every path, NaN, infinities and subnormals
    // included, and the fused bias sums bit for bit bias_backward's.
    Vec c = x;
    const float edge[] = {std::numeric_limits<float>::quiet_NaN(), inf, -inf, 1e-40f, -1e-40f, 3.4e38f, 1.00390625f};
    std::copy(std::begin(edge), std::end(edge), c.begin() + 20);
    std::vector<bf16> cb(n), cbb(n);
    Vec sums(F, 0.25f), want_sums(F, 0.25f);
    cast_f32_to_bf16(cb.data(), c.data(), n);
    cast_f32_to_bf16_bias_grad(cbb.data(), sums.data(), c.data() + F, N - 1, F);  // rows without the NaN
    bias_backward(want_sums.data(), c.data() + F, N - 1, F);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(cb[i].bits, f32_to_bf16(c[i]).bits) << i << ": " << c[i];
    for (int64_t i = 0; i < (N - 1) * F; ++i) ASSERT_EQ(cbb[i].bits, cb[F + i].bits) << i;
    EXPECT_EQ(std::memcmp(sums.data(), want_sums.data(), sizeof(float) * F), 0);
    first.push_back(y);
  }
  // The paths agree with each other as closely as each does with float64.
  for (size_t k = 1; k < first.size(); ++k) EXPECT_TRUE(close_to(first[k], to_double(first[0]), 1e-5));
}

struct MlpShape {
  int64_t N, F;
};
constexpr MlpShape kFusedShapes[] = {{3, 37}, {301, 67}, {2048, 1536}};

TEST_F(ElementwiseTest, GeluFusedWithTheCastIsTheCastOfGelu) {
  for (auto [N, F] : kFusedShapes) {
    const int64_t n = N * F;
    Vec x = normal(n, 0.0f, 3.0f);
    const float special[] = {0.0f, -0.0f, 1e-20f, -20.0f, 50.0f, -100.0f};
    std::copy(std::begin(special), std::end(special), x.begin());
    const Vec dy = normal(n, 0.0f, 2.0f), db0 = normal(F);
    Vec y(n), dx(n);
    gelu_forward(y.data(), x.data(), n);
    gelu_backward(dx.data(), x.data(), dy.data(), n);
    const auto want_y = cast_all(y), want_dx = cast_all(dx);
    Vec want_db = db0;
    bias_backward(want_db.data(), dx.data(), N, F);
    for (int threads : {1, 2, 3}) {
      Threads scope(threads);
      std::vector<bf16> got_y(n, bf16{0x1234}), got_dx(n, bf16{0x1234}), got_dx_nobias(n, bf16{0x1234});
      gelu_forward(got_y.data(), x.data(), n);
      Vec db = db0;
      gelu_backward(got_dx.data(), db.data(), x.data(), dy.data(), N, F);
      gelu_backward(got_dx_nobias.data(), nullptr, x.data(), dy.data(), N, F);
      EXPECT_TRUE(within_one_bf16_step(got_y, want_y)) << N << "x" << F << ", " << threads << " threads";
      EXPECT_TRUE(within_one_bf16_step(got_dx, want_dx)) << N << "x" << F << ", " << threads << " threads";
      EXPECT_TRUE(within_one_bf16_step(got_dx_nobias, want_dx)) << N << "x" << F << ", " << threads << " threads";
      EXPECT_TRUE(close_to(db, to_double(want_db), 1e-6)) << N << "x" << F << ", " << threads << " threads";
    }
  }
  // One pass where there were two (forward) or three (backward: activation, cast, bias).
  EXPECT_DOUBLE_EQ(gelu_bf16_cost(2048, 1536, false, false).bytes,
                   gelu_cost(2048 * 1536, false).bytes + cast_cost(2048 * 1536).bytes - 4.0 * 2 * 2048 * 1536);
  EXPECT_DOUBLE_EQ(gelu_bf16_cost(2048, 1536, true, true).bytes, 10.0 * 2048 * 1536 + 8.0 * 1536);
}

TEST_F(ElementwiseTest, SwigluFusedWithTheCastIsTheCastOfSwiglu) {
  for (auto [N, F] : kFusedShapes) {
    const Vec gu = normal(N * 2 * F, 0.0f, 3.0f), dy = normal(N * F, 0.0f, 2.0f);
    Vec y(N * F), dgu(N * 2 * F);
    swiglu_forward(y.data(), gu.data(), N, F);
    swiglu_backward(dgu.data(), gu.data(), dy.data(), N, F);
    const auto want_y = cast_all(y), want_dgu = cast_all(dgu);
    for (int threads : {1, 2, 3}) {
      Threads scope(threads);
      std::vector<bf16> got_y(N * F, bf16{0x1234}), got_dgu(N * 2 * F, bf16{0x1234});
      swiglu_forward(got_y.data(), gu.data(), N, F);
      swiglu_backward(got_dgu.data(), gu.data(), dy.data(), N, F);
      EXPECT_TRUE(within_one_bf16_step(got_y, want_y)) << N << "x" << F << ", " << threads << " threads";
      EXPECT_TRUE(within_one_bf16_step(got_dgu, want_dgu)) << N << "x" << F << ", " << threads << " threads";
    }
  }
  EXPECT_DOUBLE_EQ(swiglu_bf16_cost(2048, 1024, true).bytes, 16.0 * 2048 * 1024);
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

}  // namespace
}  // namespace loom::kernels
