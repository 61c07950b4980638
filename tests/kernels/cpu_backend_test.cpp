// The CPU backend's linear backward: the bias gradient taken in the pass that casts dY to bf16 is the
// column sum of dY (float64 reference), and a backward split in two calls through prepare_output_grad
// (what tensor parallelism does to run the weight gradient under the input gradient's collective)
// gives exactly what the whole call gives, in bf16 and in f32, and traces one cast of dY, not two.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/core/tensor.h"
#include "loom/error.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/kernels/elementwise.h"
#include "loom/profile/tracer.h"

namespace loom::kernels {
namespace {

struct Linear {
  Tensor x, w, dy;
};

Linear make_linear(DType dtype, int64_t N, int64_t IC, int64_t OC, Allocator& alloc) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto filled = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& f : v) f = dist(rng);
    return v;
  };
  auto as = [&](const std::vector<float>& v, const Shape& shape, DType dt) {
    Tensor t = Tensor::empty(shape, dt, alloc, MemCategory::Workspace);
    if (dt == DType::BF16)
      cast_f32_to_bf16(t.data<bf16>(), v.data(), static_cast<int64_t>(v.size()));
    else
      std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
    return t;
  };
  return {as(filled(N * IC), {N, IC}, dtype), as(filled(OC * IC), {OC, IC}, dtype),
          as(filled(N * OC), {N, OC}, DType::F32)};
}

bool same(const Tensor& a, const Tensor& b) { return std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0; }

// f32 tensors: |got - want| <= rtol * rms(want) everywhere (rtol 0: bit for bit).
::testing::AssertionResult close(const Tensor& got, const Tensor& want, double rtol) {
  if (rtol == 0) return same(got, want) ? ::testing::AssertionSuccess() : ::testing::AssertionFailure() << "bits differ";
  const float *g = got.data<float>(), *w = want.data<float>();
  double ss = 0;
  for (int64_t i = 0; i < want.numel(); ++i) ss += static_cast<double>(w[i]) * w[i];
  const double tol = rtol * std::sqrt(ss / static_cast<double>(want.numel()));
  for (int64_t i = 0; i < want.numel(); ++i)
    if (!(std::abs(static_cast<double>(g[i]) - w[i]) <= tol))
      return ::testing::AssertionFailure() << "[" << i << "] got " << g[i] << " want " << w[i] << " (tolerance " << tol << ")";
  return ::testing::AssertionSuccess();
}

// A two-thread backend whose spans are counted.
struct TracedBackend {
  Allocator alloc;
  profile::Tracer tracer{profile::Tracer::Mode::Summary};
  CpuBackend be{alloc, &tracer, 2};
};

TEST(CpuBackend, ASplitBackwardGivesTheWholeBackwardAndCastsDyOnce) {
  TracedBackend t;
  Allocator& alloc = t.alloc;
  profile::Tracer& tracer = t.tracer;
  CpuBackend& be = t.be;
  const int64_t N = 96, IC = 48, OC = 80;
  for (DType dtype : {DType::BF16, DType::F32}) {
    SCOPED_TRACE(dtype == DType::BF16 ? "bf16" : "f32");
    const Linear l = make_linear(dtype, N, IC, OC, alloc);
    auto zeros = [&](const Shape& s) { return Tensor::zeros(s, DType::F32, alloc, MemCategory::Workspace); };
    Tensor dx1 = zeros({N, IC}), dw1 = zeros({OC, IC}), db1 = zeros({OC});
    be.linear_backward(&dx1, false, dw1, &db1, l.dy, l.x, l.w);
    // The bias gradient is dY's column sums, whichever pass took them.
    for (int64_t j = 0; j < OC; ++j) {
      double want = 0;
      for (int64_t n = 0; n < N; ++n) want += l.dy.data<float>()[n * OC + j];
      EXPECT_NEAR(db1.data<float>()[j], want, 1e-4 * (1 + std::abs(want))) << j;
    }
    tracer.reset_stats();
    Tensor dx2 = zeros({N, IC}), dw2 = zeros({OC, IC}), db2 = zeros({OC});
    const Tensor g = be.prepare_output_grad(l.dy, &db2, l.w);
    EXPECT_EQ(g.dtype(), dtype);
    be.linear_backward(&dx2, false, Tensor(), nullptr, g, l.x, l.w);
    be.linear_backward(nullptr, false, dw2, nullptr, g, l.x, l.w);
    EXPECT_TRUE(same(dx1, dx2));
    EXPECT_TRUE(same(dw1, dw2));
    EXPECT_TRUE(same(db1, db2));
    const auto stats = tracer.stats();
    if (dtype == DType::BF16) {
      ASSERT_TRUE(stats.count("cast_dy_bf16"));
      EXPECT_EQ(stats.at("cast_dy_bf16").calls, 1);
      EXPECT_EQ(stats.count("bias_bwd"), 0u) << "the bias gradient rides on the cast";
    } else {
      EXPECT_EQ(stats.count("cast_dy_bf16"), 0u);
      EXPECT_EQ(stats.at("bias_bwd").calls, 1);
    }
  }
}

TEST(CpuBackend, ABf16DyWithABiasGradientIsRefused) {
  Allocator alloc;
  CpuBackend be(alloc, nullptr, 1);
  const Linear l = make_linear(DType::BF16, 8, 16, 8, alloc);
  Tensor dw = Tensor::zeros({8, 16}, DType::F32, alloc, MemCategory::Workspace);
  Tensor db = Tensor::zeros({8}, DType::F32, alloc, MemCategory::Workspace);
  const Tensor g = be.prepare_output_grad(l.dy, nullptr, l.w);
  EXPECT_THROW(be.linear_backward(nullptr, false, dw, &db, g, l.x, l.w), loom::Error);
}

// The MLP activation's backward fused with the up projection's output-gradient preparation gives the
// unfused path's gradients (activation backward in f32, then the linear's backward with its bias): in
// f32 bit for bit (the same kernels), in bf16 from one fused pass (no cast of dY, no bias pass) to
// within the rounding of an element of dY to a neighbouring bf16 (elementwise_activations_test).
TEST(CpuBackend, TheActivationBackwardPreparesTheUpProjectionsGradientInOnePass) {
  TracedBackend t;
  const int64_t N = 96, IC = 48, F = 40;
  for (Activation act : {Activation::Gelu, Activation::SwiGLU}) {
    const int64_t W = act == Activation::SwiGLU ? 2 * F : F;  // the up projection's width
    for (DType dtype : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(std::string(act == Activation::Gelu ? "gelu " : "swiglu ") + (dtype == DType::BF16 ? "bf16" : "f32"));
      const Linear up = make_linear(dtype, N, IC, W, t.alloc);  // x [N, IC] -> pre [N, W]; up.dy is `pre`
      const Linear act_grad = make_linear(DType::F32, N, 1, F, t.alloc);  // its dy: d(loss)/d(activation)
      const Tensor& pre = up.dy;
      const Tensor& d_act = act_grad.dy;
      const bool bias = act == Activation::Gelu;
      auto zeros = [&](const Shape& s) { return Tensor::zeros(s, DType::F32, t.alloc, MemCategory::Workspace); };
      Tensor d_pre1 = zeros({N, W}), dx1 = zeros({N, IC}), dw1 = zeros({W, IC}), db1 = zeros({W});
      if (bias)
        t.be.gelu_backward(d_pre1, pre, d_act);
      else
        t.be.swiglu_backward(d_pre1, pre, d_act);
      t.be.linear_backward(&dx1, false, dw1, bias ? &db1 : nullptr, d_pre1, up.x, up.w);
      t.tracer.reset_stats();
      Tensor d_pre2 = zeros({N, W}), dx2 = zeros({N, IC}), dw2 = zeros({W, IC}), db2 = zeros({W});
      const Tensor g = t.be.activation_backward_output_grad(act, d_pre2, pre, d_act, bias ? &db2 : nullptr, up.w);
      EXPECT_EQ(g.dtype(), dtype);
      t.be.linear_backward(&dx2, false, dw2, nullptr, g, up.x, up.w);
      const double tol = dtype == DType::F32 ? 0.0 : 1e-2;
      EXPECT_TRUE(close(dx2, dx1, tol));
      EXPECT_TRUE(close(dw2, dw1, tol));
      EXPECT_TRUE(close(db2, db1, dtype == DType::F32 ? 0.0 : 1e-6));
      const auto stats = t.tracer.stats();
      EXPECT_EQ(stats.count("cast_dy_bf16"), 0u);
      EXPECT_EQ(stats.count("bias_bwd"), dtype == DType::F32 && bias ? 1u : 0u);
      const std::string fused = bias ? "gelu_bwd_bf16" : "swiglu_bwd_bf16";
      EXPECT_EQ(stats.count(fused), dtype == DType::BF16 ? 1u : 0u);
    }
  }
}

// The forward's fused activation writes the next GEMM's bf16 input: the cast of the f32 activation.
TEST(CpuBackend, ABf16OutputFusesTheCastIntoTheActivation) {
  Allocator alloc;
  CpuBackend be(alloc, nullptr, 2);
  const Linear l = make_linear(DType::F32, 64, 2, 48, alloc);
  const Tensor& pre = l.dy;  // [64, 48]
  for (bool swiglu : {false, true}) {
    const Shape out_shape{64, swiglu ? 24 : 48};
    Tensor f32 = Tensor::zeros(out_shape, DType::F32, alloc, MemCategory::Workspace);
    Tensor want = Tensor::zeros(out_shape, DType::BF16, alloc, MemCategory::Workspace);
    Tensor got = Tensor::zeros(out_shape, DType::BF16, alloc, MemCategory::Workspace);
    if (swiglu) {
      be.swiglu_forward(f32, pre);
      be.swiglu_forward(got, pre);
    } else {
      be.gelu_forward(f32, pre);
      be.gelu_forward(got, pre);
    }
    cast_f32_to_bf16(want.data<bf16>(), f32.data<float>(), f32.numel());
    // Within one bf16 step (a loop tail may round an FMA differently: elementwise_activations_test).
    for (int64_t i = 0; i < got.numel(); ++i)
      ASSERT_LE(std::abs(static_cast<int>(got.data<bf16>()[i].bits) - static_cast<int>(want.data<bf16>()[i].bits)), 1)
          << (swiglu ? "swiglu " : "gelu ") << i;
  }
}

}  // namespace
}  // namespace loom::kernels
