// Element-wise kernels (elementwise.h), part 3: softmax cross-entropy, the bias gradient, AdamW,
// reductions, casts and add, and the determinism and declared costs of all fast kernels. Rerun a
// failure with LOOM_TEST_SEED=<seed>.
#include "elementwise_test_support.h"
#include "loom/core/philox.h"

namespace loom::kernels {
namespace {
using namespace elementwise_test;

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

// Vocabulary-parallel: R ranks each hold V / R columns (the last padded when R does not divide V);
// partials on every rank, one "all-gather" (a concatenation here), finish on every rank. Losses and each
// rank's dlogits columns must be the whole-vocabulary float64 answer.
TEST_F(ElementwiseTest, VocabularyParallelCrossEntropyMatchesTheWholeVocabulary) {
  struct Case {
    int64_t N, V;
    int R;
  };
  for (auto [N, V, R] : {Case{7, 1000, 2}, Case{47, 1000, 3}, Case{33, 8191, 4}, Case{5, 10, 8}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " V=" + std::to_string(V) + " R=" + std::to_string(R));
    Vec logits = normal(N * V, 0.0f, 3.0f);
    for (int64_t v = 0; v < V; ++v) logits[V + v] += 80.0f;
    auto targets = tokens(N, static_cast<int32_t>(V));
    targets[2] = -1;
    targets[3] = static_cast<int32_t>(V - 1);  // in the last (padded) shard
    const float grad_scale = 1.0f / static_cast<float>(N);
    DVec want_loss, want_dlogits;
    naive_cross_entropy(want_loss, want_dlogits, to_double(logits), targets, N, V, grad_scale);
    const int64_t Vl = (V + R - 1) / R;  // columns per rank, padded
    std::vector<Vec> shard(static_cast<size_t>(R));
    Vec gathered(static_cast<size_t>(R * N * 3));
    for (int r = 0; r < R; ++r) {
      auto& x = shard[static_cast<size_t>(r)];
      x.assign(static_cast<size_t>(N * Vl), 123.0f);  // padding columns hold garbage: they must not count
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < Vl && r * Vl + c < V; ++c) x[n * Vl + c] = logits[n * V + r * Vl + c];
      vocab_shard_partials(gathered.data() + r * N * 3, x.data(), targets.data(), N, Vl, r * Vl, V, true);
    }
    for (bool train : {true, false}) {
      for (int r = 0; r < R; ++r) {
        Vec x = shard[static_cast<size_t>(r)], losses(N, -1.0f);
        vocab_shard_finish(losses.data(), train ? x.data() : nullptr, targets.data(), gathered.data(), R, r, N, Vl, V,
                           grad_scale);
        EXPECT_TRUE(close_to(losses, want_loss, 1e-5)) << "rank " << r;
        if (!train) continue;
        DVec want(static_cast<size_t>(N * Vl), 0.0);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t c = 0; c < Vl && r * Vl + c < V; ++c) want[n * Vl + c] = want_dlogits[n * V + r * Vl + c];
        EXPECT_TRUE(close_to(x, want, 1e-5)) << "rank " << r << " dlogits";
      }
    }
  }
}

// The column sums run over fixed blocks of rows (detail::blocked_column_sums), so they are bitwise the same
// for any thread count; one block (N <= kSumRows) adds the rows in order, as the reference does, and
// after its own sum.
TEST_F(ElementwiseTest, BiasBackwardAccumulatesColumnSumsBitwiseTheSameForAnyThreadCount) {
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
    Vec first;
    for (int threads : {1, 2, 3}) {
      Threads scope(threads);
      Vec db = dbias0;
      bias_backward(db.data(), dout.data(), N, OC);
      EXPECT_TRUE(close_to(db, want, 1e-5)) << "N=" << N << ", " << threads << " threads";
      if (first.empty()) first = db;
      EXPECT_TRUE(bitwise_equal(db, first)) << "N=" << N << ", " << threads << " threads against 1";
    }
  }
}

// Stochastic rounding keyed by the global element: each element is the scalar f32_to_bf16_stochastic
// with its Philox lane, so a run cut anywhere (a shard, a thread's chunk) rounds alike; and it is
// unbiased: the mean of many roundings of x is x, where round-to-nearest is off by up to half an ulp.
TEST_F(ElementwiseTest, StochasticCastIsKeyedByTheGlobalElementAndUnbiased) {
  const int64_t n = 100003;
  const Vec x = normal(n, 0.0f, 3.0f);
  const StochasticRounding sr{0x1234, 0x5678, 1000};
  std::vector<bf16> whole(static_cast<size_t>(n)), parts(static_cast<size_t>(n));
  for (int threads : {1, 3}) {
    Threads scope(threads);
    cast_f32_to_bf16_stochastic(whole.data(), x.data(), n, sr);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t g = static_cast<uint64_t>(sr.first + i);
      const auto block = Philox::block(sr.key, sr.stream, g / 8);
      wrong += whole[i].bits != f32_to_bf16_stochastic(x[i], block[(g % 8) / 2] >> (16 * (g % 2))).bits;
    }
    EXPECT_EQ(wrong, 0) << threads << " threads";
  }
  const int64_t cut = 12347;  // not a multiple of 8
  cast_f32_to_bf16_stochastic(parts.data(), x.data(), cut, sr);
  cast_f32_to_bf16_stochastic(parts.data() + cut, x.data() + cut, n - cut, {sr.key, sr.stream, sr.first + cut});
  EXPECT_EQ(std::memcmp(whole.data(), parts.data(), whole.size() * sizeof(bf16)), 0);

  // 1 + 2^-10 lies an eighth of the way from 1 to the next bf16, 1 + 2^-7: nearest-even gives 1.
  const float v = 1.0f + 1.0f / 1024.0f;
  const int64_t m = 1 << 16;
  Vec same(static_cast<size_t>(m), v);
  std::vector<bf16> r(static_cast<size_t>(m));
  cast_f32_to_bf16_stochastic(r.data(), same.data(), m, {99, 7, 0});
  double mean = 0;
  for (const bf16 b : r) mean += bf16_to_f32(b);
  mean /= static_cast<double>(m);
  EXPECT_NEAR(mean, v, 4e-5) << "unbiased (nearest-even gives " << bf16_to_f32(f32_to_bf16(v)) << ")";
  EXPECT_NE(bf16_to_f32(f32_to_bf16(v)), v);
}

// The fused pass (issue 15 item 2) against the two unfused kernels it replaces: the same bf16 copy
// bit for bit, and bias_backward's gradient bit for bit (the same column sums in the same order).
TEST_F(ElementwiseTest, CastWithBiasGradientIsTheCastAndTheBiasBackwardInOnePass) {
  struct Shape {
    int64_t N, OC;
  };
  for (auto [N, OC] : {Shape{7, 67}, Shape{301, 67}, Shape{2048, 1152}}) {
    const Vec dy = normal(N * OC, 0.0f, 3.0f), dbias0 = normal(OC);
    std::vector<bf16> want_lp(static_cast<size_t>(N * OC));
    cast_f32_to_bf16(want_lp.data(), dy.data(), N * OC);
    Vec want_db = dbias0;
    bias_backward(want_db.data(), dy.data(), N, OC);
    for (int threads : {1, 2, 3}) {
      Threads scope(threads);
      std::vector<bf16> lp(static_cast<size_t>(N * OC), bf16{0x1234});
      Vec db = dbias0;
      cast_f32_to_bf16_bias_grad(lp.data(), db.data(), dy.data(), N, OC);
      EXPECT_EQ(std::memcmp(lp.data(), want_lp.data(), lp.size() * sizeof(bf16)), 0) << "N=" << N << ", " << threads;
      EXPECT_TRUE(bitwise_equal(db, want_db)) << "N=" << N << ", " << threads << " threads";
    }
  }
  // One read of dy where there were two: the fused cost is the cast's plus dbias's, not the bias pass's.
  EXPECT_DOUBLE_EQ(cast_bias_grad_cost(2048, 1152).bytes,
                   cast_cost(2048 * 1152).bytes + 8.0 * 1152);
  EXPECT_LT(cast_bias_grad_cost(2048, 1152).bytes,
            cast_cost(2048 * 1152).bytes + bias_backward_cost(2048, 1152).bytes);
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

// bf16-pure's update (issue 16 item 1): one step from bf16 state against the fp64 formula on the
// widened values -- within one bf16 ulp of it either way, to nearest without a key -- keyed by the
// global element (a run cut anywhere and across threads gives the same bits), and unbiased: an update
// far below bf16's resolution moves the weight on average by exactly its size, where rounding to
// nearest would lose it every time.
TEST_F(ElementwiseTest, Bf16AdamWIsTheFloat64UpdateRoundedStochasticallyPerGlobalElement) {
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.5f;
  const int64_t n = 100003, step = 3;
  std::vector<bf16> p0(n), m0(n), v0(n);
  const Vec pf = normal(n, 0.0f, 0.5f), mf = normal(n, 0.0f, 0.1f), vf = normal(n, 0.0f, 0.1f), g = normal(n, 0.0f, 2.0f);
  for (int64_t i = 0; i < n; ++i) p0[i] = f32_to_bf16(pf[i]), m0[i] = f32_to_bf16(mf[i]), v0[i] = f32_to_bf16(vf[i] * vf[i]);
  DVec want_p(n), want_m(n), want_v(n);
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), step), bc2 = 1.0 - std::pow(static_cast<double>(beta2), step);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]) * grad_scale, p = bf16_to_f32(p0[i]);
    want_m[i] = beta1 * static_cast<double>(bf16_to_f32(m0[i])) + (1.0 - beta1) * gi;
    want_v[i] = beta2 * static_cast<double>(bf16_to_f32(v0[i])) + (1.0 - beta2) * gi * gi;
    want_p[i] = p - lr * ((want_m[i] / bc1) / (std::sqrt(want_v[i] / bc2) + eps) + wd * p);
  }
  // Within one bf16 ulp (2^-7 relative, plus an f32 rounding's worth) of the fp64 value.
  auto within_ulp = [&](const std::vector<bf16>& got, const DVec& want, const char* what) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i)
      bad += std::abs(bf16_to_f32(got[i]) - want[i]) > std::abs(want[i]) * (1.0 / 128 + 1e-6) + 1e-6;
    EXPECT_EQ(bad, 0) << what;
  };
  const StochasticRounding sr{0xfeed, 0xbeef, 4242};
  std::vector<bf16> whole_p;
  for (int threads : {1, 3}) {
    Threads scope(threads);
    for (const StochasticRounding* key : {static_cast<const StochasticRounding*>(nullptr), &sr}) {
      auto p = p0, m = m0, v = v0;
      adamw_update_bf16(p.data(), m.data(), v.data(), g.data(), n, lr, beta1, beta2, eps, wd, step, grad_scale, key);
      within_ulp(p, want_p, "weights");
      within_ulp(m, want_m, "m");
      within_ulp(v, want_v, "v");
      if (!key) {
        // To nearest: the f32 formula's value rounded. Where it differs from the fp64 value rounded, the
        // two straddle a rounding midpoint: the result is within half a bf16 ulp of the fp64 value, give
        // or take the f32 arithmetic's own error, which is relative to the operands, not to the result:
        // an update that nearly cancels the weight leaves a tiny result with the weight's f32 error, and
        // a new m that nearly cancels (beta1 m against (1 - beta1) g) carries its operands' f32 error
        // into the step (seed 481370586, element 40274: m 8e-9 off, the weight 4e-10 past half an ulp).
        int64_t off = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double half_ulp = std::ldexp(1.0, std::ilogb(want_p[i]) - 8);
          const double m_operands = beta1 * std::abs(static_cast<double>(bf16_to_f32(m0[i]))) +
                                    (1.0 - beta1) * std::abs(static_cast<double>(g[i]) * grad_scale);
          const double step_per_m = lr / bc1 / (std::sqrt(want_v[i] / bc2) + eps);
          const double f32_error = 1e-6 * (std::abs(static_cast<double>(bf16_to_f32(p0[i]))) + std::abs(want_p[i]) +
                                           m_operands * step_per_m);
          off += p[i].bits != f32_to_bf16(static_cast<float>(want_p[i])).bits &&
                 std::abs(bf16_to_f32(p[i]) - want_p[i]) > half_ulp + f32_error;
        }
        EXPECT_EQ(off, 0);
        continue;
      }
      if (whole_p.empty()) whole_p = p;
      EXPECT_EQ(std::memcmp(p.data(), whole_p.data(), p.size() * sizeof(bf16)), 0) << threads << " threads";
    }
  }
  // A run cut at an element that is not a multiple of 8 rounds every element alike.
  auto p = p0, m = m0, v = v0;
  const int64_t cut = 12347;
  adamw_update_bf16(p.data(), m.data(), v.data(), g.data(), cut, lr, beta1, beta2, eps, wd, step, grad_scale, &sr);
  const StochasticRounding rest{sr.key, sr.stream, sr.first + cut};
  adamw_update_bf16(p.data() + cut, m.data() + cut, v.data() + cut, g.data() + cut, n - cut, lr, beta1, beta2, eps, wd,
                    step, grad_scale, &rest);
  EXPECT_EQ(std::memcmp(p.data(), whole_p.data(), p.size() * sizeof(bf16)), 0);

  // Weight 1, decay only (no gradient): each step should shrink it by lr * wd * 1 = 2^-12, a 32nd of a
  // bf16 ulp at 1. Rounded to nearest it never moves; stochastically its mean moves by exactly that.
  const int64_t k = 1 << 16;
  std::vector<bf16> ones(k, f32_to_bf16(1.0f)), zm(k, bf16{0}), zv(k, bf16{0});
  const Vec zero(k, 0.0f);
  auto nearest = ones;
  adamw_update_bf16(nearest.data(), zm.data(), zv.data(), zero.data(), k, 1.0f / 64, beta1, beta2, eps, 1.0f / 64, 1,
                    1.0f, nullptr);
  EXPECT_EQ(bf16_to_f32(nearest[0]), 1.0f) << "to nearest the update is lost";
  auto stochastic = ones;
  const StochasticRounding key{7, 11, 0};
  adamw_update_bf16(stochastic.data(), zm.data(), zv.data(), zero.data(), k, 1.0f / 64, beta1, beta2, eps, 1.0f / 64, 1,
                    1.0f, &key);
  double mean = 0;
  for (const bf16 b : stochastic) mean += bf16_to_f32(b);
  mean /= static_cast<double>(k);
  EXPECT_NEAR(mean, 1.0 - 1.0 / 4096, 4e-5) << "unbiased";
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

// The gradient accumulators are zeroed on every thread: exactly [0, n), whatever the split, and nothing
// past it (the arena's next tensor).
TEST_F(ElementwiseTest, FillZeroClearsExactlyTheRangeOnAnyThreadCount) {
  for (int threads : {1, 3})
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{1000003}}) {
      Vec x = normal(n + 5, 1.0f, 2.0f);
      const Vec before = x;
      Threads scope(threads);
      fill_zero(x.data() + 1, n);
      EXPECT_EQ(x[0], before[0]) << n;
      for (int64_t i = 1; i <= n; ++i) ASSERT_EQ(std::bit_cast<uint32_t>(x[i]), 0u) << "n=" << n << " i=" << i;
      for (int64_t i = n + 1; i < n + 5; ++i) EXPECT_EQ(x[i], before[i]) << n;
    }
  EXPECT_EQ(fill_zero_cost(1000).bytes, 4000);
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
