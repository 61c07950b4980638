#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "loom/core/bf16.h"
#include "loom/error.h"
#include "loom/kernels/gemm.h"

using namespace loom;
using namespace loom::kernels;

namespace {
// float64 oracle over the same (possibly bf16-rounded) operands.
std::vector<double> naive(const GemmDesc& d, const std::vector<float>& A, const std::vector<float>& B,
                          const std::vector<float>& C0, const std::vector<float>& bias) {
  std::vector<double> C(d.M * d.N);
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t n = 0; n < d.N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < d.K; ++k)
        acc += double(A[d.trans_a ? k * d.M + m : m * d.K + k]) * B[d.trans_b ? n * d.K + k : k * d.N + n];
      if (d.bias) acc += bias[n];
      if (d.accumulate || d.residual) acc += C0[m * d.N + n];
      C[m * d.N + n] = acc;
    }
  return C;
}

void check(GemmDesc d, uint32_t seed) {
  SCOPED_TRACE(d.str() + " seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    if (d.ab_type == DType::BF16)
      for (auto& x : v) x = round_to_bf16(x);
    return v;
  };
  auto A = rnd(d.M * d.K), B = rnd(d.K * d.N), C0 = rnd(d.M * d.N), bias = rnd(d.N);
  std::vector<bf16> Ab(A.size()), Bb(B.size());
  for (size_t i = 0; i < A.size(); ++i) Ab[i] = f32_to_bf16(A[i]);
  for (size_t i = 0; i < B.size(); ++i) Bb[i] = f32_to_bf16(B[i]);
  const void* a = d.ab_type == DType::BF16 ? static_cast<const void*>(Ab.data()) : A.data();
  const void* b = d.ab_type == DType::BF16 ? static_cast<const void*>(Bb.data()) : B.data();
  auto expect = naive(d, A, B, C0, bias);
  Allocator alloc;
  // A residual epilogue adds C0 from its own tensor into an output that starts as garbage.
  std::vector<float> C = d.residual ? std::vector<float>(C0.size(), 1e30f) : C0, R = C;
  gemm(d, a, b, C.data(), bias.data(), alloc, d.residual ? C0.data() : nullptr);
  gemm_reference(d, a, b, R.data(), bias.data(), d.residual ? C0.data() : nullptr);
  for (size_t i = 0; i < C.size(); ++i) {
    double tol = 1e-5 * (std::abs(expect[i]) + std::sqrt(double(d.K)));
    ASSERT_NEAR(C[i], expect[i], tol) << "oneDNN, element " << i;
    ASSERT_NEAR(R[i], expect[i], tol) << "reference, element " << i;
  }
}
}  // namespace

TEST(Gemm, EveryTransposeAccumulateAndBiasMatchesFloat64InF32) {
  uint32_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool acc : {false, true})
        check({.M = 37, .N = 29, .K = 53, .trans_a = ta, .trans_b = tb, .accumulate = acc, .bias = !acc}, seed++);
}

TEST(Gemm, Bf16OperandsAccumulateInF32) {
  uint32_t seed = 200;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      check({.M = 64, .N = 48, .K = 96, .trans_a = ta, .trans_b = tb, .ab_type = DType::BF16, .accumulate = ta},
            seed++);
}

// kernels::linear_gemms -- the one description of a linear layer's GEMMs that the backend runs and
// `loom calibrate` times -- against the layer's calculus in float64: y = x . W^T, dX = dY . W and
// dW += dY^T . x (accumulated onto what the gradient held), with x [rows, in], W [out, in], dY [rows, out].
TEST(Gemm, LinearGemmsAreALinearLayersForwardAndBothGradients) {
  const int64_t rows = 23, out = 17, in = 11;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  auto rnd = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& e : v) e = dist(rng);
    return v;
  };
  const auto x = rnd(rows * in), w = rnd(out * in), dy = rnd(rows * out), dw0 = rnd(out * in);
  const LinearGemms g = linear_gemms(rows, out, in, DType::F32);
  Allocator alloc;
  std::vector<float> y(static_cast<size_t>(rows * out)), dx(static_cast<size_t>(rows * in)), dw = dw0;
  gemm(g.forward, x.data(), w.data(), y.data(), nullptr, alloc);
  gemm(g.backward_data, dy.data(), w.data(), dx.data(), nullptr, alloc);
  gemm(g.backward_weight, dy.data(), x.data(), dw.data(), nullptr, alloc);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double e = 0;
      for (int64_t i = 0; i < in; ++i) e += double(x[r * in + i]) * w[o * in + i];
      ASSERT_NEAR(y[r * out + o], e, 1e-4) << "y[" << r << ", " << o << "]";
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in; ++i) {
      double e = 0;
      for (int64_t o = 0; o < out; ++o) e += double(dy[r * out + o]) * w[o * in + i];
      ASSERT_NEAR(dx[r * in + i], e, 1e-4) << "dx[" << r << ", " << i << "]";
    }
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double e = dw0[o * in + i];
      for (int64_t r = 0; r < rows; ++r) e += double(dy[r * out + o]) * x[r * in + i];
      ASSERT_NEAR(dw[o * in + i], e, 1e-4) << "dw[" << o << ", " << i << "]";
    }
  EXPECT_TRUE(g.backward_weight.accumulate && !g.forward.accumulate && !g.backward_data.accumulate);
  EXPECT_EQ(linear_gemms(rows, out, in, DType::BF16).forward.ab_type, DType::BF16);
}

// A residual connection added in the epilogue (binary post-op) instead of copied into C and accumulated:
// against float64, and bit for bit what the copy-then-accumulate path gives (the same one addition of
// the residual after the bias), in f32 and bf16.
TEST(Gemm, ResidualEpilogueIsTheCopyThenAccumulateWithoutTheCopy) {
  uint32_t seed = 300;
  for (DType t : {DType::F32, DType::BF16})
    for (bool bias : {false, true}) {
      const GemmDesc d{.M = 70, .N = 48, .K = 96, .trans_b = true, .ab_type = t, .bias = bias, .residual = true};
      check(d, seed++);
      std::mt19937 rng(seed++);
      std::normal_distribution<float> dist;
      std::vector<float> A(d.M * d.K), B(d.N * d.K), res(d.M * d.N), b(d.N);
      for (auto* v : {&A, &B, &res, &b})
        for (auto& x : *v) x = dist(rng);
      std::vector<bf16> Ab(A.size()), Bb(B.size());
      for (size_t i = 0; i < A.size(); ++i) Ab[i] = f32_to_bf16(A[i]);
      for (size_t i = 0; i < B.size(); ++i) Bb[i] = f32_to_bf16(B[i]);
      const void* a = t == DType::BF16 ? static_cast<const void*>(Ab.data()) : A.data();
      const void* bb = t == DType::BF16 ? static_cast<const void*>(Bb.data()) : B.data();
      Allocator alloc;
      std::vector<float> fused(res.size(), -7.0f), copied = res;
      gemm(d, a, bb, fused.data(), b.data(), alloc, res.data());
      GemmDesc acc = d;
      acc.residual = false, acc.accumulate = true;
      gemm(acc, a, bb, copied.data(), b.data(), alloc);
      EXPECT_EQ(fused, copied) << dtype_name(t) << (bias ? " with bias" : "");
    }
  // A residual that is C itself, or missing, is refused (use accumulate).
  Allocator alloc;
  std::vector<float> x(16, 1.0f), c(16);
  const GemmDesc d{.M = 4, .N = 4, .K = 4, .residual = true};
  EXPECT_THROW(gemm(d, x.data(), x.data(), c.data(), nullptr, alloc, c.data()), ShapeError);
  EXPECT_THROW(gemm(d, x.data(), x.data(), c.data(), nullptr, alloc, nullptr), ShapeError);
}

TEST(Gemm, ReportsTheChosenImplementationAndBf16Mode) {
  EXPECT_FALSE(gemm_impl_name(DType::F32).empty());
  // Under DNNL_MAX_CPU_ISA=AVX2 (a ctest variant) oneDNN refuses bf16 and Loom widens to f32.
  const char* isa = std::getenv("DNNL_MAX_CPU_ISA");
  if (isa && std::string(isa) == "AVX2") EXPECT_EQ(gemm_bf16_mode(), Bf16GemmMode::WidenToF32);
  std::printf("f32: %s | bf16: %s (%s)\n", gemm_impl_name(DType::F32).c_str(), gemm_impl_name(DType::BF16).c_str(),
              gemm_bf16_mode() == Bf16GemmMode::Native ? "native" : "widened to f32");
}

TEST(Gemm, LargeShapeMatchesTheReference) {
  check({.M = 256, .N = 384, .K = 384, .trans_b = true}, 300);
  check({.M = 256, .N = 384, .K = 384, .trans_b = true, .ab_type = DType::BF16}, 301);
}

// Run-time shapes (a mixture of experts' changing row counts): one primitive per flag set serves every
// shape, and each shape's result still matches float64, in both precisions and every transpose.
TEST(Gemm, RunTimeShapesMatchFloat64ForEverySizeTheyAreGiven) {
  uint32_t seed = 400;
  for (DType t : {DType::F32, DType::BF16})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (int64_t m : {1, 7, 64, 93})
          check({.M = m, .N = 40, .K = 24 + m % 5, .trans_a = ta, .trans_b = tb, .ab_type = t, .accumulate = ta,
                 .runtime_shape = true},
                seed++);
}
